//! What COPY and ADD read: a build context or a stage's tree listed without following symlinks
//! (a symlink is an entry, copied as a link), `.dockerignore` as the `ignore` crate's gitignore
//! matcher with Docker's anchoring, the entries a source names (a path or a pattern), the
//! lexical normalization that keeps paths under a root, and the unpacking of a local archive ADD
//! names into a tree through [`InRoot`].

use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use super::MAX_ENTRIES;
use crate::error::{Result, SandboxError};
use crate::inroot::InRoot;

/// Whether `rel` is a directory of `tree` (resolved inside it).
pub(super) fn is_dir_in(tree: &InRoot, rel: &Path) -> bool {
    tree.dir(rel, false, false).is_ok()
}

/// Whether ADD unpacks archive `p` (the decompressors this crate has).
pub(super) fn can_unpack(p: &Path) -> bool {
    let n = p.to_string_lossy().to_lowercase();
    [".tar", ".tar.gz", ".tgz", ".tar.zst"].iter().any(|s| n.ends_with(s))
}

/// Unpack a tar (plain, gzip or zstd, told by its first bytes) under directory `dest` of
/// `tree`: every entry resolved inside the tree ([`InRoot`]), `..` climbing out of `dest`
/// refused, hard links copied from their target already unpacked, device nodes and FIFOs
/// skipped, at most [`MAX_ENTRIES`] entries.
pub(super) fn unpack_into(tree: &InRoot, dest: &Path, f: fs::File) -> Result<()> {
    let mut r = std::io::BufReader::new(f);
    let magic = {
        use std::io::BufRead;
        r.fill_buf().map_err(SandboxError::io("read", dest))?.get(..4).map(<[u8]>::to_vec)
    };
    let dec: Box<dyn Read> = match magic.as_deref() {
        Some([0x1f, 0x8b, ..]) => Box::new(flate2::read::MultiGzDecoder::new(r)),
        Some([0x28, 0xb5, 0x2f, 0xfd]) => Box::new(
            zstd::stream::read::Decoder::with_buffer(r).map_err(SandboxError::io("zstd", dest))?,
        ),
        _ => Box::new(r),
    };
    let bad = |m: String| SandboxError::Invalid(m);
    tree.dir(dest, true, false)?;
    let mut ar = tar::Archive::new(dec);
    let entries = ar.entries().map_err(|e| bad(format!("not a tar archive: {e}")))?;
    for (n, e) in entries.enumerate() {
        if n >= MAX_ENTRIES {
            return Err(bad(format!("more than {MAX_ENTRIES} entries")));
        }
        let mut e = e.map_err(|e| bad(format!("a broken tar entry: {e}")))?;
        let name = e.path().map_err(|e| bad(format!("an entry's name: {e}")))?.into_owned();
        let Some(rel) = normalize(&Path::new("/").join(&name)) else {
            return Err(bad(format!("entry {} climbs out of the destination", name.display())));
        };
        if rel.as_os_str().is_empty() {
            continue;
        }
        let target = dest.join(&rel);
        let mode = e.header().mode().unwrap_or(0o644) & 0o7777;
        match e.header().entry_type() {
            tar::EntryType::Directory => tree.mkdir_mode(&target, mode)?,
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                tree.write_from(&target, &mut e, mode)?
            }
            tar::EntryType::Symlink => {
                let to = e.link_name().ok().flatten().map(|l| l.into_owned()).unwrap_or_default();
                tree.symlink(&target, &to)?
            }
            tar::EntryType::Link => {
                let to = e.link_name().ok().flatten().map(|l| l.into_owned()).unwrap_or_default();
                let Some(src) = normalize(&Path::new("/").join(&to)) else {
                    return Err(bad(format!(
                        "hard link {} points out of the destination",
                        name.display()
                    )));
                };
                let mut f = tree.open_regular(&dest.join(src)).ok_or_else(|| {
                    bad(format!(
                        "hard link {} to {}, which is not an earlier file",
                        name.display(),
                        to.display()
                    ))
                })?;
                let _ = nix::fcntl::fcntl(
                    std::os::fd::AsRawFd::as_raw_fd(&f),
                    nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
                );
                tree.write_from(&target, &mut f, mode)?
            }
            _ => {}
        }
    }
    Ok(())
}

