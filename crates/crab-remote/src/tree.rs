//! File trees into blobs and back: a directory walked into content-defined chunks (FastCDC)
//! and one tree blob per directory (so an unchanged subtree is one known id), and a tree
//! materialized into an empty directory, checking every name, size and hash on the way.
//!
//! Export skips rereading files whose (path, inode, size, mtime, ctime) match an earlier
//! export in this process: btrfs snapshots of one subvolume keep inode numbers, so a file
//! the sandbox did not touch since its image or its previous point is not read again.
//!
//! Hard links are carried: a file whose inode an earlier entry of the walk already had names
//! that entry's path (`link_hex`), and the restore links it to the file it restored there
//! (resolved beneath the tree's root, no symlink followed, a regular file). Extended
//! attributes are carried in the `user.` namespace only, within size caps; `security.*`
//! (file capabilities, SELinux labels), `trusted.*` and `system.*` (ACLs) are neither exported
//! nor accepted from the remote — a point from the remote must not be able to grant a binary
//! capabilities or label it for the host's policy. Not carried: sockets. Device nodes come back only for the harmless
//! character devices a root file system ships (`null`, `zero`, `full`, `random`, `urandom`,
//! `tty`, `console`, `ptmx`); others are skipped with a warning.

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{RemoteError, Result};
use crate::format::{
    BlobKind, Content, Entry, EntryKind, Tree, Xattr, XATTR_MAX_COUNT, XATTR_MAX_NAME,
    XATTR_MAX_TOTAL, XATTR_MAX_VALUE, XATTR_PREFIX,
};
use crate::id::Id;
use crate::repo::{Fetcher, Packer, Repo};

/// Most tree ids a point record names for its restore to fetch at once
/// ([`crate::format::PointRecord::walk`]; ≈ 70 bytes each in the record).
pub const WALK_HINT_MAX: usize = 1024;

/// Cache key of a file's content.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FileKey {
    pub(crate) rel: PathBuf,
    pub(crate) ino: u64,
    pub(crate) size: u64,
    pub(crate) mtime_ns: i64,
    pub(crate) ctime_ns: i64,
}

/// What an export read and stored.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct TreeStats {
    /// Entries walked.
    pub entries: u64,
    /// Bytes of file content in the tree.
    pub logical_bytes: u64,
    /// Bytes actually read (files not found in the cache).
    pub read_bytes: u64,
}

fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    m.mtime().saturating_mul(1_000_000_000).saturating_add(m.mtime_nsec())
}

const SAFE_CHAR_DEVICES: &[(u64, u64)] =
    &[(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 1), (5, 2)];

fn dev_major_minor(rdev: u64) -> (u64, u64) {
    (libc::major(rdev) as u64, libc::minor(rdev) as u64)
}

/// A directory being restored: its path, entries, next index, its own entry (applied once
/// its children are done) and its tree id.
type RestoreFrame = (PathBuf, Vec<Entry>, usize, Option<Entry>, Id);

/// Decoded bytes of file content a restore downloads per step, ahead of its writes.
pub const FEED_WINDOW: u64 = 16 << 20;
/// Steps downloaded ahead of the one being written.
const FEED_AHEAD: usize = 3;

