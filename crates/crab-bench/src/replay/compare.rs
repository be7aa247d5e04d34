//! Recovery correctness by state equivalence.
//!
//! At the end of a run the sandbox's state is captured from the host: every path of its root
//! filesystem (type, mode, SHA-256 of the content, link target; `/proc`, `/dev`, `/sys` and
//! `/.crab` skipped), its live processes (executable and arguments, from the pids of its cgroup),
//! its listening TCP sockets (from `/proc/<pid>/net/tcp{,6}` of its processes), and the agent's
//! conversation. A recovered run is compared with the fault-free reference. What legitimately
//! differs between *two* fault-free runs of the same trajectory (timestamps, random names, pids
//! printed in output) is learned from a second reference run and excluded — as *patterns*, so a
//! recovered run's own random names are recognised too:
//!
//! - a path present in one reference only, whose generalised form (digit runs → `<n>`,
//!   random-looking tokens such as the `ab12cd34` of `/tmp/tmpab12cd34` → `<r>`) equals that of
//!   a path present in the other reference only, becomes that pattern;
//! - a path under a `__pycache__` directory, or under a `.git/objects` store (object names hash
//!   commit times), makes that directory a subtree pattern;
//! - any other differing path is excluded exactly (as before);
//! - a conversation message that differs between the references is compared in its generalised
//!   form when the two references agree in that form, and excluded only when they do not.
//!
//! Two rules are fixed rather than learned: a file under `/var/cache/` (regenerable by
//! definition) is compared by presence and kind, not content ([`CACHE_DIR`]); a message line
//! reporting `EPIPE` (`write error: Broken pipe`, awk's `close failed on file /dev/stdout (Broken
//! pipe)`: printed or not as a pipe's reader and writer race) is left out of both sides, counted
//! in `racy_lines`. Python `tempfile` names (`tmp` + 8 of `[a-z0-9_]`) are
//! random tokens even when all letters. And the second reference run
//! starts with its pid counter moved on (see the replay's `PID_SHIFT`), so a pid a command
//! prints differs between the references as it does after a recovery, and is learned.
//!
//! Every comparison reports how many paths each pattern excluded. Nothing else is excluded: a
//! lost or extra file, a changed byte, a lost process or socket is a difference.
//!
//! Content hashes of files a sandbox inherits unchanged from its image are cached by (inode,
//! size, mtime, ctime), which such files share with the image. A file whose ctime is not older
//! than the run's first sandbox creation is always read: timestamps are coarse (a jiffy), so two
//! sandboxes writing a file at the same moment could otherwise share a key.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crab_common::ApiError;

use super::sandbox;

/// One path of a sandbox's filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// `file`, `dir`, `symlink`, `fifo`, `socket`, `char`, `block`.
    pub kind: &'static str,
    /// Permission bits (and setuid/setgid/sticky).
    pub mode: u32,
    /// SHA-256 (hex) of a regular file's content.
    pub hash: Option<String>,
    /// A symlink's target.
    pub target: Option<String>,
}

/// The captured state of a sandbox at the end of a run.
#[derive(Debug, Clone, Default)]
pub struct State {
    /// Path (inside the sandbox) → entry.
    pub files: BTreeMap<String, Entry>,
    /// Live processes, `exe args...`, sorted (a multiset).
    pub processes: Vec<String>,
    /// Listening TCP sockets, `addr:port`.
    pub sockets: BTreeSet<String>,
    /// The agent's conversation.
    pub conversation: Vec<Value>,
}

type HashKey = (u64, u64, i64, i64, i64, i64);

fn hash_cache() -> &'static Mutex<HashMap<HashKey, String>> {
    static CACHE: OnceLock<Mutex<HashMap<HashKey, String>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

fn hash_file(path: &Path, md: &std::fs::Metadata, fresh_after: i64) -> String {
    let key = (md.ino(), md.size(), md.mtime(), md.mtime_nsec(), md.ctime(), md.ctime_nsec());
    let cacheable = md.ctime() < fresh_after;
    if cacheable {
        if let Some(h) = hash_cache().lock().ok().and_then(|c| c.get(&key).cloned()) {
            return h;
        }
    }
    let mut hasher = Sha256::new();
    let h = match std::fs::File::open(path) {
        Ok(mut f) => {
            let mut buf = vec![0u8; 1 << 16];
            loop {
                match f.read(&mut buf) {
                    Ok(0) => break format!("{:x}", hasher.finalize()),
                    Ok(n) => hasher.update(&buf[..n]),
                    Err(e) => break format!("unreadable: {e}"),
                }
            }
        }
        Err(e) => format!("unreadable: {e}"),
    };
    if cacheable {
        if let Ok(mut c) = hash_cache().lock() {
            c.insert(key, h.clone());
        }
    }
    h
}

