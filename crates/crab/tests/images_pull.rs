//! `crab image pull` against a real registry: Debian's `docker-registry` on loopback
//! (`scripts/test-registry.sh`), images made by other tools (`scripts/test-images.sh`: umoci,
//! GNU tar, buildah, pushed by skopeo), the real daemon of `CRAB_STATE_DIR`.
//!
//! * `layers_whiteouts_links_and_config_arrive`: the 3-layer fixture's files, owners, modes,
//!   hard links, the user.* xattr, whiteouts, the opaque dir and the symlinked dir made a dir,
//!   checked with `stat` in a sandbox of it; its config and digest recorded; a second pull is
//!   "already pulled".
//! * `platforms_are_picked_and_an_unknown_one_refused`.
//! * `http_needs_insecure` and `basic_auth_with_and_without_credentials`.
//! * `a_tampered_blob_is_refused`: a layer flipped in the registry's storage is refused with a
//!   digest error and no image is installed.
//! * `an_interrupted_pull_resumes`: a proxy cuts the big layer's download mid-way; the finished
//!   layer is kept, and the next pull fetches only the rest of the big one (the registry's log:
//!   no GET of the finished layer, one GET of the big one writing exactly the missing bytes).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use crab_testkit::daemon as common;
use crab_testkit::require_root;

const PORT: u16 = 5761;
const AUTH_PORT: u16 = 5762;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn script(name: &str, args: &[&str]) -> String {
    let out = Command::new(root().join("scripts").join(name)).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{name} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A registry on `port` (basic auth with `auth`), the fixtures pushed; its directory.
fn registry(port: u16, auth: Option<&str>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("crab-test-registry-{port}"));
    let mut args = vec!["start", dir.to_str().unwrap(), &*Box::leak(port.to_string().into())];
    if let Some(a) = auth {
        args.extend(["--auth", a]);
    }
    script("test-registry.sh", &args);
    if auth.is_none() {
        let cache = root().join("target/test-images");
        script("test-images.sh", &["push", cache.to_str().unwrap(), &format!("127.0.0.1:{port}")]);
    }
    dir
}

fn anon() -> &'static PathBuf {
    static R: OnceLock<PathBuf> = OnceLock::new();
    R.get_or_init(|| registry(PORT, None))
}

fn reference(repo: &str) -> String {
    format!("127.0.0.1:{PORT}/{repo}:1")
}

