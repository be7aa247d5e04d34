//! `crab image push` against a real registry (Debian's `docker-registry` on loopback,
//! `scripts/test-registry.sh`), read back by other tools (`skopeo copy` + `umoci unpack`,
//! `skopeo inspect --config`) and by `crab image pull`; the real daemon of `CRAB_STATE_DIR`.
//!
//! * `pulled_and_imported_layers_push_back`: the 3-layer fixture pulled and pushed again keeps
//!   its layer digests (its blobs are the cached originals); an OCI layout with a 4th layer
//!   made by umoci (a lower file deleted, a setuid file owned 1000:1000, a hard link, a
//!   symlink, an xattr) and a config (User, Env, Cmd) imported — its layers are not in the blob
//!   cache, so the top one is made from its tree — pushed, copied back by skopeo and unpacked
//!   by umoci: the tree is what a sandbox of the image sees, the config is the image's.
//! * `a_built_image_pushes_and_pulls_back`: a Dockerfile build on the fixture (a RUN deletes
//!   lower files, adds a hard link, a symlink, a setuid file) pushed, unpacked by umoci, pulled
//!   back by `crab image pull` and run; a second push uploads no blob (the registry's log).
//! * `a_root_filesystem_is_one_layer`: a root-filesystem tar import is pushed as one layer of
//!   its tree, without Crab's `/.crab`.
//! * `refusals_are_clear`: an unknown image, a digest reference, a closed port, a registry
//!   that wants credentials (none, a wrong password), plain http without `--insecure`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use crab_testkit::daemon as common;
use crab_testkit::require_root;

const PORT: u16 = 5763;
const AUTH_PORT: u16 = 5764;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn script(name: &str, args: &[&str]) -> String {
    run(root().join("scripts").join(name).to_str().unwrap(), args)
}

fn registry_dir(port: u16) -> PathBuf {
    std::env::temp_dir().join(format!("crab-test-registry-{port}"))
}

