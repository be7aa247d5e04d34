//! Cgroups of sandboxes on hybrid (v1 controllers + cgroup2) and pure cgroup2 hosts.
//!
//! Every sandbox gets a cgroup2 group `<v2>/crab-<instance>/<name>`, where the instance is named
//! after the daemon's state directory (`StateDir::cgroup_parent`), so two daemons with a sandbox
//! of the same name never kill, freeze or limit each other's (sandboxes recorded by an older
//! daemon keep their `crab/<name>`; see `SandboxRecord::cgroup`). It gives the BPF cgroup id the
//! inspector filters on, `cgroup.freeze` for consistent checkpoints and `cgroup.kill` for
//! teardown. Resource limits go through whatever controllers the host offers: the v2 group's own
//! controllers on a pure-v2 host, the v1 hierarchies (`memory`, `pids`, `cpu`) on a hybrid one,
//! under the same relative path.

use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crab_common::api::Limits;

/// A failed cgroup operation with the file it touched.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No cgroup2 hierarchy is mounted.
    #[error(
        "no cgroup2 hierarchy is mounted (looked at /sys/fs/cgroup and /sys/fs/cgroup/unified)"
    )]
    NoCgroup2,
    /// A file operation failed.
    #[error("cgroup {op} {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The freezer did not settle in time.
    #[error("cgroup {path} did not reach frozen={want} within {waited:?}")]
    FreezeTimeout {
        /// The group.
        path: PathBuf,
        /// The state asked for.
        want: bool,
        /// How long we waited.
        waited: Duration,
    },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CgroupError + 'a {
    move |source| CgroupError::Io { op, path: path.to_path_buf(), source }
}

/// The cgroup mounts of this host.
#[derive(Debug, Clone)]
pub struct Hierarchy {
    /// The cgroup2 mount (`/sys/fs/cgroup/unified` on hybrid hosts, `/sys/fs/cgroup` on v2).
    pub v2: PathBuf,
    /// v1 controller mounts that limits can use: (controller, mount point).
    pub v1: Vec<(String, PathBuf)>,
}

const V1_CONTROLLERS: [&str; 4] = ["memory", "pids", "cpu", "devices"];

impl Hierarchy {
    /// Find the host's cgroup mounts from `/proc/self/mountinfo`.
    pub fn detect() -> Result<Self, CgroupError> {
        let info = fs::read_to_string("/proc/self/mountinfo")
            .map_err(io("read", Path::new("/proc/self/mountinfo")))?;
        let mut v2 = None;
        let mut v1 = Vec::new();
        for line in info.lines() {
            let Some((left, right)) = line.split_once(" - ") else { continue };
            let mount_point = left.split(' ').nth(4).unwrap_or("");
            let mut r = right.split(' ');
            let fstype = r.next().unwrap_or("");
            let super_opts = r.nth(1).unwrap_or("");
            if fstype == "cgroup2" && v2.is_none() {
                v2 = Some(PathBuf::from(mount_point));
            } else if fstype == "cgroup" {
                for c in V1_CONTROLLERS {
                    if super_opts.split(',').any(|o| o == c) && !v1.iter().any(|(n, _)| n == c) {
                        v1.push((c.to_string(), PathBuf::from(mount_point)));
                    }
                }
            }
        }
        Ok(Hierarchy { v2: v2.ok_or(CgroupError::NoCgroup2)?, v1 })
    }

    /// Make task migrations into cgroups cheap: ensure the cgroup2 mount has `favordynmods`
    /// (kernel ≥ 6.0), remounting it with its current options plus that one when `enable`.
    ///
    /// Without it every write to a `cgroup.procs` (each `crab exec`, sandbox start and restore
    /// joins the sandbox's cgroups) takes the global `cgroup_threadgroup_rwsem` for writing,
    /// which may wait for an RCU grace period: 6–27 ms per migration measured on a quiet host
    /// with migrations 200 ms apart, ≈ 0.05 ms with it (on a busier host the wait did not
    /// always happen; docs/performance.md). The price, per the
    /// kernel's documentation, is a slightly slower fork and exit host-wide (the rwsem's reader
    /// side loses its per-CPU fast path). The option stays set when the daemon exits (another
    /// daemon may rely on it); `mount -o remount,<opts without favordynmods>` reverts it.
    pub fn favordynmods(&self, enable: bool) -> (bool, String) {
        let info = match fs::read_to_string("/proc/self/mountinfo") {
            Ok(i) => i,
            Err(e) => return (false, format!("cannot read /proc/self/mountinfo: {e}")),
        };
        let Some((mnt_opts, super_opts)) = mount_options(&info, &self.v2) else {
            return (false, format!("{} is not in /proc/self/mountinfo", self.v2.display()));
        };
        let has = super_opts.split(',').any(|o| o == "favordynmods");
        if has {
            return (true, format!("{} is mounted with favordynmods", self.v2.display()));
        }
        if !enable {
            return (
                false,
                "off (crab daemon --no-cgroup-favordynmods): each cgroup migration waits for an RCU grace period".into(),
            );
        }
        match remount_cgroup2(&self.v2, &mnt_opts, &super_opts, true) {
            Ok(data) => (true, format!("remounted {} with {data}", self.v2.display())),
            Err(e) => (false, format!("{e}; cgroup migrations wait for RCU grace periods")),
        }
    }

