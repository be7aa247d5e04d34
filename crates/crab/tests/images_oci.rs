//! Issue 29: OCI images from files — image layouts (directory and tar) and `docker save`
//! archives, made by *other* tools (umoci, skopeo) or written entry by entry — become layered
//! Crab images, with the real daemon and pool:
//!
//! * `other_tools_images_import_share_layers_and_keep_their_config`: a two-layer image made by
//!   umoci (whiteout, a symlinked dir replaced by a dir, hard links, a `user.*` xattr, `User`,
//!   `WorkingDir`, `Env`, `Entrypoint`/`Cmd`), imported as a layout directory, as a layout tar
//!   and as skopeo's `docker-archive`: the three share their layers (same chain ids, stored
//!   once), sandboxes of them run as the image's user in its directory with its env, `docker
//!   run` runs its entrypoint and command, and removing images keeps sandboxes and other images
//!   working and frees layers no image uses.
//! * `whiteouts_opaque_dirs_and_platforms`: hand-written layers with an opaque directory (the
//!   marker after this layer's own entry) and whiteouts; an index of two platforms picks
//!   linux/amd64 by default, another with `--platform`, and refuses one it lacks.
//! * `hostile_layers_are_refused_naming_the_entry`: absolute names, `..`, writes through a
//!   lower layer's symlink, hard links out or to nothing, climbing symlinks, a wrong diff id and
//!   a tampered blob are each refused naming the entry (or digest), leaving no image, no new
//!   layer and no staging subvolume, and nothing written outside.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};

use crab_testkit::daemon as common;
use crab_testkit::oci::{chain_ids, tar_of, tar_of_dir, tiny_root, Entry, Layout};
use crab_testkit::require_root;

use common::{crab, crab_ok, unique};

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(prefix: &str) -> Self {
        let d = std::env::temp_dir().join(unique(prefix));
        fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Images removed on drop.
struct Images(Vec<String>);

impl Drop for Images {
    fn drop(&mut self) {
        for i in &self.0 {
            let _ = crab(&["image", "rm", i]);
        }
    }
}

fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn image_record(name: &str) -> Value {
    let p = common::state_dir().join("pool/images").join(format!("{name}.json"));
    serde_json::from_slice(&fs::read(&p).unwrap()).unwrap()
}

fn image_info(name: &str) -> Value {
    let all: Value = serde_json::from_str(&crab_ok(&["--json", "image", "ls"])).unwrap();
    all.as_array().unwrap().iter().find(|i| i["name"] == name).cloned().unwrap()
}

fn layers_dir() -> PathBuf {
    common::state_dir().join("pool/layers")
}

fn layer_exists(chain: &str) -> bool {
    layers_dir().join(chain.trim_start_matches("sha256:")).exists()
}

/// Run `script` in a fresh sandbox of `image`; (stdout, stderr, code).
fn in_sandbox(image: &str, args: &[&str], script: &str) -> (String, String, i32) {
    let name = unique("t-oci");
    crab_ok(&["sandbox", "create", image, "--name", &name]);
    let mut a = vec!["exec"];
    a.extend_from_slice(args);
    a.extend_from_slice(&[&name, "--", "sh", "-c", script]);
    let o = crab(&a);
    let _ = crab(&["sandbox", "rm", "--force", &name]);
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        o.status.code().unwrap_or(-1),
    )
}