/// The file content of one tree restore, downloaded by a task of its own a few windows
/// ahead of the writes (which wait only for the window they need), each blob forgotten once
/// its last file is written: download and writes overlap, and memory stays a few windows.
struct Feed {
    /// Per chunk of the writes, in their order: its id and the window that fetches it.
    order: Vec<(Id, usize)>,
    /// Position of each fetched id's last use (then it is forgotten).
    last_use: HashMap<Id, usize>,
    /// Next position the writes consume.
    cursor: usize,
    /// Windows downloaded (`usize::MAX`: the download failed).
    ready: tokio::sync::watch::Receiver<usize>,
    /// The newest window the writes waited for (the download stays `FEED_AHEAD` ahead).
    writing: tokio::sync::watch::Sender<usize>,
    failed: std::sync::Arc<std::sync::Mutex<Option<RemoteError>>>,
    fetcher: Fetcher,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Feed {
    /// Wait until the next `n` chunks of the writes are downloaded.
    async fn want(&mut self, n: usize) -> Result<()> {
        let end = (self.cursor + n).min(self.order.len());
        let Some(need) = self.order[self.cursor..end].iter().map(|(_, w)| *w).max() else {
            return Ok(());
        };
        // The download keeps `FEED_AHEAD` windows beyond the one needed now (a file larger
        // than a window needs several at once).
        self.writing.send_if_modified(|w| {
            let moved = *w < need;
            *w = (*w).max(need);
            moved
        });
        let got = self.ready.wait_for(|r| *r > need).await.map(|r| *r);
        if matches!(got, Ok(r) if r != usize::MAX) {
            return Ok(());
        }
        let err = crab_common::sync::lock(&self.failed).take();
        Err(err.unwrap_or_else(|| RemoteError::Io {
            op: "download file content",
            path: PathBuf::new(),
            source: std::io::Error::other("the download task ended early"),
        }))
    }

    /// The next `n` chunks were written: forget those no later file reads.
    fn took(&mut self, n: usize) {
        let end = (self.cursor + n).min(self.order.len());
        for p in self.cursor..end {
            let id = self.order[p].0;
            if self.last_use.get(&id) == Some(&p) {
                self.fetcher.forget(&id);
            }
        }
        self.cursor = end;
    }
}

struct ExportFrame {
    abs: PathBuf,
    rel: PathBuf,
    names: Vec<Vec<u8>>,
    next: usize,
    out: Vec<Entry>,
    /// The entry describing this directory in its parent (None for the root).
    entry: Option<Entry>,
}

fn list_dir(abs: &Path) -> Result<Vec<Vec<u8>>> {
    let mut names = Vec::new();
    for de in std::fs::read_dir(abs).map_err(RemoteError::io("read directory", abs))? {
        let de = de.map_err(RemoteError::io("read directory", abs))?;
        names.push(de.file_name().as_bytes().to_vec());
    }
    names.sort();
    Ok(names)
}

fn base_entry(kind: EntryKind, m: &std::fs::Metadata) -> Entry {
    Entry {
        name: None,
        name_hex: None,
        kind,
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        mtime_ns: mtime_ns(m),
        content: None,
        subtree: None,
        target_hex: None,
        rdev: None,
        xattrs: None,
        link_hex: None,
    }
}

/// The `user.*` extended attributes of `path` (not following a symlink), sorted; those over
/// the caps are left out with a warning.
fn read_xattrs(path: &Path) -> Result<Option<Vec<Xattr>>> {
    let names = match xattr::list(path) {
        Ok(n) => n,
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(None),
        Err(e) => return Err(RemoteError::Io { op: "listxattr", path: path.into(), source: e }),
    };
    let mut out = Vec::new();
    let mut total = 0;
    for n in names {
        let Some(name) = n.to_str().filter(|n| n.starts_with(XATTR_PREFIX)) else { continue };
        let Some(value) = xattr::get(path, name).map_err(|e| RemoteError::Io {
            op: "getxattr",
            path: path.into(),
            source: e,
        })?
        else {
            continue;
        };
        total += value.len();
        if name.len() > XATTR_MAX_NAME
            || value.len() > XATTR_MAX_VALUE
            || total > XATTR_MAX_TOTAL
            || out.len() == XATTR_MAX_COUNT
        {
            tracing::warn!(path = %path.display(), name, "extended attribute over the caps; not exported");
            continue;
        }
        out.push(Xattr { name: name.to_string(), value_hex: hex::encode(&value) });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((!out.is_empty()).then_some(out))
}

/// Check `e`'s extended attributes against the rules (namespace, caps, no duplicates).
fn checked_xattrs(e: &Entry, what: &str) -> Result<Vec<(String, Vec<u8>)>> {
    let Some(list) = &e.xattrs else { return Ok(Vec::new()) };
    if list.len() > XATTR_MAX_COUNT {
        return Err(RemoteError::corrupt(what, format!("{} extended attributes", list.len())));
    }
    let mut out: Vec<(String, Vec<u8>)> = Vec::with_capacity(list.len());
    let mut total = 0;
    for x in list {
        let value = hex::decode(&x.value_hex).map_err(|_| {
            RemoteError::corrupt(what, format!("extended attribute {:?} is not hex", x.name))
        })?;
        total += value.len();
        if !x.name.starts_with(XATTR_PREFIX)
            || x.name.len() == XATTR_PREFIX.len()
            || x.name.len() > XATTR_MAX_NAME
            || x.name.contains('\0')
        {
            return Err(RemoteError::corrupt(
                what,
                format!(
                    "extended attribute name {:?} is not user.* (the only namespace carried)",
                    x.name
                ),
            ));
        }
        if value.len() > XATTR_MAX_VALUE || total > XATTR_MAX_TOTAL {
            return Err(RemoteError::corrupt(what, "extended attributes over the size caps"));
        }
        if out.iter().any(|(n, _)| *n == x.name) {
            return Err(RemoteError::corrupt(
                what,
                format!("duplicate extended attribute {:?}", x.name),
            ));
        }
        out.push((x.name.clone(), value));
    }
    Ok(out)
}

/// Make `path`'s `user.*` extended attributes exactly `e`'s (others are left alone).
fn sync_xattrs(path: &Path, e: &Entry) -> Result<()> {
    let want = checked_xattrs(e, &path.display().to_string())?;
    let have = match xattr::list(path) {
        Ok(n) => n.collect::<Vec<_>>(),
        Err(err) if err.raw_os_error() == Some(libc::EOPNOTSUPP) && want.is_empty() => Vec::new(),
        Err(err) => {
            return Err(RemoteError::Io { op: "listxattr", path: path.into(), source: err })
        }
    };
    for n in have {
        let Some(name) = n.to_str().filter(|n| n.starts_with(XATTR_PREFIX)) else { continue };
        if !want.iter().any(|(w, _)| w == name) {
            xattr::remove(path, name).map_err(|err| RemoteError::Io {
                op: "removexattr",
                path: path.into(),
                source: err,
            })?;
        }
    }
    for (name, value) in &want {
        xattr::set(path, name, value).map_err(|err| RemoteError::Io {
            op: "setxattr",
            path: path.into(),
            source: err,
        })?;
    }
    Ok(())
}

/// The file an entry's `link_hex` names: beneath `root`, every component a plain name, every
/// directory on the way a real directory (no symlink followed), the file a regular file.
fn link_target(root: &Path, e: &Entry, object: &str) -> Result<PathBuf> {
    let hexed = e.link_hex.as_deref().unwrap_or_default();
    let rel = hex::decode(hexed)
        .map_err(|_| RemoteError::corrupt(object, "hard link path is not hex"))?;
    let bad = |why: &str| {
        RemoteError::corrupt(
            object,
            format!("hard link to {:?}: {why}", String::from_utf8_lossy(&rel)),
        )
    };
    let comps: Vec<&[u8]> = rel.split(|&b| b == b'/').collect();
    let mut p = root.to_path_buf();
    for (i, c) in comps.iter().enumerate() {
        if c.is_empty() || *c == b"." || *c == b".." || c.contains(&0) {
            return Err(bad("not a plain relative path"));
        }
        p.push(OsStr::from_bytes(c));
        let m =
            std::fs::symlink_metadata(&p).map_err(|_| bad("no such file restored before it"))?;
        let last = i + 1 == comps.len();
        if (!last && !m.is_dir()) || (last && !m.is_file()) {
            return Err(bad("not a regular file beneath the tree's root"));
        }
    }
    Ok(p)
}

impl Repo {
    /// Store the tree rooted at `root`; returns the root tree's id.
    pub(crate) async fn export_tree(
        &self,
        packer: &mut Packer<'_>,
        root: &Path,
        stats: &mut TreeStats,
    ) -> Result<Id> {
        // (dev, inode) of files with more than one name → the first name's path and content.
        let mut links: HashMap<(u64, u64), (PathBuf, Content)> = HashMap::new();
        let mut stack = vec![ExportFrame {
            abs: root.to_path_buf(),
            rel: PathBuf::new(),
            names: list_dir(root)?,
            next: 0,
            out: Vec::new(),
            entry: None,
        }];
        loop {
            let Some(top) = stack.last_mut() else {
                return Err(RemoteError::corrupt(root.display().to_string(), "empty walk"));
            };
            if top.next == top.names.len() {
                let Some(done) = stack.pop() else { continue };
                let tree = Tree { entries: done.out };
                let json = serde_json::to_vec(&tree).map_err(|e| {
                    RemoteError::corrupt(done.abs.display().to_string(), e.to_string())
                })?;
                let id = packer.add(BlobKind::Tree, &json).await?;
                match (stack.last_mut(), done.entry) {
                    (Some(parent), Some(mut entry)) => {
                        entry.subtree = Some(id);
                        parent.out.push(entry);
                    }
                    _ => return Ok(id),
                }
                continue;
            }
            let name = top.names[top.next].clone();
            top.next += 1;
            let abs = top.abs.join(OsStr::from_bytes(&name));
            let rel = top.rel.join(OsStr::from_bytes(&name));
            let m = match std::fs::symlink_metadata(&abs) {
                Ok(m) => m,
                // Only a live tree changes under us; snapshots do not.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(RemoteError::Io { op: "stat", path: abs, source: e }),
            };
            stats.entries += 1;
            let ft = m.file_type();
            use std::os::unix::fs::FileTypeExt;
            let mut entry = if ft.is_dir() {
                let mut e = base_entry(EntryKind::Dir, &m);
                e.set_name(&name);
                e.xattrs = read_xattrs(&abs)?;
                let names = list_dir(&abs)?;
                stack.push(ExportFrame {
                    abs,
                    rel,
                    names,
                    next: 0,
                    out: Vec::new(),
                    entry: Some(e),
                });
                continue;
            } else if ft.is_file() {
                let mut e = base_entry(EntryKind::File, &m);
                let key = (m.dev(), m.ino());
                match links.get(&key).filter(|_| m.nlink() > 1) {
                    Some((first, c)) => {
                        e.link_hex = Some(hex::encode(first.as_os_str().as_bytes()));
                        e.content = Some(c.clone());
                    }
                    None => {
                        let c = self.export_file(packer, &abs, rel.clone(), &m, stats).await?;
                        if m.nlink() > 1 {
                            links.insert(key, (rel, c.clone()));
                        }
                        e.content = Some(c);
                    }
                }
                e.xattrs = read_xattrs(&abs)?;
                e
            } else if ft.is_symlink() {
                let target = std::fs::read_link(&abs).map_err(RemoteError::io("readlink", &abs))?;
                let mut e = base_entry(EntryKind::Symlink, &m);
                e.target_hex = Some(hex::encode(target.as_os_str().as_bytes()));
                e
            } else if ft.is_char_device() || ft.is_block_device() {
                let kind = if ft.is_char_device() { EntryKind::Char } else { EntryKind::Block };
                let mut e = base_entry(kind, &m);
                e.rdev = Some(m.rdev());
                e
            } else if ft.is_fifo() {
                let mut e = base_entry(EntryKind::Fifo, &m);
                e.xattrs = read_xattrs(&abs)?;
                e
            } else {
                tracing::debug!(path = %abs.display(), "not exporting a socket");
                continue;
            };
            entry.set_name(&name);
            if let Some(top) = stack.last_mut() {
                top.out.push(entry);
            }
        }
    }

    /// The id the tree at `dir` has in this repository (whether stored or not); reads and
    /// hashes every file, stores nothing.
    pub async fn local_tree_id(&self, dir: &Path) -> Result<Id> {
        let mut packer = Packer::dry(self);
        let mut stats = TreeStats::default();
        self.export_tree(&mut packer, dir, &mut stats).await
    }

    async fn export_file(
        &self,
        packer: &mut Packer<'_>,
        abs: &Path,
        rel: PathBuf,
        m: &std::fs::Metadata,
        stats: &mut TreeStats,
    ) -> Result<Content> {
        stats.logical_bytes += m.len();
        let key = FileKey {
            rel,
            ino: m.ino(),
            size: m.len(),
            mtime_ns: mtime_ns(m),
            ctime_ns: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
        };
        let hit = self.file_cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key).cloned();
        if let Some(c) = hit {
            if c.chunks.iter().all(|id| packer.has(id)) {
                packer.dedup_blobs += c.chunks.len() as u64;
                return Ok(c);
            }
        }
        packer.pause_point().await;
        let content = self.export_reader(packer, abs, stats).await?;
        if content.size != m.len() {
            tracing::debug!(path = %abs.display(), "file changed while it was exported");
        } else {
            self.file_cache.lock().unwrap_or_else(|p| p.into_inner()).insert(key, content.clone());
            self.cache_dirty.store(true, std::sync::atomic::Ordering::Release);
        }
        Ok(content)
    }

    /// Chunk the file at `abs` into data blobs.
    pub(crate) async fn export_reader(
        &self,
        packer: &mut Packer<'_>,
        abs: &Path,
        stats: &mut TreeStats,
    ) -> Result<Content> {
        let f = std::fs::File::open(abs).map_err(RemoteError::io("open", abs))?;
        let p = self.config.chunker;
        let mut content = Content::default();
        for chunk in
            fastcdc::v2020::StreamCDC::new(f, p.min as usize, p.avg as usize, p.max as usize)
        {
            let chunk = chunk.map_err(|e| RemoteError::Io {
                op: "read",
                path: abs.to_path_buf(),
                source: std::io::Error::other(e.to_string()),
            })?;
            stats.read_bytes += chunk.length as u64;
            content.size += chunk.length as u64;
            content.chunks.push(packer.add(BlobKind::Data, &chunk.data).await?);
        }
        Ok(content)
    }

    /// Chunk bytes held in memory.
    pub(crate) async fn export_bytes(
        &self,
        packer: &mut Packer<'_>,
        data: &[u8],
    ) -> Result<Content> {
        let p = self.config.chunker;
        let mut content = Content { size: data.len() as u64, chunks: Vec::new() };
        for c in fastcdc::v2020::FastCDC::new(data, p.min as usize, p.avg as usize, p.max as usize)
        {
            content
                .chunks
                .push(packer.add(BlobKind::Data, &data[c.offset..c.offset + c.length]).await?);
        }
        Ok(content)
    }

    /// Check a content's declared size against its chunks' sizes in the index.
    fn check_content(&self, c: &Content, what: &str) -> Result<()> {
        let mut sum = 0u64;
        for id in &c.chunks {
            let e = self.lookup(id).ok_or_else(|| RemoteError::Missing {
                object: format!("blob {id}"),
                what: what.to_string(),
            })?;
            sum += e.raw_length;
        }
        if sum != c.size {
            return Err(RemoteError::corrupt(
                what,
                format!("size {} but its chunks hold {sum} bytes", c.size),
            ));
        }
        Ok(())
    }

    /// Read a content into memory (verified).
    pub(crate) async fn read_content(&self, c: &Content, what: &str) -> Result<Vec<u8>> {
        self.check_content(c, what)?;
        self.prefetch(&c.chunks, what).await?;
        let mut out = Vec::with_capacity(c.size as usize);
        for id in &c.chunks {
            out.extend_from_slice(&self.blob(id, what).await?);
        }
        Ok(out)
    }

    pub(crate) async fn tree(&self, id: &Id, what: &str) -> Result<Tree> {
        let bytes = self.blob(id, what).await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| RemoteError::corrupt(format!("tree {id}"), format!("JSON: {e}")))
    }

