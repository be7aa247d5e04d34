//! `crab bench images` (issue 29): OCI images side by side in one run, against the daemon the
//! CLI talks to and a loopback registry of the bench's own (Debian's `docker-registry`), with
//! other tools' figures measured on the same bytes in the same run:
//!
//! * **unpack**: a 3-layer OCI image (the base image's tree split in three gzip layers by
//!   `umoci`) imported by `crab image import` (verify, apply each layer once as btrfs
//!   snapshots, the user-namespace copy) vs `umoci unpack` of the same layout;
//! * **pull**: the same image from the loopback registry, nothing of it stored (blob cache and
//!   layers gone), by `crab image pull` vs `skopeo copy` + `umoci unpack`;
//! * **create**: sandbox create p50 from that image vs from the base image, alternated
//!   batches ([`crate::foundation::run`]);
//! * **disk**: five images on that base (`umoci insert` of one small file each): the sum of
//!   their sizes vs what the pool's usage grew by;
//! * **build**: a Dockerfile `FROM` that image (RUN + COPY + ENV), first build vs a rebuild
//!   from the cache.
//!
//! The external tools are run as processes (`umoci`, `skopeo`, `docker-registry`, `df`); the
//! Crab side goes through the `crab` CLI (`image import`/`pull`/`build`), as a user's would.
//! Every image and file it makes is removed at the end, also on failure.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crab_client::Client;
use crab_common::ApiError;

use crate::stats::Summary;

/// What [`run`] measures.
#[derive(Debug, Clone)]
pub struct ImagesOptions {
    /// Rounds of each side-by-side measurement.
    pub rounds: usize,
    /// The image whose tree becomes the 3-layer fixture (and the create baseline).
    pub base: String,
    /// Loopback port of the bench's registry.
    pub registry_port: u16,
    /// Scratch directory (removed afterwards).
    pub work: PathBuf,
}

/// Results of [`run`].
#[derive(Debug, Clone, Serialize)]
pub struct ImagesReport {
    /// Bytes of the fixture's gzip blobs (3 layers + config + manifest).
    pub fixture_blob_bytes: u64,
    /// `crab image import` of the layout, ms.
    pub import_ms: Summary,
    /// `umoci unpack` of the same layout, ms.
    pub umoci_unpack_ms: Summary,
    /// `import_ms.p50 / umoci_unpack_ms.p50`.
    pub import_ratio_p50: f64,
    /// `crab image pull` from the loopback registry, nothing stored, ms.
    pub pull_ms: Summary,
    /// `skopeo copy` + `umoci unpack` of the same, ms.
    pub skopeo_umoci_ms: Summary,
    /// `pull_ms.p50 / skopeo_umoci_ms.p50`.
    pub pull_ratio_p50: f64,
    /// Create p50 of each batch from the base image, ms.
    pub create_base_ms: Vec<f64>,
    /// Create p50 of each batch from the OCI image, ms.
    pub create_oci_ms: Vec<f64>,
    /// Median OCI batch p50 / median base batch p50.
    pub create_ratio_p50: f64,
    /// Five images on one base: the sum of their sizes, bytes.
    pub five_images_sum_bytes: u64,
    /// What the pool's usage grew by while they were imported, bytes.
    pub five_images_pool_growth_bytes: i64,
    /// First build of the Dockerfile, ms.
    pub build_first_ms: f64,
    /// The same build again (every step from the cache), ms.
    pub build_cached_ms: f64,
    /// Load average at the start and at the end (1, 5, 15 min).
    pub loadavg: (String, String),
    /// Processes using more than 20 % of a CPU at the start (what else was running).
    pub other_busy: String,
}

fn err(what: impl std::fmt::Display) -> ApiError {
    ApiError::internal(format!("bench images: {what}"))
}