#[test]
fn other_tools_images_import_share_layers_and_keep_their_config() {
    require_root!();
    let s = Scratch::new("oci-umoci");
    let l = s.0.join("layout");
    let b = s.0.join("bundle");
    let lp = l.to_str().unwrap();
    let img = format!("{lp}:t");
    run(Command::new("umoci").args(["init", "--layout", lp]));
    run(Command::new("umoci").args(["new", "--image", &img]));
    // Layer 1: the tiny root, a directory `data` and a symlink `sbin` to a directory.
    run(Command::new("umoci").args(["unpack", "--image", &img, b.to_str().unwrap()]));
    let root = b.join("rootfs");
    tiny_root(&root);
    fs::create_dir_all(root.join("data")).unwrap();
    fs::write(root.join("data/old"), "old\n").unwrap();
    run(Command::new("umoci").args(["repack", "--image", &img, b.to_str().unwrap()]));
    fs::remove_dir_all(&b).unwrap();
    // Layer 2: a file with a hard link and an xattr, a deleted program (a whiteout), the
    // symlinked `sbin` replaced by a directory.
    run(Command::new("umoci").args(["unpack", "--image", &img, b.to_str().unwrap()]));
    let root = b.join("rootfs");
    fs::create_dir_all(root.join("opt/app")).unwrap();
    fs::write(root.join("opt/app/x"), "from layer two\n").unwrap();
    fs::hard_link(root.join("opt/app/x"), root.join("opt/app/y")).unwrap();
    run(Command::new("/usr/bin/python3").args([
        "-c",
        "import os,sys; os.setxattr(sys.argv[1], 'user.crab', b'kept')",
        root.join("opt/app/x").to_str().unwrap(),
    ]));
    fs::remove_file(root.join("usr/bin/ln")).unwrap();
    fs::remove_file(root.join("sbin")).unwrap();
    fs::create_dir(root.join("sbin")).unwrap();
    fs::write(root.join("sbin/tool"), "tool\n").unwrap();
    fs::remove_file(root.join("data/old")).unwrap();
    run(Command::new("umoci").args(["repack", "--image", &img, b.to_str().unwrap()]));
    run(Command::new("umoci").args([
        "config",
        "--image",
        &img,
        "--config.user",
        "app",
        "--config.workingdir",
        "/home/app",
        "--config.env",
        "FOO=bar",
        "--config.entrypoint",
        "/bin/sh",
        "--config.entrypoint",
        "-c",
        "--config.cmd",
        "echo from-cmd $FOO",
    ]));
    // The same image as a layout tar and as skopeo's docker-archive (`docker save` format).
    let tar = s.0.join("layout.tar");
    run(Command::new("tar").args(["-C", lp, "-cf", tar.to_str().unwrap(), "."]));
    let save = s.0.join("save.tar");
    run(Command::new("skopeo").args([
        "copy",
        "--quiet",
        &format!("oci:{img}"),
        &format!("docker-archive:{}:crab-test/tiny:1", save.display()),
    ]));

    let names: Vec<String> =
        ["dir", "tar", "save"].iter().map(|k| unique(&format!("oci-{k}"))).collect();
    let _cleanup = Images(names.clone());
    for (n, p) in names.iter().zip([&l, &tar, &save]) {
        crab_ok(&["image", "import", n, p.to_str().unwrap()]);
    }
    // One chain of layers for the three.
    let chains: Vec<Value> = names.iter().map(|n| image_record(n)["layers"].clone()).collect();
    assert_eq!(chains[0].as_array().unwrap().len(), 2, "{:?}", chains[0]);
    assert_eq!(chains[0], chains[1]);
    assert_eq!(chains[0], chains[2]);
    for n in &names {
        let i = image_info(n);
        assert!(i["shared_bytes"].as_u64().unwrap() > 0, "{i}");
        assert_eq!(i["config"]["user"], "app", "{i}");
        assert_eq!(i["config"]["workdir"], "/home/app");
        assert!(i["digest"].as_str().unwrap().starts_with("sha256:"));
    }
    let r = image_info(&names[2])["reference"].as_str().unwrap().to_string();
    assert!(r.ends_with("crab-test/tiny:1"), "{r}");

    for n in &names {
        // Runs as the image's account, in its directory, with its environment.
        let (o, e, c) = in_sandbox(n, &[], "id -u; id -G; pwd; echo $FOO $HOME");
        assert_eq!(c, 0, "{e}");
        assert_eq!(o, "1000\n1000 2000\n/home/app\nbar /home/app\n", "{n}");
        let (o, e, c) = in_sandbox(
            n,
            &["-u", "root", "-w", "/"],
            "id -u; pwd; cat /opt/app/y; stat -c '%h %i' /opt/app/x /opt/app/y; \
             ls /usr/bin/ln 2>/dev/null || echo ln-gone; cat /sbin/tool; ls /data",
        );
        assert_eq!(c, 0, "{e}");
        let lines: Vec<&str> = o.lines().collect();
        assert_eq!(&lines[..3], ["0", "/", "from layer two"], "{o}");
        let (x, y) = (lines[3], lines[4]);
        assert!(x.starts_with("2 ") && x == y, "hard link: {x} / {y}");
        assert_eq!(&lines[5..], ["ln-gone", "tool"], "{o}");
    }
    // The xattr and owners as stored (the image's own subvolume, before the shift).
    let x = common::state_dir().join("pool/images").join(&names[0]).join("opt/app/x");
    let got = run(Command::new("/usr/bin/python3").args([
        "-c",
        "import os,sys; print(os.getxattr(sys.argv[1], 'user.crab').decode())",
        x.to_str().unwrap(),
    ]));
    assert_eq!(got.trim(), "kept");
    // `docker run IMAGE` runs its entrypoint + command; arguments replace the command.
    assert_eq!(crab_ok(&["docker", "run", "--rm", &names[0]]).trim(), "from-cmd bar");
    assert_eq!(crab_ok(&["docker", "run", "--rm", &names[0], "echo args"]).trim(), "args");

    // Removing images: a sandbox of one keeps working; shared layers stay while any image
    // uses them and go with the last.
    let sb = unique("t-oci-keep");
    crab_ok(&["sandbox", "create", &names[0], "--name", &sb]);
    crab_ok(&["image", "rm", &names[0]]);
    crab_ok(&["image", "rm", &names[1]]);
    let chain: Vec<String> =
        chains[0].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    assert!(chain.iter().all(|c| layer_exists(c)), "layers still used by {}", names[2]);
    assert_eq!(crab_ok(&["exec", &sb, "--", "cat", "/opt/app/x"]), "from layer two\n");
    crab_ok(&["image", "rm", &names[2]]);
    assert!(chain.iter().all(|c| !layer_exists(c)), "layers no image uses are deleted");
    assert_eq!(crab_ok(&["exec", &sb, "--", "cat", "/opt/app/x"]), "from layer two\n");
    crab_ok(&["sandbox", "rm", "--force", &sb]);
}

