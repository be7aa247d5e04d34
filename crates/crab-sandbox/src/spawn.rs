//! The two single-threaded helpers that enter namespaces: the sandbox starter and the exec
//! helper.
//!
//! Namespaces and `fork` do not mix with a multi-threaded async daemon, so the daemon re-executes
//! its own binary (`crab __start-sandbox SPEC` / `crab __nsexec SPEC`), or the small
//! `crab-nsexec` built beside it, for the work that needs a fresh single-threaded process. Both
//! binaries dispatch to [`start_sandbox`] and [`exec_in_sandbox`] before they start any runtime;
//! [`HELPER_ABI`] tells whether two binaries were built from the same sources.
//!
//! * The **starter** joins the sandbox's cgroups, unshares pid, mount, uts, ipc and (unless the
//!   network mode is `host`) net namespaces, and forks the sandbox's pid 1 — or, for a
//!   user-namespaced sandbox, `clone`s it into a new user namespace with all of those at once,
//!   writes its id maps and releases it as the namespace's root. That child makes the
//!   mount tree private, bind-mounts the root subvolume, mounts `/proc`, a minimal `/dev`
//!   (device nodes — the host's bound, in a user namespace —, devpts, `/dev/shm`), pivots into the root, sets the hostname, points stdio
//!   at `/dev/null`, closes every other fd and execs `/.crab/init`. The starter reports the
//!   init's host pid and exits, so the init is re-parented away from the daemon and outlives it.
//! * The **exec helper** joins the cgroups and the init's namespaces (its user namespace last,
//!   becoming root there), forks (so the command is
//!   inside the pid namespace), and the child execs the command with the daemon's pipes as
//!   stdout/stderr and `/dev/null` (or a pipe, with `-i`) as stdin. The helper waits and exits
//!   with the command's status (`128+signal` when killed by a signal).

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::CloneFlags;
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};
use serde::{Deserialize, Serialize};

use crab_common::api::{NetMode, SecurityProfile};

use crate::profile;

/// Digest of the sources the helpers' specs and behaviour come from (see `build.rs`). A helper
/// binary that reports another value (`__helper-abi`) was built from other sources and must
/// not be given this build's specs.
pub const HELPER_ABI: &str = env!("CRAB_HELPER_ABI");

/// File name of the small helper binary built beside `crab`.
pub const SMALL_HELPER: &str = "crab-nsexec";

/// The binary to run the namespace helpers with, given `crab`'s own path: the small
/// [`SMALL_HELPER`] beside it when it answers `__helper-abi` with this build's [`HELPER_ABI`],
/// else `exe` itself. Returns the choice, whether it is the small helper, and what was seen.
pub fn choose_helper(exe: &Path) -> (PathBuf, bool, String) {
    let small = exe.with_file_name(SMALL_HELPER);
    if exe.file_name().is_some_and(|n| n == SMALL_HELPER) || !small.is_file() {
        return (
            exe.to_path_buf(),
            false,
            format!("{}: no {SMALL_HELPER} beside it", exe.display()),
        );
    }
    let seen = std::process::Command::new(&small)
        .arg("__helper-abi")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    match seen {
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == HELPER_ABI => {
            (small.clone(), true, small.display().to_string())
        }
        Ok(o) => (
            exe.to_path_buf(),
            false,
            format!(
                "{}: {} was built from other sources (helper ABI {:?}, this build {HELPER_ABI}); rebuild both with `cargo build -p crab`",
                exe.display(),
                small.display(),
                String::from_utf8_lossy(&o.stdout).trim()
            ),
        ),
        Err(e) => (
            exe.to_path_buf(),
            false,
            format!("{}: running {} failed: {e}", exe.display(), small.display()),
        ),
    }
}

/// Cgroup directories a helper must join.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CgroupPaths {
    /// cgroup2 directory.
    pub v2: PathBuf,
    /// v1 controller directories.
    pub v1: Vec<PathBuf>,
}

impl CgroupPaths {
    fn enter_self(&self) -> Result<(), String> {
        self.open_procs()?.enter()
    }