fn crab_stdin(args: &[&str], stdin: &str) -> Output {
    use std::io::Write;
    let mut c = Command::new(common::bin())
        .args(["--state-dir", common::state_dir().to_str().unwrap()])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    c.wait_with_output().unwrap()
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

fn image_json(name: &str) -> Option<serde_json::Value> {
    let v: serde_json::Value =
        serde_json::from_str(&common::crab_ok(&["image", "ls", "--json"])).unwrap();
    v.as_array().unwrap().iter().find(|i| i["name"] == name).cloned()
}

#[test]
fn layers_whiteouts_links_and_config_arrive() {
    require_root!();
    anon();
    common::ensure_daemon();
    let name = common::unique("pl");
    let img = Img(name.clone());
    let r = reference("layers");
    let out = common::crab_ok(&["image", "pull", "--insecure", "--name", &name, &r]);
    assert!(out.contains(&name), "{out}");
    let info = image_json(&name).expect("image listed");
    assert_eq!(info["reference"], r.as_str());
    assert!(info["digest"].as_str().unwrap().starts_with("sha256:"));
    assert_eq!(info["config"]["user"], "1000:1000");
    assert_eq!(info["config"]["workdir"], "/app");
    assert_eq!(info["config"]["env"][0], "A=b");
    assert_eq!(info["config"]["entrypoint"][0], "/bin/sh");
    assert_eq!(info["config"]["cmd"][0], "echo hi");
    assert_eq!(info["config"]["labels"]["fixture"], "layers");

    let sb = common::unique("plsb");
    common::crab_ok(&["sandbox", "create", &img.0, "--name", &sb]);
    let stat = |paths: &[&str]| -> String {
        let mut a = vec!["exec", &sb, "--", "/usr/bin/stat", "-c", "%n %u:%g %a %h %F"];
        a.extend_from_slice(paths);
        let o = common::crab(&a);
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
    };
    let s = stat(&[
        "/app",
        "/app/secret",
        "/app/sub",
        "/app/hl1",
        "/data/link",
        "/data/link/inside",
        "/opaque/new",
    ]);
    let _ = common::crab(&["sandbox", "rm", "--force", &sb]);
    for want in [
        "/app 1000:1000 755 1 directory",
        "/app/secret 1000:1000 600 1 regular file",
        "/app/sub 1000:1000 2775 1 directory",
        "/app/hl1 1000:1000 644 2 regular file",
        "/data/link 0:0 755 1 directory",
        "/data/link/inside 0:0 644 1 regular file",
        "/opaque/new 0:0 644 1 regular file",
    ] {
        assert!(s.contains(want), "{want:?} not in {s}");
    }
    // The image's own files (no sandbox needed for what is absent or an xattr).
    let rootfs = common::state_dir().join("pool/images").join(&name);
    for gone in ["etc/gone", "etc/gone-too", "opaque/old1", "opaque/old2", "data/real/inside"] {
        assert!(!rootfs.join(gone).exists(), "{gone} survived its whiteout");
    }
    assert!(rootfs.join("data/real/file").exists());
    let x = Command::new("python3")
        .args(["-c", "import os,sys; print(os.getxattr(sys.argv[1], 'user.crab').decode())"])
        .arg(rootfs.join("app/xattr-file"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&x.stdout).trim(), "test-value", "{}", text(&x));

    // Twice: nothing to do.
    let o = common::crab(&["image", "pull", "--insecure", "--name", &name, &r]);
    assert!(o.status.success() && text(&o).contains("already pulled"), "{}", text(&o));
    // Another reference under that name is refused without --replace.
    let o = common::crab(&["image", "pull", "--insecure", "--name", &name, &reference("base")]);
    assert!(!o.status.success() && text(&o).contains("--replace"), "{}", text(&o));
}

#[test]
fn platforms_are_picked_and_an_unknown_one_refused() {
    require_root!();
    anon();
    common::ensure_daemon();
    let r = reference("multi");
    for (plat, label) in [(None, "amd64"), (Some("linux/arm64"), "arm64")] {
        let name = common::unique("pm");
        let _img = Img(name.clone());
        let mut a = vec!["image", "pull", "--insecure", "--name", &name];
        if let Some(p) = plat {
            a.extend(["--platform", p]);
        }
        a.push(&r);
        common::crab_ok(&a);
        assert_eq!(image_json(&name).unwrap()["config"]["labels"]["platform"], label);
    }
    let name = common::unique("pm");
    let o = common::crab(&[
        "image",
        "pull",
        "--insecure",
        "--name",
        &name,
        "--platform",
        "linux/s390x",
        &r,
    ]);
    let t = text(&o);
    assert!(!o.status.success() && t.contains("linux/s390x") && t.contains("linux/arm64"), "{t}");
    assert!(image_json(&name).is_none());
}

#[test]
fn http_needs_insecure() {
    require_root!();
    anon();
    common::ensure_daemon();
    let name = common::unique("ph");
    let o = common::crab(&["image", "pull", "--name", &name, &reference("base")]);
    let t = text(&o);
    assert!(!o.status.success() && t.contains("--insecure"), "{t}");
    assert!(image_json(&name).is_none());
}

#[test]
fn basic_auth_with_and_without_credentials() {
    require_root!();
    let reg = registry(AUTH_PORT, Some("crab:s3cret"));
    let cache = root().join("target/test-images");
    let fixtures = script("test-images.sh", &["build", cache.to_str().unwrap()]);
    let src = format!("oci:{}/layout:base", fixtures.trim());
    let dst = format!("docker://127.0.0.1:{AUTH_PORT}/private:1");
    let o = Command::new("skopeo")
        .args([
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            "--dest-creds",
            "crab:s3cret",
            &src,
            &dst,
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    common::ensure_daemon();
    let r = format!("127.0.0.1:{AUTH_PORT}/private:1");
    let name = common::unique("pa");
    let _img = Img(name.clone());
    let o = common::crab(&["image", "pull", "--insecure", "--name", &name, &r]);
    let t = text(&o);
    assert!(!o.status.success() && t.contains("anonymous") && t.contains("--username"), "{t}");
    let o = crab_stdin(
        &[
            "image",
            "pull",
            "--insecure",
            "--name",
            &name,
            "--username",
            "crab",
            "--password-stdin",
            &r,
        ],
        "wrong\n",
    );
    let t = text(&o);
    assert!(!o.status.success() && t.contains("--username/--password-stdin"), "{t}");
    let o = crab_stdin(
        &[
            "image",
            "pull",
            "--insecure",
            "--name",
            &name,
            "--username",
            "crab",
            "--password-stdin",
            &r,
        ],
        "s3cret\n",
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(image_json(&name).unwrap()["reference"], r.as_str());
    script("test-registry.sh", &["stop", reg.to_str().unwrap(), &AUTH_PORT.to_string()]);
}

#[test]
fn a_tampered_blob_is_refused() {
    require_root!();
    let reg = anon();
    common::ensure_daemon();
    // The tamper fixture's own layer: the last of its manifest.
    let o = Command::new("skopeo")
        .args(["inspect", "--tls-verify=false", &format!("docker://{}", reference("tamper"))])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let digest = v["Layers"].as_array().unwrap().last().unwrap().as_str().unwrap().to_string();
    let hex = digest.trim_start_matches("sha256:");
    let data =
        reg.join(format!("storage/docker/registry/v2/blobs/sha256/{}/{hex}/data", &hex[..2]));
    let mut bytes = std::fs::read(&data).unwrap();
    let keep = bytes.clone();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&data, &bytes).unwrap();
    // Not from the daemon's cache either.
    let _ = std::fs::remove_file(common::state_dir().join("cache/blobs/sha256").join(hex));
    let name = common::unique("pt");
    let o = common::crab(&["image", "pull", "--insecure", "--name", &name, &reference("tamper")]);
    std::fs::write(&data, &keep).unwrap();
    let t = text(&o);
    assert!(!o.status.success() && t.contains("digest") && t.contains(&digest), "{t}");
    assert!(image_json(&name).is_none());
    assert!(!common::state_dir().join("cache/blobs/sha256").join(hex).exists());
}

/// A TCP proxy to the registry that cuts a connection once it has carried `budget` bytes of
/// answer to a request naming `cut` (and nothing else), while `armed`.
fn cutting_proxy(
    to: u16,
    cut: String,
    budget: usize,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> u16 {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let s = TcpStream::connect(("127.0.0.1", to)).unwrap();
            let hit = Arc::new(AtomicBool::new(false));
            let (mut c2, mut s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
            let (cut, hit2) = (cut.clone(), hit.clone());
            std::thread::spawn(move || {
                let mut b = vec![0u8; 65536];
                while let Ok(n) = c2.read(&mut b) {
                    if n == 0 {
                        break;
                    }
                    if String::from_utf8_lossy(&b[..n]).contains(&cut) {
                        hit2.store(true, Ordering::SeqCst);
                    }
                    if s2.write_all(&b[..n]).is_err() {
                        break;
                    }
                }
                let _ = s2.shutdown(Shutdown::Write);
            });
            let armed = armed.clone();
            std::thread::spawn(move || {
                let (mut c, mut s) = (c, s);
                let mut b = vec![0u8; 16384];
                let mut sent = 0usize;
                while let Ok(n) = s.read(&mut b) {
                    if n == 0 {
                        break;
                    }
                    if hit.load(Ordering::SeqCst) && armed.load(Ordering::SeqCst) {
                        if sent + n > budget {
                            let _ = c.write_all(&b[..budget - sent]);
                            let _ = c.shutdown(Shutdown::Both);
                            let _ = s.shutdown(Shutdown::Both);
                            return;
                        }
                        sent += n;
                    }
                    if c.write_all(&b[..n]).is_err() {
                        break;
                    }
                }
                let _ = c.shutdown(Shutdown::Write);
            });
        }
    });
    port
}

/// A pull cut off in the middle of its big layer keeps what it finished; the next pull asks
/// the registry only for the rest of the big layer (a range request), per the registry's log.
#[test]
fn an_interrupted_pull_resumes() {
    require_root!();
    let reg = anon();
    common::ensure_daemon();
    let o = Command::new("skopeo")
        .args(["inspect", "--tls-verify=false", &format!("docker://{}", reference("resume"))])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let layers: Vec<String> =
        v["Layers"].as_array().unwrap().iter().map(|l| l.as_str().unwrap().to_string()).collect();
    let big = layers.last().unwrap().clone();
    let small = layers[layers.len() - 2].clone();
    let cache = common::state_dir().join("cache/blobs/sha256");
    for d in [&big, &small] {
        let h = d.trim_start_matches("sha256:");
        let _ = std::fs::remove_file(cache.join(h));
        let _ = std::fs::remove_file(cache.join(format!("{h}.partial")));
    }
    let armed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let port = cutting_proxy(PORT, big.clone(), 3 << 20, armed.clone());
    let r = format!("127.0.0.1:{port}/resume:1");
    let name = common::unique("pr");
    let _img = Img(name.clone());
    let o = common::crab(&["image", "pull", "--insecure", "--name", &name, &r]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(image_json(&name).is_none());
    let bh = big.trim_start_matches("sha256:");
    let partial =
        std::fs::metadata(cache.join(format!("{bh}.partial"))).map(|m| m.len()).unwrap_or(0);
    assert!(partial > 0, "no partial download kept: {}", text(&o));
    assert!(
        cache.join(small.trim_start_matches("sha256:")).exists(),
        "the small layer was not kept"
    );

    let log = reg.join("registry.log");
    let before = std::fs::metadata(&log).unwrap().len() as usize;
    armed.store(false, std::sync::atomic::Ordering::SeqCst);
    let o = common::crab(&["image", "pull", "--insecure", "--name", &name, &r]);
    assert!(o.status.success(), "{}", text(&o));
    let all = std::fs::read(&log).unwrap();
    let new = String::from_utf8_lossy(&all[before..]).into_owned();
    let gets = |d: &str| -> Vec<u64> {
        new.lines()
            .filter(|l| l.contains("response completed") && l.contains("method=GET"))
            // This pull's repository only (other tests pull the same blobs meanwhile).
            .filter(|l| l.contains(&format!("/v2/resume/blobs/{d}")))
            .filter_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("http.response.written="))
                    .and_then(|n| n.parse().ok())
            })
            .collect()
    };
    assert!(gets(&small).is_empty(), "the finished layer was downloaded again");
    let g = gets(&big);
    assert_eq!(g.len(), 1, "{g:?}");
    let size = std::fs::metadata(cache.join(bh)).unwrap().len();
    assert_eq!(g[0], size - partial, "the big layer was not resumed where it stopped");
}

