//! Images: read-only btrfs subvolumes holding a root filesystem.
//!
//! An image is built with debootstrap (`debian`: bookworm minbase plus the tools agents expect)
//! or imported from a directory or tar archive. Work happens in a subvolume under the pool's
//! `tmp/`; only a finished, read-only subvolume is renamed into `images/` and its record
//! written last, so a half-built image is never visible. Imports refuse absolute paths, `..`
//! components and links that escape the root, naming the entry (see [`crate::archive`]).

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

use crab_common::api::{ImageDefaults, ImageInfo};
use crab_common::paths::StateDir;
use crab_common::{names, Progress};

use crate::error::{Result, SandboxError};
use crate::layers::{self, LayerBlob, LayerLimits};
use crate::{archive, btrfs, pool, runtime};

/// Packages every `debian` image has on top of minbase.
/// Beyond the required set (python3, git, procps, iproute2, curl, ca-certificates) it carries
/// what agent workloads and the inspector's corpus exercise: a C toolchain, make, pip, sqlite.
pub const DEBIAN_PACKAGES: &[&str] = &[
    "python3",
    "git",
    "procps",
    "iproute2",
    "curl",
    "ca-certificates",
    "psmisc",
    "gcc",
    "libc6-dev",
    "make",
    "python3-pip",
    "sqlite3",
];

/// The persisted record of an image (`images/<name>.json`). Format 1: name, source, time,
/// size. Format 2 adds, for OCI images, the registry reference, manifest digest, config
/// defaults and the chain ids of its layers (bottom first); a format-1 record reads as an image
/// without them.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ImageRecord {
    format: u32,
    name: String,
    source: String,
    created_at: u64,
    size_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reference: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    digest: Option<String>,
    #[serde(default, skip_serializing_if = "ImageDefaults::is_empty")]
    config: ImageDefaults,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    layers: Vec<String>,
}

/// The newest image record format this build writes.
const IMAGE_RECORD_FORMAT: u32 = 2;

impl ImageRecord {
    fn new(name: &str, source: String) -> Self {
        ImageRecord {
            format: IMAGE_RECORD_FORMAT,
            name: name.to_string(),
            source,
            created_at: now(),
            size_bytes: 0,
            reference: None,
            digest: None,
            config: ImageDefaults::default(),
            layers: Vec::new(),
        }
    }
}

impl From<ImageRecord> for ImageInfo {
    fn from(r: ImageRecord) -> Self {
        ImageInfo {
            name: r.name,
            source: r.source,
            created_at: r.created_at,
            size_bytes: r.size_bytes,
            reference: r.reference,
            digest: r.digest,
            shared_bytes: 0,
            config: r.config,
        }
    }
}

fn read_record(state: &StateDir, name: &str) -> Option<ImageRecord> {
    let b = fs::read(state.image_record(name)).ok()?;
    let r: ImageRecord = serde_json::from_slice(&b).ok()?;
    (r.format <= IMAGE_RECORD_FORMAT).then_some(r)
}