const SKIP_TOP: [&str; 4] = ["proc", "dev", "sys", ".crab"];

/// Walk a sandbox's root filesystem (as seen from the host). Files changed at or after
/// `fresh_after` (seconds since the epoch; the run's first sandbox creation, minus a margin) are
/// always hashed from their content.
pub fn walk_rootfs(root: &Path, fresh_after: i64) -> Result<BTreeMap<String, Entry>, ApiError> {
    let mut out = BTreeMap::new();
    let mut stack: Vec<PathBuf> = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let rd = std::fs::read_dir(&dir)
            .map_err(|e| ApiError::internal(format!("walking {}: {e}", dir.display())))?;
        for e in rd {
            let e = e.map_err(|e| ApiError::internal(format!("walking {}: {e}", dir.display())))?;
            let p = e.path();
            let rel = format!("/{}", p.strip_prefix(root).unwrap_or(&p).to_string_lossy());
            if dir == root && SKIP_TOP.iter().any(|s| rel[1..] == **s) {
                continue;
            }
            let Ok(md) = std::fs::symlink_metadata(&p) else { continue };
            let ft = md.file_type();
            use std::os::unix::fs::FileTypeExt;
            let kind = if ft.is_dir() {
                "dir"
            } else if ft.is_symlink() {
                "symlink"
            } else if ft.is_file() {
                "file"
            } else if ft.is_fifo() {
                "fifo"
            } else if ft.is_socket() {
                "socket"
            } else if ft.is_char_device() {
                "char"
            } else {
                "block"
            };
            let entry = Entry {
                kind,
                mode: md.mode() & 0o7777,
                hash: ft.is_file().then(|| hash_file(&p, &md, fresh_after)),
                target: ft.is_symlink().then(|| {
                    std::fs::read_link(&p)
                        .map(|t| t.to_string_lossy().into_owned())
                        .unwrap_or_default()
                }),
            };
            if ft.is_dir() {
                stack.push(p);
            }
            out.insert(rel, entry);
        }
    }
    Ok(out)
}

/// The live processes of sandbox `name`: executable (as seen inside) and arguments.
pub fn processes(name: &str) -> Result<Vec<String>, ApiError> {
    let dir = sandbox::cgroup_dir(name)?;
    let mut out = Vec::new();
    for pid in sandbox::pids_in(&dir) {
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|p| normalize_exe(&p.to_string_lossy()))
            .unwrap_or_else(|_| "?".into());
        out.push(format!("{exe} {}", args.join(" ")));
    }
    out.sort();
    Ok(out)
}

/// An executable path as seen inside the sandbox: the host may show it under the sandbox's
/// rootfs (`…/sandboxes/<name>/rootfs/usr/bin/x`), which differs between sandboxes.
fn normalize_exe(p: &str) -> String {
    let p = p.strip_suffix(" (deleted)").unwrap_or(p);
    match p.find("/rootfs/") {
        Some(i) => p[i + "/rootfs".len()..].to_string(),
        None => p.to_string(),
    }
}

/// Listening TCP sockets of sandbox `name` (its network namespace, read through any of its
/// processes).
pub fn listening(name: &str) -> Result<BTreeSet<String>, ApiError> {
    let dir = sandbox::cgroup_dir(name)?;
    let mut out = BTreeSet::new();
    for pid in sandbox::pids_in(&dir) {
        for (file, v6) in [("tcp", false), ("tcp6", true)] {
            let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")) else {
                continue;
            };
            out.extend(parse_listen(&text, v6));
        }
    }
    Ok(out)
}

fn parse_listen(text: &str, v6: bool) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || f[3] != "0A" {
            continue;
        }
        let Some((addr, port)) = f[1].split_once(':') else { continue };
        let port = u16::from_str_radix(port, 16).unwrap_or(0);
        let fam = if v6 { "tcp6" } else { "tcp" };
        out.push(format!("{fam} {addr}:{port}"));
    }
    out
}