    /// Every blob a tree references (its trees and data), fetching tree blobs level by level.
    pub(crate) async fn tree_blobs(&self, root: &Id, what: &str) -> Result<(Vec<Id>, Vec<Id>)> {
        let mut trees = vec![*root];
        let mut data = Vec::new();
        let mut level = vec![*root];
        let mut seen: HashSet<Id> = HashSet::from([*root]);
        while !level.is_empty() {
            self.prefetch(&level, what).await?;
            let mut next = Vec::new();
            for id in &level {
                for e in self.tree(id, what).await?.entries {
                    if let Some(s) = e.subtree {
                        if seen.insert(s) {
                            next.push(s);
                            trees.push(s);
                        }
                    }
                    if let Some(c) = e.content {
                        data.extend(c.chunks);
                    }
                }
            }
            level = next;
        }
        Ok((trees, data))
    }

    /// The file bytes materializing tree `root` writes, from its *declared* sizes (file
    /// contents; a hard link's name writes none): read from the tree objects only, before
    /// anything is written. A subtree referenced by several entries counts once per reference
    /// (each is written), computed once per id; sums saturate.
    pub(crate) async fn tree_write_bytes(&self, root: &Id, what: &str) -> Result<u64> {
        Ok(self.tree_walk(root, what).await?.0)
    }