fn tiny_layer(l: &Layout, s: &Scratch) -> crab_testkit::oci::LayerDesc {
    let root = s.0.join("tiny");
    if !root.exists() {
        tiny_root(&root);
    }
    l.layer(&tar_of_dir(&root), true)
}

#[test]
fn whiteouts_opaque_dirs_and_platforms() {
    require_root!();
    let s = Scratch::new("oci-wh");
    let l = Layout::new(&s.0.join("layout"));
    let base = tiny_layer(&l, &s);
    let f = |n: &str, d: &str| Entry::File(n.into(), d.as_bytes().to_vec(), 0o644, 0);
    let lower = l.layer(
        &tar_of(&[
            Entry::Dir("data/"),
            f("data/a", "a"),
            f("data/b", "b"),
            Entry::Dir("keep/"),
            f("keep/gone", "x"),
            f("keep/stays", "y"),
        ]),
        false,
    );
    // The opaque marker comes after this layer's own `data/c`: c stays, a and b go.
    let upper = l.layer(
        &tar_of(&[f("data/c", "c"), f("data/.wh..wh..opq", ""), f("keep/.wh.gone", "")]),
        true,
    );
    let amd = l.image(&[base.clone(), lower, upper], json!({"Cmd": ["sh"]}), "amd64");
    let other = l.layer(&tar_of(&[f("arch", "arm64")]), false);
    let arm = l.image(&[base, other], json!({}), "arm64");
    l.index(&[amd, arm]);

    let names = vec![unique("oci-amd"), unique("oci-arm")];
    let _cleanup = Images(names.clone());
    let lp = l.dir.to_str().unwrap();
    crab_ok(&["image", "import", &names[0], lp]);
    let (o, e, c) =
        in_sandbox(&names[0], &[], "ls /data; ls /keep; cat /arch 2>/dev/null || echo no-arch");
    assert_eq!(c, 0, "{e}");
    assert_eq!(o, "c\nstays\nno-arch\n");
    crab_ok(&["image", "import", &names[1], lp, "--platform", "linux/arm64"]);
    let (o, _, _) = in_sandbox(&names[1], &[], "cat /arch; ls /data 2>/dev/null || echo no-data");
    assert_eq!(o, "arm64no-data\n");
    let o = crab(&["image", "import", &unique("oci-s390"), lp, "--platform", "linux/s390x"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("linux/s390x") && err.contains("linux/amd64") && err.contains("linux/arm64"),
        "{err}"
    );
}

/// Import a one-image layout whose layers are the tiny root plus `layers`; the CLI's output
/// and the chain ids of its layers.
fn import_layers(
    s: &Scratch,
    name: &str,
    layers: &[Vec<u8>],
) -> (std::process::Output, Vec<String>) {
    let dir = s.0.join(format!("layout-{name}"));
    let l = Layout::new(&dir);
    let mut descs = vec![tiny_layer(&l, s)];
    descs.extend(layers.iter().map(|t| l.layer(t, false)));
    let m = l.image(&descs, json!({}), "amd64");
    l.index(&[m]);
    let diff_ids: Vec<String> = descs.iter().map(|d| d.diff_id.clone()).collect();
    (crab(&["image", "import", name, dir.to_str().unwrap()]), chain_ids(&diff_ids))
}

/// Staging subvolumes of these chains' layers left in the pool's `tmp/` (other tests' imports
/// run meanwhile: only ours count).
fn staging_leftovers(chains: &[String]) -> Vec<String> {
    let ours: Vec<String> = chains.iter().map(|c| format!("layer-{}", &c[7..19])).collect();
    fs::read_dir(common::state_dir().join("pool/tmp"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| ours.iter().any(|o| n.starts_with(o.as_str())))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn hostile_layers_are_refused_naming_the_entry() {
    require_root!();
    let s = Scratch::new("oci-hostile");
    let canary = s.0.join("escaped");
    let canary_s = canary.to_str().unwrap().trim_start_matches('/').to_string();
    let f = |n: &str| Entry::File(n.into(), b"evil".to_vec(), 0o644, 0);
    let up = "../".repeat(12);
    let cases: Vec<(&str, Vec<Vec<u8>>, String)> = vec![
        ("absolute", vec![tar_of(&[f(&format!("/{canary_s}"))])], "has an absolute path".into()),
        ("dotdot", vec![tar_of(&[f(&format!("{up}{canary_s}"))])], "has a `..` component".into()),
        (
            "through-symlink",
            vec![
                tar_of(&[Entry::Symlink("hop".into(), s.0.to_str().unwrap().into())]),
                tar_of(&[f("hop/escaped")]),
            ],
            "would be written through the symlink hop".into(),
        ),
        (
            "same-layer-symlink",
            vec![tar_of(&[Entry::Symlink("hop2".into(), "/".into()), f("hop2/escaped")])],
            "would be written through the symlink hop2".into(),
        ),
        (
            "hardlink-out",
            vec![tar_of(&[Entry::Link("shadow".into(), format!("{up}etc/shadow"))])],
            "is a hard link to".into(),
        ),
        (
            "hardlink-nothing",
            vec![tar_of(&[Entry::Link("ghost".into(), "no/such/file".into())])],
            "does not exist".into(),
        ),
        (
            "climbing-symlink",
            vec![tar_of(&[Entry::Symlink("etc/up".into(), format!("{up}etc"))])],
            "which leaves the root".into(),
        ),
    ];
    for (what, layers, want) in &cases {
        let name = unique(&format!("oci-bad-{what}"));
        let (o, chains) = import_layers(&s, &name, layers);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{what}: imported");
        assert!(err.contains(want), "{what}: {err}");
        assert!(err.contains("layer sha256:"), "{what} names the layer: {err}");
        assert!(!canary.exists(), "{what}: wrote outside the layer");
        assert!(!common::state_dir().join("pool/images").join(&name).exists(), "{what}");
        assert_eq!(staging_leftovers(&chains[1..]), Vec::<String>::new(), "{what}: staging");
        // chains[0] is the tiny base, which images of tests running meanwhile may hold.
        assert!(!chains[1..].iter().any(|c| layer_exists(c)), "{what}: a layer of it was kept");
    }
    // A layer whose bytes are not the config's diff id.
    let dir = s.0.join("layout-diffid");
    let l = Layout::new(&dir);
    let base = tiny_layer(&l, &s);
    let mut bad = l.layer(&tar_of(&[f("ok")]), false);
    bad.diff_id = crab_testkit::oci::digest(b"something else");
    let m = l.image(&[base, bad], json!({}), "amd64");
    l.index(&[m]);
    let o = crab(&["image", "import", &unique("oci-bad-diffid"), dir.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("not the diff id"), "{err}");
    // A tampered blob (its bytes no longer hash to its name).
    let dir = s.0.join("layout-tampered");
    let l = Layout::new(&dir);
    let good = l.layer(&tar_of(&[f("ok")]), false);
    let m = l.image(&[tiny_layer(&l, &s), good.clone()], json!({}), "amd64");
    l.index(&[m]);
    let p = dir.join("blobs/sha256").join(&good.digest[7..]);
    let mut bytes = fs::read(&p).unwrap();
    bytes[600] ^= 1;
    fs::write(&p, bytes).unwrap();
    let o = crab(&["image", "import", &unique("oci-bad-blob"), dir.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(&good.digest) && err.contains("tampered"), "{err}");
}