/// Capture the state of sandbox `name` whose rootfs is at `rootfs`.
pub async fn capture(
    name: &str,
    rootfs: &Path,
    fresh_after: i64,
    conversation: Vec<Value>,
) -> Result<State, ApiError> {
    let root = rootfs.to_path_buf();
    let files = tokio::task::spawn_blocking(move || walk_rootfs(&root, fresh_after))
        .await
        .map_err(|e| ApiError::internal(format!("walking the rootfs: {e}")))??;
    Ok(State { files, processes: processes(name)?, sockets: listening(name)?, conversation })
}

/// What is excluded from comparisons of one trajectory: learned from two fault-free runs.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Noise {
    /// Paths that differ between the two reference runs and fit no pattern (excluded exactly).
    pub paths: BTreeSet<String>,
    /// Path patterns (see [`generalize`]; a trailing `/**` is a subtree).
    pub patterns: BTreeSet<String>,
    /// Conversation messages that differ between the references even when generalised
    /// (excluded).
    pub messages: BTreeSet<usize>,
    /// Conversation messages that differ between the references but agree generalised
    /// (compared generalised).
    pub fuzzy_messages: BTreeSet<usize>,
}

fn differing_paths(a: &BTreeMap<String, Entry>, b: &BTreeMap<String, Entry>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (k, v) in a {
        if b.get(k) != Some(v) {
            out.insert(k.clone());
        }
    }
    for k in b.keys() {
        if !a.contains_key(k) {
            out.insert(k.clone());
        }
    }
    out
}

/// Whether an alphanumeric token looks generated: at least 5 characters mixing letters and
/// digits (`ab12cd34`, `x7k2q`), or at least 8 letters in mixed case (`KqZbWtRe`).
fn random_token(t: &str) -> bool {
    let n = t.chars().count();
    let digits = t.chars().filter(char::is_ascii_digit).count();
    let upper = t.chars().filter(char::is_ascii_uppercase).count();
    let lower = t.chars().filter(char::is_ascii_lowercase).count();
    (n >= 5 && digits > 0 && digits < n) || (n >= 8 && upper > 0 && lower > 0 && upper + 1 < n)
}

/// The generalised form of a text: every maximal run of digits becomes `<n>` and every
/// random-looking alphanumeric token (see [`random_token`]) `<r>`; the rest is kept.
/// `/tmp/tmpab12cd34/log-20260101.txt` → `/tmp/tmp<r>/log-<n>.txt`. A token is split off a
/// known prefix first (`tmp`, `tmp.`, `pytest-`), so `tmpab12cd34` keeps its `tmp`.
pub fn generalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if let Some(n) = python_tempname(&chars, i) {
            out.push_str("tmp<r>");
            i += n;
            continue;
        }
        if !chars[i].is_ascii_alphanumeric() {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && chars[i].is_ascii_alphanumeric() {
            i += 1;
        }
        let tok: String = chars[start..i].iter().collect();
        let (prefix, rest) = match tok.strip_prefix("tmp") {
            Some(r) if !r.is_empty() => ("tmp", r),
            _ => ("", tok.as_str()),
        };
        if rest.chars().all(|c| c.is_ascii_digit()) {
            out.push_str(prefix);
            out.push_str("<n>");
        } else if random_token(rest) {
            out.push_str(prefix);
            out.push_str("<r>");
        } else {
            out.push_str(&tok);
        }
    }
    out
}

/// The length of a Python `tempfile` name at `chars[i]` (`tmp` + 8 of `[a-z0-9_]`, e.g.
/// `tmpkqzbwt_e`, `tmphd900lm_`), if one starts there: a name of letters only, or split by its
/// `_`, is not a random-looking token to [`random_token`], yet is as random.
fn python_tempname(chars: &[char], i: usize) -> Option<usize> {
    let name_char = |c: &char| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_';
    let starts_word = i == 0 || !(chars[i - 1].is_ascii_alphanumeric() || chars[i - 1] == '_');
    if !starts_word || chars.get(i..i + 3)? != ['t', 'm', 'p'] {
        return None;
    }
    let rest = chars.get(i + 3..i + 11)?;
    let ends = chars.get(i + 11).is_none_or(|c| !name_char(c));
    (rest.iter().all(name_char) && ends).then_some(11)
}