    /// Turn cgroup2's `favordynmods` on or off (the benchmark's A/B; the daemon only turns it
    /// on, in [`Hierarchy::favordynmods`]). Returns whether it was on before.
    pub fn set_favordynmods(&self, on: bool) -> Result<bool, String> {
        let info = fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let (mnt_opts, super_opts) = mount_options(&info, &self.v2)
            .ok_or_else(|| format!("{} is not in /proc/self/mountinfo", self.v2.display()))?;
        let was = super_opts.split(',').any(|o| o == "favordynmods");
        if was != on {
            remount_cgroup2(&self.v2, &mnt_opts, &super_opts, on)?;
        }
        Ok(was)
    }

    /// Remove the (parent) cgroup `rel` from every hierarchy where it is empty: a directory
    /// with child cgroups or processes stays (rmdir refuses it). Returns how many went.
    pub fn remove_if_empty(&self, rel: &str) -> usize {
        let mut removed = 0;
        let dirs =
            std::iter::once(self.v2.join(rel)).chain(self.v1.iter().map(|(_, m)| m.join(rel)));
        for d in dirs {
            match fs::remove_dir(&d) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::debug!(path = %d.display(), error = %e, "cgroup stays"),
            }
        }
        removed
    }

    /// The cgroup at `rel` (e.g. `crab-<instance>/<name>`) in every hierarchy.
    pub fn sandbox(&self, rel: &str) -> SandboxCgroup {
        SandboxCgroup {
            v2: self.v2.join(rel),
            v1: self.v1.iter().map(|(c, m)| (c.clone(), m.join(rel))).collect(),
        }
    }
}

/// The per-mount and the superblock options of the mount at `point` in a mountinfo text.
fn mount_options(info: &str, point: &Path) -> Option<(String, String)> {
    info.lines().rev().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut l = left.split(' ');
        if Path::new(l.nth(4)?) != point {
            return None;
        }
        let mnt_opts = l.next()?.to_string();
        let super_opts = right.split(' ').nth(2)?.to_string();
        Some((mnt_opts, super_opts))
    })
}

/// Remount the cgroup2 mount at `point` with its current options, `favordynmods` added or
/// removed (a cgroup2 remount sets every cgroup option anew, so the others are passed again).
fn remount_cgroup2(
    point: &Path,
    mnt_opts: &str,
    super_opts: &str,
    favordynmods: bool,
) -> Result<String, String> {
    let keep = super_opts.split(',').filter(|o| !matches!(*o, "rw" | "ro" | "" | "favordynmods"));
    let data = keep.chain(favordynmods.then_some("favordynmods")).collect::<Vec<_>>().join(",");
    nix::mount::mount(
        None::<&str>,
        point,
        None::<&str>,
        remount_flags(mnt_opts),
        Some(data.as_str()),
    )
    .map_err(|e| {
        format!(
            "mount -o remount,{data} {}: {e} (kernels before 6.0 lack favordynmods)",
            point.display()
        )
    })?;
    Ok(data)
}

/// The `MS_*` flags that keep a mount's per-mount options across `MS_REMOUNT` (a remount sets
/// them all anew).
fn remount_flags(mnt_opts: &str) -> nix::mount::MsFlags {
    use nix::mount::MsFlags;
    let mut f = MsFlags::MS_REMOUNT;
    for o in mnt_opts.split(',') {
        f |= match o {
            "ro" => MsFlags::MS_RDONLY,
            "nosuid" => MsFlags::MS_NOSUID,
            "nodev" => MsFlags::MS_NODEV,
            "noexec" => MsFlags::MS_NOEXEC,
            "noatime" => MsFlags::MS_NOATIME,
            "nodiratime" => MsFlags::MS_NODIRATIME,
            "relatime" => MsFlags::MS_RELATIME,
            "strictatime" => MsFlags::MS_STRICTATIME,
            _ => MsFlags::empty(),
        };
    }
    f
}