pub(super) fn is_archive(p: &Path) -> bool {
    let n = p.to_string_lossy().to_lowercase();
    [".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tar.zst"]
        .iter()
        .any(|s| n.ends_with(s))
}

/// `p` (absolute) relative to `/`, with `.` and `..` resolved lexically; `None` when it climbs
/// above the root.
pub(super) fn normalize(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir if !out.pop() => return None,
            _ => {}
        }
    }
    Some(out)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum EntryKind {
    Dir,
    File,
    Symlink(PathBuf),
}

/// An entry of a context or tree (never followed through a symlink).
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) rel: PathBuf,
    pub(super) kind: EntryKind,
    pub(super) mode: u32,
    /// Where it goes, relative to the destination.
    pub(super) dest_rel: PathBuf,
    /// A single file matched by name (see [`Item::to_dir`]).
    pub(super) to_dir: bool,
}

/// The entries of a build context (minus `.dockerignore`d ones) or of a stage's tree.
pub(super) struct Context {
    pub(super) entries: Vec<Entry>,
}

impl Context {
    pub(super) fn read(root: &Path) -> Result<Context> {
        let ignore = root.join(".dockerignore");
        let matcher = match fs::symlink_metadata(&ignore) {
            Ok(m) if m.is_file() => {
                let text =
                    fs::read_to_string(&ignore).map_err(SandboxError::io("read", &ignore))?;
                Some(dockerignore(root, &text)?)
            }
            _ => None,
        };
        Context::walk(root, matcher.as_ref())
    }

    /// Every entry under `root`, sorted, without following symlinks or crossing mounts.
    pub(super) fn walk(
        root: &Path,
        ignore: Option<&ignore::gitignore::Gitignore>,
    ) -> Result<Context> {
        let dev = fs::symlink_metadata(root).map_err(SandboxError::io("stat", root))?.dev();
        let mut entries = Vec::new();
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            let dir = root.join(&rel);
            let rd = fs::read_dir(&dir).map_err(SandboxError::io("list", &dir))?;
            for e in rd {
                let e = e.map_err(SandboxError::io("list", &dir))?;
                let r = rel.join(e.file_name());
                let m =
                    fs::symlink_metadata(e.path()).map_err(SandboxError::io("stat", e.path()))?;
                if let Some(ig) = ignore {
                    if ig.matched_path_or_any_parents(&r, m.is_dir()).is_ignore() {
                        if m.is_dir() && ig.num_whitelists() > 0 {
                            // An exception pattern may re-include something below.
                            stack.push(r);
                        }
                        continue;
                    }
                }
                let kind = if m.file_type().is_symlink() {
                    EntryKind::Symlink(
                        fs::read_link(e.path()).map_err(SandboxError::io("readlink", e.path()))?,
                    )
                } else if m.is_dir() {
                    if m.dev() == dev {
                        stack.push(r.clone());
                    }
                    EntryKind::Dir
                } else if m.is_file() {
                    EntryKind::File
                } else {
                    continue;
                };
                entries.push(Entry {
                    rel: r,
                    kind,
                    mode: m.mode() & 0o7777,
                    dest_rel: PathBuf::new(),
                    to_dir: false,
                });
                if entries.len() > MAX_ENTRIES {
                    return Err(SandboxError::Invalid(format!(
                        "{} has more than {MAX_ENTRIES} entries; exclude some with .dockerignore",
                        root.display()
                    )));
                }
            }
        }
        entries.sort_by(|a, b| a.rel.cmp(&b.rel));
        Ok(Context { entries })
    }

    /// The entries source `src` names (a path or a pattern), with where each goes.
    pub(super) fn select(&self, src: &str) -> std::result::Result<Vec<Entry>, String> {
        let clean = normalize(&Path::new("/").join(src))
            .ok_or_else(|| format!("source {src:?} climbs out of the context"))?;
        let pattern = src.contains(['*', '?', '[']);
        let mut out = Vec::new();
        let mut roots: Vec<(PathBuf, bool)> = Vec::new(); // (matched path, is dir)
        if clean.as_os_str().is_empty() {
            roots.push((PathBuf::new(), true));
        } else if pattern {
            let mut b = ignore::gitignore::GitignoreBuilder::new("/");
            b.add_line(None, &format!("/{}", clean.display()))
                .map_err(|e| format!("pattern {src:?}: {e}"))?;
            let m = b.build().map_err(|e| format!("pattern {src:?}: {e}"))?;
            for e in &self.entries {
                if m.matched(Path::new("/").join(&e.rel), e.kind == EntryKind::Dir).is_ignore() {
                    roots.push((e.rel.clone(), e.kind == EntryKind::Dir));
                }
            }
        } else {
            match self.entries.iter().find(|e| e.rel == clean) {
                Some(e) => roots.push((e.rel.clone(), e.kind == EntryKind::Dir)),
                None => {
                    return Err(format!(
                        "source {src:?} is not in the build context (missing, excluded by .dockerignore, or under a symlinked directory)"
                    ))
                }
            }
        }
        if roots.is_empty() {
            return Err(format!("no file of the build context matches {src:?}"));
        }
        let multi = pattern && roots.len() > 1;
        for (r, is_dir) in roots {
            if is_dir {
                // A directory's contents go under the destination.
                for e in &self.entries {
                    if let Ok(sub) = e.rel.strip_prefix(&r) {
                        if !sub.as_os_str().is_empty() {
                            out.push(Entry {
                                dest_rel: sub.to_path_buf(),
                                to_dir: false,
                                ..e.clone()
                            });
                        }
                    }
                }
            } else if let Some(e) = self.entries.iter().find(|e| e.rel == r) {
                let name = r.file_name().map(PathBuf::from).unwrap_or_default();
                out.push(Entry { dest_rel: name, to_dir: !multi, ..e.clone() });
            }
        }
        Ok(out)
    }
}

