//! The limits users hit and the bounds of every listener (issue 28), end to end against real
//! daemons (root):
//!
//! * a 1 MB command line in ten arguments and a 200 KB environment run through `crab exec`
//!   (the exec helper takes its spec on a descriptor, not as an argument); one argument past
//!   the kernel's 128 KiB is refused before anything starts, naming `MAX_ARG_STRLEN`;
//! * a 1 GiB file write and a 1 GiB exec stdin stream through the API socket (raw bodies, as
//!   `curl` sends them) with the daemon's peak memory (`VmHWM`) bounded, the bytes checked by
//!   sha256 inside the sandbox;
//! * a body over `--max-upload` gets a 413 naming the flag: at once when its length is
//!   declared, when it passes the limit when it is not (a daemon of its own with a 1 MiB limit);
//! * the E2B port is bounded like the API socket (a daemon of its own with a small descriptor
//!   limit and short timeouts): a head never finished is dropped at the header timeout, a body
//!   trickled is cut off at the body deadline, a flood past its connection cap is refused with
//!   a 503 while the API socket still answers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crab_testkit::daemon as common;
use crab_testkit::require_root;

use common::{crab, unique, OtherDaemon, Sandbox};

/// What the daemon may grow by while 1 GiB passes through it (it holds a few MiB at a time; a
/// daemon that buffered the body would grow by 1 GiB or more).
const RSS_GROWTH_MAX_KIB: u64 = 256 << 10;
/// The key whose SHA-256 is in `tests/e2b/test-keys`.
const TEST_KEY: &str = "e2b_crab_test_key";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn sha256_hex(data: &[u8]) -> String {
    let mut c =
        Command::new("sha256sum").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    c.stdin.take().unwrap().write_all(data).unwrap();
    let out = c.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().to_string()
}

/// `VmHWM` (KiB) of the daemon whose state directory is `state`.
fn hwm_kib(state: &Path) -> u64 {
    let pid = std::fs::read_to_string(state.join("daemon.pid")).unwrap();
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid.trim())).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// One raw HTTP/1.1 exchange on `stream`: send `head` (and nothing more), read the answer until
/// the server closes or 30 s pass.
fn raw_answer(mut stream: impl Read + Write, head: &str) -> String {
    stream.write_all(head.as_bytes()).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
                    break;
                }
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn unix(state: &Path) -> UnixStream {
    let s = UnixStream::connect(state.join("crab.sock")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s
}

#[test]
fn a_1mb_command_line_and_a_200k_environment_run_through_crab_exec() {
    require_root!();
    let sb = Sandbox::new("t-lim-argv");
    let args: Vec<String> =
        (0..10).map(|i| ((b'a' + i) as char).to_string().repeat(100_000)).collect();
    let big1 = format!("BIG1={}", "x".repeat(100_000));
    let big2 = format!("BIG2={}", "y".repeat(100_000));
    let script = r#"printf %s "$*" | sha256sum; echo $#; printf %s "$BIG1$BIG2" | wc -c"#;
    let mut a: Vec<&str> =
        vec!["exec", "-e", &big1, "-e", &big2, &sb.name, "--", "sh", "-c", script, "sh"];
    a.extend(args.iter().map(String::as_str));
    let o = crab(&a);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0].split_whitespace().next().unwrap(), sha256_hex(args.join(" ").as_bytes()));
    assert_eq!(lines[1], "10");
    assert_eq!(lines[2].trim(), "200000");
}