/// The cgroup directories of one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxCgroup {
    /// Its cgroup2 directory.
    pub v2: PathBuf,
    /// Its v1 controller directories.
    pub v1: Vec<(String, PathBuf)>,
}

fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    let mut f = fs::OpenOptions::new().write(true).open(path).map_err(io("open", path))?;
    f.write_all(value.as_bytes()).map_err(io("write", path))
}

impl SandboxCgroup {
    /// Create the directories and apply `limits` with the controllers available.
    pub fn create(&self, limits: &Limits) -> Result<(), CgroupError> {
        fs::create_dir_all(&self.v2).map_err(io("create", &self.v2))?;
        for (_, dir) in &self.v1 {
            fs::create_dir_all(dir).map_err(io("create", dir))?;
        }
        self.apply_limits(limits)
    }

    /// [`SandboxCgroup::create`], then the device allowlist unless `profile` is privileged.
    pub fn create_for(
        &self,
        limits: &Limits,
        profile: &crab_common::api::SecurityProfile,
    ) -> Result<(), CgroupError> {
        self.create(limits)?;
        if profile.privileged {
            return Ok(());
        }
        let v1 = self.restrict_devices()?;
        // The cgroup-v2 device program: the enforcement on pure-v2 hosts, a second layer
        // where the v1 controller exists too.
        match crate::devices::attach(&self.v2) {
            Ok(()) => Ok(()),
            Err(e) if v1 => {
                tracing::warn!(cgroup = %self.v2.display(), error = %e, "no cgroup-v2 device program; the v1 devices controller enforces the allowlist");
                Ok(())
            }
            Err(e) => Err(CgroupError::Io {
                op: "restrict devices of",
                path: self.v2.clone(),
                source: std::io::Error::other(format!(
                    "{e}; this host has no cgroup-v1 devices controller either, so the device \
                     allowlist cannot be enforced (needs a kernel with CONFIG_CGROUP_BPF)"
                )),
            }),
        }
    }

    fn v1_dir(&self, controller: &str) -> Option<&Path> {
        self.v1.iter().find(|(c, _)| c == controller).map(|(_, d)| d.as_path())
    }

    fn apply_limits(&self, limits: &Limits) -> Result<(), CgroupError> {
        let v2_has = |c: &str| {
            fs::read_to_string(self.v2.join("cgroup.controllers"))
                .map(|s| s.split_whitespace().any(|x| x == c))
                .unwrap_or(false)
        };
        if let Some(mem) = limits.memory_bytes {
            if v2_has("memory") {
                write_file(&self.v2.join("memory.max"), &mem.to_string())?;
            } else if let Some(d) = self.v1_dir("memory") {
                write_file(&d.join("memory.limit_in_bytes"), &mem.to_string())?;
            }
        }
        if let Some(p) = limits.pids_max {
            if v2_has("pids") {
                write_file(&self.v2.join("pids.max"), &p.to_string())?;
            } else if let Some(d) = self.v1_dir("pids") {
                write_file(&d.join("pids.max"), &p.to_string())?;
            }
        }
        if let Some(m) = limits.cpu_millis {
            let quota = m * 100; // period 100 ms
            if v2_has("cpu") {
                write_file(&self.v2.join("cpu.max"), &format!("{quota} 100000"))?;
            } else if let Some(d) = self.v1_dir("cpu") {
                write_file(&d.join("cpu.cfs_period_us"), "100000")?;
                write_file(&d.join("cpu.cfs_quota_us"), &quota.to_string())?;
            }
        }
        Ok(())
    }

    /// Apply the default profile's device allowlist (see [`crate::profile::ALLOWED_DEVICES`])
    /// through the v1 `devices` controller. Returns `false` when the host has no such
    /// controller (pure cgroup2: the device program of [`crate::devices`] enforces it).
    pub fn restrict_devices(&self) -> Result<bool, CgroupError> {
        let Some(d) = self.v1_dir("devices") else { return Ok(false) };
        write_file(&d.join("devices.deny"), "a")?;
        let allow = d.join("devices.allow");
        for (_, major, minor) in crate::profile::ALLOWED_DEVICES {
            write_file(&allow, &format!("c {major}:{minor} rwm"))?;
        }
        // devpts ptys.
        write_file(&allow, "c 136:* rwm")?;
        Ok(true)
    }