    /// [`Repo::tree_write_bytes`], and the tree objects it read (level by level).
    async fn tree_walk(&self, root: &Id, what: &str) -> Result<(u64, Vec<Id>)> {
        // Fetch every tree object level by level (one prefetch per level).
        let (trees, _) = self.tree_blobs(root, what).await?;
        let mut memo: HashMap<Id, u64> = HashMap::new();
        // (tree, its entries, next entry, bytes so far)
        let mut stack: Vec<(Id, Vec<Entry>, usize, u64)> =
            vec![(*root, self.tree(root, what).await?.entries, 0, 0)];
        let mut open: HashSet<Id> = HashSet::from([*root]);
        while let Some(top) = stack.last_mut() {
            if top.2 == top.1.len() {
                let (id, total) = (top.0, top.3);
                stack.pop();
                open.remove(&id);
                memo.insert(id, total);
                if let Some(parent) = stack.last_mut() {
                    parent.3 = parent.3.saturating_add(total);
                }
                continue;
            }
            let e = &top.1[top.2];
            top.2 += 1;
            let (id, sub) = (top.0, e.subtree.filter(|_| e.kind == EntryKind::Dir));
            let file = match (e.kind, &e.content, &e.link_hex) {
                (EntryKind::File, Some(c), None) => c.size,
                _ => 0,
            };
            top.3 = top.3.saturating_add(file);
            let Some(sub) = sub else { continue };
            if let Some(n) = memo.get(&sub) {
                top.3 = top.3.saturating_add(*n);
            } else if !open.insert(sub) {
                return Err(RemoteError::corrupt(format!("tree {id}"), "a tree contains itself"));
            } else {
                let entries = self.tree(&sub, what).await?.entries;
                stack.push((sub, entries, 0, 0));
            }
        }
        Ok((memo.get(root).copied().unwrap_or(0), trees))
    }

