//! Issue 29, builds and commits: `crab image build -f Dockerfile CONTEXT --name N` and
//! `crab image commit SB[@POINT] NAME`, with the real daemon, real build sandboxes and btrfs:
//!
//! * `every_instruction_builds_then_comes_from_the_cache`: a two-stage Dockerfile with every
//!   supported instruction (heredocs, `--chown`, `COPY --from`, `ADD` of a local tar.gz,
//!   `.dockerignore`, a context
//!   symlink pointing out of the context) built twice — the second build's every filesystem
//!   step is a cache hit — its configuration in the image record, its files in a sandbox of
//!   it, which is checkpointed, restored and forked like any other.
//! * `refusals_and_failures_leave_nothing`: an unsupported instruction, a FROM of a registry
//!   reference whose registry is not there, a context source out of the context, and a failing RUN (named with its line,
//!   exit code and last output) leave no image and no build sandbox.
//! * `a_build_on_a_layered_image_shares_its_layers_and_keeps_its_config`: FROM an OCI image
//!   made without Crab (imported from a layout): its RUN runs as the base's USER in its WORKDIR
//!   with its ENV, the built image counts the base's layer as shared and outlives the base.
//! * `commit_takes_a_points_files`: an image of a sandbox at a restore point has that point's
//!   files (not later ones) and the sandbox's image's defaults; the sandbox is untouched.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use crab_testkit::daemon as common;
use crab_testkit::require_root;

use common::{crab, crab_ok, ensure_daemon, unique, Sandbox};

/// Held by each test that builds: builds run one at a time on the daemon anyway, and a test
/// that checks no build sandbox is left must not see another test's running one.
static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_build_test() -> std::sync::MutexGuard<'static, ()> {
    BUILDING.lock().unwrap_or_else(|p| p.into_inner())
}

/// A build context directory, removed on drop.
struct Ctx(PathBuf);