    /// Open every `cgroup.procs` now (host paths), to join later, e.g. after `setns`.
    fn open_procs(&self) -> Result<OpenCgroups, String> {
        let files = std::iter::once(&self.v2)
            .chain(self.v1.iter())
            .map(|dir| {
                let p = dir.join("cgroup.procs");
                File::options()
                    .write(true)
                    .open(&p)
                    .map(|f| (p.clone(), f))
                    .map_err(|e| format!("open {}: {e}", p.display()))
            })
            .collect::<Result<_, _>>()?;
        Ok(OpenCgroups(files))
    }
}

/// `cgroup.procs` files opened ahead of joining.
struct OpenCgroups(Vec<(PathBuf, File)>);

impl OpenCgroups {
    /// Move the calling process into every group.
    fn enter(mut self) -> Result<(), String> {
        let pid = std::process::id().to_string();
        for (p, f) in &mut self.0 {
            f.write_all(pid.as_bytes()).map_err(|e| format!("join cgroup {}: {e}", p.display()))?;
        }
        Ok(())
    }
}

/// What the starter needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartSpec {
    /// Host path of the sandbox's root subvolume.
    pub rootfs: PathBuf,
    /// Hostname inside.
    pub hostname: String,
    /// Network mode.
    pub net: NetMode,
    /// Cgroups to join.
    pub cgroup: CgroupPaths,
    /// Security profile of every process in the sandbox.
    #[serde(default)]
    pub profile: SecurityProfile,
    /// The profile's seccomp filters, compiled by the daemon (compiled here when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seccomp: Option<crate::seccomp::CompiledFilters>,
}

/// What the exec helper needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecSpec {
    /// Host pid of the sandbox's init.
    pub init_pid: u32,
    /// Cgroups to join.
    pub cgroup: CgroupPaths,
    /// argv.
    pub cmd: Vec<String>,
    /// Environment, `KEY=VALUE` (complete; the helper adds nothing).
    pub env: Vec<String>,
    /// Working directory inside.
    pub workdir: String,
    /// The account to run as (`name`, `uid`, `name:group`, `uid:gid`), looked up in the
    /// sandbox's own `/etc/passwd` and `/etc/group`; absent: root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Whether stdin is inherited from the helper (a pipe); otherwise `/dev/null`.
    pub stdin: bool,
    /// Security profile the command runs under.
    #[serde(default)]
    pub profile: SecurityProfile,
    /// The profile's seccomp filters, compiled once by the daemon: the helper only installs
    /// them (compiled here when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seccomp: Option<crate::seccomp::CompiledFilters>,
}

/// The path of the init binary inside every sandbox root.
pub const INIT_PATH: &str = ".crab/init";

fn err<E: std::fmt::Display>(what: impl Into<String>) -> impl FnOnce(E) -> String {
    let what = what.into();
    move |e| format!("{what}: {e}")
}

/// Run the starter: returns the host pid of the new sandbox's init.
///
/// Must be called from a single-threaded process (the `crab __start-sandbox` helper).
pub fn start_sandbox(spec: &StartSpec) -> Result<u32, String> {
    not_dumpable()?;
    spec.cgroup.enter_self()?;
    let mut flags = CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC;
    if spec.net != NetMode::Host {
        flags |= CloneFlags::CLONE_NEWNET;
    }
    if !spec.profile.privileged {
        // After joining the cgroups: the sandbox's own group becomes its cgroup root.
        flags |= CloneFlags::CLONE_NEWCGROUP;
    }
    if let Some(ids) = spec.profile.userns {
        return start_in_userns(spec, flags, ids);
    }
    nix::sched::unshare(flags).map_err(err("unshare namespaces"))?;
    if matches!(spec.net, NetMode::Private | NetMode::Nat) {
        set_loopback_up().map_err(err("bring up lo"))?;
    }
    if let Some(r) = profile::ping_range(&spec.profile).filter(|_| spec.net != NetMode::Host) {
        profile::allow_ping(r);
    }
    let (rd, wr) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(err("pipe2"))?;
    // SAFETY: the helper process is single-threaded (it runs before any runtime or thread is
    // started), so the child may use any function after fork.
    match unsafe { fork() }.map_err(err("fork"))? {
        ForkResult::Child => {
            drop(rd);
            let e = init_child(spec);
            // Only reached on failure: report it through the pipe and exit.
            let mut w = File::from(wr);
            let _ = w.write_all(e.as_bytes());
            std::process::exit(1);
        }
        ForkResult::Parent { child } => {
            drop(wr);
            let mut msg = String::new();
            File::from(rd).read_to_string(&mut msg).map_err(err("read starter pipe"))?;
            if !msg.is_empty() {
                let _ = waitpid(child, None);
                return Err(msg);
            }
            Ok(child.as_raw() as u32)
        }
    }
}