    /// [`Repo::tree_write_bytes`] of turning a copy of tree `base` into tree `target` (what
    /// [`Repo::patch_tree`] writes): subtrees with equal ids and files with equal content
    /// write nothing; new directories count whole.
    pub(crate) async fn patch_write_bytes(
        &self,
        base: &Id,
        target: &Id,
        what: &str,
    ) -> Result<u64> {
        Ok(self.patch_walk(base, target, what).await?.0)
    }

    /// The tree objects [`Repo::patch_tree`] from `base` to `target` reads, top levels
    /// first, at most [`WALK_HINT_MAX`]: an exporter records them in the point
    /// ([`crate::format::PointRecord::walk`]) so that a restore fetches them at once instead
    /// of one round trip per level.
    pub(crate) async fn walk_hint(&self, base: &Id, target: &Id, what: &str) -> Result<Vec<Id>> {
        let mut trees = self.patch_walk(base, target, what).await?.1;
        trees.truncate(WALK_HINT_MAX);
        Ok(trees)
    }

    /// [`Repo::patch_write_bytes`], and the tree objects it read: both sides of every level
    /// that differs, level by level, then every tree of the directories `base` lacks.
    async fn patch_walk(&self, base: &Id, target: &Id, what: &str) -> Result<(u64, Vec<Id>)> {
        let mut total = 0u64;
        let mut read: Vec<Id> = Vec::new();
        let mut whole: Vec<Id> = Vec::new();
        let mut level = vec![(*base, *target)];
        while !level.is_empty() {
            level.retain(|(b, t)| b != t);
            let ids: Vec<Id> = level.iter().flat_map(|(b, t)| [*b, *t]).collect();
            self.prefetch(&ids, what).await?;
            read.extend_from_slice(&ids);
            let mut next = Vec::new();
            for (b, t) in std::mem::take(&mut level) {
                let (old, new) = (self.tree(&b, what).await?, self.tree(&t, what).await?);
                let old_obj = format!("tree {b}");
                let mut old_by: HashMap<Vec<u8>, Entry> = HashMap::new();
                for o in old.entries {
                    old_by.insert(o.name_bytes(&old_obj)?, o);
                }
                let object = format!("tree {t}");
                for e in new.entries {
                    let old = old_by.remove(&e.name_bytes(&object)?);
                    match (old, e.kind, e.subtree) {
                        (Some(o), EntryKind::Dir, Some(ns)) if o.kind == EntryKind::Dir => {
                            if let Some(os) = o.subtree {
                                next.push((os, ns));
                            }
                        }
                        (_, EntryKind::Dir, Some(ns)) => {
                            let (n, trees) = self.tree_walk(&ns, what).await?;
                            total = total.saturating_add(n);
                            whole.extend(trees);
                        }
                        (Some(o), EntryKind::File, _)
                            if o.kind == EntryKind::File
                                && o.content == e.content
                                && o.link_hex == e.link_hex => {}
                        (_, EntryKind::File, _) if e.link_hex.is_none() => {
                            total = total.saturating_add(e.content.as_ref().map_or(0, |c| c.size));
                        }
                        _ => {}
                    }
                }
            }
            level = next;
        }
        let mut seen = HashSet::new();
        read.extend(whole);
        read.retain(|id| seen.insert(*id));
        Ok((total, read))
    }