impl Ctx {
    fn new(tag: &str) -> Ctx {
        let d = std::env::temp_dir().join(unique(&format!("crab-build-{tag}")));
        std::fs::create_dir_all(&d).unwrap();
        Ctx(d)
    }
    fn write(&self, rel: &str, text: &str) {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An image removed on drop.
struct Image(String);

impl Drop for Image {
    fn drop(&mut self) {
        let _ = crab(&["image", "rm", &self.0]);
    }
}

/// `crab --json image build -f …`: its frames, then the result (or the error frame).
fn build(ctx: &Ctx, name: &str, extra: &[&str]) -> (Vec<serde_json::Value>, serde_json::Value) {
    let df = format!("{}/Dockerfile", ctx.path());
    let mut args = vec!["--json", "image", "build", "-f", &df, ctx.path(), "--name", name];
    args.extend_from_slice(extra);
    let out = crab(&args);
    // One frame a line; after an error frame the CLI's own error document follows.
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let frames: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&text)
        .into_iter::<serde_json::Value>()
        .map(|v| v.unwrap_or_else(|e| panic!("{e}: {text}")))
        .collect();
    let last = frames
        .iter()
        .rev()
        .find(|f| f["t"] == "done" || f["t"] == "error")
        .cloned()
        .unwrap_or_else(|| panic!("no result frame: {text}"));
    assert_eq!(out.status.success(), last["t"] == "done", "exit status vs result: {text}");
    (frames, last)
}

fn build_sandboxes() -> Vec<String> {
    let v: Vec<serde_json::Value> =
        serde_json::from_str(&crab_ok(&["--json", "sandbox", "ls"])).unwrap();
    v.iter()
        .filter_map(|s| s["name"].as_str())
        .filter(|n| n.starts_with("build-"))
        .map(str::to_string)
        .collect()
}

fn image_names() -> Vec<String> {
    let v: Vec<serde_json::Value> =
        serde_json::from_str(&crab_ok(&["--json", "image", "ls"])).unwrap();
    v.iter().filter_map(|i| i["name"].as_str()).map(str::to_string).collect()
}

fn sandbox_of(image: &str, prefix: &str) -> Sandbox {
    let name = unique(prefix);
    crab_ok(&["sandbox", "create", image, "--name", &name]);
    Sandbox { name }
}

const DOCKERFILE: &str = r#"# syntax=docker/dockerfile:1
ARG BASE=debian
FROM $BASE AS builder
ARG NONCE
RUN echo "$NONCE" > /nonce && mkdir -p /out && echo built-by-stage-one > /out/artifact

FROM ${BASE}
ARG NONCE
ARG GREETING=hi
ENV APP_HOME=/opt/app \
    PATH=/opt/app/bin:$PATH
LABEL org.example.name="demo app" version=1
MAINTAINER crab tests
RUN echo "$NONCE" > /nonce
WORKDIR $APP_HOME
COPY --chown=user:user src/ ./src/
COPY --from=builder /out/artifact /opt/artifact
COPY escape ./escape
ADD notes.txt ./
ADD bundle.tar.gz /opt/bundle/
COPY <<EOF /etc/motd-build
greeting=$GREETING
EOF
RUN echo "$GREETING from $(id -un) in $(pwd)" \
 && mkdir -p bin && printf '#!/bin/sh\necho tool "$@"\n' > bin/tool && chmod +x bin/tool
USER user
RUN <<EOF
id -un > /tmp/run-as
echo "home=$HOME"
EOF
SHELL ["/bin/bash", "-c"]
RUN [[ -n "$BASH_VERSION" ]] && echo in-bash > /tmp/shell
EXPOSE 8080 53/udp
ENTRYPOINT ["tool"]
CMD ["--help"]
"#;

#[test]
fn every_instruction_builds_then_comes_from_the_cache() {
    require_root!();
    let _one = one_build_test();
    ensure_daemon();
    let ctx = Ctx::new("all");
    ctx.write("Dockerfile", DOCKERFILE);
    ctx.write("src/a.txt", "hello\n");
    ctx.write("src/pkg/b.py", "print('b')\n");
    ctx.write("notes.txt", "notes\n");
    ctx.write("debug.log", "excluded\n");
    ctx.write("src/skip.tmp", "excluded\n");
    ctx.write(".dockerignore", "*.log\n**/*.tmp\n");
    // A local archive ADD unpacks: a file, a symlink and a hard link.
    ctx.write("bundle/inner/f", "in the tarball\n");
    std::os::unix::fs::symlink("inner/f", ctx.0.join("bundle/ln")).unwrap();
    std::fs::hard_link(ctx.0.join("bundle/inner/f"), ctx.0.join("bundle/hl")).unwrap();
    let tar = std::process::Command::new("tar")
        .args(["czf", "bundle.tar.gz", "-C", "bundle", "."])
        .current_dir(&ctx.0)
        .status()
        .unwrap();
    assert!(tar.success());
    std::fs::remove_dir_all(ctx.0.join("bundle")).unwrap();
    // A context symlink to a host file outside the context: copied as a link, never followed.
    let secret = Ctx::new("secret");
    secret.write("host-secret", "host secret\n");
    let target = format!("{}/host-secret", secret.path());
    std::os::unix::fs::symlink(&target, ctx.0.join("escape")).unwrap();
    let nonce = unique("nonce");
    let img = Image(unique("t-build"));
    let arg = format!("NONCE={nonce}");
    let (frames, done) = build(&ctx, &img.0, &["--build-arg", &arg, "--build-arg", "GREETING=hey"]);
    assert_eq!(done["t"], "done", "first build failed: {done}");
    // The build's output came as frames.
    assert!(
        frames.iter().any(|f| f["t"] == "message" && f["line"] == "hey from root in /opt/app"),
        "the RUN's output is not among the frames"
    );
    let r = &done["result"];
    let fs_steps: Vec<&serde_json::Value> =
        r["steps"].as_array().unwrap().iter().filter(|s| s.get("cached").is_some()).collect();
    assert_eq!(fs_steps.len(), 12, "{}", r["steps"]);
    assert!(fs_steps.iter().all(|s| s["cached"] == false), "first build: {}", r["steps"]);
    // Its configuration.
    let c = &r["config"];
    let env: Vec<&str> = c["env"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(env.contains(&"APP_HOME=/opt/app"), "{env:?}");
    assert!(env.iter().any(|e| e.starts_with("PATH=/opt/app/bin:/usr/local/sbin")), "{env:?}");
    assert!(!env.iter().any(|e| e.starts_with("NONCE=")), "ARGs are not ENV: {env:?}");
    assert_eq!(c["workdir"], "/opt/app");
    assert_eq!(c["user"], "user");
    assert_eq!(c["entrypoint"], serde_json::json!(["tool"]));
    assert_eq!(c["cmd"], serde_json::json!(["--help"]));
    assert_eq!(c["labels"]["org.example.name"], "demo app");
    assert_eq!(c["labels"]["maintainer"], "crab tests");
    assert_eq!(c["exposed_ports"], serde_json::json!(["8080/tcp", "53/udp"]));
    assert_eq!(c["shell"], serde_json::json!(["/bin/bash", "-c"]));
    assert!(r["source"].as_str().unwrap().starts_with("build -f "), "{}", r["source"]);
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&crab_ok(&["--json", "image", "ls"])).unwrap();
    let rec = listed.iter().find(|i| i["name"] == img.0.as_str()).unwrap();
    assert_eq!(&rec["config"], c, "the image record keeps the Dockerfile's configuration");

    // The second build: every filesystem step from the cache, no sandbox started.
    let (_, again) = build(&ctx, &img.0, &["--build-arg", &arg, "--build-arg", "GREETING=hey"]);
    assert_eq!(again["t"], "done", "second build failed: {again}");
    let steps = again["result"]["steps"].as_array().unwrap();
    let fs2: Vec<&serde_json::Value> = steps.iter().filter(|s| s.get("cached").is_some()).collect();
    assert_eq!(fs2.len(), 12);
    assert!(fs2.iter().all(|s| s["cached"] == true), "second build: {steps:?}");
    assert!(build_sandboxes().is_empty(), "build sandboxes left: {:?}", build_sandboxes());
    // --no-cache makes every step again (and the image with them).
    let (_, fresh) =
        build(&ctx, &img.0, &["--build-arg", &arg, "--build-arg", "GREETING=hey", "--no-cache"]);
    assert_eq!(fresh["t"], "done", "--no-cache build failed: {fresh}");
    let steps = fresh["result"]["steps"].as_array().unwrap();
    assert!(
        steps.iter().filter(|s| s.get("cached").is_some()).all(|s| s["cached"] == false),
        "--no-cache: {steps:?}"
    );
    assert!(fresh["result"]["created_at"].as_u64() >= r["created_at"].as_u64());

    // A sandbox of it has the files the steps made, as the Dockerfile said.
    let sb = sandbox_of(&img.0, "t-build-sb");
    assert_eq!(sb.sh_ok("cat /nonce"), format!("{nonce}\n"));
    assert_eq!(sb.sh_ok("cat /opt/artifact"), "built-by-stage-one\n");
    assert_eq!(
        sb.sh_ok("stat -c '%U:%G' /opt/app/src/a.txt /opt/app/src/pkg/b.py"),
        "user:user\nuser:user\n"
    );
    assert_eq!(sb.sh_ok("cat /opt/app/notes.txt /etc/motd-build"), "notes\ngreeting=hey\n");
    assert_eq!(
        sb.sh_ok("cat /opt/bundle/inner/f /opt/bundle/hl; readlink /opt/bundle/ln"),
        "in the tarball\nin the tarball\ninner/f\n"
    );
    assert_ne!(sb.sh("test -e /opt/app/debug.log").2, 0, ".dockerignore: *.log was copied");
    assert_ne!(sb.sh("test -e /opt/app/src/skip.tmp").2, 0, ".dockerignore: **/*.tmp was copied");
    assert_eq!(sb.sh_ok("readlink /opt/app/escape"), format!("{target}\n"), "the link itself");
    assert_ne!(sb.sh("cat /opt/app/escape").2, 0, "the host file behind the link came along");
    assert_eq!(sb.sh_ok("cat /tmp/run-as /tmp/shell"), "user\nin-bash\n");
    // exec honours the built configuration: USER, WORKDIR, ENV (PATH).
    assert_eq!(sb.sh_ok("id -un; pwd; tool x"), "user\n/opt/app\ntool x\n");
    // Checkpointed, restored and forked like any other sandbox.
    sb.sh_ok("echo one > /tmp/state");
    let p: serde_json::Value =
        serde_json::from_str(&crab_ok(&["--json", "checkpoint", &sb.name, "--kind", "fs"]))
            .unwrap();
    let id = p["point"]["id"].as_str().unwrap().to_string();
    sb.sh_ok("echo two > /tmp/state && rm /opt/app/src/a.txt");
    crab_ok(&["restore", &sb.name, &id]);
    assert_eq!(sb.sh_ok("cat /tmp/state /opt/app/src/a.txt"), "one\nhello\n");
    let out = crab_ok(&["--json", "fork", &sb.name, &id, "--count", "1"]);
    let branches: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let fork = Sandbox { name: branches[0]["sandbox"].as_str().unwrap().to_string() };
    assert_eq!(fork.sh_ok("cat /tmp/state /opt/artifact"), "one\nbuilt-by-stage-one\n");
    // An image committed from it keeps the built image's configuration.
    let committed = Image(unique("t-build-commit"));
    let info: serde_json::Value = serde_json::from_str(&crab_ok(&[
        "--json",
        "image",
        "commit",
        &format!("{}@{id}", sb.name),
        &committed.0,
    ]))
    .unwrap();
    assert_eq!(&info["config"], c);
}

#[test]
fn refusals_and_failures_leave_nothing() {
    require_root!();
    let _one = one_build_test();
    ensure_daemon();
    let ctx = Ctx::new("bad");
    let img = Image(unique("t-build-bad"));
    let before = image_names();
    let refused = |dockerfile: &str, want: &[&str]| {
        ctx.write("Dockerfile", dockerfile);
        let (_, last) = build(&ctx, &img.0, &[]);
        assert_eq!(last["t"], "error", "{dockerfile:?} built: {last}");
        let msg = last["error"]["message"].as_str().unwrap().to_string();
        for w in want {
            assert!(msg.contains(w), "{dockerfile:?}: {msg:?} lacks {w:?}");
        }
        assert!(!image_names().contains(&img.0), "an image appeared");
        assert!(build_sandboxes().is_empty(), "build sandboxes left: {:?}", build_sandboxes());
    };
    refused("FROM debian\nRUN true\nHEALTHCHECK CMD true\n", &["line 3", "HEALTHCHECK"]);
    refused("FROM debian\nFROBNICATE x\n", &["line 2", "FROBNICATE"]);
    // A reference the daemon pulls on first use, from a registry that is not there.
    refused(
        "FROM 127.0.0.1:9/nothing:1\n",
        &["line 1", "FROM 127.0.0.1:9/nothing:1", "on first use"],
    );
    refused("FROM debian\nCOPY ../outside /x\n", &["line 2", "climbs out of the context"]);
    refused("FROM debian\nADD https://example.com/x /x\n", &["line 2", "URLs are not fetched"]);
    // A local archive whose entry climbs out of the destination.
    let evil = crab_testkit::oci::tar_of(&[crab_testkit::oci::Entry::File(
        "../../../../etc/crab-evil".into(),
        b"x".to_vec(),
        0o644,
        0,
    )]);
    std::fs::write(ctx.0.join("evil.tar"), evil).unwrap();
    refused("FROM debian\nADD evil.tar /opt/x/\n", &["line 2", "climbs out of the destination"]);
    let nonce = unique("n");
    refused(
        &format!(
            "FROM debian\nRUN echo {nonce}\nRUN echo first-line && echo last-words >&2 && exit 3\n"
        ),
        &["line 3", "RUN echo first-line", "exited with code 3", "last-words"],
    );
    // No image appeared but other tests' (they run meanwhile: counts are not ours to compare).
    let made: Vec<String> = image_names()
        .into_iter()
        .filter(|n| !before.contains(n) && n.starts_with("t-build-bad"))
        .collect();
    assert!(made.is_empty(), "refused builds left images: {made:?}");
}

#[test]
fn commit_takes_a_points_files() {
    require_root!();
    let sb = Sandbox::new("t-commit");
    sb.sh_ok("echo at-point > /root/marker && mkdir -p /srv/data && echo kept > /srv/data/f");
    let p: serde_json::Value =
        serde_json::from_str(&crab_ok(&["--json", "checkpoint", &sb.name, "--kind", "fs"]))
            .unwrap();
    let id = p["point"]["id"].as_str().unwrap().to_string();
    sb.sh_ok("echo later > /root/marker && echo new > /root/later");
    let at = Image(unique("t-commit-at"));
    let src = format!("{}@{id}", sb.name);
    let info: serde_json::Value =
        serde_json::from_str(&crab_ok(&["--json", "image", "commit", &src, &at.0])).unwrap();
    assert_eq!(info["source"], format!("commit {src}"));
    let from_point = sandbox_of(&at.0, "t-commit-a");
    assert_eq!(from_point.sh_ok("cat /root/marker /srv/data/f"), "at-point\nkept\n");
    assert_ne!(from_point.sh("test -e /root/later").2, 0, "a file made after the point");
    // Image ids again inside (the sandbox's user namespace shifted back and forth).
    assert_eq!(from_point.sh_ok("stat -c '%u %g' /root/marker /home/user"), "0 0\n1000 1000\n");
    // Without a point: the sandbox's files now; the sandbox itself goes on untouched.
    let now = Image(unique("t-commit-now"));
    crab_ok(&["image", "commit", &sb.name, &now.0]);
    let from_now = sandbox_of(&now.0, "t-commit-b");
    assert_eq!(from_now.sh_ok("cat /root/marker /root/later"), "later\nnew\n");
    assert_eq!(sb.sh_ok("cat /root/marker"), "later\n");
    sb.sh_ok("echo still-writable > /root/marker");
    // An unknown point is refused, and no image appears.
    let bad = unique("t-commit-bad");
    let o = crab(&["image", "commit", &format!("{}@c999999", sb.name), &bad]);
    assert!(!o.status.success());
    assert!(!image_names().contains(&bad));
}

#[test]
fn a_build_on_a_layered_image_shares_its_layers_and_keeps_its_config() {
    use crab_testkit::oci::{tar_of_dir, tiny_root, Layout};
    require_root!();
    let _one = one_build_test();
    ensure_daemon();
    // A one-layer OCI image made without Crab: a tiny root, a non-root USER, its own ENV.
    let dir = Ctx::new("oci-base");
    let root = dir.0.join("root");
    tiny_root(&root);
    let layout = Layout::new(&dir.0.join("layout"));
    let layer = layout.layer(&tar_of_dir(&root), true);
    let config = serde_json::json!({
        "Env": ["PATH=/usr/bin:/bin", "BASE_VAR=from-base"],
        "User": "app",
        "WorkingDir": "/home/app",
    });
    let m = layout.image(&[layer], config, "amd64");
    layout.index(&[m]);
    let base = Image(unique("t-build-base"));
    crab_ok(&["image", "import", &base.0, layout.dir.to_str().unwrap()]);
    let ctx = Ctx::new("on-oci");
    ctx.write(
        "Dockerfile",
        &format!(
            "FROM {}\nRUN echo \"$BASE_VAR $(id -u) $(pwd)\" > out\nUSER root\nRUN cat /home/app/out > /root/out\n",
            base.0
        ),
    );
    let img = Image(unique("t-build-on-oci"));
    let (_, done) = build(&ctx, &img.0, &[]);
    assert_eq!(done["t"], "done", "{done}");
    let c = &done["result"]["config"];
    assert_eq!(c["user"], "root");
    assert_eq!(c["workdir"], "/home/app");
    assert!(c["env"].as_array().unwrap().iter().any(|e| e == "BASE_VAR=from-base"), "{c}");
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&crab_ok(&["--json", "image", "ls"])).unwrap();
    let rec = listed.iter().find(|i| i["name"] == img.0.as_str()).unwrap();
    assert!(rec["shared_bytes"].as_u64().unwrap() > 0, "the base's layer is shared: {rec}");
    // The RUN ran as the base's USER in its WORKDIR with its ENV; the image outlives its base.
    drop(base);
    let sb = sandbox_of(&img.0, "t-build-oci-sb");
    assert_eq!(sb.sh_ok("cat /root/out"), "from-base 1000 /home/app\n");
}
