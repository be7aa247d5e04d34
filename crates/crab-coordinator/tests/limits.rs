//! The proxy's bounds over real loopback sockets: a client that floods a sandbox endpoint with
//! idle connections, sends headers a byte at a time, announces a body it never sends, or sends
//! one too large, gets a bounded share of the proxy and a JSON error — while another sandbox's
//! requests keep answering.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crab_common::{ApiError, ErrorCode};
use crab_coordinator::{Coordinator, ProxyConfig, ProxyServer};
use crab_testkit::upstream::{InstantHooks, MemoryDirectory, StubConfig, StubUpstream};

struct H {
    _stub: StubUpstream,
    coord: Arc<Coordinator>,
    a: ProxyServer,
    b: ProxyServer,
    _dir: tempfile::TempDir,
}

/// Two sandboxes, `a` and `b`, each with its own private endpoint (as inside their network
/// namespaces).
async fn harness(tweak: impl FnOnce(&mut ProxyConfig)) -> H {
    let stub = StubUpstream::start(StubConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sandboxes = MemoryDirectory::new(dir.path(), &["a", "b"]);
    let mut cfg = ProxyConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream_openai: stub.url(),
        upstream_anthropic: stub.url(),
        ..Default::default()
    };
    tweak(&mut cfg);
    let coord = Coordinator::new(cfg, sandboxes, InstantHooks::new()).unwrap();
    let a = coord.serve_sandbox(TcpListener::bind("127.0.0.1:0").await.unwrap(), "a").unwrap();
    let b = coord.serve_sandbox(TcpListener::bind("127.0.0.1:0").await.unwrap(), "b").unwrap();
    H { _stub: stub, coord, a, b, _dir: dir }
}

/// Send raw bytes, read the whole answer until the server closes (or `within` passes).
async fn raw(addr: SocketAddr, req: &[u8], within: Duration) -> (String, Duration) {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(req).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(within, s.read_to_end(&mut out)).await;
    (String::from_utf8_lossy(&out).into_owned(), t.elapsed())
}

