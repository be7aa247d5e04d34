//! The `nat` network mode: a veth pair per sandbox, an address from a private range, and
//! masquerading egress through one nftables table per daemon instance.
//!
//! Topology (routed /32s, no bridge): the sandbox's end is `eth0` with `A/32 peer G` and a
//! default route via `G`; the host's end (`crab<tag><id>`, 15 characters) carries `G/32 peer
//! A/32`, which gives the host its route to `A`. `G` is the range's first address, the same on
//! every host end (a link-scoped gateway the sandbox ARPs for); sandboxes get the following
//! ones. The daemon's table `inet crab-<instance>` (named after `StateDir::instance`, so two
//! daemons never touch each other's rules) refuses (ICMP admin-prohibited, so tools fail at
//! once instead of hanging) everything a sandbox sends to the host itself
//! (any host address, IPv4 or IPv6: the daemon's proxy listener and every other local server),
//! and everything between two sandbox interfaces of *any* daemon (east-west); it drops any
//! connection opened towards a sandbox, spoofed sources and IPv6 forwarding, and masquerades
//! the rest. The
//! in-sandbox LLM endpoint `127.0.0.1:7431` is a listener inside the sandbox's own namespace
//! and needs none of this.
//!
//! Links and addresses are made with iproute2 (`ip -batch`, in the sandbox's namespace through
//! `nsenter`) and the table with one `nft -f` transaction that replaces it whole from the
//! current leases, so it never holds a stale rule and disappears with the last `nat` sandbox.
//! Everything is reconciled when a daemon opens its state directory: the host ends of dead
//! sandboxes and stray host ends of this instance are deleted.
//!
//! Checkpoint/restore: CRIU dumps `eth0` as a veth whose peer is outside and, on restore,
//! recreates the pair with the host end named by `external veth[eth0]:<name>`
//! ([`Nat::prepare_restore`]); [`Nat::finish_restore`] then configures the host end and (for a
//! fork branch, which gets its own address) re-addresses `eth0`.

use std::collections::HashMap;
use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::error::{Result, SandboxError};

/// The daemon's default `nat` range (`crab daemon --nat-range`).
pub const DEFAULT_NAT_RANGE: &str = "10.213.0.0/16";
/// The sandbox's end of its veth pair.
pub const SANDBOX_IF: &str = "eth0";

/// A `nat` sandbox's network: its address, gateway and the host end of its veth pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NatLease {
    /// The range it was allocated from (`10.213.0.0/16`).
    pub range: String,
    /// The sandbox's address (on `eth0`, as a /32).
    pub addr: Ipv4Addr,
    /// Its gateway: the range's first address, on the host end.
    pub gateway: Ipv4Addr,
    /// Name of the host end of the veth pair of the current incarnation (a restore makes a
    /// new pair with a new name).
    pub host_if: String,
}

/// Parse and check a `nat` range: an IPv4 network address in a private range, /8 to /30,
/// that overlaps no address or route of the host (other than a Crab sandbox's).
pub fn parse_range(s: &str) -> Result<Ipv4Net> {
    let bad = |why: String| {
        SandboxError::Invalid(format!(
            "nat range {s:?} {why}; give a private IPv4 network such as {DEFAULT_NAT_RANGE}"
        ))
    };
    let net: Ipv4Net =
        s.trim().parse().map_err(|_| bad("is not an IPv4 network in CIDR form".into()))?;
    if net.addr() != net.network() {
        return Err(bad(format!("has host bits set (did you mean {}?)", net.trunc())));
    }
    if !(8..=30).contains(&net.prefix_len()) {
        return Err(bad(format!(
            "has prefix /{}; allowed: /8 to /30 (a gateway and at least one sandbox)",
            net.prefix_len()
        )));
    }
    let private: [Ipv4Net; 4] = [
        Ipv4Net::new(Ipv4Addr::new(10, 0, 0, 0), 8),
        Ipv4Net::new(Ipv4Addr::new(172, 16, 0, 0), 12),
        Ipv4Net::new(Ipv4Addr::new(192, 168, 0, 0), 16),
        Ipv4Net::new(Ipv4Addr::new(100, 64, 0, 0), 10),
    ]
    .map(|n| n.unwrap_or_default());
    if !private.iter().any(|p| p.contains(&net)) {
        return Err(bad(
            "is not inside a private range (10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 100.64.0.0/10)"
                .into(),
        ));
    }
    for (what, other, dev) in host_networks()? {
        if dev.starts_with(IF_PREFIX) {
            continue;
        }
        if other.contains(&net.network()) || net.contains(&other.network()) {
            return Err(bad(format!("overlaps the host's {what} {other} on {dev}")));
        }
    }
    Ok(net)
}