/// `POST /v1/sandboxes/{sb}/exec` with `body` (too large for a command line of `curl`): the
/// first frame of its answer.
fn exec_frame(sb: &str, body: &serde_json::Value) -> serde_json::Value {
    let body = body.to_string();
    let head = format!(
        "POST /v1/sandboxes/{sb}/exec HTTP/1.1\r\nhost: crab\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = raw_answer(unix(&common::state_dir()), &head);
    let line =
        answer.lines().find(|l| l.contains("\"t\"")).unwrap_or_else(|| panic!("{answer:.500}"));
    serde_json::from_str(line.trim()).unwrap()
}

#[test]
fn one_argument_past_128k_is_refused_before_start_naming_the_limit() {
    require_root!();
    let sb = Sandbox::new("t-lim-e2big");
    let body = serde_json::json!({"cmd": ["sh", "-c", "touch /ran", "z".repeat(200_000)]});
    let v = exec_frame(&sb.name, &body);
    let msg = v.to_string();
    assert_eq!(v["t"], "error", "{msg:.300}");
    assert!(
        msg.contains("MAX_ARG_STRLEN") && msg.contains("argument 3") && msg.contains("stdin"),
        "{msg:.600}"
    );
    assert_eq!(sb.sh("test -e /ran && echo ran").0, "", "the command ran");
    // An environment string past it too, named by its variable.
    let body =
        serde_json::json!({"cmd": ["true"], "env": [format!("HUGE={}", "z".repeat(200_000))]});
    let v = exec_frame(&sb.name, &body);
    assert!(v.to_string().contains("environment variable HUGE"), "{:.300}", v.to_string());
}

/// `bash -c` a 1 GiB random stream into `consumer` (reading stdin), its sha256 into `sum`.
fn gib_into(consumer: &str, sum: &Path) -> std::process::Output {
    let script =
        format!("head -c 1G /dev/urandom | tee >(sha256sum >{}) | {consumer}", sum.display());
    let out = Command::new("bash").args(["-c", &script]).output().unwrap();
    // The process substitution may finish after the pipeline.
    assert!(common::wait_until(30.0, || std::fs::read_to_string(sum).is_ok_and(|s| s.len() >= 64)));
    out
}

#[test]
fn a_1g_upload_and_a_1g_stdin_stream_through_the_api_with_the_daemon_bounded() {
    require_root!();
    let state = common::state_dir();
    let sock = state.join("crab.sock");
    let sock = sock.to_str().unwrap();
    let sb = Sandbox::new("t-lim-1g");
    let tmp = std::env::temp_dir().join(unique("crab-lim"));
    std::fs::create_dir_all(&tmp).unwrap();

    // A file write, chunked (no declared length).
    let before = hwm_kib(&state);
    let url = format!("http://crab/v1/sandboxes/{}/files?path=/root/big", sb.name);
    let o = gib_into(&format!("curl -sS --unix-socket {sock} -X PUT -T - '{url}'"), &tmp.join("w"));
    let after = hwm_kib(&state);
    eprintln!("daemon VmHWM, 1 GiB API upload: {before} KiB before, {after} KiB after");
    let entry: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(entry["size"], 1u64 << 30, "{entry}");
    let sent = std::fs::read_to_string(tmp.join("w")).unwrap();
    let (inside, _, _) = sb.sh("sha256sum /root/big && rm /root/big");
    assert_eq!(inside.split_whitespace().next(), sent.split_whitespace().next());
    assert!(
        after.saturating_sub(before) < RSS_GROWTH_MAX_KIB,
        "the daemon grew by {} KiB",
        after - before
    );

    // A stdin: an exec session, its stdin a raw body streamed into the pipe.
    let before = hwm_kib(&state);
    let exec =
        serde_json::json!({"cmd": ["sh", "-c", "sha256sum; echo read"], "stdin_session": "big"});
    let reader = Command::new("curl")
        .args(["-sSN", "--unix-socket", sock, "-X", "POST", "-H", "content-type: application/json"])
        .args(["--data-binary", &exec.to_string()])
        .arg(format!("http://crab/v1/sandboxes/{}/exec", sb.name))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let url = format!("http://crab/v1/sandboxes/{}/exec/big/stdin?eof=true", sb.name);
    let feed = format!(
        "curl -sS --retry 20 --retry-all-errors --retry-delay 0 --unix-socket {sock} -X POST \
         -H 'content-type: application/octet-stream' -T - '{url}'"
    );
    let o = gib_into(&feed, &tmp.join("s"));
    let written: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(written["written"], 1u64 << 30, "{written}");
    let frames = reader.wait_with_output().unwrap();
    let after = hwm_kib(&state);
    eprintln!("daemon VmHWM, 1 GiB API stdin: {before} KiB before, {after} KiB after");
    let mut stdout = Vec::new();
    for line in String::from_utf8_lossy(&frames.stdout).lines() {
        let f: serde_json::Value = serde_json::from_str(line).unwrap();
        if f["t"] == "stdout" {
            use base64::Engine as _;
            stdout.extend(
                base64::engine::general_purpose::STANDARD.decode(f["d"].as_str().unwrap()).unwrap(),
            );
        }
    }
    let sent = std::fs::read_to_string(tmp.join("s")).unwrap();
    let stdout = String::from_utf8_lossy(&stdout);
    assert_eq!(
        stdout.split_whitespace().collect::<Vec<_>>(),
        [sent.split_whitespace().next().unwrap(), "-", "read"]
    );
    assert!(
        after.saturating_sub(before) < RSS_GROWTH_MAX_KIB,
        "the daemon grew by {} KiB",
        after - before
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn a_declared_body_over_max_upload_is_refused_at_once_naming_the_flag() {
    require_root!();
    let state = common::state_dir();
    let sb = Sandbox::new("t-lim-413");
    for (method, path, ct) in [
        (
            "PUT",
            format!("/v1/sandboxes/{}/files?path=/root/never", sb.name),
            "application/octet-stream",
        ),
        ("PUT", format!("/v1/sandboxes/{}/files/tar?path=/root", sb.name), "application/x-tar"),
        (
            "POST",
            format!("/v1/sandboxes/{}/exec/none/stdin?eof=true", sb.name),
            "application/octet-stream",
        ),
    ] {
        // 5 GiB declared, none sent: the answer must come from the head alone.
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: crab\r\ncontent-type: {ct}\r\ncontent-length: {}\r\n\r\n",
            5u64 << 30
        );
        let answer = raw_answer(unix(&state), &head);
        assert!(answer.starts_with("HTTP/1.1 413"), "{method} {path}: {answer}");
        assert!(answer.contains("--max-upload") && answer.contains("too_large"), "{answer}");
    }
    assert_eq!(sb.sh("test -e /root/never && echo there").0, "");
}

/// A daemon of its own (no E2B), serving `debian` from the main test daemon's image, with
/// `args`.
fn daemon_with_debian(prefix: &str, args: &[&str]) -> OtherDaemon {
    let image = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    assert!(
        image.is_dir(),
        "no debian image in the test daemon's state dir: run `crab image build debian`"
    );
    let mut a = vec!["--pool-size", "4G"];
    a.extend_from_slice(args);
    let d = OtherDaemon::start(&PathBuf::from("/var/lib").join(unique(prefix)), &a, &[]);
    d.crab_ok(&["image", "import", "debian", image.to_str().unwrap()]);
    d
}

#[test]
fn an_undeclared_body_over_max_upload_fails_when_it_passes_the_limit() {
    require_root!();
    let d = daemon_with_debian("crab-lim-max", &["--max-upload", "1M", "--http-body-timeout", "2"]);
    d.crab_ok(&["sandbox", "create", "debian", "--name", "up"]);
    let sock = d.state.join("crab.sock");
    let sock = sock.to_str().unwrap();
    d.crab_ok(&["exec", "up", "--", "sh", "-c", "printf original > /root/f; chmod 640 /root/f"]);
    // 2 MiB chunked into a file write.
    let o = Command::new("bash")
        .args(["-c", &format!("head -c 2M /dev/zero | curl -sS --unix-socket {sock} -X PUT -T - 'http://crab/v1/sandboxes/up/files?path=/root/f'")])
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&o.stdout);
    assert!(
        answer.contains("too_large")
            && answer.contains("--max-upload")
            && answer.contains("1048576"),
        "{answer}"
    );
    // The write was cut off: the file is as it was (never a shorter new one), and the hidden
    // file the write was filling is gone.
    let left = d.crab_ok(&[
        "exec",
        "up",
        "--",
        "sh",
        "-c",
        "cat /root/f; stat -c ' %a' /root/f; ls -A /root | grep -c crab-upload || true",
    ]);
    assert_eq!(left, "original 640\n0\n", "after a cut-off write");
    // Under the limit it goes through.
    let o = Command::new("bash")
        .args(["-c", &format!("head -c 1000000 /dev/zero | curl -sS --unix-socket {sock} -X PUT -T - 'http://crab/v1/sandboxes/up/files?path=/root/g'")])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("\"size\":1000000"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // A command that takes its stdin slowly (it reads nothing for 5 s, past the 2 s body
    // deadline, while its pipe is full) does not make the client late: the body deadline
    // counts only the time spent waiting for the client.
    let exec = serde_json::json!({"cmd": ["sh", "-c", "sleep 5; wc -c"], "stdin_session": "slow"});
    let reader = Command::new("curl")
        .args(["-sSN", "--unix-socket", sock, "-X", "POST", "-H", "content-type: application/json"])
        .args(["--data-binary", &exec.to_string()])
        .arg("http://crab/v1/sandboxes/up/exec")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let feed = format!(
        "head -c 1000000 /dev/zero | curl -sS --retry 20 --retry-all-errors --retry-delay 0 \
         --unix-socket {sock} -X POST -H 'content-type: application/octet-stream' -T - \
         'http://crab/v1/sandboxes/up/exec/slow/stdin?eof=true'"
    );
    let o = Command::new("bash").args(["-c", &feed]).output().unwrap();
    let written = String::from_utf8_lossy(&o.stdout);
    assert!(written.contains("\"written\":1000000"), "{written}");
    let frames = String::from_utf8_lossy(&reader.wait_with_output().unwrap().stdout).into_owned();
    // "1000000\n", base64.
    assert!(frames.contains("MTAwMDAwMAo="), "{frames}");
}

/// A `crab` that runs with at most `nofile` descriptors (its connection caps follow).
fn limited_crab(dir: &Path, nofile: u32) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let real = std::fs::canonicalize(common::bin()).unwrap();
    let wrapper = dir.join("crab");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec prlimit --nofile={nofile}:{nofile} -- {} \"$@\"\n",
            real.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    wrapper
}

#[test]
fn the_e2b_port_is_bounded_like_the_api_socket() {
    require_root!();
    let tmp = std::env::temp_dir().join(unique("crab-lim-e2b"));
    let bin = limited_crab(&tmp, 512);
    let port = 20000 + (u32::from_str_radix(&unique("p")[2..], 16).unwrap() % 20000) as u16;
    let listen = format!("127.0.0.1:{port}");
    let keys = repo().join("crates/crab/tests/e2b/test-keys");
    let d = OtherDaemon::start_from(
        &bin,
        &PathBuf::from("/var/lib").join(unique("crab-lim-e2b")),
        &[
            "--pool-size",
            "2G",
            "--e2b-listen",
            &listen,
            "--e2b-keys",
            keys.to_str().unwrap(),
            "--http-header-timeout",
            "8",
            "--http-body-timeout",
            "3",
        ],
        &[],
    );
    let tcp = || {
        let s = TcpStream::connect(&listen).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    };

    // A request head never finished: dropped at the header timeout (on both doors).
    let unfinished = "GET /health HTTP/1.1\r\nhost: crab\r\nx-slow: ";
    assert_eq!(raw_answer(tcp(), unfinished), "", "the E2B port answered an unfinished head");
    assert_eq!(
        raw_answer(unix(&d.state), unfinished),
        "",
        "the API socket answered an unfinished head"
    );

    // A body trickled a byte every 200 ms: cut off at the body deadline (3 s + 0 s per MiB),
    // long before its 1000 bytes arrive.
    let mut s = tcp();
    s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    s.write_all(
        format!("POST /sandboxes HTTP/1.1\r\nhost: crab\r\nx-api-key: {TEST_KEY}\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{").as_bytes(),
    )
    .unwrap();
    let mut answer = Vec::new();
    let mut sent = 1;
    let mut buf = [0u8; 4096];
    while sent < 1000 {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
        if !answer.is_empty() || s.write_all(b" ").is_err() {
            break;
        }
        sent += 1;
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(sent < 1000, "the trickled body was taken whole: {answer}");
    assert!(
        answer.is_empty() || answer.contains(" 408 ") || answer.contains("did not arrive"),
        "{answer}"
    );

    // A flood past the E2B port's cap (64 of 512 descriptors): the rest are refused with a
    // 503 at once, and the API socket still answers while they are held.
    // All connections first (the header timeout would free places if they came slowly),
    // then what each was told: a refusal is written at accept.
    let conns: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(&listen).unwrap()).collect();
    let (mut refused, mut held) = (0, Vec::new());
    for mut s in conns {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(n) if n > 0 => {
                let a = String::from_utf8_lossy(&buf[..n]);
                assert!(a.starts_with("HTTP/1.1 503") && a.contains("E2B API"), "{a}");
                refused += 1;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                held.push(s)
            }
            _ => {}
        }
    }
    assert!(
        refused >= 200 - 64 - 8,
        "only {refused} of 200 connections were refused past a cap of 64"
    );
    assert!(held.len() <= 64, "{} connections were admitted past a cap of 64", held.len());
    assert!(
        d.crab(&["version"]).status.success(),
        "the API socket did not answer during the flood"
    );
    drop(held);
    let health =
        || raw_answer(tcp(), "GET /health HTTP/1.1\r\nhost: crab\r\nconnection: close\r\n\r\n");
    assert!(common::wait_until(10.0, || health().starts_with("HTTP/1.1 20")), "{}", health());
    // The daemon's CLI is the wrapper: remove the daemon before it.
    d.destroy();
    let _ = std::fs::remove_dir_all(&tmp);
}