    /// Create the non-directory entry `e` at `path` (which must not exist) and apply its
    /// metadata; device nodes other than the harmless character devices are skipped.
    async fn create_leaf(
        &self,
        path: &Path,
        e: &Entry,
        object: &str,
        what: &str,
        links_root: &Path,
        stats: &mut TreeStats,
    ) -> Result<()> {
        let path = path.to_path_buf();
        if e.kind == EntryKind::File && e.link_hex.is_some() {
            let target = link_target(links_root, e, object)?;
            let size = std::fs::symlink_metadata(&target).map(|m| m.len()).ok();
            if size != e.content.as_ref().map(|c| c.size) {
                return Err(RemoteError::corrupt(object, "a hard link's size is not its file's"));
            }
            // One inode: its metadata is the first name's, already applied.
            return std::fs::hard_link(&target, &path).map_err(RemoteError::io("link", &path));
        }
        match e.kind {
            EntryKind::Dir => {
                return Err(RemoteError::corrupt(object, "a directory is not a leaf"))
            }
            EntryKind::File => {
                let c = e
                    .content
                    .as_ref()
                    .ok_or_else(|| RemoteError::corrupt(object, "file without content"))?;
                self.check_content(c, &format!("{what}: {}", path.display()))?;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .map_err(RemoteError::io("create", &path))?;
                for id in &c.chunks {
                    let data = self.blob(id, what).await?;
                    f.write_all(&data).map_err(RemoteError::io("write", &path))?;
                }
                stats.logical_bytes += c.size;
            }
            EntryKind::Symlink => {
                let t = e
                    .target_hex
                    .as_deref()
                    .ok_or_else(|| RemoteError::corrupt(object, "symlink without target"))?;
                let t = hex::decode(t)
                    .map_err(|_| RemoteError::corrupt(object, "symlink target is not hex"))?;
                if t.is_empty() || t.contains(&0) {
                    return Err(RemoteError::corrupt(object, "bad symlink target"));
                }
                std::os::unix::fs::symlink(OsStr::from_bytes(&t), &path)
                    .map_err(RemoteError::io("symlink", &path))?;
            }
            EntryKind::Char | EntryKind::Block => {
                let rdev =
                    e.rdev.ok_or_else(|| RemoteError::corrupt(object, "device without rdev"))?;
                if e.kind == EntryKind::Block || !SAFE_CHAR_DEVICES.contains(&dev_major_minor(rdev))
                {
                    tracing::warn!(path = %path.display(), rdev, "not restoring a device node from the remote");
                    return Ok(());
                }
                mknod(&path, libc::S_IFCHR | (e.mode & 0o777), rdev)?;
            }
            EntryKind::Fifo => mknod(&path, libc::S_IFIFO | (e.mode & 0o777), 0)?,
        }
        apply_meta(&path, e)
    }