/// Whether `path` falls under pattern `pat` (a generalised path, or `dir/**`).
fn matches(pat: &str, path: &str) -> bool {
    if let Some(dir) = pat.strip_suffix("/**") {
        let g = generalize(path);
        return g.strip_prefix(dir).is_some_and(|r| r.is_empty() || r.starts_with('/'))
            || path.strip_prefix(dir).is_some_and(|r| r.is_empty() || r.starts_with('/'));
    }
    generalize(path) == pat
}

/// The `.git/objects` directory a path is in, if any: a content-addressed store whose object
/// names hash contents that hold commit times, so two runs that commit write different names.
fn git_objects_dir(path: &str) -> Option<&str> {
    let i = path.find("/.git/objects/")?;
    Some(&path[..i + "/.git/objects".len()])
}

/// The `__pycache__` directory a path is in or is, if any.
fn pycache_dir(path: &str) -> Option<&str> {
    let i = path.find("/__pycache__")?;
    let end = i + "/__pycache__".len();
    let rest = &path[end..];
    (rest.is_empty() || rest.starts_with('/')).then_some(&path[..end])
}

/// A line a command prints or not depending on scheduling alone: a writer into a pipe whose
/// reader already exited (`yes | head -1`, `echo … | grep -q`, `awk … | tr` with a failing `tr`)
/// gets `EPIPE` only when the reader won the race — and bash says `write error: Broken pipe`,
/// awk `close failed on file /dev/stdout (Broken pipe)`. `strerror(EPIPE)` is the mark: any line
/// carrying it reports that race, whichever program printed it.
const RACY_LINE: &str = "Broken pipe";

/// A conversation message without its [`RACY_LINE`] lines (itself when it has none).
fn without_racy_lines(m: &Value) -> std::borrow::Cow<'_, Value> {
    match m.get("content").and_then(Value::as_str) {
        Some(c) if c.contains(RACY_LINE) => {
            let kept: Vec<&str> = c.split('\n').filter(|l| !l.contains(RACY_LINE)).collect();
            let mut m = m.clone();
            m["content"] = Value::String(kept.join("\n"));
            std::borrow::Cow::Owned(m)
        }
        _ => std::borrow::Cow::Borrowed(m),
    }
}

/// The program names a line opens with (`find: tr: range-endpoints…` → `find`, `tr`): two
/// programs of one pipeline that report on stderr at the same moment interleave their
/// `name: ` prefixes and messages in the scheduler's order, so one run prints `find: tr: …`
/// where another printed `tr: find: …` (the message bodies then land on different lines).
fn prefix_names(line: &str) -> (Vec<&str>, &str) {
    let mut names = Vec::new();
    let mut rest = line;
    while let Some((name, tail)) = rest.split_once(": ") {
        let is_name = !name.is_empty()
            && name.chars().all(|c| c.is_ascii_alphanumeric() || "_.+-".contains(c));
        if !is_name {
            break;
        }
        names.push(name);
        rest = tail;
    }
    (names, rest)
}

/// Whether `a` and `b` differ only by such an interleave: one of them has a line that opens
/// with two or more program names, and the two hold the same program names and the same line
/// bodies, each counted, in any order (an interleave moves names and bodies between lines).
fn interleaved_alike(a: &Value, b: &Value) -> bool {
    let (Some(a), Some(b)) =
        (a.get("content").and_then(Value::as_str), b.get("content").and_then(Value::as_str))
    else {
        return false;
    };
    let marked = |c: &str| c.split('\n').any(|l| prefix_names(l).0.len() >= 2);
    if !(marked(a) || marked(b)) {
        return false;
    }
    let split = |c: &str| {
        let (mut names, mut bodies) = (Vec::new(), Vec::new());
        for l in c.split('\n') {
            let (n, rest) = prefix_names(l);
            names.extend(n.into_iter().map(str::to_owned));
            bodies.push(rest.to_owned());
        }
        names.sort_unstable();
        bodies.sort_unstable();
        (names, bodies)
    };
    split(a) == split(b)
}