/// The host's IPv4 addresses (as their networks) and non-default routes: `(kind, net, dev)`.
fn host_networks() -> Result<Vec<(&'static str, Ipv4Net, String)>> {
    let mut out = Vec::new();
    let addrs: serde_json::Value =
        serde_json::from_slice(&run(&["ip", "-4", "-j", "addr", "show"])?)
            .map_err(|e| SandboxError::Other(format!("parsing `ip -j addr`: {e}")))?;
    for link in addrs.as_array().into_iter().flatten() {
        let dev = link["ifname"].as_str().unwrap_or("").to_string();
        if dev == "lo" {
            continue;
        }
        for a in link["addr_info"].as_array().into_iter().flatten() {
            let (Some(ip), Some(len)) = (a["local"].as_str(), a["prefixlen"].as_u64()) else {
                continue;
            };
            if let (Ok(ip), Ok(len)) = (ip.parse::<Ipv4Addr>(), u8::try_from(len)) {
                if let Ok(n) = Ipv4Net::new(ip, len) {
                    out.push(("address", n.trunc(), dev.clone()));
                }
            }
        }
    }
    let routes: serde_json::Value =
        serde_json::from_slice(&run(&["ip", "-4", "-j", "route", "show", "table", "main"])?)
            .map_err(|e| SandboxError::Other(format!("parsing `ip -j route`: {e}")))?;
    for r in routes.as_array().into_iter().flatten() {
        let dst = r["dst"].as_str().unwrap_or("default");
        let dev = r["dev"].as_str().unwrap_or("").to_string();
        let net = if dst.contains('/') {
            dst.parse::<Ipv4Net>().ok()
        } else {
            dst.parse::<Ipv4Addr>().ok().and_then(|a| Ipv4Net::new(a, 32).ok())
        };
        if let Some(n) = net {
            out.push(("route", n, dev));
        }
    }
    Ok(out)
}

/// Prefix of every Crab host-side interface (all daemons): east-west isolation matches it.
const IF_PREFIX: &str = "crab";

/// The `nat` state of one daemon instance.
#[derive(Debug)]
pub struct Nat {
    /// `crab-<instance>`: the nftables table.
    table: String,
    /// 4 hex digits of the instance: its host interfaces are `crab<tag>*`.
    tag: String,
    default_range: Mutex<Ipv4Net>,
    leases: Mutex<HashMap<String, NatLease>>,
}

fn run(args: &[&str]) -> Result<Vec<u8>> {
    run_input(args, None)
}

fn run_input(args: &[&str], input: Option<&str>) -> Result<Vec<u8>> {
    let cmd = args.join(" ");
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| SandboxError::Command {
            cmd: cmd.clone(),
            detail: format!("cannot run it: {e} (install iproute2 and nftables)"),
        })?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin.write_all(text.as_bytes()).map_err(|e| SandboxError::Command {
            cmd: cmd.clone(),
            detail: format!("writing its input: {e}"),
        })?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| SandboxError::Command { cmd: cmd.clone(), detail: e.to_string() })?;
    if !out.status.success() {
        return Err(SandboxError::Command {
            cmd,
            detail: format!(
                "{}: {}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                input.map(|i| format!("\ninput:\n{i}")).unwrap_or_default()
            ),
        });
    }
    Ok(out.stdout)
}

