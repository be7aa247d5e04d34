//! End-to-end tests against the real CRIU binary (root needed): version, check, dump and
//! restore of a small process tree, `leave_running`, notify hooks, and the shape of errors.
//!
//! They need CRIU 4.2.1 at `$CRAB_CRIU` or `/opt/crab/criu/bin/criu` (`make setup`). When not
//! run as root they are skipped with a note on stderr; a missing CRIU binary fails them.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crab_criu::{phase, Criu, CriuError, DumpOpts, RestoreOpts};

use crab_testkit::require_root;

fn criu() -> Criu {
    Criu::locate().unwrap_or_else(|e| panic!("{e}; hint: {}", e.hint()))
}

/// Start `sh -c script` the way a sandbox must be started to be dumpable: its own session, no
/// descriptors above 2, stdio on /dev/null.
fn spawn_clean(script: &str) -> Child {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(script).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    // SAFETY: setsid and close_range are async-signal-safe system calls; nothing allocates.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // Mark every inherited descriptor above 2 close-on-exec (std's own error pipe
            // included, which it needs until exec).
            let r = libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC as libc::c_uint,
            );
            if r == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().expect("spawn sh")
}

fn counter_script(file: &Path) -> String {
    // Written through a rename so that a reader (or a kill) never sees a truncated file.
    format!(
        "i=0; while :; do i=$((i+1)); echo $i > {f}.tmp; mv {f}.tmp {f}; sleep 0.05; done",
        f = file.display()
    )
}

fn read_counter(file: &Path) -> Option<u64> {
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}