/// Learn the noise from two fault-free runs.
pub fn learn(a: &State, b: &State) -> Noise {
    let mut noise = Noise::default();
    for i in 0..a.conversation.len().max(b.conversation.len()) {
        let x = a.conversation.get(i).map(without_racy_lines);
        let y = b.conversation.get(i).map(without_racy_lines);
        let (x, y) = (x.as_deref(), y.as_deref());
        if x == y {
            continue;
        }
        let gen = |m: Option<&Value>| m.map(|m| generalize(&m.to_string()));
        if x.is_some() && gen(x) == gen(y) {
            noise.fuzzy_messages.insert(i);
        } else {
            noise.messages.insert(i);
        }
    }
    let only_a: BTreeSet<String> =
        a.files.keys().filter(|k| !b.files.contains_key(*k)).map(|k| generalize(k)).collect();
    let only_b: BTreeSet<String> =
        b.files.keys().filter(|k| !a.files.contains_key(*k)).map(|k| generalize(k)).collect();
    for p in differing_paths(&a.files, &b.files) {
        if let Some(d) = pycache_dir(&p).or_else(|| git_objects_dir(&p)) {
            noise.patterns.insert(format!("{d}/**"));
            continue;
        }
        let g = generalize(&p);
        let one_sided = a.files.contains_key(&p) != b.files.contains_key(&p);
        if one_sided && g != p && only_a.contains(&g) && only_b.contains(&g) {
            noise.patterns.insert(g);
        } else {
            noise.paths.insert(p);
        }
    }
    // exact paths a pattern already covers are listed once, under the pattern
    let pats: Vec<String> = noise.patterns.iter().cloned().collect();
    noise.paths.retain(|p| !pats.iter().any(|pat| matches(pat, p)));
    noise
}

impl Noise {
    /// The pattern or exact path that excludes `path`, if any.
    pub fn excludes(&self, path: &str) -> Option<&str> {
        if let Some(p) = self.paths.get(path) {
            return Some(p.as_str());
        }
        self.patterns.iter().find(|pat| matches(pat, path)).map(String::as_str)
    }
}

/// Differences between a run and the reference, noise excluded (at most `max` listed, plus a
/// count), and what the noise excluded.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Diff {
    /// Number of differences.
    pub count: usize,
    /// The first few, human-readable.
    pub examples: Vec<String>,
    /// Differing paths excluded, by the pattern (or exact path) that excluded them.
    pub excluded: BTreeMap<String, usize>,
    /// Conversation messages excluded (differing in the references even generalised).
    pub excluded_messages: usize,
    /// Conversation messages equal once their `Broken pipe` (`EPIPE`) lines are left out.
    pub racy_lines: usize,
}

impl Diff {
    fn add(&mut self, what: String) {
        self.count += 1;
        if self.examples.len() < 8 {
            self.examples.push(what);
        }
    }

    /// Whether the states are equivalent.
    pub fn is_equal(&self) -> bool {
        self.count == 0
    }
}

/// Where regenerable caches live (FHS: "data cached for applications ... the application must
/// be able to regenerate or restore the data"): a file there is compared by presence and kind,
/// never by content. apt rebuilds `/var/cache/apt/pkgcache.bin` or not depending on whether its
/// inputs' mtimes fall in the same second as the cache's, so two fault-free runs of one
/// trajectory end with either of two caches (seen on Terminal-Bench's `apt-get` tasks).
pub const CACHE_DIR: &str = "/var/cache/";

/// What [`compare`] reports as excluding the content of a file under [`CACHE_DIR`].
pub const CACHE_CONTENT: &str = "/var/cache/** (content)";