/// Delete host link `name`; a missing one is fine.
fn delete_link(name: &str) {
    if !std::path::Path::new("/sys/class/net").join(name).exists() {
        return;
    }
    if let Err(e) = run(&["ip", "link", "del", name]) {
        tracing::warn!(link = name, error = %e, "cannot delete a sandbox's host interface");
    }
}

fn host_links() -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

impl Nat {
    /// The `nat` state of instance `instance` (`StateDir::instance`).
    pub fn new(instance: &str) -> Self {
        let mut hash: u32 = 0x811c_9dc5;
        for b in instance.bytes() {
            hash ^= u32::from(b);
            hash = hash.wrapping_mul(0x0100_0193);
        }
        let default = DEFAULT_NAT_RANGE.parse().unwrap_or_default();
        Nat {
            table: format!("crab-{instance}").chars().take(60).collect(),
            tag: format!("{:04x}", hash & 0xffff),
            default_range: Mutex::new(default),
            leases: Mutex::new(HashMap::new()),
        }
    }

    /// The nftables table of this instance (`inet <table>`).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Prefix of this instance's host interfaces.
    pub fn if_prefix(&self) -> String {
        format!("{IF_PREFIX}{}", self.tag)
    }

    /// Set the range new `nat` sandboxes get addresses from when their request names none.
    pub fn set_default_range(&self, range: &str) -> Result<()> {
        let net = parse_range(range)?;
        *self.default_range.lock().unwrap_or_else(|p| p.into_inner()) = net;
        Ok(())
    }

