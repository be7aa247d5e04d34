//! Integration tests of the native sandbox runtime through the real CLI and daemon (root).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::path::Path;

use common::{cgroup_parent, crab, crab_ok, state_dir, unique, wait_until, Sandbox};

#[test]
fn exec_returns_output_and_exit_codes() {
    let sb = Sandbox::new("t-exec");
    let (out, err, code) = sb.sh("echo out; echo err >&2; exit 3");
    assert_eq!(out, "out\n");
    assert_eq!(err, "err\n");
    assert_eq!(code, 3);
    // argv is passed as is, working directory and environment apply.
    let out = crab_ok(&[
        "exec",
        "-w",
        "/tmp",
        "-e",
        "FOO=bar baz",
        &sb.name,
        "--",
        "sh",
        "-c",
        "pwd; echo $FOO; hostname",
    ]);
    assert_eq!(out, format!("/tmp\nbar baz\n{}\n", sb.name));
    // A missing program is 127 like a shell.
    let o = crab(&["exec", &sb.name, "--", "no-such-program"]);
    assert_eq!(o.status.code(), Some(127));
    // Login shells are silent.
    let o = crab(&["exec", &sb.name, "--", "bash", "-lc", "true"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(o.stdout.is_empty() && o.stderr.is_empty(), "login shell printed: {o:?}");
}

#[test]
fn stdin_passes_through_with_i() {
    let sb = Sandbox::new("t-stdin");
    let mut child = std::process::Command::new(common::bin())
        .args([
            "--state-dir",
            state_dir().to_str().unwrap(),
            "exec",
            "-i",
            &sb.name,
            "--",
            "sh",
            "-c",
            "tr a-z A-Z",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"hello crab\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "HELLO CRAB\n");
    // Without -i, stdin is /dev/null.
    assert_eq!(sb.sh_ok("cat; echo end"), "end\n");
}

#[test]
fn stdin_streams_with_i() {
    // The command sees each line as it is written, long before stdin closes (issue 11: `exec
    // -i` streams stdin), and megabytes go through.
    use std::io::{BufRead, Write};
    let sb = Sandbox::new("t-stdin-stream");
    let mut child = std::process::Command::new(common::bin())
        .args(["--state-dir", state_dir().to_str().unwrap(), "exec", "-i", &sb.name, "--"])
        .args(["sh", "-c", "read a; echo got $a; read b; echo got $b; wc -c"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    stdin.write_all(b"one\n").unwrap();
    stdin.flush().unwrap();
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "got one\n", "the first line did not come through while stdin was open");
    stdin.write_all(b"two\n").unwrap();
    stdin.write_all(&vec![b'x'; 3 << 20]).unwrap();
    drop(stdin);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert_eq!(rest, format!("got two\n{}\n", 3 << 20));
    assert!(child.wait().unwrap().success());
}

#[test]
fn background_server_answers_a_later_exec() {
    let sb = Sandbox::new("t-srv");
    sb.sh_ok("cd /tmp && echo served > index.html && nohup python3 -m http.server 8000 >/tmp/http.log 2>&1 &");
    let got =
        wait_until(10.0, || sb.sh("curl -sf http://127.0.0.1:8000/index.html").0 == "served\n");
    assert!(got, "server did not answer");
    // The host's loopback does not see it (own network namespace).
    let host = std::process::Command::new("curl")
        .args(["-sf", "--max-time", "1", "http://127.0.0.1:8000/index.html"])
        .output();
    if let Ok(h) = host {
        assert_ne!(
            String::from_utf8_lossy(&h.stdout),
            "served\n",
            "sandbox port leaked to the host"
        );
    }
    let info = sb.info();
    assert!(info["processes"].as_u64().unwrap() >= 2, "{info}");
}

#[test]
fn sandbox_sees_only_its_own_processes() {
    let sb = Sandbox::new("t-pid");
    let out = sb.sh_ok("cat /proc/1/cmdline | tr '\\0' ' '; echo; ls /proc | grep -c '^[0-9]'");
    let mut lines = out.lines();
    assert_eq!(lines.next().unwrap().trim(), "crab-init");
    let n: u32 = lines.next().unwrap().trim().parse().unwrap();
    assert!(n <= 4, "sandbox sees {n} processes");
    // No fds above 2 leak into commands.
    let fds = sb.sh_ok("ls /proc/self/fd | sort -n | tr '\\n' ' '");
    assert_eq!(fds.trim(), "0 1 2 3", "fds: {fds}"); // 3 is ls's own directory handle
}

#[test]
fn writes_never_reach_the_image() {
    let sb = Sandbox::new("t-cow");
    sb.sh_ok("echo x > /etc/crab-cow-test && rm -f /usr/bin/zdump && mkdir -p /tmp/t && echo y > /tmp/t/f");
    let image = state_dir().join("pool/images/debian");
    assert!(!image.join("etc/crab-cow-test").exists());
    assert!(image.join("usr/bin/zdump").exists() || !Path::new("/nonexistent").exists());
    assert!(!image.join("tmp/t").exists());
    // /tmp is on the sandbox's own filesystem, not a tmpfs.
    let fs = sb.sh_ok("stat -f -c %T /tmp");
    assert_eq!(fs.trim(), "btrfs");
    let root = state_dir().join("pool/sandboxes").join(&sb.name).join("rootfs");
    assert_eq!(std::fs::read_to_string(root.join("tmp/t/f")).unwrap(), "y\n");
}

#[test]
fn rm_leaves_nothing_behind() {
    let sb = Sandbox::new("t-rm");
    sb.sh_ok("sleep 1000 >/dev/null 2>&1 &");
    let name = sb.name.clone();
    // Refused without --force while something runs.
    let o = crab(&["sandbox", "rm", &name]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--force"));
    crab_ok(&["sandbox", "rm", "--force", &name]);
    std::mem::forget(sb);
    assert!(!state_dir().join("pool/sandboxes").join(&name).exists());
    assert!(!Path::new("/sys/fs/cgroup/unified").join(cgroup_parent()).join(&name).exists());
    for c in ["memory", "pids", "cpu"] {
        assert!(
            !Path::new("/sys/fs/cgroup").join(c).join(cgroup_parent()).join(&name).exists(),
            "{c} cgroup left"
        );
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&name));
    let ls = crab_ok(&["sandbox", "ls", "--json"]);
    assert!(!ls.contains(&name));
}

#[test]
fn timeout_kills_the_command_and_its_output_holders() {
    let sb = Sandbox::new("t-timeout");
    let start = std::time::Instant::now();
    let o = crab(&[
        "exec",
        "--timeout",
        "1",
        &sb.name,
        "--",
        "sh",
        "-c",
        "sleep 300 & sleep 200; echo never",
    ]);
    assert!(start.elapsed().as_secs_f64() < 10.0);
    assert_ne!(o.status.code(), Some(0));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("never"));
    assert!(String::from_utf8_lossy(&o.stderr).contains("timed out"));
    assert!(wait_until(5.0, || !sb.sh_ok("ps -e -o comm").contains("sleep")), "sleep survived");
    // A background process with redirected output survives the exec that started it.
    sb.sh_ok("nohup sleep 300 >/dev/null 2>&1 &");
    assert!(sb.sh_ok("ps -e -o comm").contains("sleep"));
}

#[test]
fn bad_input_gets_clear_errors() {
    common::ensure_daemon();
    let o = crab(&["exec", "no-such-sandbox", "--", "true"]);
    assert_eq!(o.status.code(), Some(125));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no sandbox named \"no-such-sandbox\"") && err.contains("hint:"), "{err}");
    let o = crab(&["sandbox", "create", "no-such-image"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no image named"));
    let o = crab(&["sandbox", "create", "debian", "--name", "bad/name"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("invalid sandbox name"));
    let sb = Sandbox::new("t-clash");
    let o = crab(&["sandbox", "create", "debian", "--name", &sb.name]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists"));
    // The clash did not damage the existing sandbox.
    assert_eq!(sb.sh_ok("echo alive"), "alive\n");
    // JSON errors carry the stable code.
    let o = crab(&["--json", "sandbox", "inspect", "no-such-sandbox"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["code"], "sandbox_not_found");
    // The socket is root-only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(state_dir().join("crab.sock")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
}

fn python_tar(path: &Path, script: &str) {
    let code = format!(
        "import tarfile, io\nt = tarfile.open({:?}, 'w')\ndef add(name, data=b'x', kind=tarfile.REGTYPE, link=''):\n    i = tarfile.TarInfo(name); i.type = kind; i.linkname = link; i.size = len(data) if kind == tarfile.REGTYPE else 0; i.mode = 0o755\n    t.addfile(i, io.BytesIO(data) if kind == tarfile.REGTYPE else None)\n{script}\nt.close()\n",
        path.to_str().unwrap()
    );
    let ok = std::process::Command::new("python3").arg("-c").arg(code).status().unwrap();
    assert!(ok.success());
}

#[test]
fn archive_import_refuses_unsafe_entries() {
    common::ensure_daemon();
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("abs", "add('/etc/evil')", "/etc/evil", "absolute"),
        ("dotdot", "add('usr/../../evil')", "usr/../../evil", "`..`"),
        ("symlink", "add('bin', kind=tarfile.DIRTYPE)\nadd('bin/sh', kind=tarfile.SYMTYPE, link='../../../etc/shadow')", "bin/sh", "leaves the root"),
        ("hardlink", "add('x', kind=tarfile.LNKTYPE, link='../outside')", "x", "hard link"),
    ];
    for (name, script, entry, why) in cases {
        let tar = dir.path().join(format!("{name}.tar"));
        python_tar(&tar, script);
        let img = unique("t-img");
        let o = crab(&["image", "import", &img, tar.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{name} imported");
        assert!(err.contains(entry) && err.contains(why), "{name}: {err}");
        assert!(!crab_ok(&["image", "ls"]).contains(&img));
    }
    // A safe archive (absolute symlink targets are fine) imports and can be removed.
    let tar = dir.path().join("ok.tar");
    python_tar(&tar, "add('etc', kind=tarfile.DIRTYPE)\nadd('etc/hello', b'hi')\nadd('etc/link', kind=tarfile.SYMTYPE, link='/etc/hello')");
    let img = unique("t-img");
    crab_ok(&["image", "import", &img, tar.to_str().unwrap()]);
    assert!(crab_ok(&["image", "ls"]).contains(&img));
    let root = state_dir().join("pool/images").join(&img);
    assert_eq!(std::fs::read_to_string(root.join("etc/hello")).unwrap(), "hi");
    assert!(root.join(".crab/init").exists());
    crab_ok(&["image", "rm", &img]);
    assert!(!root.exists());
    // A directory with an escaping symlink is refused too.
    let rootdir = dir.path().join("rootfs");
    std::fs::create_dir_all(rootdir.join("a")).unwrap();
    std::os::unix::fs::symlink("../../x", rootdir.join("a/l")).unwrap();
    let o = crab(&["image", "import", &unique("t-img"), rootdir.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("a/l"));
}

#[test]
fn failed_create_leaves_nothing_behind() {
    common::ensure_daemon();
    let name = unique("t-fail");
    // pids.max = 0 makes the sandbox's first fork fail after snapshot and cgroup exist.
    let o = crab(&["sandbox", "create", "debian", "--name", &name, "--pids", "0"]);
    assert!(!o.status.success(), "create with pids=0 succeeded");
    assert!(String::from_utf8_lossy(&o.stderr).contains("error:"));
    assert!(!state_dir().join("pool/sandboxes").join(&name).exists());
    assert!(!Path::new("/sys/fs/cgroup/unified").join(cgroup_parent()).join(&name).exists());
    assert!(!Path::new("/sys/fs/cgroup/pids/crab").join(&name).exists());
    assert!(!crab_ok(&["sandbox", "ls"]).contains(&name));
    // The name is free again.
    let sb = Sandbox { name: name.clone() };
    crab_ok(&["sandbox", "create", "debian", "--name", &name]);
    assert_eq!(sb.sh_ok("echo ok"), "ok\n");
}

#[test]
fn network_modes() {
    let none = Sandbox::with_args("t-netnone", &["--net", "none"]);
    let o = none.sh_ok("ip -o link show lo");
    assert!(o.contains("state DOWN") && !o.contains("LOWER_UP"), "lo is up with --net none: {o}");
    assert_eq!(none.sh_ok("ip -o link | wc -l").trim(), "1");
    let private = Sandbox::new("t-netpriv");
    let links = private.sh_ok("ip -o link | wc -l");
    assert_eq!(links.trim(), "1", "a private netns has only lo");
    let host = Sandbox::with_args("t-nethost", &["--net", "host"]);
    let host_links = host.sh_ok("ip -o link | wc -l");
    let real =
        std::process::Command::new("sh").args(["-c", "ip -o link | wc -l"]).output().unwrap();
    assert_eq!(host_links.trim(), String::from_utf8_lossy(&real.stdout).trim());
}

/// `crab version --json` reports the start-up soft-dirty probe, agreeing with a probe here.
#[test]
fn version_reports_soft_dirty() {
    common::ensure_daemon();
    let v: serde_json::Value = serde_json::from_str(&crab_ok(&["version", "--json"])).unwrap();
    let sd = &v["features"]["soft_dirty"];
    let here = crab_criu::soft_dirty::probe();
    assert_eq!(sd["available"].as_bool(), Some(here.available), "{v}");
    assert!(!sd["reason"].as_str().unwrap_or("").is_empty(), "{v}");
}

fn ready_roots(image: &str) -> Vec<String> {
    let prefix = format!("warm-{image}-");
    let mut v: Vec<String> = std::fs::read_dir(state_dir().join("pool/tmp"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    v.sort();
    v
}

/// The daemon keeps ready-made roots of a used image (`--warm-roots`, 2 by default); a create
/// takes one, each sandbox still gets its own root, and a rebuilt or removed image's ready roots
/// are never handed out and do not stay behind.
#[test]
fn ready_roots_serve_creates_and_never_outlive_their_image() {
    common::ensure_daemon();
    let image = unique("t-warm");
    let src = std::env::temp_dir().join(&image);
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::fs::write(src.join("etc/marker"), "v1\n").unwrap();
    crab_ok(&["image", "import", &image, src.to_str().unwrap()]);
    let a = unique("t-warm-a");
    crab_ok(&["sandbox", "create", &image, "--name", &a]);
    assert!(
        wait_until(20.0, || ready_roots(&image).len() == 2),
        "no ready roots after the first create: {:?}",
        ready_roots(&image)
    );
    let before = ready_roots(&image);
    let b = unique("t-warm-b");
    crab_ok(&["sandbox", "create", &image, "--name", &b]);
    let after = ready_roots(&image);
    assert!(
        before.iter().any(|r| !after.contains(r)),
        "no ready root was taken: {before:?} → {after:?}"
    );
    let root = |n: &str| state_dir().join("pool/sandboxes").join(n).join("rootfs");
    assert_eq!(std::fs::read_to_string(root(&b).join("etc/hostname")).unwrap(), format!("{b}\n"));
    std::fs::write(root(&a).join("etc/marker"), "changed in a\n").unwrap();
    assert_eq!(std::fs::read_to_string(root(&b).join("etc/marker")).unwrap(), "v1\n");
    // Re-import the image: its old ready roots go; the next create gets the new content.
    assert!(wait_until(20.0, || ready_roots(&image).len() == 2));
    let old = ready_roots(&image);
    std::fs::write(src.join("etc/marker"), "v2\n").unwrap();
    crab_ok(&["image", "rm", &image]);
    assert!(
        ready_roots(&image).is_empty(),
        "ready roots outlived image rm: {:?}",
        ready_roots(&image)
    );
    crab_ok(&["image", "import", &image, src.to_str().unwrap()]);
    let c = unique("t-warm-c");
    crab_ok(&["sandbox", "create", &image, "--name", &c]);
    assert_eq!(std::fs::read_to_string(root(&c).join("etc/marker")).unwrap(), "v2\n");
    assert!(wait_until(20.0, || ready_roots(&image).len() == 2));
    assert!(ready_roots(&image).iter().all(|r| !old.contains(r)), "an old ready root survived");
    for n in [&a, &b, &c] {
        crab_ok(&["sandbox", "rm", "--force", n]);
    }
    crab_ok(&["image", "rm", &image]);
    assert!(ready_roots(&image).is_empty());
    let _ = std::fs::remove_dir_all(&src);
}