/// Compare `run` with `reference`, excluding `noise`.
pub fn compare(reference: &State, run: &State, noise: &Noise) -> Diff {
    let mut d = Diff::default();
    for p in differing_paths(&reference.files, &run.files) {
        if let Some(by) = noise.excludes(&p) {
            *d.excluded.entry(by.to_string()).or_default() += 1;
            continue;
        }
        if let (true, Some(a), Some(b)) =
            (p.starts_with(CACHE_DIR), reference.files.get(&p), run.files.get(&p))
        {
            if a.kind == b.kind {
                *d.excluded.entry(CACHE_CONTENT.to_string()).or_default() += 1;
                continue;
            }
        }
        let what = match (reference.files.get(&p), run.files.get(&p)) {
            (Some(_), None) => "missing",
            (None, Some(_)) => "extra",
            _ => "differs",
        };
        d.add(format!("path {p} {what}"));
    }
    if reference.processes != run.processes {
        d.add(format!("processes {:?} ≠ reference {:?}", run.processes, reference.processes));
    }
    if reference.sockets != run.sockets {
        d.add(format!("listening sockets {:?} ≠ reference {:?}", run.sockets, reference.sockets));
    }
    if reference.conversation.len() != run.conversation.len() {
        d.add(format!(
            "conversation has {} messages, reference {}",
            run.conversation.len(),
            reference.conversation.len()
        ));
    } else {
        for (i, (a, b)) in reference.conversation.iter().zip(&run.conversation).enumerate() {
            if a == b {
                continue;
            }
            let (a, b) = (without_racy_lines(a), without_racy_lines(b));
            if a == b || interleaved_alike(&a, &b) {
                d.racy_lines += 1;
                continue;
            }
            if noise.messages.contains(&i) {
                d.excluded_messages += 1;
                continue;
            }
            if noise.fuzzy_messages.contains(&i)
                && generalize(&a.to_string()) == generalize(&b.to_string())
            {
                continue;
            }
            let s = b["content"].as_str().unwrap_or("");
            let s: String = s.chars().take(120).collect();
            d.add(format!("conversation message {i} differs: {s:?}"));
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_lines() {
        let text = "  sl  local_address rem_address   st\n   0: 0100007F:1F90 00000000:0000 0A 0\n   1: 0100007F:1F91 0100007F:9999 01 0\n";
        assert_eq!(parse_listen(text, false), vec!["tcp 0100007F:8080".to_string()]);
        assert_eq!(
            normalize_exe("/var/lib/crab/pool/sandboxes/x/rootfs/usr/bin/python3.11"),
            "/usr/bin/python3.11"
        );
    }

    #[test]
    fn noise_is_excluded_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        std::fs::create_dir_all(r.join("proc/1")).unwrap();
        std::fs::write(r.join("a"), "1").unwrap();
        std::fs::write(r.join("stamp"), "t1").unwrap();
        std::os::unix::fs::symlink("a", r.join("l")).unwrap();
        let a = State { files: walk_rootfs(r, 0).unwrap(), ..Default::default() };
        assert!(
            a.files.contains_key("/a")
                && a.files.contains_key("/l")
                && !a.files.contains_key("/proc/1")
        );
        assert_eq!(a.files["/l"].target.as_deref(), Some("a"));
        std::fs::write(r.join("stamp"), "t2").unwrap();
        let b = State { files: walk_rootfs(r, 0).unwrap(), ..Default::default() };
        let noise = learn(&a, &b);
        assert_eq!(noise.paths.iter().collect::<Vec<_>>(), vec!["/stamp"]);
        std::fs::write(r.join("a"), "2").unwrap();
        std::fs::write(r.join("stamp"), "t3").unwrap();
        let c = State { files: walk_rootfs(r, 0).unwrap(), ..Default::default() };
        let d = compare(&a, &c, &noise);
        assert_eq!(d.count, 1, "{:?}", d.examples);
        assert!(d.examples[0].contains("/a"));
        assert!(compare(&a, &b, &noise).is_equal());
    }

    fn file(h: &str) -> Entry {
        Entry { kind: "file", mode: 0o644, hash: Some(h.into()), target: None }
    }

    fn state(files: &[(&str, &str)], procs: &[&str], conv: &[&str]) -> State {
        State {
            files: files.iter().map(|(p, h)| (p.to_string(), file(h))).collect(),
            processes: procs.iter().map(|p| p.to_string()).collect(),
            sockets: BTreeSet::new(),
            conversation: conv
                .iter()
                .map(|c| serde_json::json!({"role": "tool", "content": c}))
                .collect(),
        }
    }

    #[test]
    fn python_tempnames_git_objects_and_broken_pipes_are_noise_and_nothing_more() {
        // letters-only and underscore-split tempfile names generalise like mixed ones
        for n in ["/tmp/tmplltzgacv/src", "/tmp/tmphd900lm_/src", "/tmp/tmpk_qzbwte/src"] {
            assert_eq!(generalize(n), "/tmp/tmp<r>/src", "{n}");
        }
        assert_eq!(generalize("tmpfile tmp1 attempt"), "tmpfile tmp<n> attempt");
        // references that committed differently: the objects store is a subtree pattern
        let a = state(&[("/r/.git/objects/6a/fa55", "x"), ("/r/f", "1")], &[], &["x"]);
        let b = state(&[("/r/.git/objects/76/0b12", "y"), ("/r/f", "1")], &[], &["x"]);
        let noise = learn(&a, &b);
        assert!(noise.patterns.contains("/r/.git/objects/**"), "{noise:?}");
        let run = state(&[("/r/.git/objects/f1/ba8c", "z"), ("/r/f", "1")], &[], &["x"]);
        assert!(compare(&a, &run, &noise).is_equal());
        let lost = state(&[("/r/.git/objects/f1/ba8c", "z")], &[], &["x"]);
        assert!(!compare(&a, &lost, &noise).is_equal(), "a lost work-tree file is caught");
        // a broken-pipe line alone is not a difference; another changed line is
        let piped = state(&[], &[], &["out\nbash: line 1: echo: write error: Broken pipe\nend"]);
        let quiet = state(&[], &[], &["out\nend"]);
        let d = compare(&piped, &quiet, &Noise::default());
        assert!(d.is_equal() && d.racy_lines == 1, "{d:?}");
        let other = state(&[], &[], &["out\nEND"]);
        assert!(!compare(&piped, &other, &Noise::default()).is_equal());
        // awk's report of the same race is the same noise; a lost output line beside it is not
        let awk =
            state(&[], &[], &["out\nawk: close failed on file /dev/stdout (Broken pipe)\nend"]);
        let d = compare(&awk, &quiet, &Noise::default());
        assert!(d.is_equal() && d.racy_lines == 1, "{d:?}");
        let lost = state(&[], &[], &["awk: close failed on file /dev/stdout (Broken pipe)\nend"]);
        assert!(!compare(&lost, &quiet, &Noise::default()).is_equal());
    }

    #[test]
    fn interleaved_diagnostics_of_two_programs_are_noise_and_nothing_more() {
        let body = "range-endpoints of ' -\\012' are in reverse collating sequence order";
        let a = format!("<returncode>1</returncode>\nfind: tr: {body}\n‘/test’: Permission denied");
        let b = format!("<returncode>1</returncode>\ntr: find: {body}\n‘/test’: Permission denied");
        let d = compare(&state(&[], &[], &[&a]), &state(&[], &[], &[&b]), &Noise::default());
        assert!(d.is_equal() && d.racy_lines == 1, "{d:?}");
        // against the same two reports not interleaved: the same names and bodies
        let c = format!("<returncode>1</returncode>\nfind: ‘/test’: Permission denied\ntr: {body}");
        let d = compare(&state(&[], &[], &[&a]), &state(&[], &[], &[&c]), &Noise::default());
        assert!(d.is_equal() && d.racy_lines == 1, "{d:?}");
        // a lost line, a changed return code, or no interleave at all are differences
        let lost = format!("<returncode>1</returncode>\ntr: find: {body}");
        assert!(!compare(&state(&[], &[], &[&a]), &state(&[], &[], &[&lost]), &Noise::default())
            .is_equal());
        let rc = b.replace("<returncode>1", "<returncode>2");
        assert!(!compare(&state(&[], &[], &[&a]), &state(&[], &[], &[&rc]), &Noise::default())
            .is_equal());
        let plain = state(&[], &[], &["x: one\ny: two"]);
        let swapped = state(&[], &[], &["y: two\nx: one"]);
        assert!(!compare(&plain, &swapped, &Noise::default()).is_equal());
    }

    #[test]
    fn cache_content_is_not_state_but_a_lost_cache_file_is_a_difference() {
        let r = state(&[("/var/cache/apt/pkgcache.bin", "a"), ("/app/x", "1")], &[], &[]);
        let run = state(&[("/var/cache/apt/pkgcache.bin", "b"), ("/app/x", "1")], &[], &[]);
        let d = compare(&r, &run, &Noise::default());
        assert!(d.is_equal(), "{d:?}");
        assert_eq!(d.excluded.get(CACHE_CONTENT), Some(&1), "{d:?}");
        // gone, or a changed byte outside the cache, is still caught
        let lost = state(&[("/app/x", "1")], &[], &[]);
        assert!(!compare(&r, &lost, &Noise::default()).is_equal());
        let changed = state(&[("/var/cache/apt/pkgcache.bin", "a"), ("/app/x", "2")], &[], &[]);
        assert!(!compare(&r, &changed, &Noise::default()).is_equal());
    }

    #[test]
    fn generalize_random_names_numbers_and_words() {
        assert_eq!(generalize("/tmp/tmpab12cd34/x"), "/tmp/tmp<r>/x");
        assert_eq!(generalize("/tmp/tmp.KqZbWtReXy"), "/tmp/tmp.<r>");
        assert_eq!(generalize("/var/log/run-20260101-1200.log"), "/var/log/run-<n>-<n>.log");
        assert_eq!(generalize("/proc/4711/status"), "/proc/<n>/status");
        assert_eq!(generalize("/testbed/src/main.py"), "/testbed/src/main.py");
        assert_eq!(generalize("pid 4711 at 12:00:01"), "pid <n> at <n>:<n>:<n>");
    }

    /// Two references with their own random tmp dirs, pids in output and pyc files: a
    /// recovered run with yet other random names is equal; a lost file, a changed byte, an
    /// extra file, a lost process or a different output is still caught.
    #[test]
    fn patterns_exclude_noise_and_divergence_is_still_caught() {
        let a = state(
            &[
                ("/testbed/a.py", "h1"),
                ("/testbed/out.txt", "h2"),
                ("/testbed/__pycache__/a.cpython-311.pyc", "p1"),
                ("/tmp/tmpab12cd34", "d"),
                ("/tmp/tmpab12cd34/data", "x"),
            ],
            &["/usr/bin/python3 -m http.server 8000"],
            &["ok", "server pid 4711 started"],
        );
        let b = state(
            &[
                ("/testbed/a.py", "h1"),
                ("/testbed/out.txt", "h2"),
                ("/testbed/__pycache__/a.cpython-311.pyc", "p2"),
                ("/tmp/tmpzz99yy88", "d"),
                ("/tmp/tmpzz99yy88/data", "y"),
            ],
            &["/usr/bin/python3 -m http.server 8000"],
            &["ok", "server pid 5120 started"],
        );
        let noise = learn(&a, &b);
        assert!(noise.patterns.contains("/tmp/tmp<r>"), "{noise:?}");
        assert!(noise.patterns.contains("/tmp/tmp<r>/data"), "{noise:?}");
        assert!(noise.patterns.contains("/testbed/__pycache__/**"), "{noise:?}");
        assert!(noise.paths.is_empty(), "{noise:?}");
        assert!(noise.fuzzy_messages.contains(&1) && noise.messages.is_empty(), "{noise:?}");

        let good = state(
            &[
                ("/testbed/a.py", "h1"),
                ("/testbed/out.txt", "h2"),
                ("/tmp/tmpq1w2e3r4", "d"),
                ("/tmp/tmpq1w2e3r4/data", "z"),
            ],
            &["/usr/bin/python3 -m http.server 8000"],
            &["ok", "server pid 6001 started"],
        );
        let d = compare(&a, &good, &noise);
        assert!(d.is_equal(), "{d:?}");
        assert_eq!(d.excluded.get("/tmp/tmp<r>"), Some(&2), "{d:?}");
        assert_eq!(d.excluded.get("/tmp/tmp<r>/data"), Some(&2), "{d:?}");
        assert_eq!(d.excluded.get("/testbed/__pycache__/**"), Some(&1), "{d:?}");

        let cases: [(&str, State); 5] = [
            (
                "lost file",
                state(
                    &[("/testbed/a.py", "h1")],
                    &["/usr/bin/python3 -m http.server 8000"],
                    &["ok", "server pid 1 started"],
                ),
            ),
            (
                "changed byte",
                state(
                    &[("/testbed/a.py", "h1"), ("/testbed/out.txt", "h2'")],
                    &["/usr/bin/python3 -m http.server 8000"],
                    &["ok", "server pid 1 started"],
                ),
            ),
            (
                "extra file",
                state(
                    &[("/testbed/a.py", "h1"), ("/testbed/out.txt", "h2"), ("/testbed/new", "n")],
                    &["/usr/bin/python3 -m http.server 8000"],
                    &["ok", "server pid 1 started"],
                ),
            ),
            (
                "lost process",
                state(
                    &[("/testbed/a.py", "h1"), ("/testbed/out.txt", "h2")],
                    &[],
                    &["ok", "server pid 1 started"],
                ),
            ),
            (
                "different output",
                state(
                    &[("/testbed/a.py", "h1"), ("/testbed/out.txt", "h2")],
                    &["/usr/bin/python3 -m http.server 8000"],
                    &["ok", "server failed to start"],
                ),
            ),
        ];
        for (what, run) in cases {
            let d = compare(&a, &run, &noise);
            assert!(!d.is_equal(), "{what} was not caught: {d:?}");
        }
    }
}