    /// The current lease of sandbox `name`.
    pub fn lease(&self, name: &str) -> Option<NatLease> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner()).get(name).cloned()
    }

    fn new_host_if(&self) -> String {
        format!("{}{:07x}", self.if_prefix(), crate::runtime::rand_u32() & 0x0fff_ffff)
    }

    /// Give sandbox `name` an address from `range` (the default when `None`) unless it has one.
    /// The address is free in this daemon and has no route on the host (another daemon's).
    pub fn allocate(&self, name: &str, range: Option<&str>) -> Result<NatLease> {
        let net = match range {
            Some(r) => parse_range(r)?,
            None => *self.default_range.lock().unwrap_or_else(|p| p.into_inner()),
        };
        let routed: Vec<Ipv4Net> = host_networks()?
            .into_iter()
            .filter(|(k, n, _)| *k == "route" && n.prefix_len() == 32)
            .map(|(_, n, _)| n)
            .collect();
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = leases.get(name) {
            return Ok(l.clone());
        }
        let gateway = net.hosts().next().ok_or_else(|| {
            SandboxError::Invalid(format!("nat range {net} has no room for a gateway"))
        })?;
        let addr = net
            .hosts()
            .skip(1)
            .find(|a| {
                !leases.values().any(|l| l.addr == *a) && !routed.iter().any(|r| r.addr() == *a)
            })
            .ok_or_else(|| {
                SandboxError::Conflict(format!(
                    "nat range {net} is exhausted ({} sandboxes); remove some or start the daemon with a larger --nat-range",
                    leases.len()
                ))
            })?;
        let lease = NatLease { range: net.to_string(), addr, gateway, host_if: self.new_host_if() };
        leases.insert(name.to_string(), lease.clone());
        Ok(lease)
    }

    /// Wire a freshly started sandbox (init `pid`, its own empty network namespace) to its
    /// lease: a new veth pair, addresses, routes, and the table.
    pub fn attach(&self, name: &str, pid: u32) -> Result<NatLease> {
        let mut lease = self.lease(name).ok_or_else(|| {
            SandboxError::Other(format!("sandbox {name:?} has no nat address allocated"))
        })?;
        delete_link(&lease.host_if);
        lease.host_if = self.new_host_if();
        self.store(name, &lease);
        let pid_s = pid.to_string();
        run(&[
            "ip",
            "link",
            "add",
            &lease.host_if,
            "type",
            "veth",
            "peer",
            "name",
            SANDBOX_IF,
            "netns",
            &pid_s,
        ])?;
        let wired =
            self.configure_host(&lease).and_then(|()| self.configure_inside(&lease, pid, false));
        if let Err(e) = wired {
            delete_link(&lease.host_if);
            return Err(e);
        }
        self.reconcile_table()?;
        Ok(lease)
    }

    fn store(&self, name: &str, lease: &NatLease) {
        self.leases.lock().unwrap_or_else(|p| p.into_inner()).insert(name.into(), lease.clone());
    }

    fn configure_host(&self, l: &NatLease) -> Result<()> {
        ensure_forwarding()?;
        let dev = l.host_if.as_str();
        // No IPv6 on the host end: the sandbox must not reach the host over link-local.
        let v6 = format!("/proc/sys/net/ipv6/conf/{dev}/disable_ipv6");
        if std::path::Path::new(&v6).exists() {
            std::fs::write(&v6, "1")
                .map_err(SandboxError::io("write", std::path::Path::new(&v6)))?;
        }
        let batch = format!(
            "addr add {g}/32 peer {a}/32 dev {dev}\nlink set {dev} up\n",
            g = l.gateway,
            a = l.addr
        );
        run_input(&["ip", "-batch", "-"], Some(&batch)).map(drop)
    }

    fn configure_inside(&self, l: &NatLease, pid: u32, readdress: bool) -> Result<()> {
        let netns = format!("--net=/proc/{pid}/ns/net");
        let mut batch = String::new();
        if readdress {
            batch.push_str(&format!("addr flush dev {SANDBOX_IF}\n"));
        }
        batch.push_str(&format!(
            "addr add {a}/32 peer {g}/32 dev {SANDBOX_IF}\nlink set {SANDBOX_IF} up\nroute replace default via {g} dev {SANDBOX_IF}\n",
            a = l.addr,
            g = l.gateway
        ));
        run_input(&["nsenter", &netns, "ip", "-batch", "-"], Some(&batch)).map(drop)
    }

    /// Before CRIU restores sandbox `name` (in place, or as a fork branch, which gets its own
    /// address from the source's range): the `external` entry that names the host end CRIU
    /// must create. The previous incarnation's host end is deleted first.
    pub fn prepare_restore(&self, name: &str, range: Option<&str>) -> Result<String> {
        let mut lease = match self.lease(name) {
            Some(l) => l,
            None => self.allocate(name, range)?,
        };
        delete_link(&lease.host_if);
        lease.host_if = self.new_host_if();
        self.store(name, &lease);
        Ok(format!("veth[{SANDBOX_IF}]:{}", lease.host_if))
    }

    /// After CRIU restored sandbox `name` (root task `pid`) with the veth pair
    /// [`Nat::prepare_restore`] named: configure the host end and give `eth0` the lease's
    /// address (a fork branch's differs from the image's).
    pub fn finish_restore(&self, name: &str, pid: u32) -> Result<NatLease> {
        let lease = self.lease(name).ok_or_else(|| {
            SandboxError::Other(format!("sandbox {name:?} has no nat address allocated"))
        })?;
        self.configure_host(&lease)
            .and_then(|()| self.configure_inside(&lease, pid, true))
            .and_then(|()| self.reconcile_table())
            .map_err(|e| {
                SandboxError::Other(format!("wiring the restored network of {name}: {e}"))
            })?;
        Ok(lease)
    }

    /// Forget sandbox `name`'s lease and delete its host interface (which takes the sandbox's
    /// end with it).
    pub fn release(&self, name: &str) {
        let lease = self.leases.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
        if let Some(l) = lease {
            delete_link(&l.host_if);
            if let Err(e) = self.reconcile_table() {
                tracing::warn!(sandbox = name, error = %e, "cannot update the nat table");
            }
        }
    }

    /// At start-up: take the leases of the adopted sandboxes (`alive` tells which still run),
    /// delete every host interface of this instance that no live lease names, and rebuild
    /// the table.
    pub fn adopt(&self, leases: Vec<(String, NatLease, bool)>) -> Result<()> {
        let mut keep = Vec::new();
        {
            let mut map = self.leases.lock().unwrap_or_else(|p| p.into_inner());
            for (name, lease, alive) in leases {
                if alive {
                    keep.push(lease.host_if.clone());
                }
                map.insert(name, lease);
            }
        }
        let prefix = self.if_prefix();
        for link in host_links() {
            if link.starts_with(&prefix) && !keep.contains(&link) {
                tracing::info!(link, "deleting a leftover sandbox interface");
                delete_link(&link);
            }
        }
        self.reconcile_table()
    }

    /// Replace the table with one built from the current leases (deleted when there are none),
    /// in one nft transaction.
    fn reconcile_table(&self) -> Result<()> {
        let addrs: Vec<String> = {
            let map = self.leases.lock().unwrap_or_else(|p| p.into_inner());
            let mut v: Vec<String> = map.values().map(|l| l.addr.to_string()).collect();
            v.sort();
            v
        };
        let t = &self.table;
        let mut s = format!("table inet {t} {{}}\ndelete table inet {t}\n");
        if !addrs.is_empty() {
            s.push_str(&table_rules(t, &self.if_prefix(), &addrs));
        }
        run_input(&["nft", "-f", "-"], Some(&s)).map(drop)
    }
}

