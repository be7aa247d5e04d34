//! `crab daemon`: the daemon's flags and its start.

use std::process::ExitCode;

use clap::Args;
use crab_common::paths::StateDir;

use super::parse_size;

/// A daemon-wide default limit: a size or count, or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limit(Option<u64>);

fn parse_limit(s: &str) -> Result<Limit, String> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(Limit(None));
    }
    parse_size(s).map(|n| Limit(Some(n))).map_err(|e| format!("{e}, or `none`"))
}
use crate::daemon::{self, DaemonOptions};

#[derive(Debug, Args)]
pub(super) struct DaemonArgs {
    /// Size of the sparse btrfs pool file created when the state dir is not on btrfs.
    #[arg(long, default_value = "32G", value_parser = parse_size)]
    pool_size: u64,
    /// Where the LLM proxy listens (loopback only unless --proxy-allow-remote).
    #[arg(long, env = "CRAB_PROXY_LISTEN", default_value = crab_coordinator::DEFAULT_LISTEN)]
    proxy_listen: std::net::SocketAddr,
    /// Let the LLM proxy listen beyond loopback (it carries API keys).
    #[arg(long)]
    proxy_allow_remote: bool,
    /// Seconds an LLM-proxy client may take to send a request head (and may sit idle between
    /// requests) before it is disconnected.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    proxy_header_timeout: u64,
    /// Connections one sandbox may have open to its in-sandbox LLM proxy at once (lowered to a
    /// quarter of the daemon's file-descriptor budget for the proxy if that is less).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    proxy_max_connections_per_sandbox: u64,
    /// Ask the LLM upstream to stream the chat answers agents ask for whole
    /// (`/v1/chat/completions`, `/v1/messages`) and hand each agent its whole answer assembled
    /// from the stream: the stream's first byte starts a parked sandbox's wake while the model
    /// is still generating. `auto`: on when the daemon parks (`--memory-budget`).
    #[arg(long, value_enum, default_value_t = StreamWhole::Auto)]
    stream_whole_answers: StreamWhole,
    /// OpenAI-style upstream base URL, without /v1.
    #[arg(long, env = "CRAB_UPSTREAM_OPENAI", default_value = "https://api.openai.com")]
    upstream_openai: String,
    /// Anthropic-style upstream base URL, without /v1.
    #[arg(long, env = "CRAB_UPSTREAM_ANTHROPIC", default_value = "https://api.anthropic.com")]
    upstream_anthropic: String,
    /// Process dumps (CRIU) running at once, host-wide.
    #[arg(long, default_value_t = 1)]
    max_concurrent_dumps: usize,
    /// Checkpoint disk bandwidth budget, bytes per second (e.g. 200M); unlimited by default.
    #[arg(long, value_parser = parse_size)]
    disk_bandwidth: Option<u64>,
    /// Durable tier: export every restore point to this store (file:///dir or
    /// s3://bucket/prefix; S3 endpoint, region and credentials from the AWS_* variables).
    #[arg(long, env = "CRAB_REMOTE")]
    remote: Option<String>,
    /// Upload budget of the exports, bytes per second (e.g. 50M); unlimited by default.
    #[arg(long, value_parser = parse_size, requires = "remote")]
    remote_bandwidth: Option<u64>,
    /// Key file (64 hex digits) encrypting the remote store at rest.
    #[arg(long, requires = "remote")]
    remote_key: Option<std::path::PathBuf>,
    /// Standby: keep the newest remote point of this sandbox materialized here as it is
    /// exported elsewhere, so a failover restore is local (repeatable; added to the saved
    /// follow set, see `crab remote follow`).
    #[arg(long = "follow", value_name = "SANDBOX", requires = "remote")]
    follow: Vec<String>,
    /// Standby for every sandbox of the remote store that does not run on this host.
    #[arg(long, requires = "remote")]
    follow_all: bool,
    /// Serve the E2B-compatible API (REST + envd) here, e.g. 127.0.0.1:3000 (loopback only
    /// unless --e2b-allow-remote); point E2B_API_URL and E2B_SANDBOX_URL at it.
    #[arg(long, env = "CRAB_E2B_LISTEN", requires = "e2b_keys")]
    e2b_listen: Option<std::net::SocketAddr>,
    /// Let the E2B API listen beyond loopback (plain HTTP: put TLS in front of it).
    #[arg(long, requires = "e2b_listen")]
    e2b_allow_remote: bool,
    /// Accepted E2B API keys: a file of SHA-256 digests (hex), one per line
    /// (`printf %s KEY | sha256sum`).
    #[arg(long, env = "CRAB_E2B_KEYS", requires = "e2b_listen")]
    e2b_keys: Option<std::path::PathBuf>,
    /// Private IPv4 range (CIDR) that `--network nat` sandboxes get addresses from (the
    /// first address is their gateway on the host ends; a sandbox may ask for another range).
    #[arg(long, env = "CRAB_NAT_RANGE", default_value = crab_sandbox::net::DEFAULT_NAT_RANGE)]
    nat_range: String,
    /// Disk quota of sandboxes created without `--disk` (`none`: unlimited). Keep it below
    /// the pool's size so one sandbox cannot take the room every other sandbox's checkpoints
    /// need.
    #[arg(long, env = "CRAB_DEFAULT_DISK", value_parser = parse_limit, default_value = "10G")]
    default_disk: Limit,
    /// Memory limit of sandboxes created without `--memory` (`none`: unlimited).
    #[arg(long, env = "CRAB_DEFAULT_MEMORY", value_parser = parse_limit, default_value = "4G")]
    default_memory: Limit,
    /// Process (task) limit of sandboxes created without `--pids` (`none`: unlimited).
    #[arg(long, env = "CRAB_DEFAULT_PIDS", value_parser = parse_limit, default_value = "1024")]
    default_pids: Limit,
    /// Leave the host's cgroup2 mount as it is. By default the daemon remounts cgroup2 with
    /// `favordynmods` (kernel >= 6.0) when it lacks it: without it a join of a sandbox's
    /// cgroups (each exec, start and restore) can wait for an RCU grace period (6-27 ms on a
    /// quiet host here);
    /// the cost is slightly slower fork/exit host-wide. `crab version --json` shows the state.
    #[arg(long)]
    no_cgroup_favordynmods: bool,
    /// Ready-made root filesystems (writable btrfs snapshots, made in the background) kept per
    /// recently used image, so `sandbox create` renames one into place instead of taking a
    /// snapshot, a btrfs transaction commit, on the caller's time. 0 turns it off.
    #[arg(long, env = "CRAB_WARM_ROOTS", default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=64))]
    warm_roots: u64,
    /// Largest body streamed into a sandbox in one request — a file written (`PUT .../files`,
    /// E2B's `POST /files`), a tar extracted, an exec's streamed stdin; a larger one is refused
    /// with a 413 naming this flag. The daemon holds none of it in memory.
    #[arg(long, env = "CRAB_MAX_UPLOAD", value_parser = parse_size, default_value = "4G")]
    max_upload: u64,
    /// Seconds a client of the API socket or the E2B port may take to send a request head (and
    /// may sit idle between requests) before it is disconnected.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_header_timeout: u64,
    /// Seconds the API socket and the E2B port wait for a client's request body to come (time
    /// spent waiting for its bytes; not time the daemon spends passing them on, e.g. to a slow
    /// command's stdin), plus one second per MiB received: a large upload has time, a trickled
    /// one is cut off.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86400))]
    http_body_timeout: u64,
    /// Host uid and gid of root inside user-namespaced sandboxes (the default kind): ids
    /// 0-65535 inside are this and the 65535 above it on the host, for every sandbox (one
    /// range, like Docker's userns-remap; images are shifted into it once). `host` makes new
    /// sandboxes run in the host's user namespace, as `sandbox create --userns host` does for
    /// one (UNSAFE: uid 0 inside is the host's root). Points keep the range they were taken in:
    /// a remote point restores only on a host with the same range.
    #[arg(long, env = "CRAB_USERNS_BASE", value_name = "UID|host", default_value = "1000000000", value_parser = parse_userns)]
    userns_base: Userns,
    /// What a sandbox asked for with a registry reference (`python:3.12`, an E2B template, the
    /// SDK's `image=`) does when no local image holds it: `missing` pulls it on first use (with
    /// the daemon user's `~/.docker/config.json` credentials, if any), `never` refuses with a
    /// hint to `crab image pull` it.
    #[arg(long, env = "CRAB_PULL", default_value = "missing", value_parser = ["missing", "never"])]
    pull: String,
    /// A registry (`HOST[:PORT]`) that first-use pulls speak plain http to (a loopback test
    /// registry); repeat for more.
    #[arg(long = "insecure-registry", env = "CRAB_INSECURE_REGISTRIES", value_delimiter = ',')]
    insecure_registries: Vec<String>,
    /// Park sandboxes at turn boundaries while the running sandboxes' memory exceeds SIZE
    /// (e.g. `8G`): a sandbox whose agent waits on the LLM, whose expected wait (the p25 of its
    /// own recent waits) lets it stay parked `--park-margin` times the wake cost, has its processes stopped
    /// after its turn's point (a full dump first when that point lacks them and the wait pays
    /// for it too); its LLM answer, or any call, wakes it first. Unset: sandboxes park only by
    /// hand (`crab sandbox park`). A sandbox labelled `crab.park=never` never parks.
    #[arg(long, env = "CRAB_MEMORY_BUDGET", value_name = "SIZE", value_parser = parse_size)]
    memory_budget: Option<u64>,
    /// How many times the wake cost (the fastest of the recent wakes) the time a sandbox can be
    /// expected to stay parked must be for it to park: until its wake, which comes twice the
    /// wake cost before the expected answer, or, for a streamed answer, its expected lead
    /// after the head less that.
    #[arg(long, default_value_t = 3.0, value_parser = parse_margin)]
    park_margin: f64,
}