/// `crab sandbox create REF`, an E2B template `REF` and a daemon that does not pull: a
/// reference no local image holds is pulled once, on first use, by whichever door asks first
/// (the daemon of `make test` names the test registry with `CRAB_INSECURE_REGISTRIES`), and
/// used as it is afterwards; an unreachable registry and `--pull never` are refused naming the
/// fix, leaving no image and no sandbox.
#[test]
fn a_reference_is_pulled_on_first_use_by_every_door() {
    require_root!();
    anon();
    common::ensure_daemon();
    let insecure = std::env::var("CRAB_INSECURE_REGISTRIES").unwrap_or_default();
    if !insecure.split(',').any(|h| h == format!("127.0.0.1:{PORT}")) {
        return crab_testkit::privilege::cannot_run(&format!(
            "the daemon must speak http to the test registry: export \
             CRAB_INSECURE_REGISTRIES=127.0.0.1:{PORT} before it starts (`make test` does)"
        ));
    }
    // A repository no other test pulls, so this is its first use.
    let repo = common::unique("firstuse");
    let r = format!("127.0.0.1:{PORT}/{repo}:1");
    let copied = Command::new("skopeo")
        .args(["copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false"])
        .arg(format!("docker://{}", reference("layers")))
        .arg(format!("docker://{r}"))
        .output()
        .unwrap();
    assert!(copied.status.success(), "skopeo copy: {}", text(&copied));
    let holding = |r: &str| -> Vec<String> {
        let v: serde_json::Value =
            serde_json::from_str(&common::crab_ok(&["image", "ls", "--json"])).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .filter(|i| i["reference"] == r)
            .map(|i| i["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(holding(&r).is_empty());

    // The CLI (and through it the SDK and `crab docker run`, which send the same request).
    let sb = common::unique("fu");
    let o = common::crab(&["sandbox", "create", &r, "--name", &sb, "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let info: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names = holding(&r);
    assert_eq!(names.len(), 1, "{names:?}");
    let _img = Img(names[0].clone());
    assert_eq!(info["image"], names[0].as_str(), "{info}");
    // The image's config is the sandbox's: its user (1000) and working directory (/app).
    let o =
        common::crab(&["exec", &sb, "--", "/bin/sh", "-c", "id -u; pwd; cat /data/link/inside"]);
    let _ = common::crab(&["sandbox", "rm", "--force", &sb]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.starts_with("1000\n/app\n"), "{out}");

    // A Dockerfile FROM the reference builds on that image (resolved by the host, no pull).
    let ctx = std::env::temp_dir().join(common::unique("fu-ctx"));
    std::fs::create_dir_all(&ctx).unwrap();
    std::fs::write(ctx.join("Dockerfile"), format!("FROM {r}\nRUN id -u > /app/built-by\n"))
        .unwrap();
    let built = common::unique("fu-built");
    let _built = Img(built.clone());
    let o = common::crab(&[
        "image",
        "build",
        "-f",
        ctx.join("Dockerfile").to_str().unwrap(),
        ctx.to_str().unwrap(),
        "--name",
        &built,
    ]);
    let _ = std::fs::remove_dir_all(&ctx);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(holding(&r), names, "the build pulled again");
    let sb3 = common::unique("fu");
    common::crab_ok(&["sandbox", "create", &built, "--name", &sb3]);
    let o = common::crab(&["exec", &sb3, "--", "cat", "/app/built-by"]);
    let _ = common::crab(&["sandbox", "rm", "--force", &sb3]);
    assert_eq!(text(&o).trim(), "1000", "RUN ran as the image's user: {}", text(&o));

    // The E2B front door, through the real SDK: the same image, not a second pull.
    if let Ok(listen) = std::env::var("CRAB_E2B_LISTEN") {
        script("install-test-servers.sh", &[]);
        let python = std::env::var("CRAB_TEST_SERVERS")
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from("/opt/crab/test-servers"))
            .join("venv/bin/python");
        // (The fixture has no setsid or find, which E2B commands and listings need: a file
        // read proves the sandbox is of the image.)
        let prog = "import sys\nfrom e2b import Sandbox\n\
                    s = Sandbox.create(template=sys.argv[1])\n\
                    try:\n    print(s.files.read('/data/link/inside', user='root'))\n\
                    finally:\n    s.kill()\n";
        let o = Command::new("timeout")
            .args(["--kill-after=10", "300"])
            .arg(&python)
            .args(["-c", prog, &r])
            .env("E2B_API_URL", format!("http://{listen}"))
            .env("E2B_SANDBOX_URL", format!("http://{listen}"))
            .env("E2B_API_KEY", "e2b_crab_test_key")
            .output()
            .unwrap();
        let out = text(&o);
        assert!(o.status.success(), "e2b SDK: {out}");
        assert!(out.contains("inside"), "{out}");
        assert_eq!(holding(&r), names, "the E2B door pulled again");
    } else {
        crab_testkit::privilege::cannot_run("CRAB_E2B_LISTEN is not set (`make test` sets it)");
    }

    // A registry that is not there: the pull's error, and nothing made.
    let dead = format!("127.0.0.1:{}/nothing:1", PORT + 40);
    let sb2 = common::unique("fu");
    let o = common::crab(&["sandbox", "create", &dead, "--name", &sb2]);
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(out.contains("on first use") && out.contains("nothing:1"), "{out}");
    assert!(holding(&format!("127.0.0.1:{}/nothing:1", PORT + 40)).is_empty());
    assert!(!common::crab(&["sandbox", "inspect", &sb2]).status.success(), "a sandbox was made");

    // A daemon that does not pull refuses, naming `crab image pull`.
    let state = std::env::temp_dir().join(common::unique("crab-nopull"));
    let d = common::OtherDaemon::start(&state, &["--pull", "never", "--pool-size", "2G"], &[]);
    let o = d.crab(&["sandbox", "create", &r]);
    let out = text(&o);
    d.destroy();
    assert!(!o.status.success(), "{out}");
    assert!(out.contains("does not pull") && out.contains("crab image pull"), "{out}");
}

/// A remote point of a sandbox made from a pulled image, restored on hosts that lack the
/// image (`crab sandbox create --from-remote`, daemons of their own on one `file://` store):
/// a host that may pull gets the image by digest from the registry the point names and patches
/// the point's files onto it (`base_image`, stage `image_pull`); a host that may not
/// (`--pull never`) or cannot (the registry is plain http and not named to it) downloads the
/// whole tree from the store — all three see the point's files.
#[test]
fn a_point_of_a_pulled_image_restores_where_the_image_is_not() {
    require_root!();
    anon();
    let tmp = std::env::temp_dir().join(common::unique("crab-rimg"));
    std::fs::create_dir_all(&tmp).unwrap();
    let remote = format!("file://{}", tmp.join("store").display());
    let env = vec![("CRAB_INSECURE_REGISTRIES".to_string(), format!("127.0.0.1:{PORT}"))];
    let args = ["--pool-size", "4G", "--remote", remote.as_str()];
    let a = common::OtherDaemon::start(&tmp.join("a"), &args, &env);
    // A repository of its own (another test counts the registry's requests for `resume`).
    let r = format!("127.0.0.1:{PORT}/{}:1", common::unique("rimg"));
    let copied = Command::new("skopeo")
        .args(["copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false"])
        .arg(format!("docker://{}", reference("resume")))
        .arg(format!("docker://{r}"))
        .output()
        .unwrap();
    assert!(copied.status.success(), "skopeo copy: {}", text(&copied));
    a.crab_ok(&["image", "pull", "--insecure", "--name", "app", &r]);
    let sb = common::unique("rimg");
    a.crab_ok(&["sandbox", "create", "app", "--name", &sb]);
    a.crab_ok(&["exec", &sb, "--", "sh", "-c", "echo delta > /delta"]);
    a.crab_ok(&["checkpoint", &sb, "--kind", "fs", "--durable"]);
    a.destroy();

    let restore = |d: &common::OtherDaemon| -> serde_json::Value {
        let copy = common::unique("rimg-copy");
        let o = d.crab(&["--json", "sandbox", "create", "--from-remote", &sb, "--name", &copy]);
        assert!(o.status.success(), "{}", text(&o));
        let rep: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(d.crab_ok(&["exec", &copy, "--", "cat", "/delta"]), "delta\n");
        // The image's own big file, whichever way it came.
        let o = d.crab(&["exec", &copy, "--", "stat", "-c", "%s", "/big/bytes"]);
        assert_eq!(text(&o).trim(), "8388608");
        rep
    };
    let stages = |rep: &serde_json::Value| -> Vec<String> {
        rep["stages"].as_array().unwrap().iter().map(|s| s[0].as_str().unwrap().into()).collect()
    };

    let b = common::OtherDaemon::start(&tmp.join("b"), &args, &env);
    let rep = restore(&b);
    assert_eq!(rep["base_image"], "app", "the tree was not patched onto the pulled image: {rep}");
    assert!(stages(&rep).contains(&"image_pull".to_string()), "{rep}");
    let img: serde_json::Value =
        serde_json::from_str(&b.crab_ok(&["image", "ls", "--json"])).unwrap();
    let digest =
        img.as_array().unwrap().iter().find(|i| i["name"] == "app").unwrap()["digest"].clone();
    assert!(digest.as_str().unwrap().starts_with("sha256:"), "{img}");
    b.destroy();

    let mut never = args.to_vec();
    never.extend(["--pull", "never"]);
    let c = common::OtherDaemon::start(&tmp.join("c"), &never, &env);
    let rep = restore(&c);
    assert!(rep["base_image"].is_null(), "{rep}");
    assert!(!c.crab_ok(&["image", "ls"]).contains("app"), "an image was pulled");
    c.destroy();

    // (`make test` exports the registry for every daemon: this one is told none.)
    let none = [("CRAB_INSECURE_REGISTRIES".to_string(), String::new())];
    let d = common::OtherDaemon::start(&tmp.join("d"), &args, &none);
    let rep = restore(&d);
    assert!(rep["base_image"].is_null(), "{rep}");
    d.destroy();
    let _ = std::fs::remove_dir_all(&tmp);
}

/// `crab image rm` of an image a sandbox was made from: removed, the sandbox named as one that
/// keeps working, and it does.
#[test]
fn removing_a_used_image_names_its_sandboxes_which_keep_working() {
    require_root!();
    anon();
    common::ensure_daemon();
    let name = common::unique("rmused");
    common::crab_ok(&["image", "pull", "--insecure", "--name", &name, &reference("base")]);
    let sb = common::unique("rmused-sb");
    common::crab_ok(&["sandbox", "create", &name, "--name", &sb]);
    let v: serde_json::Value =
        serde_json::from_str(&common::crab_ok(&["--json", "image", "rm", &name])).unwrap();
    assert_eq!(v["used_by"], serde_json::json!([sb]), "{v}");
    assert!(image_json(&name).is_none());
    let o = common::crab(&["exec", &sb, "--", "cat", "/etc/passwd"]);
    let _ = common::crab(&["sandbox", "rm", "--force", &sb]);
    assert!(text(&o).contains("root:x:0:0"), "{}", text(&o));
}