/// Every image record.
fn records(state: &StateDir) -> Result<Vec<ImageRecord>> {
    let dir = state.images();
    let mut out = Vec::new();
    let rd = match fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(SandboxError::io("list", &dir)(e)),
    };
    for e in rd.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        if let Some(name) = file.strip_suffix(".json") {
            if let Some(r) = read_record(state, name) {
                out.push(r);
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The defaults image `name`'s config gives its sandboxes (empty for images without one).
pub fn defaults_of(state: &StateDir, name: &str) -> ImageDefaults {
    read_record(state, name).map(|r| r.config).unwrap_or_default()
}

/// The root subvolume of image `name`, if the image exists.
pub fn rootfs_of(state: &StateDir, name: &str) -> Result<PathBuf> {
    let root = state.image_rootfs(name);
    if read_record(state, name).is_none() || !btrfs::is_subvolume(&root) {
        return Err(SandboxError::NoImage(name.to_string()));
    }
    Ok(root)
}

/// All images, with the bytes of their layers other images share.
pub fn list(state: &StateDir) -> Result<Vec<ImageInfo>> {
    let recs = records(state)?;
    let mut uses: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
    for r in &recs {
        for l in &r.layers {
            *uses.entry(l.as_str()).or_default() += 1;
        }
    }
    let shared = |r: &ImageRecord| -> u64 {
        r.layers
            .iter()
            .filter(|l| uses.get(l.as_str()).copied().unwrap_or(0) > 1)
            .filter_map(|l| layers::record(state, l))
            .map(|l| l.diff_bytes)
            .sum()
    };
    let shared: Vec<u64> = recs.iter().map(shared).collect();
    Ok(recs
        .into_iter()
        .zip(shared)
        .map(|(r, s)| ImageInfo { shared_bytes: s, ..r.into() })
        .collect())
}

/// Describe image `name`.
pub fn get(state: &StateDir, name: &str) -> Result<ImageInfo> {
    rootfs_of(state, name)?;
    list(state)?
        .into_iter()
        .find(|i| i.name == name)
        .ok_or_else(|| SandboxError::NoImage(name.to_string()))
}

/// Remove image `name` (sandboxes made from it are independent snapshots and stay).
pub fn remove(state: &StateDir, name: &str) -> Result<()> {
    names::validate("image", name).map_err(|e| SandboxError::Invalid(e.message))?;
    if read_record(state, name).is_none() && !state.image_rootfs(name).exists() {
        return Err(SandboxError::NoImage(name.to_string()));
    }
    let chains = read_record(state, name).map(|r| r.layers).unwrap_or_default();
    // Record first: without it the image is invisible, whatever happens next.
    let rec = state.image_record(name);
    fs::remove_file(&rec).or_else(ignore_missing).map_err(SandboxError::io("remove", &rec))?;
    crate::shift::forget(state, name);
    btrfs::remove_tree(&state.image_rootfs(name))
        .map_err(SandboxError::io("delete subvolume", state.image_rootfs(name)))?;
    if !chains.is_empty() {
        let keep: std::collections::HashSet<String> =
            records(state)?.into_iter().flat_map(|r| r.layers).collect();
        layers::release(state, &chains, &keep);
    }
    // Build steps no image uses any more (skipped while a build runs; its end collects them).
    crate::build::collect_unused(state);
    Ok(())
}

fn ignore_missing(e: std::io::Error) -> std::io::Result<()> {
    if e.kind() == std::io::ErrorKind::NotFound {
        Ok(())
    } else {
        Err(e)
    }
}

use crab_common::clock::now_s as now;

/// A staging subvolume under the pool's `tmp/`, deleted on drop unless committed.
struct Staging {
    path: PathBuf,
    committed: bool,
}

impl Staging {
    fn new(state: &StateDir, name: &str) -> Result<Self> {
        let path = state.tmp().join(format!("image-{name}-{:08x}", runtime::rand_u32()));
        btrfs::create_subvolume(&path)?;
        Ok(Staging { path, committed: false })
    }

    /// A writable snapshot of `src` (an image's top layer) to finish as image `name`.
    fn snapshot_of(state: &StateDir, name: &str, src: &Path) -> Result<Self> {
        let path = state.tmp().join(format!("image-{name}-{:08x}", runtime::rand_u32()));
        btrfs::snapshot(src, &path, false)?;
        Ok(Staging { path, committed: false })
    }

    /// Finish: install the init, make it read-only, move it into place, write the record.
    /// With `replace`, an existing image of that name is moved aside first and deleted only
    /// once the new one and its record are in place; any failure puts the old one back.
    fn commit(
        mut self,
        state: &StateDir,
        name: &str,
        mut rec: ImageRecord,
        replace: bool,
    ) -> Result<ImageInfo> {
        let root_time = fs::symlink_metadata(&self.path).ok().map(|m| {
            use std::os::unix::fs::MetadataExt;
            (m.mtime(), m.mtime_nsec())
        });
        runtime::install_init(&self.path)?;
        // The init is Crab's, not the image's: fixed times for it, and the root's time as the
        // image had it, so that an image's tree is the same on every host running this Crab
        // (a remote point recognizes its base image by its tree, `crab_remote`).
        crate::layers::set_times(&self.path.join(".crab/init"), 0, 0);
        crate::layers::set_times(&self.path.join(".crab"), 0, 0);
        if let Some((sec, nsec)) = root_time {
            crate::layers::set_times(&self.path, sec, nsec);
        }
        let size_bytes = du(&self.path);
        let dst = state.image_rootfs(name);
        let mut aside: Option<PathBuf> = None;
        if dst.exists() {
            if !replace {
                return Err(SandboxError::NameTaken { kind: "image", name: name.to_string() });
            }
            let to = state.tmp().join(format!("image-{name}-old-{:08x}", runtime::rand_u32()));
            btrfs::set_readonly(&dst, false)?;
            if let Err(e) = fs::rename(&dst, &to) {
                let _ = btrfs::set_readonly(&dst, true);
                return Err(SandboxError::io("rename", &dst)(e));
            }
            aside = Some(to);
        }
        // Put the old image back (used on every failure below).
        let restore_old = |aside: &Option<PathBuf>| {
            if let Some(old) = aside {
                if let Err(e) = fs::rename(old, &dst) {
                    tracing::error!(from = %old.display(), to = %dst.display(), error = %e,
                        "cannot put the previous image back");
                } else {
                    let _ = btrfs::set_readonly(&dst, true);
                }
            }
        };
        // Rename first: a read-only subvolume cannot be moved (its `..` entry would change).
        if let Err(e) = fs::rename(&self.path, &dst) {
            restore_old(&aside);
            return Err(SandboxError::io("rename", &self.path)(e));
        }
        self.committed = true;
        if let Err(e) = btrfs::set_readonly(&dst, true) {
            let _ = btrfs::remove_tree(&dst);
            restore_old(&aside);
            return Err(e.into());
        }
        rec.size_bytes = size_bytes;
        rec.created_at = now();
        let bytes =
            serde_json::to_vec_pretty(&rec).map_err(|e| SandboxError::Other(e.to_string()))?;
        if let Err(e) = runtime::write_atomic(&state.image_record(name), &bytes) {
            let _ = btrfs::remove_tree(&dst);
            restore_old(&aside);
            return Err(e);
        }
        if let Some(old) = aside {
            if let Err(e) = btrfs::remove_tree(&old) {
                tracing::warn!(path = %old.display(), error = %e, "cannot delete the replaced image");
            }
        }
        Ok(rec.into())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = btrfs::set_readonly(&self.path, false);
            if let Err(e) = btrfs::remove_tree(&self.path) {
                tracing::warn!(path = %self.path.display(), error = %e, "could not remove staging subvolume");
            }
        }
    }
}

/// Apparent size of the files under `root` (du -sb).
fn du(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            total += m.size();
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    total
}

fn check_new_name(state: &StateDir, name: &str) -> Result<()> {
    names::validate("image", name).map_err(|e| SandboxError::Invalid(e.message))?;
    if state.image_rootfs(name).exists() || state.image_record(name).exists() {
        return Err(SandboxError::NameTaken { kind: "image", name: name.to_string() });
    }
    Ok(())
}

/// Version of what a debian build does after debootstrap (quiet login shells, E2B's `user`
/// account, ...). It is part of the recipe, so an image built by an older finalize step is
/// stale: `image build --rebuild-stale` replaces it, a plain `image build` names it.
pub const DEBIAN_FINALIZE: u32 = 2;

/// The recipe string of a debian build (stored as the image's source).
fn debian_recipe(include: &[String]) -> String {
    let mut pkgs: Vec<String> = DEBIAN_PACKAGES.iter().map(|s| s.to_string()).collect();
    for p in include {
        if !pkgs.contains(p) {
            pkgs.push(p.clone());
        }
    }
    format!("debootstrap bookworm minbase +{}; finalize {DEBIAN_FINALIZE}", pkgs.join(","))
}

/// Build a Debian bookworm image with debootstrap. When an image of that name with the same
/// recipe exists, it is returned as is (cached). One built from another recipe (other
/// packages, an older finalize step) is refused, or with `rebuild_stale` rebuilt and swapped
/// in once the new one is complete (sandboxes made from the old one are independent
/// snapshots and keep running).
pub fn build_debian(
    state: &StateDir,
    name: &str,
    include: &[String],
    rebuild_stale: bool,
    progress: &dyn Progress,
) -> Result<ImageInfo> {
    for p in include {
        if p.is_empty() || !p.chars().all(|c| c.is_ascii_alphanumeric() || "+-.:".contains(c)) {
            return Err(SandboxError::Invalid(format!("invalid package name {p:?}")));
        }
    }
    let recipe = debian_recipe(include);
    let mut replace = false;
    if let Some(r) = read_record(state, name) {
        if r.source == recipe && btrfs::is_subvolume(&state.image_rootfs(name)) {
            progress.message(&format!("image {name} is already built ({recipe})"));
            return Ok(r.into());
        }
        if !rebuild_stale {
            let named = if name == "debian" { String::new() } else { format!(" --name {name}") };
            return Err(SandboxError::Conflict(format!(
                "image {name:?} exists but was built from another recipe ({}; this build's is \
                 {recipe}); rebuild it in place with `crab image build debian{named} \
                 --rebuild-stale`, remove it with `crab image rm {name}`, or pick another --name",
                r.source
            )));
        }
        progress.message(&format!(
            "image {name} is stale (built from {}); rebuilding it from {recipe}",
            r.source
        ));
        replace = true;
    } else {
        check_new_name(state, name)?;
    }
    let Some(debootstrap) = pool::which("debootstrap") else {
        return Err(SandboxError::Host {
            what: "debootstrap is not installed".into(),
            hint: "install it with `apt-get install debootstrap` (`make setup` does it)".into(),
        });
    };
    let mirror = debian_mirror()?;
    let staging = Staging::new(state, name)?;
    let cache = state.root().join("cache/debootstrap");
    fs::create_dir_all(&cache).map_err(SandboxError::io("create", &cache))?;
    let log_path = state.logs().join(format!("image-build-{name}.log"));
    let mut pkgs: Vec<String> = DEBIAN_PACKAGES.iter().map(|s| s.to_string()).collect();
    pkgs.extend(include.iter().cloned());
    // The pool is mounted nodev,nosuid; debootstrap refuses such a target (it makes device
    // nodes and runs set-uid maintainer scripts), so it gets a bind mount of the staging
    // subvolume without those flags, unmounted when the build ends.
    let bind = DevBind::new(&staging.path)?;
    progress.stage("debootstrap", None);
    let mut child = Command::new(debootstrap)
        .arg("--variant=minbase")
        .arg(format!("--include={}", pkgs.join(",")))
        .arg(format!("--cache-dir={}", cache.display()))
        .arg("bookworm")
        .arg(&staging.path)
        .arg(&mirror)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(SandboxError::io("run", "debootstrap"))?;
    let mut log = String::new();
    if let Some(out) = child.stdout.take() {
        let mut steps = 0u64;
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            log.push_str(&line);
            log.push('\n');
            if let Some(msg) = line.strip_prefix("I: ") {
                steps += 1;
                progress.advance(steps);
                progress.message(msg);
            }
        }
    }
    let status = child.wait().map_err(SandboxError::io("wait", "debootstrap"))?;
    drop(bind);
    let _ = fs::write(&log_path, &log);
    if !status.success() {
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        return Err(SandboxError::Command {
            cmd: format!("debootstrap bookworm from {mirror}"),
            detail: format!(
                "{status}; log {}; last lines: {}",
                log_path.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            ),
        });
    }
    progress.stage("finalize", None);
    quiet_login_shells(&staging.path)?;
    add_e2b_user(&staging.path)?;
    // Apt lists and caches are not part of the image's job.
    for d in ["var/cache/apt/archives", "var/lib/apt/lists"] {
        let p = staging.path.join(d);
        if let Ok(rd) = fs::read_dir(&p) {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_file()).unwrap_or(false) {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
    }
    staging.commit(state, name, ImageRecord::new(name, recipe), replace)
}

/// The Debian archive debootstrap fetches from: `CRAB_DEBIAN_MIRROR` when set, else the host's
/// own apt configuration (`apt-get indextargets`, which reads both `sources.list` styles): the
/// repository that serves the host's `bookworm` suite, or failing that any Debian one.
pub fn debian_mirror() -> Result<String> {
    if let Ok(m) = std::env::var("CRAB_DEBIAN_MIRROR") {
        if !m.is_empty() {
            return Ok(m);
        }
    }
    let out = Command::new("apt-get")
        .args(["indextargets", "--format", "$(REPO_URI) $(RELEASE) $(TARGET_OF)"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output();
    let text = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        _ => String::new(),
    };
    pick_mirror(&text).ok_or_else(|| SandboxError::Host {
        what: "no Debian archive in this host's apt sources (`apt-get indextargets` lists no \
               `deb` repository for bookworm)"
            .into(),
        hint: "add Debian's archive to /etc/apt/sources.list(.d), or set CRAB_DEBIAN_MIRROR to \
               the archive's URL"
            .into(),
    })
}

/// From `apt-get indextargets` lines (`URI RELEASE TARGET_OF`), the archive serving
/// `bookworm` itself (not `-security`/`-updates`, which debootstrap cannot bootstrap from),
/// else one serving another Debian suite.
fn pick_mirror(text: &str) -> Option<String> {
    let mut any = None;
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(uri), Some(release), Some(of)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if of != "deb" || !(uri.starts_with("http://") || uri.starts_with("https://")) {
            continue;
        }
        let uri = uri.trim_end_matches('/').to_string();
        if release == "bookworm" {
            return Some(uri);
        }
        // Another Debian suite of the same archive (a trixie host's mirror also serves
        // bookworm).
        const DEBIAN_SUITES: &[&str] =
            &["bullseye", "trixie", "forky", "sid", "oldstable", "stable", "testing", "unstable"];
        if any.is_none() && DEBIAN_SUITES.contains(&release) {
            any = Some(uri);
        }
    }
    any
}

/// A bind mount of a directory onto itself with `dev,suid`, detached on drop.
struct DevBind {
    path: PathBuf,
}

impl DevBind {
    fn new(path: &Path) -> Result<Self> {
        use nix::mount::{mount, MsFlags};
        let err = |what: &'static str| {
            move |e: nix::errno::Errno| SandboxError::io(what, path)(std::io::Error::from(e))
        };
        mount(Some(path), path, None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .map_err(err("bind mount"))?;
        let bind = DevBind { path: path.to_path_buf() };
        mount(
            None::<&str>,
            path,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOATIME,
            None::<&str>,
        )
        .map_err(err("remount dev,suid"))?;
        Ok(bind)
    }
}

impl Drop for DevBind {
    fn drop(&mut self) {
        if let Err(e) = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot unmount the build's bind mount");
        }
    }
}