/// `--stream-whole-answers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum StreamWhole {
    Auto,
    On,
    Off,
}

fn parse_margin(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(m) if m.is_finite() && m >= 1.0 => Ok(m),
        _ => Err(format!("{s:?} is not a margin of at least 1 (e.g. 3)")),
    }
}

/// `--userns-base`: a range, or none (`host`).
#[derive(Debug, Clone, Copy)]
struct Userns(Option<crab_common::api::IdRange>);

fn parse_userns(s: &str) -> Result<Userns, String> {
    if s == "host" {
        return Ok(Userns(None));
    }
    let base: u32 = s.parse().map_err(|_| format!("{s:?} is neither a uid nor `host`"))?;
    crab_common::api::IdRange::at(base).map(|r| Userns(Some(r)))
}

/// Runs the daemon in the foreground until it is told to stop.
pub(super) async fn run(a: DaemonArgs, state: StateDir) -> ExitCode {
    let proxy = crab_coordinator::ProxyConfig {
        listen: a.proxy_listen,
        allow_remote: a.proxy_allow_remote,
        upstream_openai: a.upstream_openai,
        upstream_anthropic: a.upstream_anthropic,
        header_read_timeout: Some(std::time::Duration::from_secs(a.proxy_header_timeout)),
        max_sandbox_connections: a.proxy_max_connections_per_sandbox as usize,
        stream_whole_answers: match a.stream_whole_answers {
            StreamWhole::On => true,
            StreamWhole::Off => false,
            StreamWhole::Auto => a.memory_budget.is_some(),
        },
        ..Default::default()
    };
    let engine = crab_engine::EngineConfig {
        max_concurrent_dumps: a.max_concurrent_dumps.max(1),
        disk_bytes_per_sec: a.disk_bandwidth,
        ..Default::default()
    };
    let remote = a.remote.map(|url| crab_host::remote::RemoteOptions {
        url,
        key_file: a.remote_key,
        bandwidth_bps: a.remote_bandwidth,
        follow: a.follow,
        follow_all: a.follow_all,
    });
    let e2b = match (a.e2b_listen, a.e2b_keys) {
        (Some(listen), Some(keys)) => {
            if !listen.ip().is_loopback() && !a.e2b_allow_remote {
                eprintln!(
                    "error: --e2b-listen {listen} is not a loopback address; the E2B API grants \
                     root-equivalent control of sandboxes, so add --e2b-allow-remote to mean it"
                );
                return ExitCode::FAILURE;
            }
            match crab_e2b::Keys::load(&keys) {
                Ok(keys) => Some(daemon::E2bOptions { listen, keys }),
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        _ => None,
    };
    let opts = DaemonOptions {
        state,
        pool_size: a.pool_size,
        proxy,
        engine,
        remote,
        nat_range: a.nat_range,
        e2b,
        default_limits: crab_common::api::Limits {
            memory_bytes: a.default_memory.0,
            pids_max: a.default_pids.0,
            cpu_millis: None,
            disk_bytes: a.default_disk.0,
        },
        cgroup_favordynmods: !a.no_cgroup_favordynmods,
        warm_roots: a.warm_roots as usize,
        http: daemon::HttpOptions {
            max_upload: a.max_upload,
            header_timeout: std::time::Duration::from_secs(a.http_header_timeout),
            body_timeout: std::time::Duration::from_secs(a.http_body_timeout),
        },
        userns: a.userns_base.0,
        pulls: crab_host::PullPolicy {
            on_create: a.pull == "missing",
            insecure: a.insecure_registries,
            credentials: Some(std::sync::Arc::new(super::image_pull::docker_config_credentials)),
        },
        park: a
            .memory_budget
            .map(|budget_bytes| crab_host::ParkPolicy { budget_bytes, margin: a.park_margin }),
    };
    match daemon::run(opts).await {
        // Exit at once: nothing is left to flush, and waiting for idle blocking threads or
        // the kernel's teardown of BPF links would only delay a restart.
        Ok(()) => std::process::exit(0),
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        daemon: DaemonArgs,
    }

    /// The flags' defaults are the runtime's `DEFAULT_LIMITS`, and `none` lifts a limit.
    #[test]
    fn default_limits_are_the_runtimes() {
        let a = Cli::try_parse_from(["crab"]).unwrap().daemon;
        let d = crab_sandbox::runtime::DEFAULT_LIMITS;
        assert_eq!(
            (a.default_memory.0, a.default_pids.0, a.default_disk.0),
            (d.memory_bytes, d.pids_max, d.disk_bytes)
        );
        let a = Cli::try_parse_from(["crab", "--default-pids", "none", "--default-memory", "8G"])
            .unwrap()
            .daemon;
        assert_eq!((a.default_pids.0, a.default_memory.0), (None, Some(8 << 30)));
        assert!(Cli::try_parse_from(["crab", "--default-disk", "lots"]).is_err());
    }
}