/// The starter's way for a user-namespaced sandbox: one `clone` makes the init in a new user
/// namespace together with every other namespace of `flags` (so they all belong to it: its
/// root may mount `/proc`, set the hostname, bring `lo` up). The child waits while this
/// process — the host's root — writes its `uid_map`/`gid_map` (`0 <base> 65536`; a process
/// cannot map ids other than its own in a namespace it is already in), sets up its network
/// namespace from outside (`lo` up and the ping range, as a restore does), then lets it go on
/// as uid/gid 0 of the namespace.
fn start_in_userns(
    spec: &StartSpec,
    flags: CloneFlags,
    ids: crab_common::api::IdRange,
) -> Result<u32, String> {
    let (go_rd, go_wr) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(err("pipe2"))?;
    let (rd, wr) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(err("pipe2"))?;
    let all = flags | CloneFlags::CLONE_NEWUSER;
    let clone_flags = all.bits() as libc::c_ulong | libc::SIGCHLD as libc::c_ulong;
    // SAFETY: clone(2) without CLONE_VM and with no new stack behaves like fork(2): the child
    // gets a copy of this single-threaded process (the starter runs before any runtime or
    // thread), so it may use any function afterwards.
    let ret =
        unsafe { libc::syscall(libc::SYS_clone, clone_flags, 0usize, 0usize, 0usize, 0usize) };
    if ret < 0 {
        return Err(format!(
            "clone(CLONE_NEWUSER|{flags:?}): {} (user namespaces disabled? check /proc/sys/user/max_user_namespaces, or create the sandbox with --userns host)",
            std::io::Error::last_os_error()
        ));
    }
    if ret == 0 {
        drop(go_wr);
        drop(rd);
        let e = (|| {
            let mut go = [0u8; 1];
            match File::from(go_rd).read(&mut go) {
                Ok(1) => {}
                _ => return "the starter gave up before the id maps were written".to_string(),
            }
            if let Err(e) = become_namespace_root() {
                return e;
            }
            init_child(spec)
        })();
        let mut w = File::from(wr);
        let _ = w.write_all(e.as_bytes());
        std::process::exit(1);
    }
    drop(go_rd);
    drop(wr);
    let child = nix::unistd::Pid::from_raw(ret as i32);
    let pid = child.as_raw() as u32;
    let prepared = (|| {
        for (file, map) in [("uid_map", ids.uid_map()), ("gid_map", ids.gid_map())] {
            let p = format!("/proc/{pid}/{file}");
            std::fs::write(&p, &map).map_err(err(format!("write {p} ({})", map.trim())))?;
        }
        if matches!(spec.net, NetMode::Private | NetMode::Nat) {
            set_up_private_netns(pid, profile::ping_range(&spec.profile))?;
        }
        File::from(go_wr).write_all(b"1").map_err(err("release the sandbox's init"))
    })();
    if let Err(e) = prepared {
        let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
        let _ = waitpid(child, None);
        return Err(e);
    }
    let mut msg = String::new();
    File::from(rd).read_to_string(&mut msg).map_err(err("read starter pipe"))?;
    if !msg.is_empty() {
        let _ = waitpid(child, None);
        return Err(msg);
    }
    Ok(pid)
}

/// Become uid and gid 0 of the user namespace just entered (created or joined), with no
/// supplementary groups: until then this process's host ids are unmapped there.
fn become_namespace_root() -> Result<(), String> {
    nix::unistd::setgroups(&[]).map_err(err("setgroups([]) in the user namespace"))?;
    let root_g = nix::unistd::Gid::from_raw(0);
    nix::unistd::setresgid(root_g, root_g, root_g)
        .map_err(err("setresgid(0) in the user namespace"))?;
    let root_u = nix::unistd::Uid::from_raw(0);
    nix::unistd::setresuid(root_u, root_u, root_u)
        .map_err(err("setresuid(0) in the user namespace"))
}