/// Make `bash -l` print nothing: drop `mesg n` (which complains without a tty) from profiles.
fn quiet_login_shells(root: &Path) -> Result<()> {
    let profile = root.join("root/.profile");
    if let Ok(s) = fs::read_to_string(&profile) {
        let cleaned: String = s
            .lines()
            .filter(|l| !l.trim_start().starts_with("mesg"))
            .map(|l| format!("{l}\n"))
            .collect();
        fs::write(&profile, cleaned).map_err(SandboxError::io("write", &profile))?;
    }
    Ok(())
}

/// E2B's templates' default account: `user` (uid/gid 1000, home `/home/user`, bash), which
/// the E2B front door runs commands as unless a call asks for root. Added by editing the
/// image's account files (no chroot); a second call changes nothing.
fn add_e2b_user(root: &Path) -> Result<()> {
    use std::io::Write;
    let append = |rel: &str, line: &str| -> Result<()> {
        let p = root.join(rel);
        let text = fs::read_to_string(&p).unwrap_or_default();
        if text.lines().any(|l| l.split(':').next() == Some("user")) {
            return Ok(());
        }
        let mut f =
            fs::OpenOptions::new().append(true).open(&p).map_err(SandboxError::io("open", &p))?;
        let sep = if text.is_empty() || text.ends_with('\n') { "" } else { "\n" };
        writeln!(f, "{sep}{line}").map_err(SandboxError::io("write", &p))
    };
    append("etc/passwd", "user:x:1000:1000:E2B user:/home/user:/bin/bash")?;
    append("etc/group", "user:x:1000:")?;
    if root.join("etc/shadow").exists() {
        append("etc/shadow", "user:*:19000:0:99999:7:::")?;
    }
    if root.join("etc/gshadow").exists() {
        append("etc/gshadow", "user:!::")?;
    }
    let home = root.join("home/user");
    fs::create_dir_all(&home).map_err(SandboxError::io("create", &home))?;
    if let Ok(rd) = fs::read_dir(root.join("etc/skel")) {
        for e in rd.flatten() {
            let to = home.join(e.file_name());
            if e.file_type().map(|t| t.is_file()).unwrap_or(false) && !to.exists() {
                fs::copy(e.path(), &to).map_err(SandboxError::io("copy", &to))?;
                std::os::unix::fs::chown(&to, Some(1000), Some(1000))
                    .map_err(SandboxError::io("chown", &to))?;
            }
        }
    }
    std::os::unix::fs::chown(&home, Some(1000), Some(1000))
        .map_err(SandboxError::io("chown", &home))?;
    fs::set_permissions(&home, std::os::unix::fs::PermissionsExt::from_mode(0o750))
        .map_err(SandboxError::io("chmod", &home))
}