fn chat_request(body: &str) -> Vec<u8> {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn status_of(answer: &str) -> u16 {
    answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// The JSON body of a raw answer, as the project's `ApiError`.
fn api_error(answer: &str) -> ApiError {
    let body = answer.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not an ApiError ({e}): {answer}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_is_capped_per_sandbox_and_the_other_sandbox_still_answers() {
    let h = harness(|c| {
        c.max_sandbox_connections = 50;
        c.header_read_timeout = Some(Duration::from_secs(2));
    })
    .await;
    // 600 idle connections to a's endpoint, none sending anything.
    let mut idle = Vec::new();
    for _ in 0..600 {
        idle.push(TcpStream::connect(h.a.local_addr()).await.unwrap());
    }
    // Those past the cap were answered 503 and closed at once.
    let mut refused = 0;
    let mut open = 0;
    for s in &mut idle {
        let mut buf = vec![0u8; 4096];
        match tokio::time::timeout(Duration::from_millis(5), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {
                let answer = String::from_utf8_lossy(&buf[..n]).into_owned();
                assert_eq!(status_of(&answer), 503, "{answer}");
                assert_eq!(api_error(&answer).code, ErrorCode::Busy);
                refused += 1;
            }
            Ok(_) => refused += 1, // closed (the refusal may be lost to a reset)
            Err(_) => open += 1,
        }
    }
    assert_eq!(open, 50, "the cap admits exactly 50 ({refused} refused)");
    // Meanwhile b answers at once.
    let (answer, took) =
        raw(h.b.local_addr(), &chat_request(r#"{"messages":[]}"#), Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), 200, "{answer}");
    assert!(took < Duration::from_secs(1), "b took {took:?}");
    let top = h.coord.stats();
    let a = top.iter().find(|s| s.sandbox == "a");
    assert!(a.is_none_or(|a| a.refused_connections >= 500), "{top:?}");
    assert!(
        h.coord.metrics_text().contains("crab_proxy_connections_refused_total 550"),
        "{}",
        h.coord.metrics_text()
    );
    // The idle ones are closed by the proxy after the header timeout, and a can talk again.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let mut closed = 0;
    for s in &mut idle {
        let mut buf = [0u8; 16];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(20), s.read(&mut buf)).await {
            closed += 1;
        }
    }
    assert!(closed >= 590, "idle connections were not closed: {closed}");
    drop(idle);
    let (answer, _) =
        raw(h.a.local_addr(), &chat_request(r#"{"messages":[]}"#), Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), 200, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_headers_are_cut_off_at_the_header_timeout() {
    let h = harness(|c| c.header_read_timeout = Some(Duration::from_millis(500))).await;
    let t = Instant::now();
    let mut s = TcpStream::connect(h.a.local_addr()).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let mut closed_after = None;
    for i in 0..50 {
        // One more header byte every 100 ms: never a complete head.
        if s.write_all(if i % 2 == 0 { b"x" } else { b"y" }).await.is_err() {
            closed_after = Some(t.elapsed());
            break;
        }
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
            Ok(Ok(_)) | Ok(Err(_)) => {
                closed_after = Some(t.elapsed());
                break;
            }
            Err(_) => {}
        }
    }
    let after = closed_after.expect("the slow client was never disconnected");
    assert!(after >= Duration::from_millis(400) && after < Duration::from_secs(2), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_stalled_bodies_get_json_errors() {
    let h = harness(|c| {
        c.max_request_bytes = 64 << 10;
        c.body_read_timeout = Some(Duration::from_millis(500));
    })
    .await;
    // Announced too large: 413 at once, without reading it.
    let req = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 40000000\r\n\r\n{";
    let (answer, took) = raw(h.a.local_addr(), req.as_bytes(), Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), 413, "{answer}");
    let e = api_error(&answer);
    assert_eq!(e.code, ErrorCode::TooLarge, "{answer}");
    assert!(e.message.contains("65536"), "{e:?}");
    assert!(took < Duration::from_secs(1));
    // Too large without a length (chunked): 413 once the limit is passed.
    let chunk = "x".repeat(32 << 10);
    let mut req = String::from(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
    );
    for _ in 0..3 {
        req.push_str(&format!("{:x}\r\n{chunk}\r\n", chunk.len()));
    }
    req.push_str("0\r\n\r\n");
    let (answer, _) = raw(h.a.local_addr(), req.as_bytes(), Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), 413, "{answer}");
    assert_eq!(api_error(&answer).code, ErrorCode::TooLarge);
    // Announced, then stalled: 408 at the body timeout.
    let req = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"messages\":";
    let (answer, took) = raw(h.a.local_addr(), req.as_bytes(), Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), 408, "{answer}");
    assert_eq!(api_error(&answer).code, ErrorCode::RequestTimeout);
    assert!(took >= Duration::from_millis(450) && took < Duration::from_secs(2), "{took:?}");
    // The other errors are ApiErrors too (and still carry the SDK-shaped `error` object).
    let (answer, _) =
        raw(h.b.local_addr(), &chat_request("{not json"), Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), 400);
    assert_eq!(api_error(&answer).code, ErrorCode::InvalidRequest);
    assert!(answer.contains("\"error\":{"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_holds_at_most_its_budget_of_request_bytes() {
    let h = harness(|c| {
        c.max_request_bytes = 64 << 10;
        c.max_sandbox_buffered_bytes = 64 << 10;
        c.body_read_timeout = Some(Duration::from_secs(4));
    })
    .await;
    // a starts a 60 KiB body and stalls after 50 KiB: 50 KiB of a's budget is held.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        60 << 10
    );
    let mut stalled = TcpStream::connect(h.a.local_addr()).await.unwrap();
    stalled.write_all(head.as_bytes()).await.unwrap();
    stalled.write_all(&vec![b' '; 50 << 10]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A second 30 KiB request of a cannot be held beside it: refused as busy after the
    // budget wait, long before the stalled one's body timeout frees a's budget.
    let body = format!("{{\"messages\":[],\"pad\":\"{}\"}}", "p".repeat(30 << 10));
    let (answer, took) = raw(h.a.local_addr(), &chat_request(&body), Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), 503, "{answer}");
    assert_eq!(api_error(&answer).code, ErrorCode::Busy);
    assert!(took < Duration::from_secs(3), "{took:?}");
    // b's budget is its own.
    let (answer, took) = raw(h.b.local_addr(), &chat_request(&body), Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), 200, "{answer}");
    assert!(took < Duration::from_millis(500), "{took:?}");
    drop(stalled);
}