/// Run `f` on a thread of its own that first enters `pid`'s namespace of kind `ns` (`net`,
/// `uts`, ...: kinds `setns` allows a thread of a multi-threaded process to enter, and which
/// affect only that thread), then ends. For the daemon's work inside a restored sandbox's
/// namespaces, which must not leave any of its own threads there.
pub fn in_namespace_of<T: Send>(
    pid: u32,
    ns: &str,
    flag: CloneFlags,
    f: impl FnOnce() -> Result<T, String> + Send,
) -> Result<T, String> {
    let path = format!("/proc/{pid}/ns/{ns}");
    let file = File::open(&path).map_err(|e| format!("open {path}: {e}"))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                nix::sched::setns(&file, flag).map_err(|e| format!("setns({path}): {e}"))?;
                f()
            })
            .join()
            .unwrap_or_else(|_| Err(format!("the thread in {path} panicked")))
    })
}

/// Give the network namespace of `pid` what a fresh `private` sandbox's has: `lo` up and
/// unprivileged ICMP sockets for the host gids `ping` (`profile::ping_range`). For a restore that lets CRIU create the namespace
/// empty (`empty_ns`) instead of replaying the dumped links, addresses, routes, rules and
/// iptables with eight `ip`/`iptables` runs: a sandbox without `CAP_NET_ADMIN` (the default
/// profile) cannot have changed any of them.
pub fn set_up_private_netns(pid: u32, ping: Option<(u32, u32)>) -> Result<(), String> {
    in_namespace_of(pid, "net", CloneFlags::CLONE_NEWNET, || {
        set_loopback_up().map_err(|e| format!("bring up lo in the netns of {pid}: {e}"))?;
        if let Some(r) = ping {
            profile::allow_ping(r);
        }
        Ok(())
    })
}

fn set_loopback_up() -> Result<(), String> {
    // SAFETY: plain socket(2) call; the fd is owned by `sock` right after.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    // SAFETY: `fd` is a fresh, valid socket we own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `ifreq` is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads into `req`, which is a valid `ifreq`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(format!("SIOCGIFFLAGS: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the union member `ifru_flags` is the one SIOCGIFFLAGS filled.
    unsafe {
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    }
    // SAFETY: SIOCSIFFLAGS reads `req`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(format!("SIOCSIFFLAGS: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn mount_fs(
    src: &str,
    target: &Path,
    fstype: &str,
    flags: MsFlags,
    data: &str,
) -> Result<(), String> {
    let data = if data.is_empty() { None } else { Some(data) };
    mount(Some(src), target, Some(fstype), flags, data)
        .map_err(|e| format!("mount {fstype} on {}: {e}", target.display()))
}

fn mkdirs(p: &Path) -> Result<(), String> {
    std::fs::create_dir_all(p).map_err(err(format!("mkdir {}", p.display())))
}

