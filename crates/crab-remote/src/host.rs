//! What a point was dumped on, and the preflight that compares it with this host before its
//! processes are restored here.

use crate::error::{RemoteError, Result};
use crate::format::{HostFacts, PointRecord};

fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default()
}

/// This host's name.
pub fn hostname() -> String {
    read_trim("/proc/sys/kernel/hostname")
}

impl HostFacts {
    /// The facts of this host.
    pub fn local() -> HostFacts {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let mut cpu_flags: Vec<String> = cpuinfo
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "flags").then(|| v.split_whitespace().map(str::to_string).collect())
            })
            .unwrap_or_default();
        cpu_flags.sort();
        HostFacts {
            hostname: hostname(),
            kernel: read_trim("/proc/sys/kernel/osrelease"),
            machine: std::env::consts::ARCH.to_string(),
            cpu_flags,
        }
    }
}

/// Refuse to restore `rec`'s processes on a host with facts `here` and CRIU `criu` when what
/// CRIU needs differs: architecture, kernel release, CRIU version, or a CPU flag the dumping
/// host had and this one lacks; or when the point does not carry the filesystem its processes
/// ran on. A point without processes always passes.
///
/// There is no check of this host's image against the point's: the processes come back on the
/// point's own complete filesystem tree (every file verified by its hash), never on a local
/// image's files. A local image is only a starting copy that `local::materialize` patches into
/// that tree, and only when its own tree id equals the point's image's.
pub fn preflight(rec: &PointRecord, here: &HostFacts, criu: Option<&str>) -> Result<()> {
    if rec.procs.is_none() {
        return Ok(());
    }
    let point = format!("{}@{}", rec.sandbox, rec.point);
    let fail = |mismatch: String| Err(RemoteError::Preflight { point: point.clone(), mismatch });
    if rec.fs.is_none() {
        return fail("it has process images but no filesystem tree for them to run on".to_string());
    }
    let there = &rec.host;
    if there.machine != here.machine {
        return fail(format!(
            "it was dumped on {} and this host is {}",
            there.machine, here.machine
        ));
    }
    if there.kernel != here.kernel {
        return fail(format!(
            "it was dumped on kernel {} and this host runs {}",
            there.kernel, here.kernel
        ));
    }
    if let (Some(a), Some(b)) = (rec.criu_version.as_deref(), criu) {
        if a != b {
            return fail(format!("it was dumped by CRIU {a} and this host has CRIU {b}"));
        }
    }
    let missing: Vec<&str> = there
        .cpu_flags
        .iter()
        .filter(|f| here.cpu_flags.binary_search(f).is_err())
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        return fail(format!(
            "this host's CPU lacks flags the dumping host had: {}",
            missing.join(" ")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Content;

    fn rec(host: HostFacts) -> PointRecord {
        PointRecord {
            sandbox: "sb".into(),
            point: "c000001".into(),
            turn: 1,
            kind: "full".into(),
            created_at_ms: 0,
            exported_at_ms: 0,
            host,
            manifest: Content::default(),
            procs: Some(crate::id::Id([1; 32])),
            fs: Some(crate::id::Id([2; 32])),
            criu_version: Some("4.2.1".into()),
            conversation: None,
            image: None,
            walk: None,
            size_bytes: 0,
            uploaded_bytes: 0,
        }
    }

    #[test]
    fn preflight_names_the_mismatch() {
        let here = HostFacts::local();
        preflight(&rec(here.clone()), &here, Some("4.2.1")).expect("same host passes");
        let mut other = here.clone();
        other.kernel = "5.10.0-old".into();
        let err = preflight(&rec(other), &here, Some("4.2.1")).expect_err("kernel");
        assert!(err.to_string().contains("kernel 5.10.0-old"), "{err}");
        let err = preflight(&rec(here.clone()), &here, Some("4.1.1")).expect_err("criu");
        assert!(err.to_string().contains("CRIU 4.2.1"), "{err}");
        let mut no_fs = rec(here.clone());
        no_fs.fs = None;
        let err = preflight(&no_fs, &here, Some("4.2.1")).expect_err("no fs");
        assert!(err.to_string().contains("no filesystem tree"), "{err}");
        let mut more = here.clone();
        more.cpu_flags.push("avx9000".into());
        let err = preflight(&rec(more), &here, Some("4.2.1")).expect_err("flags");
        assert!(
            err.to_string().contains("avx9000") && err.to_string().contains("--fs-only"),
            "{err}"
        );
    }
}
