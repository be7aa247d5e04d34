//! The `nat` network mode with real namespaces, veths and nftables: a `nat` sandbox reaches a
//! server in a separate "outside" network namespace (routed through the host, so the server
//! sees the host's address: masquerade), cannot reach the host's loopback, the host's own
//! addresses, its gateway or another sandbox, still reaches the in-sandbox LLM endpoint; after a
//! full checkpoint and an in-place restore it keeps its address and its network, a fork branch
//! gets a network and an address of its own; `rm` leaves no host interface, route or (for the
//! last `nat` sandbox) table behind; bad ranges are a 400 naming the problem. A `private`
//! sandbox's namespace (created empty by CRIU at a restore or fork, set up by the daemon) holds
//! what a fresh one does.
//!
//! Needs root, CRIU, iproute2, nftables and the default image.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};

use common::{crab, crab_ok, state_dir, unique, wait_until, Sandbox};

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A network namespace playing "the outside world": a veth to the host (`198.18.N.1/30` on the
/// host, `.2` inside) and an HTTP server on `.2:8080` answering with the peer's address.
struct Outside {
    ns: String,
    host_if: String,
    addr: String,
    host_side: String,
    server: Child,
}

const SERVER_PY: &str = r#"
import http.server, socketserver, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(s):
        b = ("peer " + s.client_address[0]).encode()
        s.send_response(200); s.send_header("content-length", str(len(b))); s.end_headers(); s.wfile.write(b)
    def log_message(s, *a): pass
# TCPServer, not HTTPServer: that one looks up its own name in DNS before it listens.
socketserver.TCPServer((sys.argv[1], 8080), H).serve_forever()
"#;

impl Outside {
    fn new() -> Self {
        let tag = unique("o");
        let n = u32::from_str_radix(&tag[2..], 16).unwrap();
        let (b, c) = ((n >> 8) % 250 + 1, (n % 63) * 4);
        let ns = format!("crabtest-{tag}");
        let host_if = format!("ctest{:06x}", n & 0xff_ffff);
        let (host_side, addr) = (format!("198.18.{b}.{}", c + 1), format!("198.18.{b}.{}", c + 2));
        ip(&["netns", "add", &ns]);
        ip(&["link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &ns]);
        ip(&["addr", "add", &format!("{host_side}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&["-n", &ns, "addr", "add", &format!("{addr}/30"), "dev", "eth0"]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ip(&["-n", &ns, "route", "add", "default", "via", &host_side]);
        let server = Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c", SERVER_PY, &addr])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let o = Outside { ns, host_if, addr, host_side, server };
        let up = || {
            Command::new("ip")
                .args(["netns", "exec", &o.ns, "curl", "-sf", "-m", "1"])
                .arg(format!("http://{}:8080/", o.addr))
                .output()
                .is_ok_and(|x| x.status.success())
        };
        if !wait_until(10.0, up) {
            let mut o = o;
            let alive = o.server.try_wait().map(|s| format!("{s:?}"));
            let probe = Command::new("ip")
                .args(["netns", "exec", &o.ns, "curl", "-sS", "-m", "1"])
                .arg(format!("http://{}:8080/", o.addr))
                .output()
                .unwrap();
            panic!(
                "the outside server on {} in {} did not start (exit status {alive:?}): {}",
                o.addr,
                o.ns,
                String::from_utf8_lossy(&probe.stderr)
            );
        }
        o
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

fn nat_sandbox(prefix: &str) -> Sandbox {
    Sandbox::with_args(prefix, &["--network", "nat"])
}

fn address(sb: &Sandbox) -> String {
    sb.info()["address"].as_str().expect("a nat sandbox reports its address").to_string()
}

/// The host end of a sandbox's veth pair, from its record.
fn host_if(name: &str) -> String {
    let rec = std::fs::read(state_dir().join("pool/sandboxes").join(name).join("sandbox.json"))
        .unwrap_or_else(|e| panic!("record of {name}: {e}"));
    let rec: serde_json::Value = serde_json::from_slice(&rec).unwrap();
    rec["nat"]["host_if"].as_str().expect("record has nat.host_if").to_string()
}

/// `connect` from inside: 0 when a TCP connection to addr:port opened within 2 s.
fn connects(sb: &Sandbox, addr: &str, port: u16) -> bool {
    let (_, _, code) =
        sb.sh(&format!("timeout 3 bash -c 'exec 3<>/dev/tcp/{addr}/{port}' 2>/dev/null"));
    code == 0
}

fn get_outside(sb: &Sandbox, o: &Outside) -> String {
    sb.sh_ok(&format!("curl -sS -m 5 http://{}:8080/", o.addr))
}

fn host_addresses() -> Vec<String> {
    let out = Command::new("hostname").arg("-I").output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_string).collect()
}

/// Everything a `nat` sandbox must not reach, and what it must.
fn assert_isolated(sb: &Sandbox, peer: &Sandbox, peer_addr: &str, loopback_port: u16, when: &str) {
    assert!(connects(peer, peer_addr, 9000), "{when}: control: the peer cannot reach itself");
    assert!(!connects(sb, peer_addr, 9000), "{when}: {} reached sandbox {}", sb.name, peer.name);
    assert!(!connects(sb, "127.0.0.1", loopback_port), "{when}: reached a host loopback port?");
    for a in host_addresses() {
        if a.contains('.') {
            assert!(!connects(sb, &a, loopback_port), "{when}: reached the host address {a}");
        }
    }
    // The gateway is a host address on the host end of the veth.
    let gw = sb.sh_ok("ip route show default | awk '{print $3}'").trim().to_string();
    assert!(!gw.is_empty(), "{when}: no default route");
    assert!(!connects(sb, &gw, loopback_port), "{when}: reached the gateway {gw}");
    // The in-sandbox LLM endpoint is inside the sandbox's own namespace.
    assert!(connects(sb, "127.0.0.1", 7431), "{when}: the in-sandbox LLM endpoint is unreachable");
}

#[test]
fn nat_egress_isolation_restore_and_fork() {
    // SAFETY: geteuid has no preconditions.
    assert!(unsafe { libc::geteuid() } == 0, "needs root (CRAB_REQUIRE_PRIVILEGED)");
    let outside = Outside::new();
    let host_listener = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = host_listener.local_addr().unwrap().port();

    let a = nat_sandbox("t-nat-a");
    let b = nat_sandbox("t-nat-b");
    let (addr_a, addr_b) = (address(&a), address(&b));
    assert_ne!(addr_a, addr_b);
    assert_eq!(a.info()["net"], "nat");
    b.sh_ok("nohup python3 -m http.server 9000 --bind 0.0.0.0 >/dev/null 2>&1 &");
    assert!(wait_until(10.0, || connects(&b, &addr_b, 9000)), "server in b did not start");

    // Egress: routed through the host and masqueraded to the host's address.
    let got = get_outside(&a, &outside);
    assert_eq!(got, format!("peer {}", outside.host_side), "egress not masqueraded");
    assert_isolated(&a, &b, &addr_b, port, "fresh");

    // Full checkpoint + restore in place: same address, network back, isolation holds.
    let if_before = host_if(&a.name);
    a.sh_ok("nohup sleep 100000 >/dev/null 2>&1 &");
    let out = crab_ok(&["--json", "checkpoint", &a.name, "--kind", "full"]);
    let point: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = point["point"]["id"].as_str().unwrap().to_string();
    crab_ok(&["restore", &a.name]);
    assert_eq!(address(&a), addr_a, "restore in place changed the address");
    assert_eq!(a.sh_ok("pgrep -c sleep").trim(), "1", "the restored process is missing");
    let if_after = host_if(&a.name);
    assert_ne!(if_before, if_after, "a restore makes a new veth pair");
    assert!(
        !std::path::Path::new("/sys/class/net").join(&if_before).exists(),
        "the previous host end {if_before} was left behind"
    );
    assert_eq!(get_outside(&a, &outside), format!("peer {}", outside.host_side));
    assert_isolated(&a, &b, &addr_b, port, "after restore");

    // A fork branch: its own address, a working network, the same isolation.
    let out = crab_ok(&["--json", "fork", &a.name, &id, "--count", "1"]);
    let branches: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let branch = Sandbox { name: branches[0]["sandbox"].as_str().unwrap().to_string() };
    let addr_f = address(&branch);
    assert_ne!(addr_f, addr_a, "the fork branch has its source's address");
    assert_ne!(addr_f, addr_b);
    let inside = branch.sh_ok("ip -4 -o addr show dev eth0");
    assert!(inside.contains(&format!("{addr_f} peer")), "eth0 of the branch: {inside}");
    assert_eq!(branch.sh_ok("pgrep -c sleep").trim(), "1", "the forked process is missing");
    assert_eq!(get_outside(&branch, &outside), format!("peer {}", outside.host_side));
    assert_isolated(&branch, &b, &addr_b, port, "fork branch");
    // The source still works next to its branch.
    assert_eq!(get_outside(&a, &outside), format!("peer {}", outside.host_side));

    // rm leaves no host end and no route behind.
    let ends: Vec<(String, String)> =
        [&a, &b, &branch].iter().map(|s| (host_if(&s.name), address(s))).collect();
    drop(branch);
    drop(b);
    drop(a);
    for (end, addr) in ends {
        assert!(
            !std::path::Path::new("/sys/class/net").join(&end).exists(),
            "host end {end} left behind"
        );
        let routes = Command::new("ip").args(["-4", "route", "show", &addr]).output().unwrap();
        assert!(routes.stdout.is_empty(), "route to {addr} left behind");
    }
    drop(host_listener);
}

#[test]
fn bad_nat_ranges_are_refused_with_400() {
    common::ensure_daemon();
    let sock = state_dir().join("crab.sock");
    for (range, says) in [
        ("8.8.8.0/24", "not inside a private range"),
        ("10.1.2.3/16", "did you mean 10.1.0.0/16"),
        ("10.0.0.0/31", "/8 to /30"),
        ("banana", "CIDR"),
    ] {
        let body = format!(r#"{{"image":"debian","net":"nat","nat_range":"{range}"}}"#);
        let out = Command::new("curl")
            .args(["-s", "-w", "\n%{http_code}", "--unix-socket"])
            .arg(&sock)
            .args(["-X", "POST", "-H", "content-type: application/json", "-d", &body])
            .arg("http://crab/v1/sandboxes")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let (json, code) = text.rsplit_once('\n').unwrap();
        assert_eq!(code, "400", "{range}: {text}");
        assert!(json.contains("invalid_request") && json.contains(says), "{range}: {json}");
    }
    // A range without --network nat is refused too, and the CLI says why.
    let name = unique("t-nat-bad");
    let out = crab(&["sandbox", "create", "debian", "--name", &name, "--nat-range", "10.9.0.0/16"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--network nat"));
    assert!(
        !state_dir().join("pool/sandboxes").join(&name).exists(),
        "a refused create left a sandbox"
    );
}

/// What a `private` sandbox's network namespace holds — only `lo`, up, with 127.0.0.1 and
/// unprivileged ping allowed (`ping` itself is not in the image) — and a server on 127.0.0.1
/// answering through it.
fn private_net_state(sb: &Sandbox) -> String {
    sb.sh_ok(
        "ip -o link | awk '{print $2, $3}'; ip -o addr show dev lo | awk '{print $4}'; \
         cat /proc/sys/net/ipv4/ping_group_range; \
         python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8000/\").status)'",
    )
}

/// A restore or fork of a `private` sandbox gets a fresh network namespace that CRIU creates
/// empty and the daemon sets up (`empty_ns`), not a replay of the dumped one: it must hold the
/// same as the original's, and the restored server must answer on it.
#[test]
fn private_network_after_restore_and_in_a_fork() {
    // SAFETY: geteuid has no preconditions.
    assert!(unsafe { libc::geteuid() } == 0, "needs root (CRAB_REQUIRE_PRIVILEGED)");
    let a = Sandbox::new("t-pnet");
    a.sh_ok("cd /tmp && setsid python3 -m http.server 8000 --bind 127.0.0.1 </dev/null >/dev/null 2>&1 &");
    assert!(wait_until(10.0, || connects(&a, "127.0.0.1", 8000)), "server did not start");
    let fresh = private_net_state(&a);
    assert!(fresh.contains("lo: <LOOPBACK,UP,LOWER_UP>"), "{fresh}");
    // Every gid of the sandbox's user namespace may ping.
    assert!(fresh.contains("127.0.0.1/8") && fresh.contains("0\t65535"), "{fresh}");
    assert!(fresh.trim_end().ends_with("200"), "{fresh}");

    crab_ok(&["checkpoint", &a.name, "--kind", "full"]);
    a.sh_ok("pkill -f 'http[.]server'; true");
    crab_ok(&["restore", &a.name]);
    assert_eq!(private_net_state(&a), fresh, "after the restore");

    let out = crab_ok(&["--json", "fork", &a.name, "--count", "1"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let branch = v[0]["sandbox"].as_str().expect("fork names its branch").to_string();
    let b = Sandbox { name: branch };
    assert_eq!(private_net_state(&b), fresh, "in the fork");
}