/// Runs in the new pid 1; only returns on error.
fn init_child(spec: &StartSpec) -> String {
    match init_child_inner(spec) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

fn init_child_inner(spec: &StartSpec) -> Result<std::convert::Infallible, String> {
    nix::unistd::setsid().map_err(err("setsid"))?;
    let root = &spec.rootfs;
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .map_err(err("make / private"))?;
    mount(Some(root), root, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>)
        .map_err(err(format!("bind {}", root.display())))?;
    // `/proc` and `/dev` become mount points and `/tmp` must exist; the sandbox owns these
    // names, so they are made inside its root (a symlink at `proc` or `dev` is replaced by a
    // directory) and never resolved on the host (see `crate::inroot`).
    let in_root = crate::inroot::InRoot::open(root).map_err(|e| e.to_string())?;
    for d in ["proc", "dev"] {
        in_root.own_dir(d, 0o755).map_err(|e| e.to_string())?;
    }
    if let Err(e) = in_root.dir(Path::new("tmp"), true, false) {
        tracing::debug!(error = %e, "no /tmp in the sandbox");
    }
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount_fs("proc", &root.join("proc"), "proc", nosuid, "")?;
    let dev = root.join("dev");
    mount_fs("tmpfs", &dev, "tmpfs", MsFlags::MS_NOSUID, "mode=755,size=65536k")?;
    // ptmx comes from the devpts instance mounted below (a symlink to pts/ptmx).
    for &(name, major, minor) in profile::ALLOWED_DEVICES.iter().filter(|d| d.0 != "ptmx") {
        let p = dev.join(name);
        if spec.profile.userns.is_some() {
            // No device node can be made, nor opened on a file system mounted, inside a user
            // namespace: the host's own node is bound over an empty file (a checkpoint carries
            // it as an external mount, `profile::DEVICE_MOUNT_PREFIX`).
            File::options()
                .write(true)
                .create_new(true)
                .open(&p)
                .map_err(err(format!("create {}", p.display())))?;
            let host = Path::new("/dev").join(name);
            mount(Some(&host), &p, None::<&str>, MsFlags::MS_BIND, None::<&str>)
                .map_err(err(format!("bind {} on {}", host.display(), p.display())))?;
            continue;
        }
        mknod(
            &p,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(major.into(), minor.into()),
        )
        .map_err(err(format!("mknod {}", p.display())))?;
        // mknod honours the umask; make the mode exact.
        nix::sys::stat::fchmodat(
            None,
            &p,
            Mode::from_bits_truncate(0o666),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )
        .map_err(err(format!("chmod {}", p.display())))?;
    }
    mkdirs(&dev.join("pts"))?;
    mount_fs(
        "devpts",
        &dev.join("pts"),
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    )?;
    // `/dev/shm` is a directory of `/dev`'s tmpfs bound over itself with its own flags
    // (`nosuid,nodev,noexec`), not a second tmpfs: the bind hides the directory beneath it, so
    // it is reached only through those flags, and CRIU archives and restores one tmpfs (each
    // is a `tar | gzip` run, ≈ 10–20 ms of a restore under load) instead of two. Its space is
    // `/dev`'s 64 MiB, which otherwise holds only the device nodes.
    let shm = dev.join("shm");
    mkdirs(&shm)?;
    nix::sys::stat::fchmodat(
        None,
        &shm,
        Mode::from_bits_truncate(0o1777),
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    )
    .map_err(err(format!("chmod {}", shm.display())))?;
    mount(Some(&shm), &shm, None::<&str>, MsFlags::MS_BIND, None::<&str>)
        .map_err(err(format!("bind {}", shm.display())))?;
    mount(
        None::<&str>,
        &shm,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | nosuid,
        None::<&str>,
    )
    .map_err(err(format!("remount {} nosuid,nodev,noexec", shm.display())))?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, dev.join(link))
            .map_err(err(format!("symlink /dev/{link}")))?;
    }
    nix::unistd::chdir(root.as_path()).map_err(err("chdir rootfs"))?;
    nix::unistd::pivot_root(".", ".").map_err(err("pivot_root"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(err("detach old root"))?;
    nix::unistd::chdir("/").map_err(err("chdir /"))?;
    nix::unistd::sethostname(&spec.hostname).map_err(err("sethostname"))?;
    if !spec.profile.privileged {
        profile::restrict_mounts()?;
    }
    redirect_stdio(true)?;
    // Before closing fds: a failure must still reach the starter through the error pipe.
    profile::restrict_process(&spec.profile, spec.seccomp.as_ref())?;
    close_fds_above_2();
    let init = CString::new(format!("/{INIT_PATH}")).map_err(err("init path"))?;
    let argv = [CString::new("crab-init").map_err(err("argv"))?];
    let envp = [CString::new("PATH=/usr/sbin:/usr/bin:/sbin:/bin").map_err(err("env"))?];
    nix::unistd::execve(&init, &argv, &envp).map_err(err(format!("exec /{INIT_PATH}")))?;
    Err("execve returned".into())
}

fn redirect_stdio(all: bool) -> Result<(), String> {
    let null =
        File::options().read(true).write(true).open("/dev/null").map_err(err("open /dev/null"))?;
    let fds: &[i32] = if all { &[0, 1, 2] } else { &[0] };
    for fd in fds {
        // SAFETY: dup2 onto a standard descriptor; `null` stays valid across the call.
        if unsafe { libc::dup2(null.as_raw_fd(), *fd) } < 0 {
            return Err(format!("dup2 /dev/null: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

fn close_fds_above_2() {
    // SAFETY: close_range only closes descriptors; nothing in this process uses fds above 2
    // after this point (the error pipe is CLOEXEC and closed by exec anyway).
    unsafe {
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
    }
}

/// Run the exec helper: returns the command's exit code (`128+signal` when signalled).
///
/// Must be called from a single-threaded process (the `crab __nsexec` helper).
pub fn exec_in_sandbox(spec: &ExecSpec) -> Result<i32, String> {
    if spec.cmd.is_empty() {
        return Err("no command given".into());
    }
    not_dumpable()?;
    let ns = |n: &str| {
        let p = format!("/proc/{}/ns/{n}", spec.init_pid);
        File::open(&p).map_err(err(format!("open {p}")))
    };
    let order = [
        ("ipc", CloneFlags::CLONE_NEWIPC),
        ("uts", CloneFlags::CLONE_NEWUTS),
        ("net", CloneFlags::CLONE_NEWNET),
        ("cgroup", CloneFlags::CLONE_NEWCGROUP),
        ("pid", CloneFlags::CLONE_NEWPID),
        ("mnt", CloneFlags::CLONE_NEWNS),
    ];
    let mut files: Vec<(File, CloneFlags)> =
        order.iter().map(|(n, f)| ns(n).map(|file| (file, *f))).collect::<Result<_, _>>()?;
    // The time namespace: a restore puts the init in a new one (CRIU keeps the monotonic and
    // boot clocks continuous), and a command outside it would make the next process dump
    // span two time namespaces, which CRIU cannot restore. Joined only when it differs from
    // ours (kernels without time namespaces have no such file).
    if let Some(t) = ns_to_join(spec.init_pid, "time")? {
        files.push((t, CloneFlags::from_bits_retain(libc::CLONE_NEWTIME)));
    }
    // The user namespace last, and only when the init is in one (a user-namespaced sandbox,
    // or a restore of one): as the host's root this process may join every other namespace
    // whoever owns it — a restore's cgroup namespace is made by `criu swrk`, outside the
    // sandbox's user namespace, where a process already in that namespace would hold no
    // capability — and once in it, it becomes its root (`become_namespace_root`).
    let joins_user = match ns_to_join(spec.init_pid, "user")? {
        Some(u) => {
            files.push((u, CloneFlags::CLONE_NEWUSER));
            true
        }
        None => false,
    };
    // Join the cgroup only after setns, so the helper's own namespace switching is not counted
    // as the sandbox's activity by the inspector.
    let cgroups = spec.cgroup.open_procs()?;
    for (f, flag) in &files {
        nix::sched::setns(f, *flag).map_err(err(format!("setns {flag:?}")))?;
    }
    drop(files);
    if joins_user {
        become_namespace_root()?;
    }
    cgroups.enter()?;
    let argv: Vec<CString> = spec
        .cmd
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<_, _>>()
        .map_err(err("argument contains NUL"))?;
    let envp: Vec<CString> = spec
        .env
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<_, _>>()
        .map_err(err("environment contains NUL"))?;
    // SAFETY: single-threaded helper process (see the function docs).
    match unsafe { fork() }.map_err(err("fork"))? {
        ForkResult::Child => {
            // SAFETY: prctl with an integer argument; no memory is passed.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
            let code = exec_child(spec, &argv, &envp);
            std::process::exit(code);
        }
        ForkResult::Parent { child } => loop {
            match waitpid(child, None) {
                Ok(WaitStatus::Exited(_, code)) => return Ok(code),
                Ok(WaitStatus::Signaled(_, sig, _)) => return Ok(128 + sig as i32),
                Ok(_) => continue,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(format!("waitpid: {e}")),
            }
        },
    }
}

/// Make this helper non-dumpable until its `execve` (which resets it): while it is in the
/// sandbox's namespaces, nothing there may `ptrace` it or open its `/proc/<pid>/exe`, `mem` or
/// `fd` (`crate::sealed` is the second wall: the binary is a sealed memfd anyway).
fn not_dumpable() -> Result<(), String> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(format!("prctl(PR_SET_DUMPABLE, 0): {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// The namespace of kind `kind` (`time`, `user`) of `init_pid` when it is not this process's
/// own.
fn ns_to_join(init_pid: u32, kind: &str) -> Result<Option<File>, String> {
    use std::os::unix::fs::MetadataExt;
    let theirs = format!("/proc/{init_pid}/ns/{kind}");
    let t = match File::open(&theirs) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
        Err(e) => return Err(format!("open {theirs}: {e}")),
    };
    let ours = std::fs::metadata(format!("/proc/self/ns/{kind}"))
        .map_err(|e| format!("stat /proc/self/ns/{kind}: {e}"))?;
    let tm = t.metadata().map_err(|e| format!("stat {theirs}: {e}"))?;
    Ok(((tm.dev(), tm.ino()) != (ours.dev(), ours.ino())).then_some(t))
}

/// Exec the command; returns the exit code to use when that fails (126/127 like a shell).
fn exec_child(spec: &ExecSpec, argv: &[CString], envp: &[CString]) -> i32 {
    let fail = |msg: String, code: i32| {
        let _ = writeln!(std::io::stderr(), "crab: {msg}");
        code
    };
    // A session of its own, inside the sandbox: a session leader outside the sandbox's pid
    // namespace would make the sandbox's processes undumpable by CRIU.
    if let Err(e) = nix::unistd::setsid() {
        return fail(format!("setsid: {e}"), 126);
    }
    if !spec.stdin {
        if let Err(e) = redirect_stdio(false) {
            return fail(e, 126);
        }
    }
    // The account is looked up before the process is restricted (its files are the
    // sandbox's: read bounded, never trusted beyond picking ids inside its namespace).
    let account = match spec.user.as_deref().map(crate::account::resolve) {
        Some(Ok(a)) => Some(a),
        Some(Err(e)) => return fail(e, 126),
        None => None,
    };
    if let Err(e) = profile::restrict_process(&spec.profile, spec.seccomp.as_ref()) {
        return fail(e, 126);
    }
    let mut with_home;
    let envp = match &account {
        Some(a) => {
            if let Err(e) = a.switch() {
                return fail(e, 126);
            }
            with_home = envp.to_vec();
            if !spec.env.iter().any(|e| e.starts_with("HOME=")) {
                if let Ok(h) = CString::new(format!("HOME={}", a.home)) {
                    with_home.push(h);
                }
            }
            with_home.as_slice()
        }
        None => envp,
    };
    // After the switch: the account must be able to enter it.
    if let Err(e) = nix::unistd::chdir(spec.workdir.as_str()) {
        return fail(format!("cannot enter working directory {}: {e}", spec.workdir), 126);
    }
    close_fds_above_2();
    // execvpe searches the *caller's* PATH; make it the command's.
    if let Some(path) = spec.env.iter().find_map(|kv| kv.strip_prefix("PATH=")) {
        std::env::set_var("PATH", path);
    }
    let e = nix::unistd::execvpe(&argv[0], argv, envp).err();
    let prog = spec.cmd[0].as_str();
    match e {
        Some(nix::errno::Errno::ENOENT) => fail(format!("{prog}: command not found"), 127),
        Some(e) => fail(format!("cannot run {prog}: {e}"), 126),
        None => 126,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn script(path: &Path, body: &str) {
        std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn the_small_helper_is_used_only_when_built_from_the_same_sources() {
        let dir = tempfile::tempdir().unwrap();
        let crab = dir.path().join("crab");
        script(&crab, "exit 0");
        let small = dir.path().join(SMALL_HELPER);

        let (exe, is_small, why) = choose_helper(&crab);
        assert_eq!((exe.as_path(), is_small), (crab.as_path(), false), "{why}");
        assert!(why.contains("no crab-nsexec"), "{why}");

        script(&small, "echo 0123456789abcdef");
        let (exe, is_small, why) = choose_helper(&crab);
        assert_eq!((exe.as_path(), is_small), (crab.as_path(), false), "{why}");
        assert!(
            why.contains("built from other sources") && why.contains("cargo build -p crab"),
            "{why}"
        );

        script(&small, "exit 3");
        assert!(!choose_helper(&crab).1, "a helper that fails its ABI query is not used");

        script(&small, &format!("[ \"$1\" = __helper-abi ] && echo {HELPER_ABI}"));
        let (exe, is_small, why) = choose_helper(&crab);
        assert_eq!((exe.as_path(), is_small), (small.as_path(), true), "{why}");
    }
}