/// Run `cmd`, failing with its stderr.
fn sh(cmd: &mut Command) -> Result<String, ApiError> {
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| err(format!("{cmd:?}: {e}")))?;
    if !out.status.success() {
        return Err(err(format!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Milliseconds `f` took.
fn timed(f: impl FnOnce() -> Result<(), ApiError>) -> Result<f64, ApiError> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

fn sync() {
    let _ = Command::new("sync").status();
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn busy() -> String {
    let out = Command::new("ps").args(["-eo", "comm,pcpu", "--sort=-pcpu"]).output();
    let Ok(out) = out else { return String::new() };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (c, p) = (w.next()?, w.next()?.parse::<f64>().ok()?);
            (p > 20.0).then(|| format!("{c}({p}%)"))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn pool_used(state: &Path) -> Result<i64, ApiError> {
    let out = sh(Command::new("df").args(["--output=used", "-B1"]).arg(state.join("pool")))?;
    out.lines().last().and_then(|l| l.trim().parse().ok()).ok_or_else(|| err("df: no figure"))
}

/// The images this bench makes (removed at the end).
const BIG: &str = "bench-images-big";
const PULLED: &str = "bench-images-pulled";
const BUILT: &str = "bench-images-built";

struct Cleanup<'a> {
    crab: &'a dyn Fn(&[&str]) -> Command,
    work: PathBuf,
    registry: Option<Child>,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        if let Some(mut r) = self.registry.take() {
            let _ = r.kill();
            let _ = r.wait();
        }
        let mut names = vec![BIG.to_string(), PULLED.into(), BUILT.into()];
        names.extend((1..=5).map(|i| format!("bench-images-v{i}")));
        for n in names {
            let _ = (self.crab)(&["image", "rm", &n])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// Run the benchmark (see the module doc). Needs `umoci`, `skopeo`, `docker-registry` and
/// `df` on `PATH` and the daemon's base image.
pub async fn run(
    client: &Client,
    crab_exe: &Path,
    state_dir: &Path,
    o: &ImagesOptions,
) -> Result<ImagesReport, ApiError> {
    for tool in ["umoci", "skopeo", "docker-registry"] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .map_or(true, |s| !s.success())
        {
            return Err(ApiError::invalid(
                format!("bench images needs {tool}, which is not installed"),
                "run scripts/install-deps.sh (Debian packages umoci, skopeo, docker-registry)",
            ));
        }
    }
    let base_root = state_dir.join("pool/images").join(&o.base);
    if !base_root.is_dir() {
        return Err(ApiError::invalid(
            format!("no image {:?} in {}", o.base, state_dir.display()),
            "build it first: `crab image build debian`",
        ));
    }
    let state = state_dir.to_path_buf();
    let exe = crab_exe.to_path_buf();
    let crab = move |args: &[&str]| -> Command {
        let mut c = Command::new(&exe);
        c.arg("--state-dir").arg(&state).args(args);
        c
    };
    let _ = std::fs::remove_dir_all(&o.work);
    std::fs::create_dir_all(&o.work).map_err(|e| err(format!("{}: {e}", o.work.display())))?;
    let mut guard = Cleanup { crab: &crab, work: o.work.clone(), registry: None };
    let load_start = loadavg();
    let other_busy = busy();
    let w = |p: &str| o.work.join(p);
    let ws = |p: &str| w(p).to_string_lossy().into_owned();

    // The fixture: the base tree in three layers (usr/lib and usr/share each a layer of their own).
    let layout = ws("layout");
    sh(Command::new("umoci").args(["init", "--layout", &layout]))?;
    sh(Command::new("umoci").args(["new", "--image", &format!("{layout}:big")]))?;
    let bundle = ws("b");
    sh(Command::new("umoci").args(["unpack", "--image", &format!("{layout}:big"), &bundle]))?;
    sh(Command::new("cp").arg("-a").arg(format!("{}/.", base_root.display())).arg(w("b/rootfs")))?;
    let _ = std::fs::remove_dir_all(w("b/rootfs/.crab"));
    std::fs::rename(w("b/rootfs/usr/lib"), w("lib"))
        .map_err(|e| err(format!("mv usr/lib: {e}")))?;
    std::fs::rename(w("b/rootfs/usr/share"), w("share")).map_err(|e| err(format!("mv: {e}")))?;
    let repack =
        || sh(Command::new("umoci").args(["repack", "--image", &format!("{layout}:big"), &bundle]));
    repack()?;
    std::fs::rename(w("lib"), w("b/rootfs/usr/lib")).map_err(|e| err(format!("mv: {e}")))?;
    repack()?;
    std::fs::rename(w("share"), w("b/rootfs/usr/share")).map_err(|e| err(format!("mv: {e}")))?;
    repack()?;
    let _ = std::fs::remove_dir_all(w("b"));
    let fixture_blob_bytes = sh(Command::new("du").args(["-sb", &format!("{layout}/blobs")]))?
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);

    // unpack
    let (mut import, mut umoci) = (Vec::new(), Vec::new());
    for r in 0..o.rounds {
        import.push(timed(|| sh(&mut crab(&["image", "import", BIG, &layout])).map(drop))?);
        if r + 1 < o.rounds {
            sh(&mut crab(&["image", "rm", BIG]))?;
        }
        let _ = std::fs::remove_dir_all(w("u"));
        sync();
        umoci.push(timed(|| {
            sh(Command::new("umoci").args([
                "unpack",
                "--image",
                &format!("{layout}:big"),
                &ws("u"),
            ]))
            .map(drop)
        })?);
        let _ = std::fs::remove_dir_all(w("u"));
    }

    // pull: a registry of our own on loopback.
    let port = o.registry_port;
    std::fs::write(
        w("reg.yml"),
        format!(
            "version: 0.1\nstorage: {{filesystem: {{rootdirectory: {}}}}}\nhttp: {{addr: 127.0.0.1:{port}}}\n",
            ws("reg")
        ),
    )
    .map_err(|e| err(format!("reg.yml: {e}")))?;
    let log = std::fs::File::create(w("reg.log")).map_err(|e| err(format!("reg.log: {e}")))?;
    guard.registry = Some(
        Command::new("docker-registry")
            .arg("serve")
            .arg(w("reg.yml"))
            .stdout(log.try_clone().map_err(|e| err(e.to_string()))?)
            .stderr(log)
            .spawn()
            .map_err(|e| err(format!("docker-registry: {e}")))?,
    );
    let reference = format!("127.0.0.1:{port}/bench/big:1");
    let up = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if up.elapsed() > Duration::from_secs(10) {
            return Err(err(format!("the registry did not come up (log {})", ws("reg.log"))));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    sh(Command::new("skopeo").args([
        "copy",
        "--quiet",
        "--dest-tls-verify=false",
        &format!("oci:{layout}:big"),
        &format!("docker://{reference}"),
    ]))?;
    // Nothing of it stored: every round downloads, verifies and applies every layer.
    sh(&mut crab(&["image", "rm", BIG]))?;
    let (mut pull, mut sk) = (Vec::new(), Vec::new());
    for _ in 0..o.rounds {
        let _ = crab(&["image", "rm", PULLED]).stdout(Stdio::null()).stderr(Stdio::null()).status();
        let _ = std::fs::remove_dir_all(state_dir.join("cache/blobs"));
        sync();
        pull.push(timed(|| {
            sh(&mut crab(&["image", "pull", "--insecure", "--name", PULLED, &reference])).map(drop)
        })?);
        let _ = std::fs::remove_dir_all(w("p"));
        let _ = std::fs::remove_dir_all(w("pu"));
        sync();
        sk.push(timed(|| {
            sh(Command::new("skopeo").args([
                "copy",
                "--quiet",
                "--src-tls-verify=false",
                &format!("docker://{reference}"),
                &format!("oci:{}:1", ws("p")),
            ]))?;
            sh(Command::new("umoci").args([
                "unpack",
                "--image",
                &format!("{}:1", ws("p")),
                &ws("pu"),
            ]))
            .map(drop)
        })?);
        let _ = std::fs::remove_dir_all(w("p"));
        let _ = std::fs::remove_dir_all(w("pu"));
    }
    sh(&mut crab(&["image", "rm", PULLED]))?;
    sh(&mut crab(&["image", "import", BIG, &layout]))?;

    // create: alternated batches of 10 from each image.
    let (mut c_base, mut c_oci) = (Vec::new(), Vec::new());
    for r in 0..o.rounds {
        let order = if r % 2 == 0 { [o.base.as_str(), BIG] } else { [BIG, o.base.as_str()] };
        for img in order {
            let f = crate::foundation::FoundationOptions {
                image: img,
                creates: 10,
                execs: 1,
                compare_privileged: false,
                gap: Duration::ZERO,
                favordynmods: None,
            };
            let rep = crate::foundation::run(client, crab_exe, state_dir, &f).await?;
            if img == BIG { &mut c_oci } else { &mut c_base }.push(rep.create_ms.p50);
        }
    }

    // disk: five images on that base, one small file each.
    sync();
    let used0 = pool_used(state_dir)?;
    for i in 1..=5 {
        // One small layer on top, by tar and `umoci raw add-layer` (umoci 0.4's `insert`
        // writes a layer tar without its padding and end blocks, which Crab refuses).
        std::fs::write(w("variant"), format!("variant {i}\n")).map_err(|e| err(e.to_string()))?;
        let tar = ws(&format!("v{i}.tar"));
        sh(Command::new("tar").args(["--numeric-owner", "-C", &ws(""), "-cf", &tar, "variant"]))?;
        let tag = format!("{layout}:v{i}");
        sh(Command::new("umoci").args([
            "config",
            "--image",
            &format!("{layout}:big"),
            "--tag",
            &format!("v{i}"),
            "--config.label",
            &format!("variant={i}"),
        ]))?;
        sh(Command::new("umoci").args(["raw", "add-layer", "--image", &tag, &tar]))?;
        let own = ws(&format!("v{i}"));
        sh(Command::new("skopeo").args([
            "copy",
            "--quiet",
            &format!("oci:{layout}:v{i}"),
            &format!("oci:{own}:v{i}"),
        ]))?;
        sh(&mut crab(&["image", "import", &format!("bench-images-v{i}"), &own]))?;
    }
    sync();
    let used1 = pool_used(state_dir)?;
    let images: Vec<crab_common::api::ImageInfo> =
        client.call::<(), _>(crab_client::Method::GET, "/v1/images", None).await?;
    let five_images_sum_bytes =
        images.iter().filter(|i| i.name.starts_with("bench-images-v")).map(|i| i.size_bytes).sum();

    // build: first vs cached.
    let ctx = w("ctx");
    std::fs::create_dir_all(&ctx).map_err(|e| err(e.to_string()))?;
    std::fs::write(ctx.join("f"), "payload\n").map_err(|e| err(e.to_string()))?;
    std::fs::write(
        ctx.join("Dockerfile"),
        format!(
            "FROM {BIG}\nRUN echo built > /built && python3 -c 'print(1)'\nCOPY f /f\nENV A=b\n"
        ),
    )
    .map_err(|e| err(e.to_string()))?;
    let df = ctx.join("Dockerfile").to_string_lossy().into_owned();
    let cs = ctx.to_string_lossy().into_owned();
    let build = || sh(&mut crab(&["image", "build", "-f", &df, &cs, "--name", BUILT])).map(drop);
    let build_first_ms = timed(build)?;
    let build_cached_ms = timed(build)?;

    let (i, u) = (Summary::of(&import), Summary::of(&umoci));
    let (p, s) = (Summary::of(&pull), Summary::of(&sk));
    let create_ratio_p50 = crate::stats::median(&c_oci) / crate::stats::median(&c_base);
    Ok(ImagesReport {
        fixture_blob_bytes,
        import_ratio_p50: i.p50 / u.p50,
        import_ms: i,
        umoci_unpack_ms: u,
        pull_ratio_p50: p.p50 / s.p50,
        pull_ms: p,
        skopeo_umoci_ms: s,
        create_base_ms: c_base,
        create_oci_ms: c_oci,
        create_ratio_p50,
        five_images_sum_bytes,
        five_images_pool_growth_bytes: used1 - used0,
        build_first_ms,
        build_cached_ms,
        loadavg: (load_start, loadavg()),
        other_busy,
    })
}