    /// Turn `dest`, a writable copy of tree `base` (a snapshot of a local image whose tree id
    /// is `base`), into tree `target`: subtrees with equal ids are not even read, entries
    /// equal in both are left alone, only what differs is downloaded and written; what
    /// `target` lacks is removed. Names are validated as in [`Repo::restore_tree`].
    pub(crate) async fn patch_tree(
        &self,
        base: &Id,
        target: &Id,
        dest: &Path,
        what: &str,
    ) -> Result<TreeStats> {
        let mut stats = TreeStats::default();
        let mut removes: Vec<PathBuf> = Vec::new();
        // New leaves and whole new directories (with their tree object's name, for errors).
        let mut creates: Vec<(PathBuf, Entry, String)> = Vec::new();
        // Entries whose metadata is (re)applied at the end, children before parents.
        let mut metas: Vec<(PathBuf, Entry)> = Vec::new();
        let mut data: Vec<Id> = Vec::new();
        // Level by level, each level's tree objects fetched in one prefetch.
        let mut level = vec![(dest.to_path_buf(), *base, *target)];
        let mut stack = Vec::new();
        while !level.is_empty() {
            level.retain(|(_, b, t)| b != t);
            let ids: Vec<Id> = level.iter().flat_map(|(_, b, t)| [*b, *t]).collect();
            self.prefetch(&ids, what).await?;
            for (dir, b, t) in std::mem::take(&mut level) {
                let (old, new) = (self.tree(&b, what).await?, self.tree(&t, what).await?);
                let (old_obj, object) = (format!("tree {b}"), format!("tree {t}"));
                let mut old_by: HashMap<Vec<u8>, Entry> = HashMap::new();
                for o in old.entries {
                    old_by.insert(o.name_bytes(&old_obj)?, o);
                }
                let mut seen: HashSet<Vec<u8>> = HashSet::new();
                for e in new.entries {
                    let name = e.name_bytes(&object)?;
                    first_of_name(&mut seen, &name, &object)?;
                    let path = dir.join(OsStr::from_bytes(&name));
                    stats.entries += 1;
                    let old = old_by.remove(&name);
                    match old {
                        Some(o) if o.kind == EntryKind::Dir && e.kind == EntryKind::Dir => {
                            let (Some(os), Some(ns)) = (o.subtree, e.subtree) else {
                                return Err(RemoteError::corrupt(
                                    object,
                                    "directory without subtree",
                                ));
                            };
                            if os != ns || o != e {
                                stack.push((path.clone(), os, ns));
                                metas.push((path, e));
                            }
                        }
                        Some(o) if o == e => {}
                        Some(o)
                            if o.kind == EntryKind::File
                                && e.kind == EntryKind::File
                                && o.content == e.content
                                && o.link_hex == e.link_hex =>
                        {
                            metas.push((path, e))
                        }
                        other => {
                            if other.is_some() {
                                removes.push(path.clone());
                            }
                            if let (Some(c), None) = (&e.content, &e.link_hex) {
                                data.extend_from_slice(&c.chunks);
                            }
                            creates.push((path, e, object.clone()));
                        }
                    }
                }
                removes.extend(old_by.into_keys().map(|n| dir.join(OsStr::from_bytes(&n))));
            }
            level = std::mem::take(&mut stack);
        }
        for path in &removes {
            let res = match std::fs::symlink_metadata(path) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
                Ok(_) => std::fs::remove_file(path),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            };
            res.map_err(RemoteError::io("remove", path))?;
        }
        self.prefetch(&data, what).await?;
        // In the export's walk order (a hard link's file comes before it), hard links last:
        // the files they name are in place by then.
        creates.sort_by(|a, b| a.0.cmp(&b.0));
        let (links, creates): (Vec<_>, Vec<_>) =
            creates.into_iter().partition(|(_, e, _)| e.link_hex.is_some());
        for (path, e, object) in creates.into_iter().chain(links) {
            if e.kind == EntryKind::Dir {
                let sub = e
                    .subtree
                    .ok_or_else(|| RemoteError::corrupt(&object, "directory without subtree"))?;
                std::fs::create_dir(&path).map_err(RemoteError::io("mkdir", &path))?;
                let s = self.restore_tree_in(&sub, &path, dest, what).await?;
                stats.logical_bytes += s.logical_bytes;
                apply_meta(&path, &e)?;
            } else {
                self.create_leaf(&path, &e, &object, what, dest, &mut stats).await?;
            }
        }
        for (path, e) in metas.iter().rev() {
            apply_meta(path, e)?;
        }
        Ok(stats)
    }

    /// The content chunks restoring tree `root` writes, in the order it writes them (the walk
    /// of [`Repo::restore_tree_in`]; its trees are local by then).
    async fn data_in_write_order(&self, root: &Id, what: &str) -> Result<Vec<Id>> {
        let mut out = Vec::new();
        let mut stack: Vec<(Id, Vec<Entry>, usize)> =
            vec![(*root, self.tree(root, what).await?.entries, 0)];
        let mut open: HashSet<Id> = HashSet::from([*root]);
        while let Some((id, entries, next)) = stack.last_mut() {
            let Some(e) = entries.get(*next) else {
                open.remove(id);
                stack.pop();
                continue;
            };
            *next += 1;
            match (e.kind, &e.content, &e.link_hex, e.subtree) {
                (EntryKind::Dir, _, _, Some(sub)) => {
                    if !open.insert(sub) {
                        return Err(RemoteError::corrupt(
                            format!("tree {id}"),
                            "a tree contains itself",
                        ));
                    }
                    let children = self.tree(&sub, what).await?.entries;
                    stack.push((sub, children, 0));
                }
                (EntryKind::File, Some(c), None, _) => out.extend_from_slice(&c.chunks),
                _ => {}
            }
        }
        Ok(out)
    }

    /// Start downloading `order` (chunks in write order) in windows of [`FEED_WINDOW`]
    /// decoded bytes, skipping what memory or the cache holds.
    fn feed(&self, order: Vec<Id>, what: &str) -> Result<Feed> {
        let mut first: HashMap<Id, usize> = HashMap::new();
        let mut windows: Vec<Vec<Id>> = vec![Vec::new()];
        let mut bytes = 0u64;
        let mut tagged = Vec::with_capacity(order.len());
        for id in order {
            let w = match first.get(&id) {
                Some(w) => *w,
                None => {
                    let len = self.lookup(&id).map_or(0, |e| e.raw_length);
                    if bytes > 0 && bytes.saturating_add(len) > FEED_WINDOW {
                        windows.push(Vec::new());
                        bytes = 0;
                    }
                    bytes = bytes.saturating_add(len);
                    let w = windows.len() - 1;
                    windows[w].push(id);
                    first.insert(id, w);
                    w
                }
            };
            tagged.push((id, w));
        }
        let mut fetched: HashSet<Id> = HashSet::new();
        let mut steps = Vec::with_capacity(windows.len());
        for ids in &windows {
            let runs = self.runs(ids, crate::repo::PREFETCH_GAP, what)?;
            fetched.extend(runs.iter().flat_map(|(_, es)| es.iter().map(|e| e.id)));
            steps.push(runs);
        }
        let last_use: HashMap<Id, usize> = tagged
            .iter()
            .enumerate()
            .filter(|(_, (id, _))| fetched.contains(id))
            .map(|(p, (id, _))| (*id, p))
            .collect();
        let (ready_tx, ready) = tokio::sync::watch::channel(0usize);
        let (writing, mut writing_rx) = tokio::sync::watch::channel(0usize);
        let failed = std::sync::Arc::new(std::sync::Mutex::new(None));
        let fetcher = self.fetcher().clone();
        let (f, fail, what) = (fetcher.clone(), failed.clone(), what.to_string());
        let task = tokio::spawn(async move {
            for (k, runs) in steps.into_iter().enumerate() {
                if writing_rx.wait_for(|w| k < w + FEED_AHEAD).await.is_err() {
                    return;
                }
                if let Err(e) = f.fetch(runs, &what).await {
                    *crab_common::sync::lock(&fail) = Some(e);
                    let _ = ready_tx.send(usize::MAX);
                    return;
                }
                let _ = ready_tx.send(k + 1);
            }
        });
        Ok(Feed { order: tagged, last_use, cursor: 0, ready, writing, failed, fetcher, task })
    }

    /// Materialize tree `root` into the existing, empty directory `dest`.
    pub(crate) async fn restore_tree(
        &self,
        root: &Id,
        dest: &Path,
        what: &str,
    ) -> Result<TreeStats> {
        self.restore_tree_in(root, dest, dest, what).await
    }

    /// [`Repo::restore_tree`] of a subtree: hard links resolve beneath `links_root`, the
    /// directory the whole tree is materialized in.
    async fn restore_tree_in(
        &self,
        root: &Id,
        dest: &Path,
        links_root: &Path,
        what: &str,
    ) -> Result<TreeStats> {
        self.tree_blobs(root, what).await?;
        let order = self.data_in_write_order(root, what).await?;
        let mut feed = self.feed(order, what)?;
        let mut stats = TreeStats::default();
        // (directory, its entries, next index, entry to apply to it once done)
        let mut stack: Vec<RestoreFrame> =
            vec![(dest.to_path_buf(), self.tree(root, what).await?.entries, 0, None, *root)];
        let mut names: Vec<HashSet<Vec<u8>>> = vec![HashSet::new()];
        while let Some((dir, entries, next, _, tree_id)) = stack.last_mut() {
            if *next == entries.len() {
                let Some((dir, _, _, entry, _)) = stack.pop() else { break };
                names.pop();
                if let Some(e) = entry {
                    apply_meta(&dir, &e)?;
                }
                continue;
            }
            let e = entries[*next].clone();
            *next += 1;
            let object = format!("tree {tree_id}");
            let name = e.name_bytes(&object)?;
            let Some(seen) = names.last_mut() else { break };
            first_of_name(seen, &name, &object)?;
            let path = dir.join(OsStr::from_bytes(&name));
            stats.entries += 1;
            match e.kind {
                EntryKind::Dir => {
                    let sub = e.subtree.ok_or_else(|| {
                        RemoteError::corrupt(&object, "directory without subtree")
                    })?;
                    std::fs::create_dir(&path).map_err(RemoteError::io("mkdir", &path))?;
                    let children = self.tree(&sub, what).await?.entries;
                    stack.push((path, children, 0, Some(e), sub));
                    names.push(HashSet::new());
                    continue;
                }
                _ => {
                    let chunks = match (e.kind, &e.content, &e.link_hex) {
                        (EntryKind::File, Some(c), None) => c.chunks.len(),
                        _ => 0,
                    };
                    feed.want(chunks).await?;
                    self.create_leaf(&path, &e, &object, what, links_root, &mut stats).await?;
                    feed.took(chunks);
                }
            }
        }
        Ok(stats)
    }
}