/// Import a root filesystem from a directory or a tar archive (plain or gzip).
pub fn import(
    state: &StateDir,
    name: &str,
    path: &Path,
    progress: &dyn Progress,
) -> Result<ImageInfo> {
    check_new_name(state, name)?;
    let meta = fs::metadata(path).map_err(SandboxError::io("stat", path))?;
    progress.stage("check", None);
    if meta.is_dir() {
        archive::check_dir(path)?;
        let staging = Staging::new(state, name)?;
        progress.stage("copy", None);
        let out = Command::new("cp")
            .arg("-a")
            .arg("--reflink=auto")
            .arg(format!("{}/.", path.display()))
            .arg(&staging.path)
            .output()
            .map_err(SandboxError::io("run", "cp"))?;
        if !out.status.success() {
            return Err(SandboxError::Command {
                cmd: format!("cp -a {}", path.display()),
                detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        staging.commit(
            state,
            name,
            ImageRecord::new(name, format!("import {}", path.display())),
            false,
        )
    } else {
        let entries = archive::check_tar(path)?;
        let staging = Staging::new(state, name)?;
        progress.stage("unpack", Some(entries));
        archive::unpack_tar(path, &staging.path, progress)?;
        staging.commit(
            state,
            name,
            ImageRecord::new(name, format!("import {}", path.display())),
            false,
        )
    }
}

/// An OCI image to install: its layers (bottom first, blobs verified) and config.
#[derive(Debug, Clone)]
pub struct OciImage {
    /// What `image ls` shows as its source (`pull REF`, `import PATH`).
    pub source: String,
    /// Registry reference, when pulled.
    pub reference: Option<String>,
    /// Manifest digest.
    pub digest: Option<String>,
    /// The config's defaults.
    pub config: ImageDefaults,
    /// Layer blobs, bottom first.
    pub layers: Vec<LayerBlob>,
}

/// Install an OCI image as image `name`: each layer applied once (shared with every image
/// that has it), the image a snapshot of its top layer with Crab's init. With `replace`, an
/// image of that name is swapped out once the new one is complete.
pub fn install(
    state: &StateDir,
    name: &str,
    img: &OciImage,
    replace: bool,
    limits: LayerLimits,
    progress: &dyn Progress,
) -> Result<ImageInfo> {
    if replace {
        names::validate("image", name).map_err(|e| SandboxError::Invalid(e.message))?;
    } else {
        check_new_name(state, name)?;
    }
    // One install at a time: a failed one releases the layers it made that no image uses,
    // which must not be layers another install is about to use.
    let _one = INSTALLS.lock().unwrap_or_else(|p| p.into_inner());
    let diff_ids: Vec<String> = img.layers.iter().map(|l| l.diff_id.clone()).collect();
    let chains = layers::chain_ids(&diff_ids);
    let result = (|| {
        let (chains, top) = layers::apply_all(state, &img.layers, limits, progress)?;
        progress.stage("image", None);
        let staging = Staging::snapshot_of(state, name, &top)?;
        let mut rec = ImageRecord::new(name, img.source.clone());
        rec.reference = img.reference.clone();
        rec.digest = img.digest.clone();
        rec.config = img.config.clone();
        rec.layers = chains;
        staging.commit(state, name, rec, replace)
    })();
    match result {
        Ok(info) => get(state, &info.name),
        Err(e) => {
            // Nothing of a failed install stays: its new layers go unless an image uses them.
            let keep: std::collections::HashSet<String> =
                records(state)?.into_iter().flat_map(|r| r.layers).collect();
            layers::release(state, &chains, &keep);
            Err(e)
        }
    }
}

/// Serializes [`install`]s (see there).
static INSTALLS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Make image `name` from the tree `src` (a subvolume, e.g. a build's last step or a
/// sandbox's restore point; `None`: an empty root) with `config` as its defaults: a snapshot
/// of it, finished by `finish` (an id shift back to image ids), with Crab's init, read-only,
/// its record written last. `steps` are the build steps it was made of (kept while it exists).
/// With `replace`, an image of that name is swapped out once the new one is complete.
#[allow(clippy::too_many_arguments)] // one image's whole description
pub fn from_tree(
    state: &StateDir,
    name: &str,
    src: Option<&Path>,
    source: String,
    config: ImageDefaults,
    steps: Vec<String>,
    replace: bool,
    finish: &dyn Fn(&Path) -> Result<()>,
) -> Result<ImageInfo> {
    if replace {
        names::validate("image", name).map_err(|e| SandboxError::Invalid(e.message))?;
    } else {
        check_new_name(state, name)?;
    }
    let staging = match src {
        Some(p) => Staging::snapshot_of(state, name, p)?,
        None => Staging::new(state, name)?,
    };
    finish(&staging.path)?;
    let mut rec = ImageRecord::new(name, source);
    rec.config = config;
    rec.layers = steps;
    let info = staging.commit(state, name, rec, replace)?;
    get(state, &info.name)
}

/// The build steps (or OCI chain ids) image `name` was made of, and its defaults and source;
/// `None` when there is no such image.
pub fn made_of(state: &StateDir, name: &str) -> Option<(Vec<String>, ImageDefaults, String)> {
    read_record(state, name).map(|r| (r.layers, r.config, r.source))
}

/// One layer of an image to push, bottom first.
#[derive(Debug, Clone)]
pub struct PushLayer {
    /// What it is, for progress and errors (`layer 2/3`, `the image's own files`).
    pub what: String,
    /// The chain id of a stored layer (`None`: the image's own tree over the layers below).
    pub chain: Option<String>,
    /// The tree the layer is the difference of …
    pub tree: PathBuf,
    /// … over this one (`None`: the whole tree).
    pub below: Option<PathBuf>,
    /// The blob it was installed from (or one generated for it earlier), when known.
    pub known: Option<layers::BlobRef>,
    /// For the image's own tree: a key naming this very tree (its image's identity), under
    /// which a generated blob is remembered.
    pub key: Option<String>,
}

/// What `image push` sends of image `name`: its config defaults and layers. An image made of
/// stored OCI layers (pulled, imported from an OCI layout or `docker save`) is those layers,
/// and — when the image's files differ from its top layer beyond Crab's init (a Dockerfile
/// build's steps, which are kept in the sandboxes' id space, are pushed as one layer this way)
/// — one more layer of the difference. Any other image (debootstrap, a root-filesystem import,
/// a commit, an image record of format 1) is one layer of its whole tree.
pub fn push_source(state: &StateDir, name: &str) -> Result<(ImageDefaults, Vec<PushLayer>)> {
    names::validate("image", name).map_err(|e| SandboxError::Invalid(e.message))?;
    let root = rootfs_of(state, name)?;
    let rec = read_record(state, name).ok_or_else(|| SandboxError::NoImage(name.to_string()))?;
    // The longest bottom run of stored OCI layers that forms a chain.
    let mut stored: Vec<(String, layers::LayerRecord)> = Vec::new();
    for c in &rec.layers {
        if c.starts_with("build-") {
            break;
        }
        let Some(r) = layers::record(state, c) else { break };
        if r.parent.as_deref() != stored.last().map(|(c, _)| c.as_str()) {
            break;
        }
        stored.push((c.clone(), r));
    }
    let n = stored.len();
    let mut out = Vec::with_capacity(n + 1);
    let mut below: Option<PathBuf> = None;
    for (i, (c, r)) in stored.into_iter().enumerate() {
        let tree = layers::layer_path(state, &c)?;
        out.push(PushLayer {
            what: format!("layer {}/{n}", i + 1),
            chain: Some(c),
            tree: tree.clone(),
            below: below.replace(tree),
            known: r.blob,
            key: None,
        });
    }
    let mut h = sha2::Sha256::new();
    use sha2::Digest as _;
    let root_ctime = {
        use std::os::unix::fs::MetadataExt;
        fs::symlink_metadata(&root).map(|m| (m.ctime(), m.ctime_nsec())).unwrap_or_default()
    };
    for part in [
        name.to_string(),
        rec.created_at.to_string(),
        rec.source.clone(),
        rec.layers.join(","),
        rec.size_bytes.to_string(),
        format!("{}.{}", root_ctime.0, root_ctime.1),
        below.as_ref().map(|b| b.display().to_string()).unwrap_or_default(),
    ] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    out.push(PushLayer {
        what: if n == 0 { "the image's files".into() } else { "the image's own files".into() },
        chain: None,
        tree: root,
        below,
        known: None,
        key: Some(layers::hex(&h.finalize())),
    });
    Ok((rec.config, out))
}

/// Every image's layers and build steps (what the garbage collection of steps keeps).
pub fn all_layers(state: &StateDir) -> Result<std::collections::HashSet<String>> {
    Ok(records(state)?.into_iter().flat_map(|r| r.layers).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_is_the_archive_serving_bookworm() {
        let text = "http://a.example/debian-security/ bookworm-security deb\n\
                    http://a.example/debian/ bookworm-updates deb\n\
                    http://a.example/debian/ bookworm deb\n\
                    http://a.example/debian/ bookworm deb-src\n";
        assert_eq!(pick_mirror(text).as_deref(), Some("http://a.example/debian"));
    }

    #[test]
    fn mirror_falls_back_to_another_debian_suite_but_not_to_third_party_repos() {
        let text = "https://third.example/node nodistro deb\nhttp://m.example/d/ trixie deb\n";
        assert_eq!(pick_mirror(text).as_deref(), Some("http://m.example/d"));
        assert_eq!(pick_mirror("https://third.example/node nodistro deb\n"), None);
        assert_eq!(pick_mirror("file:/srv/debian bookworm deb\n"), None);
        assert_eq!(pick_mirror(""), None);
    }

    #[test]
    fn recipe_names_the_finalize_version_and_extra_packages() {
        let r = debian_recipe(&["vim".into(), "git".into()]);
        assert!(r.starts_with("debootstrap bookworm minbase +python3,git,"), "{r}");
        assert!(r.ends_with(&format!(",vim; finalize {DEBIAN_FINALIZE}")), "{r}");
        // An image built before the finalize step was versioned is stale.
        assert_ne!(r, format!("debootstrap bookworm minbase +{}", DEBIAN_PACKAGES.join(",")));
    }
}