/// The anonymous registry with the fixtures pushed; its directory.
fn anon() -> &'static PathBuf {
    static R: OnceLock<PathBuf> = OnceLock::new();
    R.get_or_init(|| {
        let dir = registry_dir(PORT);
        script("test-registry.sh", &["start", dir.to_str().unwrap(), &PORT.to_string()]);
        let cache = root().join("target/test-images");
        script("test-images.sh", &["push", cache.to_str().unwrap(), &format!("127.0.0.1:{PORT}")]);
        dir
    })
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The image of that name, removed on drop.
struct Img(String);
impl Drop for Img {
    fn drop(&mut self) {
        let _ = common::crab(&["image", "rm", &self.0]);
    }
}

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);
impl Scratch {
    fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(common::unique(tag));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
    fn join(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
    fn s(&self, rel: &str) -> String {
        self.join(rel).display().to_string()
    }
}
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn push(name: &str, reference: &str) -> serde_json::Value {
    let out = common::crab_ok(&["--json", "image", "push", "--insecure", name, reference]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn layer_digests(reference: &str) -> Vec<String> {
    let raw = run(
        "skopeo",
        &["inspect", "--tls-verify=false", "--raw", &format!("docker://{reference}")],
    );
    let m: serde_json::Value = serde_json::from_str(&raw).unwrap();
    m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect()
}

/// `skopeo copy` of `reference` into an OCI layout and `umoci unpack` of it: the rootfs.
fn unpack(reference: &str, dir: &Scratch) -> PathBuf {
    run(
        "skopeo",
        &[
            "copy",
            "-q",
            "--src-tls-verify=false",
            &format!("docker://{reference}"),
            &format!("oci:{}:t", dir.s("back")),
        ],
    );
    run("umoci", &["unpack", "--image", &format!("{}:t", dir.s("back")), &dir.s("bundle")]);
    dir.join("bundle/rootfs")
}

/// `path uid:gid mode links type` of each path, and the paths sharing an inode (by `%i`).
const STAT: &str = "%n %u:%g %a %h %F";

/// A `STAT` line with a directory's link count left out (btrfs counts none, ext4 its subdirs).
fn norm(line: &str) -> String {
    if !line.trim_end().ends_with(" directory") {
        return line.to_string();
    }
    let mut f: Vec<&str> = line.split(' ').collect();
    if f.len() > 3 {
        f[3] = "-";
    }
    f.join(" ")
}

fn host_stat(rootfs: &Path, paths: &[&str]) -> String {
    let mut out = String::new();
    for p in paths {
        let o = Command::new("stat")
            .args(["-c", STAT])
            .arg(rootfs.join(p.trim_start_matches('/')))
            .output()
            .unwrap();
        let line =
            norm(&String::from_utf8_lossy(&o.stdout).replace(&rootfs.display().to_string(), ""));
        out.push_str(if o.status.success() { &line } else { "missing\n" });
    }
    out
}

fn sandbox_stat(sb: &str, paths: &[&str]) -> String {
    let mut out = String::new();
    for p in paths {
        let o = common::crab(&["exec", sb, "--", "/usr/bin/stat", "-c", STAT, p]);
        let line = norm(&String::from_utf8_lossy(&o.stdout));
        out.push_str(if o.status.success() { &line } else { "missing\n" });
    }
    out
}

fn inode(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).unwrap().ino()
}

fn getxattr(p: &Path, name: &str) -> String {
    let o = Command::new("python3")
        .args(["-c", "import os,sys; print(os.getxattr(sys.argv[1], sys.argv[2]).decode())"])
        .arg(p)
        .arg(name)
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

#[test]
fn pulled_and_imported_layers_push_back() {
    require_root!();
    anon();
    common::ensure_daemon();
    // A pulled image: its cached original blobs, the same digests.
    let pulled = Img(common::unique("psp"));
    let src = format!("127.0.0.1:{PORT}/layers:1");
    common::crab_ok(&["image", "pull", "--insecure", "--name", &pulled.0, &src]);
    let same = format!("127.0.0.1:{PORT}/{}:t", pulled.0);
    let rep = push(&pulled.0, &same);
    assert_eq!(layer_digests(&same), layer_digests(&src), "{rep}");
    for l in rep["layers"].as_array().unwrap() {
        assert_eq!(l["origin"], "stored", "{rep}");
    }
    assert_eq!(rep["reference"], same.as_str());
    assert!(rep["digest"].as_str().unwrap().starts_with("sha256:"));

    // An OCI layout with a 4th layer of unique files, imported (its blobs not in the cache).
    let w = Scratch::new("push-layout");
    let nonce = common::unique("u");
    run(
        "skopeo",
        &[
            "copy",
            "-q",
            "--src-tls-verify=false",
            &format!("docker://{src}"),
            &format!("oci:{}:l", w.s("lay")),
        ],
    );
    run("umoci", &["unpack", "--image", &format!("{}:l", w.s("lay")), &w.s("b")]);
    let r = w.join("b/rootfs");
    std::fs::remove_file(r.join("app/hello")).unwrap();
    let uniq = r.join(format!("app/{nonce}"));
    std::fs::write(&uniq, "unique\n").unwrap();
    std::os::unix::fs::chown(&uniq, Some(1000), Some(1000)).unwrap();
    std::fs::set_permissions(&uniq, std::os::unix::fs::PermissionsExt::from_mode(0o4750)).unwrap();
    std::fs::hard_link(&uniq, r.join("app/uniq-link")).unwrap();
    std::os::unix::fs::symlink(&nonce, r.join("app/uniq-sym")).unwrap();
    std::fs::write(r.join("app/uniq-x"), "x").unwrap();
    run(
        "python3",
        &[
            "-c",
            "import os,sys; os.setxattr(sys.argv[1], 'user.push', b'yes')",
            r.join("app/uniq-x").to_str().unwrap(),
        ],
    );
    run("umoci", &["repack", "--image", &format!("{}:l2", w.s("lay")), &w.s("b")]);
    run(
        "umoci",
        &[
            "config",
            "--image",
            &format!("{}:l2", w.s("lay")),
            "--config.user",
            "1000:1000",
            "--config.env",
            "PUSHED=1",
            "--config.cmd",
            "echo pushed",
        ],
    );
    run(
        "skopeo",
        &["copy", "-q", &format!("oci:{}:l2", w.s("lay")), &format!("oci:{}:x", w.s("imp"))],
    );
    let imported = Img(common::unique("psi"));
    common::crab_ok(&["image", "import", &imported.0, &w.s("imp")]);
    let dst = format!("127.0.0.1:{PORT}/{}:t", imported.0);
    let rep = push(&imported.0, &dst);
    let layers = rep["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4, "{rep}");
    assert_eq!(layers[3]["origin"], "generated", "{rep}");

    // Read back by skopeo + umoci: what a sandbox of the image sees.
    let back = Scratch::new("push-back");
    let rootfs = unpack(&dst, &back);
    let paths = [
        "/app",
        "/app/hello",
        "/app/secret",
        "/app/sub",
        "/app/hl1",
        "/app/hl2",
        &format!("/app/{nonce}"),
        "/app/uniq-link",
        "/app/uniq-sym",
        "/app/uniq-x",
        "/etc/gone",
        "/data/link/inside",
        "/opaque/new",
        "/opaque/old1",
    ];
    let sb = common::unique("psb");
    common::crab_ok(&["sandbox", "create", &imported.0, "--name", &sb]);
    let seen = sandbox_stat(&sb, &paths);
    let link = common::crab(&["exec", &sb, "--", "/usr/bin/readlink", "/app/uniq-sym"]);
    let _ = common::crab(&["sandbox", "rm", "--force", &sb]);
    let got = host_stat(&rootfs, &paths);
    assert_eq!(got, seen, "pushed tree (left) vs the sandbox's (right)");
    assert!(got.contains(&format!("/app/{nonce} 1000:1000 4750 2 regular file")), "{got}");
    assert!(got.lines().nth(1) == Some("missing"), "/app/hello was deleted: {got}");
    assert_eq!(String::from_utf8_lossy(&link.stdout).trim(), nonce);
    assert_eq!(std::fs::read_link(rootfs.join("app/uniq-sym")).unwrap(), PathBuf::from(&nonce));
    assert_eq!(inode(&rootfs.join(format!("app/{nonce}"))), inode(&rootfs.join("app/uniq-link")));
    assert_eq!(inode(&rootfs.join("app/hl1")), inode(&rootfs.join("app/hl2")));
    assert_eq!(getxattr(&rootfs.join("app/uniq-x"), "user.push"), "yes");
    assert_eq!(getxattr(&rootfs.join("app/xattr-file"), "user.crab"), "test-value");
    assert!(!rootfs.join(".crab").exists(), "Crab's init was pushed");
    let cfg: serde_json::Value = serde_json::from_str(&run(
        "skopeo",
        &["inspect", "--tls-verify=false", "--config", &format!("docker://{dst}")],
    ))
    .unwrap();
    assert_eq!(cfg["config"]["User"], "1000:1000", "{cfg}");
    assert_eq!(cfg["config"]["Cmd"][0], "echo pushed", "{cfg}");
    assert!(cfg["config"]["Env"].as_array().unwrap().iter().any(|e| e == "PUSHED=1"), "{cfg}");
    assert_eq!(cfg["config"]["WorkingDir"], "/app", "{cfg}");
    assert_eq!(cfg["rootfs"]["diff_ids"].as_array().unwrap().len(), 4, "{cfg}");
    assert_eq!(cfg["os"], "linux");
    assert_eq!(cfg["architecture"], "amd64");
}

/// Blob uploads the registry of `dir` has logged.
fn blob_puts(dir: &Path, repo: &str) -> usize {
    let log = std::fs::read_to_string(dir.join("registry.log")).unwrap_or_default();
    log.lines()
        .filter(|l| {
            l.contains(&format!("/v2/{repo}/blobs/uploads"))
                && (l.contains("\"PUT ") || l.contains("\"PATCH ") || l.contains("\"POST "))
        })
        .count()
}

#[test]
fn a_built_image_pushes_and_pulls_back() {
    require_root!();
    let dir = anon();
    common::ensure_daemon();
    let base = Img(common::unique("pbb"));
    common::crab_ok(&[
        "image",
        "pull",
        "--insecure",
        "--name",
        &base.0,
        &format!("127.0.0.1:{PORT}/layers:1"),
    ]);
    // The fixture has no rm/ln/chmod/chown: the build copies this host's in (they need libc
    // only, which the fixture has).
    let ctx = Scratch::new("push-ctx");
    for b in ["rm", "ln", "chmod", "chown"] {
        std::fs::copy(format!("/usr/bin/{b}"), ctx.join(b)).unwrap();
    }
    std::fs::write(
        ctx.join("Dockerfile"),
        format!(
            "FROM {}\nUSER root\nCOPY rm ln chmod chown /usr/bin/\n\
             RUN rm /app/hello /opaque/new && echo added > /app/added && ln /app/added /app/added-link \
             && ln -s added /app/sym && echo s > /app/suid && chown 1000:1000 /app/added && chmod 4755 /app/suid\n\
             USER 1000:1000\nENV BUILT=yes\nCMD [\"echo built\"]\n",
            base.0
        ),
    )
    .unwrap();
    let built = Img(common::unique("pbi"));
    common::crab_ok(&[
        "image",
        "build",
        "-f",
        &ctx.s("Dockerfile"),
        &ctx.s(""),
        "--name",
        &built.0,
    ]);
    let repo = built.0.clone();
    let dst = format!("127.0.0.1:{PORT}/{repo}:t");
    let rep = push(&built.0, &dst);
    let layers = rep["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4, "the fixture's 3 and the build's: {rep}");
    assert_eq!(layers[3]["origin"], "generated", "{rep}");
    assert!(layers.iter().all(|l| l["uploaded"] == true), "{rep}");

    let back = Scratch::new("push-bback");
    let rootfs = unpack(&dst, &back);
    for gone in ["app/hello", "opaque/new", "etc/gone", ".crab"] {
        assert!(!rootfs.join(gone).exists(), "{gone} is in the pushed image");
    }
    let got =
        host_stat(&rootfs, &["/app/added", "/app/added-link", "/app/suid", "/app/sym", "/app/hl1"]);
    for want in [
        "/app/added 1000:1000 644 2 regular file",
        "/app/added-link 1000:1000 644 2 regular file",
        "/app/suid 0:0 4755 1 regular file",
        "/app/sym 0:0 777 1 symbolic link",
        "/app/hl1 1000:1000 644 2 regular file",
    ] {
        assert!(got.contains(want), "{want:?} not in {got}");
    }
    assert_eq!(inode(&rootfs.join("app/added")), inode(&rootfs.join("app/added-link")));
    assert_eq!(std::fs::read_to_string(rootfs.join("app/added")).unwrap(), "added\n");

    // Pulled back by crab and run.
    let other = Img(common::unique("pbo"));
    common::crab_ok(&["image", "pull", "--insecure", "--name", &other.0, &dst]);
    let sb = common::unique("pbsb");
    common::crab_ok(&["sandbox", "create", &other.0, "--name", &sb]);
    let o = common::crab(&[
        "exec",
        &sb,
        "--",
        "/bin/sh",
        "-c",
        "cat /app/added; echo $BUILT; id -u; cat /app/hello 2>&1",
    ]);
    let _ = common::crab(&["sandbox", "rm", "--force", &sb]);
    let t = text(&o);
    assert!(t.contains("added\nyes\n1000\n") && t.contains("No such file"), "{t}");

    // A second push: every blob is there already, none is uploaded.
    let before = blob_puts(dir, &repo);
    assert!(before > 0, "the first push's uploads are not in the registry's log");
    let rep2 = push(&built.0, &dst);
    assert_eq!(rep2["digest"], rep["digest"], "the same image pushes as the same manifest");
    assert!(rep2["layers"].as_array().unwrap().iter().all(|l| l["uploaded"] == false), "{rep2}");
    assert_eq!(rep2["config"]["uploaded"], false, "{rep2}");
    assert_eq!(rep2["layers"][3]["origin"], "stored", "the generated layer is remembered: {rep2}");
    assert_eq!(blob_puts(dir, &repo), before, "the second push uploaded blobs");
}

#[test]
fn a_root_filesystem_is_one_layer() {
    require_root!();
    anon();
    common::ensure_daemon();
    let w = Scratch::new("push-rootfs");
    let tree = w.join("tree");
    std::fs::create_dir_all(tree.join("etc")).unwrap();
    std::fs::write(tree.join("etc/hello"), "hi\n").unwrap();
    std::os::unix::fs::symlink("hello", tree.join("etc/link")).unwrap();
    run("tar", &["-C", tree.to_str().unwrap(), "-cf", &w.s("root.tar"), "."]);
    let img = Img(common::unique("pst"));
    common::crab_ok(&["image", "import", &img.0, &w.s("root.tar")]);
    let dst = format!("127.0.0.1:{PORT}/{}:t", img.0);
    let rep = push(&img.0, &dst);
    assert_eq!(rep["layers"].as_array().unwrap().len(), 1, "{rep}");
    assert_eq!(rep["layers"][0]["origin"], "generated", "{rep}");
    let back = Scratch::new("push-rback");
    let rootfs = unpack(&dst, &back);
    assert_eq!(std::fs::read_to_string(rootfs.join("etc/hello")).unwrap(), "hi\n");
    assert_eq!(std::fs::read_link(rootfs.join("etc/link")).unwrap(), PathBuf::from("hello"));
    assert!(!rootfs.join(".crab").exists(), "Crab's init was pushed");
}

#[test]
fn refusals_are_clear() {
    require_root!();
    anon();
    common::ensure_daemon();
    let img = Img(common::unique("psr"));
    common::crab_ok(&[
        "image",
        "pull",
        "--insecure",
        "--name",
        &img.0,
        &format!("127.0.0.1:{PORT}/base:1"),
    ]);
    let refused = |args: &[&str], stdin: Option<&str>, want: &[&str]| {
        let mut c = Command::new(common::bin())
            .args(["--state-dir", common::state_dir().to_str().unwrap(), "image", "push"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        {
            use std::io::Write;
            let mut i = c.stdin.take().unwrap();
            if let Some(s) = stdin {
                i.write_all(s.as_bytes()).unwrap();
            }
        }
        let o = c.wait_with_output().unwrap();
        let t = text(&o);
        assert!(!o.status.success(), "{args:?} succeeded: {t}");
        for w in want {
            assert!(t.contains(w), "{w:?} not in {t}");
        }
    };
    let ok_ref = format!("127.0.0.1:{PORT}/refused:t");
    refused(
        &["--insecure", "no-such-image-here", &ok_ref],
        None,
        &["no-such-image-here", "crab image ls"],
    );
    let digest = format!("127.0.0.1:{PORT}/x@sha256:{}", "a".repeat(64));
    refused(&["--insecure", &img.0, &digest], None, &["names a digest", "TAG"]);
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    refused(
        &["--insecure", &img.0, &format!("127.0.0.1:{closed}/x:t")],
        None,
        &["unreachable", "Connection refused"],
    );
    refused(&[&img.0, &ok_ref], None, &["plain http", "--insecure"]);

    let adir = registry_dir(AUTH_PORT);
    script(
        "test-registry.sh",
        &["start", adir.to_str().unwrap(), &AUTH_PORT.to_string(), "--auth", "crab:s3cret"],
    );
    let auth_ref = format!("127.0.0.1:{AUTH_PORT}/x:t");
    let log_at = std::fs::read(adir.join("registry.log")).map(|b| b.len()).unwrap_or(0);
    refused(&["--insecure", &img.0, &auth_ref], None, &["refused", "anonymous", "--username"]);
    refused(
        &["--insecure", "--username", "crab", "--password-stdin", &img.0, &auth_ref],
        Some("wrong\n"),
        &["refused", "--username/--password-stdin", "check the username and password"],
    );
    // Nothing was pushed by the refused attempts; the right password pushes.
    let log = std::fs::read(adir.join("registry.log")).unwrap_or_default();
    let log = String::from_utf8_lossy(&log[log_at.min(log.len())..]).into_owned();
    assert!(log.contains("401"), "the refused attempts are not in the registry's log");
    assert!(!log.lines().any(|l| l.contains("\"PUT /v2/x/")), "a refused push put a manifest");
    let mut c = Command::new(common::bin())
        .args(["--state-dir", common::state_dir().to_str().unwrap(), "image", "push", "--insecure"])
        .args(["--username", "crab", "--password-stdin", &img.0, &auth_ref])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        c.stdin.take().unwrap().write_all(b"s3cret\n").unwrap();
    }
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success() && text(&o).contains("pushed"), "{}", text(&o));
}