fn wait_counter(file: &Path, above: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = read_counter(file) {
            if v > above {
                return v;
            }
        }
        assert!(Instant::now() < deadline, "counter in {} never passed {above}", file.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill_group(pid: i32) {
    // SAFETY: plain kill(2) / waitpid(2) on a process group and pid we created.
    unsafe {
        libc::kill(-pid, libc::SIGKILL);
        let mut st = 0;
        libc::waitpid(pid, &mut st, 0);
    }
}

/// Wait until no task uses `pid` as pid, process group or session, so that CRIU can restore
/// it. The tree's orphaned children (the `sleep`) are reaped by the machine's init, lazily.
fn wait_pid_free(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    // SAFETY: kill(2) with signal 0 only checks for existence.
    while unsafe { libc::kill(-pid, 0) } == 0 || Path::new(&format!("/proc/{pid}")).exists() {
        assert!(Instant::now() < deadline, "pid {pid} still in use");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn alive(pid: i32) -> bool {
    // A zombie still answers kill(0); look at its state instead.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

struct Dirs {
    _tmp: tempfile::TempDir,
    images: PathBuf,
    logs: PathBuf,
    work: PathBuf,
}

fn dirs() -> Dirs {
    let mut tmp = tempfile::tempdir().expect("tempdir");
    // CRAB_KEEP_TEST_DIRS=1 keeps images and logs for inspection.
    tmp.disable_cleanup(std::env::var_os("CRAB_KEEP_TEST_DIRS").is_some());
    let images = tmp.path().join("images");
    let logs = tmp.path().join("logs");
    let work = tmp.path().join("work");
    for d in [&images, &logs, &work] {
        std::fs::create_dir(d).expect("mkdir");
    }
    Dirs { images, logs, work, _tmp: tmp }
}

#[test]
fn version_and_check() {
    require_root!();
    let c = criu();
    let v = c.version().expect("version");
    assert_eq!((v.major, v.minor), (4, 2), "CRIU {v}");
    let d = dirs();
    let log = d.logs.join("check.log");
    c.check(&log).expect("criu check");
    assert!(log.exists());
}

#[test]
fn dump_kill_restore_continues() {
    require_root!();
    let c = criu();
    let d = dirs();
    let counter = d.work.join("count");
    let mut child = spawn_clean(&counter_script(&counter));
    let pid = i32::try_from(child.id()).expect("pid");
    wait_counter(&counter, 3);

    let mut phases = Vec::new();
    let opts = DumpOpts::new(pid, &d.images, d.logs.join("dump.log"));
    let stats = c
        .dump_with(&opts, |n| {
            phases.push(n.phase);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    // CRIU killed the tree after the dump.
    child.wait().expect("reap");
    assert!(phases.iter().any(|p| p == phase::POST_DUMP), "phases: {phases:?}");
    assert!(stats.image_files > 3 && stats.image_bytes > 0, "{stats:?}");
    let at_dump = read_counter(&counter).expect("counter");
    wait_pid_free(pid);
    assert_eq!(read_counter(&counter), Some(at_dump), "tree still running after dump");
    eprintln!("dump: {stats:?}");

    let mut rphases = Vec::new();
    let ropts = RestoreOpts::new(&d.images, d.logs.join("restore.log"));
    let restored = c
        .restore_with(&ropts, |n| {
            rphases.push((n.phase, n.pid));
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("restore: {restored:?}; phases {rphases:?}");
    assert_eq!(restored.pid, pid, "CRIU restores the original pid");
    assert!(rphases.iter().any(|(p, _)| p == phase::POST_RESTORE), "phases: {rphases:?}");
    // It continues counting from where it was, not from zero.
    let next = wait_counter(&counter, at_dump);
    assert!(next > at_dump && next < at_dump + 40, "{at_dump} -> {next}");
    assert!(alive(pid));
    kill_group(pid);
}

/// The nice value of `pid` (`/proc/<pid>/stat`'s 19th field), if it is there.
fn try_nice_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.split_whitespace().nth(16)?.parse().ok()
}

fn nice_of(pid: i32) -> i32 {
    try_nice_of(pid).unwrap_or_else(|| panic!("no nice in /proc/{pid}/stat"))
}

#[test]
fn a_restore_at_another_nice_gives_each_task_back_its_own() {
    require_root!();
    // What each `criu swrk` of this test binary started at (no other test asks for a nice).
    static SWRK_NICES: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());
    assert!(
        crab_criu::observer::set(Box::new(|pid, started| {
            // Another test's swrk may be gone already: only what could be read counts.
            if let (true, Some(n)) = (started, i32::try_from(pid).ok().and_then(try_nice_of)) {
                SWRK_NICES.lock().unwrap().push(n);
            }
        })),
        "no other test installs an observer"
    );
    let c = criu();
    let d = dirs();
    // Two trees: one at the default nice (0, the case an older CRIU skipped, which would
    // leave it at the restore's), one at 3.
    let mut children = Vec::new();
    for (i, nice) in [(0, 0), (1, 3)] {
        let file = d.work.join(format!("count{i}"));
        let child = spawn_clean(&counter_script(&file));
        let pid = i32::try_from(child.id()).expect("pid");
        // SAFETY: setpriority(2) on a child we started.
        assert_eq!(unsafe { libc::setpriority(libc::PRIO_PROCESS, pid as libc::id_t, nice) }, 0);
        wait_counter(&file, 2);
        children.push((child, pid, nice, file));
    }
    for (child, pid, nice, file) in &mut children {
        let images = d.images.join(pid.to_string());
        std::fs::create_dir(&images).expect("mkdir");
        let opts = DumpOpts::new(*pid, &images, d.logs.join(format!("dump{pid}.log")));
        c.dump(&opts).unwrap_or_else(|e| panic!("{e}"));
        child.wait().expect("reap");
        wait_pid_free(*pid);
        let mut ropts = RestoreOpts::new(&images, d.logs.join(format!("restore{pid}.log")));
        ropts.nice = -5;
        let restored = c.restore(&ropts).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(restored.pid, *pid);
        let v = read_counter(file).expect("counter");
        wait_counter(file, v);
        assert_eq!(nice_of(*pid), *nice, "the restored task runs at its dumped nice");
        kill_group(*pid);
    }
    let seen = SWRK_NICES.lock().unwrap().clone();
    assert_eq!(
        seen.iter().filter(|&&n| n == -5).count(),
        2,
        "the two restores ran at -5: {seen:?}"
    );
}

#[test]
fn leave_running_keeps_the_tree_alive_and_images_restore_twice() {
    require_root!();
    let c = criu();
    let d = dirs();
    let counter = d.work.join("count");
    let mut child = spawn_clean(&counter_script(&counter));
    let pid = i32::try_from(child.id()).expect("pid");
    wait_counter(&counter, 2);

    let mut opts = DumpOpts::new(pid, &d.images, d.logs.join("dump.log"));
    opts.leave_running = true;
    let stats = c.dump(&opts).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("dump (leave running): {stats:?}");
    let v = read_counter(&counter).expect("counter");
    wait_counter(&counter, v + 2);
    assert!(alive(pid));

    // Kill it, then restore the same images twice in a row (rollback twice).
    kill_group(pid);
    let _ = child.wait();
    wait_pid_free(pid);
    for round in 0..2 {
        let ropts = RestoreOpts::new(&d.images, d.logs.join(format!("restore{round}.log")));
        let r = c.restore(&ropts).unwrap_or_else(|e| panic!("{e}"));
        let now = read_counter(&counter).expect("counter");
        wait_counter(&counter, now);
        kill_group(r.pid);
        wait_pid_free(r.pid);
    }
}

#[test]
fn dump_of_missing_pid_names_the_log() {
    require_root!();
    let c = criu();
    let d = dirs();
    let log = d.logs.join("dump-missing.log");
    // Pid max is at most 2^22, so this pid cannot exist.
    let err = c.dump(&DumpOpts::new(0x7fff_fff0, &d.images, &log)).expect_err("dump must fail");
    let msg = err.to_string();
    assert!(matches!(err, CriuError::Failed { .. }), "{err:?}");
    assert!(msg.contains(&log.display().to_string()), "{msg}");
    assert_eq!(err.log_path(), Some(log.as_path()));
    assert!(log.exists());
}

#[test]
fn hook_failure_aborts_dump_and_tree_survives() {
    require_root!();
    let c = criu();
    let d = dirs();
    let counter = d.work.join("count");
    let mut child = spawn_clean(&counter_script(&counter));
    let pid = i32::try_from(child.id()).expect("pid");
    wait_counter(&counter, 2);
    let opts = DumpOpts::new(pid, &d.images, d.logs.join("dump.log"));
    let err = c
        .dump_with(&opts, |n| {
            if n.phase == phase::POST_DUMP {
                Err("refused by test".into())
            } else {
                Ok(())
            }
        })
        .expect_err("hook must abort");
    assert!(matches!(&err, CriuError::Hook { phase, .. } if phase == "post-dump"), "{err}");
    // An aborted dump resumes the tree.
    let v = read_counter(&counter).expect("counter");
    wait_counter(&counter, v + 1);
    kill_group(pid);
    let _ = child.wait();
}

#[test]
fn restore_of_garbage_images_fails_with_log() {
    require_root!();
    let c = criu();
    let d = dirs();
    std::fs::write(d.images.join("inventory.img"), b"not an image").expect("write");
    let log = d.logs.join("restore-bad.log");
    let err = c.restore(&RestoreOpts::new(&d.images, &log)).expect_err("must fail");
    assert!(err.to_string().contains(&log.display().to_string()), "{err}");
}

#[test]
fn missing_binary_is_a_clear_error() {
    let err = Criu::at("/nonexistent/criu").expect_err("must fail");
    assert!(err.to_string().contains("/nonexistent/criu"));
    assert!(err.hint().contains("make setup"));
}

fn cgroup2_mount() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        if !right.starts_with("cgroup2 ") {
            return None;
        }
        left.split(' ').nth(4).map(PathBuf::from)
    })
}

#[test]
fn restore_into_other_cgroup_with_join_and_ignore() {
    require_root!();
    let Some(cg2) = cgroup2_mount() else {
        return crab_testkit::privilege::cannot_run("no cgroup2 mount");
    };
    let c = criu();
    let d = dirs();
    let counter = d.work.join("count");
    let mut child = spawn_clean(&counter_script(&counter));
    let pid = i32::try_from(child.id()).expect("pid");
    wait_counter(&counter, 2);
    let mut opts = DumpOpts::new(pid, &d.images, d.logs.join("dump.log"));
    opts.manage_cgroups = Some(crab_criu::CgroupMode::Ignore);
    c.dump(&opts).unwrap_or_else(|e| panic!("{e}"));
    child.wait().expect("reap");
    wait_pid_free(pid);

    let group = cg2.join(format!("crab-criu-test-{}", std::process::id()));
    std::fs::create_dir(&group).expect("mkdir cgroup");
    let mut ropts = RestoreOpts::new(&d.images, d.logs.join("restore.log"));
    ropts.manage_cgroups = Some(crab_criu::CgroupMode::Ignore);
    ropts.join_cgroups = vec![group.clone()];
    let r = c.restore(&ropts).unwrap_or_else(|e| panic!("{e}"));
    let procs = std::fs::read_to_string(group.join("cgroup.procs")).expect("procs");
    // The swrk process itself has left (exited); the restored tree is in the group.
    assert!(procs.lines().any(|l| l.trim() == r.pid.to_string()), "{procs}");
    kill_group(r.pid);
    wait_pid_free(r.pid);
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::remove_dir(&group).is_err() {
        assert!(Instant::now() < deadline, "cgroup {} stays busy", group.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}