    /// Move process `pid` (0 = the caller) into every directory of this cgroup.
    pub fn enter(&self, pid: u32) -> Result<(), CgroupError> {
        write_file(&self.v2.join("cgroup.procs"), &pid.to_string())?;
        for (_, d) in &self.v1 {
            write_file(&d.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// The cgroup2 id (inode of the directory), which BPF's `bpf_get_current_cgroup_id` returns.
    pub fn id(&self) -> Result<u64, CgroupError> {
        Ok(fs::metadata(&self.v2).map_err(io("stat", &self.v2))?.ino())
    }

    /// The memory the sandbox's processes hold now, bytes (cgroup2 `memory.current`, else
    /// cgroup1 `memory.usage_in_bytes`); `None` when neither is readable.
    pub fn memory_bytes(&self) -> Option<u64> {
        let read = |p: PathBuf| fs::read_to_string(p).ok()?.trim().parse().ok();
        read(self.v2.join("memory.current"))
            .or_else(|| self.v1_dir("memory").and_then(|d| read(d.join("memory.usage_in_bytes"))))
    }

    /// Whether the cgroup2 directory exists.
    pub fn exists(&self) -> bool {
        self.v2.is_dir()
    }

    /// Every pid in the sandbox's cgroup2 group and its descendants.
    pub fn pids(&self) -> Result<Vec<u32>, CgroupError> {
        let mut out = Vec::new();
        collect_pids(&self.v2, &mut out)?;
        Ok(out)
    }

    /// Freeze (`true`) or thaw (`false`) and wait until the kernel reports it done.
    pub fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        write_file(&self.v2.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
        let events = self.v2.join("cgroup.events");
        let want = if frozen { "frozen 1" } else { "frozen 0" };
        let start = Instant::now();
        let limit = Duration::from_secs(5);
        loop {
            let s = fs::read_to_string(&events).map_err(io("read", &events))?;
            if s.lines().any(|l| l == want) {
                return Ok(());
            }
            if start.elapsed() > limit {
                return Err(CgroupError::FreezeTimeout {
                    path: self.v2.clone(),
                    want: frozen,
                    waited: limit,
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Kill every process in the group (and descendants) and wait until it is empty.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        if !self.exists() {
            return Ok(());
        }
        let kill = self.v2.join("cgroup.kill");
        if kill.exists() {
            write_file(&kill, "1")?;
        }
        let start = Instant::now();
        loop {
            let pids = self.pids()?;
            if pids.is_empty() {
                return Ok(());
            }
            for p in &pids {
                // Fallback for kernels without cgroup.kill; harmless otherwise.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*p as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(CgroupError::Io {
                    op: "kill",
                    path: self.v2.clone(),
                    source: std::io::Error::other(format!(
                        "{} processes survive SIGKILL",
                        pids.len()
                    )),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Kill everything and remove the directories (children first). Missing is fine.
    pub fn destroy(&self) -> Result<(), CgroupError> {
        self.kill_all()?;
        remove_tree(&self.v2)?;
        for (_, d) in &self.v1 {
            remove_tree(d)?;
        }
        Ok(())
    }
}

fn collect_pids(dir: &Path, out: &mut Vec<u32>) -> Result<(), CgroupError> {
    let procs = dir.join("cgroup.procs");
    match fs::read_to_string(&procs) {
        Ok(s) => out.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("read", &procs)(e)),
    }
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("list", dir)(e)),
    };
    for entry in entries.flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            collect_pids(&entry.path(), out)?;
        }
    }
    Ok(())
}

fn remove_tree(dir: &Path) -> Result<(), CgroupError> {
    if !dir.exists() {
        return Ok(());
    }
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_tree(&entry.path())?;
            }
        }
    }
    // rmdir of a cgroup can briefly fail with EBUSY while the last task is being reaped.
    let start = Instant::now();
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e)
                if start.elapsed() < Duration::from_secs(5)
                    && e.raw_os_error() == Some(libc::EBUSY) =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(io("remove", dir)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::mount::MsFlags;

    const INFO: &str = "\
25 30 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - tmpfs tmpfs rw,mode=755
35 25 0:30 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
36 25 0:31 / /sys/fs/cgroup/memory rw,relatime shared:11 - cgroup cgroup rw,memory
";

    #[test]
    fn remount_keeps_every_option() {
        let (mnt, sup) = mount_options(INFO, Path::new("/sys/fs/cgroup/unified")).expect("found");
        assert_eq!(mnt, "rw,nosuid,nodev,noexec,relatime");
        assert_eq!(sup, "rw,nsdelegate,memory_recursiveprot");
        let f = remount_flags(&mnt);
        for want in [MsFlags::MS_REMOUNT, MsFlags::MS_NOSUID, MsFlags::MS_NODEV, MsFlags::MS_NOEXEC]
        {
            assert!(f.contains(want), "{want:?} lost");
        }
        assert!(!f.contains(MsFlags::MS_RDONLY));
        assert!(mount_options(INFO, Path::new("/sys/fs/cgroup/pids")).is_none());
    }
}