fn cpath(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| RemoteError::corrupt(path.display().to_string(), "NUL in path"))
}

fn mknod(path: &Path, mode: u32, rdev: u64) -> Result<()> {
    let c = cpath(path)?;
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    if unsafe { libc::mknod(c.as_ptr(), mode, rdev as libc::dev_t) } != 0 {
        return Err(RemoteError::Io {
            op: "mknod",
            path: path.into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Owner, then mode (chown clears set-id bits), `user.*` extended attributes, then mtime;
/// never follows a symlink.
fn apply_meta(path: &Path, e: &Entry) -> Result<()> {
    std::os::unix::fs::lchown(path, Some(e.uid), Some(e.gid))
        .map_err(RemoteError::io("chown", path))?;
    if e.kind != EntryKind::Symlink {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(e.mode & 0o7777))
            .map_err(RemoteError::io("chmod", path))?;
        sync_xattrs(path, e)?;
    }
    let c = cpath(path)?;
    let ts = libc::timespec {
        tv_sec: e.mtime_ns.div_euclid(1_000_000_000),
        tv_nsec: e.mtime_ns.rem_euclid(1_000_000_000),
    };
    let times = [ts, ts];
    // SAFETY: `c` is a valid NUL-terminated path and `times` two valid timespecs, both alive
    // for the call.
    if unsafe {
        libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW)
    } != 0
    {
        return Err(RemoteError::Io {
            op: "utimensat",
            path: path.into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}
/// Refuse a tree that names `name` twice (remote bytes are untrusted).
fn first_of_name(
    seen: &mut HashSet<Vec<u8>>,
    name: &[u8],
    object: &str,
) -> Result<(), RemoteError> {
    if seen.insert(name.to_vec()) {
        return Ok(());
    }
    Err(RemoteError::corrupt(
        object.to_string(),
        format!("duplicate entry {:?}", String::from_utf8_lossy(name)),
    ))
}