/// `.dockerignore` as a gitignore matcher: each pattern anchored at the context's root, as
/// Docker matches them (`*.log` is the top directory's only; `**/*.log` any).
pub(super) fn dockerignore(root: &Path, text: &str) -> Result<ignore::gitignore::Gitignore> {
    let mut b = ignore::gitignore::GitignoreBuilder::new(root);
    for l in text.lines() {
        let l = l.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let (neg, p) = match l.strip_prefix('!') {
            Some(p) => ("!", p.trim()),
            None => ("", l),
        };
        let p = p.trim_start_matches("./").trim_start_matches('/');
        if p.is_empty() {
            continue;
        }
        b.add_line(None, &format!("{neg}/{p}"))
            .map_err(|e| SandboxError::Invalid(format!(".dockerignore pattern {l:?}: {e}")))?;
    }
    b.build().map_err(|e| SandboxError::Invalid(format!(".dockerignore: {e}")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn dockerignore_is_anchored_and_takes_exceptions() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        for f in ["a.log", "sub/b.log", "sub/keep.txt", "build/x", "build/keep", "src/main.py"] {
            fs::create_dir_all(r.join(f).parent().unwrap()).unwrap();
            fs::write(r.join(f), f).unwrap();
        }
        let m = dockerignore(r, "*.log\nbuild\n!build/keep\n**/keep.txt\n").unwrap();
        let ctx = Context::walk(r, Some(&m)).unwrap();
        let names: Vec<String> =
            ctx.entries.iter().map(|e| e.rel.to_string_lossy().into_owned()).collect();
        assert!(!names.contains(&"a.log".into()), "{names:?}");
        assert!(names.contains(&"sub/b.log".into()), "anchored: {names:?}");
        assert!(!names.contains(&"sub/keep.txt".into()), "{names:?}");
        assert!(!names.contains(&"build/x".into()), "{names:?}");
        assert!(names.contains(&"build/keep".into()), "exception: {names:?}");
        assert!(names.contains(&"src/main.py".into()), "{names:?}");
    }

    #[test]
    fn sources_select_files_dirs_and_patterns_and_never_leave_the_context() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        fs::create_dir_all(r.join("src/pkg")).unwrap();
        fs::write(r.join("src/a.py"), "a").unwrap();
        fs::write(r.join("src/pkg/b.py"), "b").unwrap();
        fs::write(r.join("top.txt"), "t").unwrap();
        std::os::unix::fs::symlink("/etc", r.join("etc-link")).unwrap();
        let ctx = Context::walk(r, None).unwrap();
        let sel = ctx.select("src").unwrap();
        let dests: Vec<_> = sel.iter().map(|e| e.dest_rel.clone()).collect();
        assert!(
            dests.contains(&PathBuf::from("pkg/b.py")) && dests.contains(&PathBuf::from("a.py"))
        );
        let one = ctx.select("./top.txt").unwrap();
        assert_eq!((one.len(), one[0].to_dir), (1, true));
        let pat = ctx.select("src/*.py").unwrap();
        assert_eq!(pat.len(), 1);
        assert!(ctx.select("../x").is_err());
        assert!(ctx.select("etc-link/passwd").is_err(), "never through a symlink");
        let link = ctx.select("etc-link").unwrap();
        assert_eq!(link[0].kind, EntryKind::Symlink(PathBuf::from("/etc")));
    }

    /// A tar of (name, kind, data or link target), names written verbatim.
    fn tar(entries: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o644);
            let body: &[u8] = if *kind == tar::EntryType::Regular { data.as_bytes() } else { b"" };
            h.set_size(body.len() as u64);
            {
                let raw = h.as_old_mut();
                raw.name = [0; 100];
                raw.name[..name.len()].copy_from_slice(name.as_bytes());
                if *kind != tar::EntryType::Regular {
                    raw.linkname = [0; 100];
                    raw.linkname[..data.len()].copy_from_slice(data.as_bytes());
                }
            }
            h.set_cksum();
            b.append(&h, body).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn archives_unpack_inside_the_tree_only() {
        use tar::EntryType as T;
        let d = tempfile::tempdir().unwrap();
        let host = d.path().join("host");
        fs::create_dir_all(&host).unwrap();
        let tree_dir = d.path().join("tree");
        fs::create_dir_all(&tree_dir).unwrap();
        let tree = InRoot::open(&tree_dir).unwrap();
        // A link to `/`, then a write through it: `/` is the tree's.
        let ok = tar(&[
            ("esc", T::Symlink, "/"),
            ("esc/through", T::Regular, "x"),
            ("a/f", T::Regular, "data"),
            ("a/hl", T::Link, "a/f"),
        ]);
        let f = d.path().join("ok.tar");
        fs::write(&f, ok).unwrap();
        unpack_into(&tree, Path::new("opt"), fs::File::open(&f).unwrap()).unwrap();
        assert_eq!(fs::read_to_string(tree_dir.join("through")).unwrap(), "x");
        assert_eq!(fs::read_to_string(tree_dir.join("opt/a/hl")).unwrap(), "data");
        // A link to the host's directory: a write through it never reaches the host (the path
        // resolves inside the tree, where it does not exist).
        let out = tar(&[("out", T::Symlink, host.to_str().unwrap()), ("out/x", T::Regular, "x")]);
        fs::write(&f, out).unwrap();
        let _ = unpack_into(&tree, Path::new("opt"), fs::File::open(&f).unwrap());
        assert!(!host.join("x").exists(), "written through a link out of the tree");
        // Entries climbing out of the destination, and hard links to what is not there.
        for bad in [
            tar(&[("../../x", T::Regular, "x")]),
            tar(&[("x", T::Link, "../../etc/passwd")]),
            tar(&[("x", T::Link, "missing")]),
        ] {
            fs::write(&f, bad).unwrap();
            assert!(unpack_into(&tree, Path::new("opt"), fs::File::open(&f).unwrap()).is_err());
        }
        assert!(!d.path().join("x").exists());
    }

    #[test]
    fn normalize_stays_under_the_root() {
        assert_eq!(normalize(Path::new("/a/./b/../c")), Some(PathBuf::from("a/c")));
        assert_eq!(normalize(Path::new("/..")), None);
    }
}
