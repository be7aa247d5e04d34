//! The in-sandbox endpoint: a listener bound inside another network namespace, attributed to one
//! sandbox. Needs root and `ip`; skipped (with a note on stderr) otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::Arc;

use crab_coordinator::{bind_in_netns, Coordinator, ProxyConfig};
use crab_testkit::upstream::{InstantHooks, MemoryDirectory, StubConfig, StubUpstream};

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Send a raw HTTP/1.1 request from inside the namespace and return the whole response text.
fn request_inside(ns: &str, port: u16, path: &str, body: &str) -> String {
    let ns = format!("/run/netns/{ns}");
    let (path, body) = (path.to_string(), body.to_string());
    std::thread::spawn(move || {
        let f = std::fs::File::open(&ns).unwrap();
        nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Crab-Sandbox: b\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
    .join()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_inside_its_namespace_reaches_the_proxy_on_loopback() {
    if !nix::unistd::geteuid().is_root() || Command::new("ip").arg("-V").output().is_err() {
        return crab_testkit::privilege::cannot_run("needs root and iproute2");
    }
    let name = format!("crab-coord-test-{}", std::process::id());
    assert!(Command::new("ip").args(["netns", "add", &name]).status().unwrap().success());
    let ns = Netns(name.clone());
    assert!(Command::new("ip")
        .args(["-n", &name, "link", "set", "lo", "up"])
        .status()
        .unwrap()
        .success());

    let stub = StubUpstream::start(StubConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hooks = InstantHooks::new();
    let cfg = ProxyConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream_openai: stub.url(),
        upstream_anthropic: stub.url(),
        ..Default::default()
    };
    let coord = Coordinator::new(cfg, MemoryDirectory::new(dir.path(), &["a", "b"]), hooks.clone())
        .unwrap();
    let std_listener =
        bind_in_netns(format!("/run/netns/{name}").as_ref(), "127.0.0.1:7431".parse().unwrap())
            .unwrap();
    let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
    let server = coord.serve_sandbox(listener, "a").unwrap();
    let coord2 = Arc::clone(&coord);

    // Attributed to "a" whatever the header says.
    let n = name.clone();
    let out = tokio::task::spawn_blocking(move || {
        request_inside(&n, 7431, "/v1/chat/completions", r#"{"q":1}"#)
    })
    .await
    .unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert_eq!(coord2.conversation("a", None).await.unwrap().len(), 1);
    assert!(coord2.conversation("b", None).await.unwrap().is_empty());
    assert_eq!(hooks.boundaries()[0].sandbox, "a");
    // Naming another sandbox from inside is refused.
    let n = name.clone();
    let out = tokio::task::spawn_blocking(move || {
        request_inside(&n, 7431, "/s/b/v1/chat/completions", r#"{"q":2}"#)
    })
    .await
    .unwrap();
    assert!(out.starts_with("HTTP/1.1 403"), "{out}");
    // The host's own 127.0.0.1:7431 is a different socket (probably nothing listens there).
    server.shutdown().await;
    drop(ns);
}