/// The nftables ruleset of one instance (see the module docs).
fn table_rules(table: &str, own: &str, addrs: &[String]) -> String {
    format!(
        r#"table inet {table} {{
  set sandboxes {{ type ipv4_addr; elements = {{ {elems} }} }}
  chain input {{
    type filter hook input priority filter - 5; policy accept;
    iifname "{own}*" reject with icmpx admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter - 5; policy accept;
    iifname "{all}*" oifname "{all}*" reject with icmpx admin-prohibited
    oifname "{own}*" ct state established,related accept
    oifname "{own}*" drop
    iifname "{own}*" meta nfproto ipv6 drop
    iifname "{own}*" ip saddr != @sandboxes drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr @sandboxes oifname != "{all}*" masquerade
  }}
}}
"#,
        elems = addrs.join(", "),
        all = IF_PREFIX,
    )
}

/// NAT needs IPv4 forwarding on the host (as Docker does, it is switched on and left on).
fn ensure_forwarding() -> Result<()> {
    let p = "/proc/sys/net/ipv4/ip_forward";
    let on = std::fs::read_to_string(p).map(|s| s.trim() == "1").unwrap_or(false);
    if !on {
        tracing::info!("enabling net.ipv4.ip_forward for nat sandboxes");
        std::fs::write(p, "1").map_err(SandboxError::io("write", std::path::Path::new(p)))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked() {
        for bad in ["10.0.0.1/16", "8.8.0.0/16", "10.0.0.0/31", "10.0.0.0/7", "fd00::/64", "x"] {
            let e = parse_range(bad).expect_err(bad).to_string();
            assert!(e.contains(bad) && e.contains(DEFAULT_NAT_RANGE), "{e}");
        }
        assert!(parse_range("10.0.0.1/16")
            .expect_err("host bits")
            .to_string()
            .contains("10.0.0.0/16"));
    }

    #[test]
    fn table_rules_name_the_instance() {
        let r = table_rules("crab-x-1", "crab12ab", &["10.213.0.2".into()]);
        assert!(r.contains("table inet crab-x-1"));
        assert!(r.contains("iifname \"crab*\" oifname \"crab*\" reject"));
        assert!(r.contains("elements = { 10.213.0.2 }"));
    }
}
