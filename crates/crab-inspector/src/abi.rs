//! The byte layout shared with `src/bpf/inspector.h`: flag values, struct offsets and parsers
//! for the keys and values that user space reads from the BPF maps. Parsing is by explicit
//! offsets (no transmutes); the sizes are checked against the maps at load time.

/// Sandbox keys are `0..MAX_SBX`.
pub(crate) const MAX_SBX: usize = 256;
pub(crate) const PATH_LEN: usize = 256;
pub(crate) const WALK_LEN: usize = 512;
/// Change records per sandbox and turn (`MAX_CHANGES`).
pub(crate) const MAX_CHANGES: u32 = 8192;
/// Tracked processes per sandbox (`MAX_PROCS`).
pub(crate) const MAX_PROCS: u32 = 4096;

pub(crate) const C_CREATED: u32 = 1 << 0;
pub(crate) const C_MODIFIED: u32 = 1 << 1;
pub(crate) const C_META: u32 = 1 << 2;
pub(crate) const C_DELETED: u32 = 1 << 3;
pub(crate) const C_RENAMED: u32 = 1 << 4;
pub(crate) const C_LINKED: u32 = 1 << 5;
pub(crate) const C_DIR: u32 = 1 << 6;
pub(crate) const C_SYMLINK: u32 = 1 << 7;
pub(crate) const C_NODE: u32 = 1 << 8;
pub(crate) const C_MMAP: u32 = 1 << 10;

pub(crate) const K_INODE: u8 = 0;

pub(crate) const P_P1: u32 = 1 << 0;
pub(crate) const P_P2: u32 = 1 << 1;
pub(crate) const P_WALK: u32 = 1 << 2;
pub(crate) const P_WALK_FULL: u32 = 1 << 3;
pub(crate) const P_P1_TRUNC: u32 = 1 << 4;
pub(crate) const P_P2_TRUNC: u32 = 1 << 5;
pub(crate) const P_WALK_IS_FILE: u32 = 1 << 6;

pub(crate) const S_OVERFLOW: u64 = 1 << 0;
pub(crate) const S_UNTRACKABLE: u64 = 1 << 1;
pub(crate) const S_MOUNT: u64 = 1 << 2;
pub(crate) const S_NS: u64 = 1 << 3;
pub(crate) const S_FOREIGN_MEM: u64 = 1 << 4;
pub(crate) const S_PENDING_LOST: u64 = 1 << 5;
pub(crate) const S_PROC_OVERFLOW: u64 = 1 << 6;
pub(crate) const S_PATH_FAULT: u64 = 1 << 7;
pub(crate) const S_FS_UNKNOWN: u64 = 1 << 8;
pub(crate) const S_SHM: u64 = 1 << 10;
pub(crate) const S_PROC_STATE: u64 = 1 << 11;

pub(crate) const PR_DEAD: u32 = 1 << 0;

pub(crate) const CKEY_SIZE: usize = 32;
pub(crate) const CHANGE_SIZE: usize = 64;
pub(crate) const PREC_SIZE: usize = 8 + PATH_LEN * 2 + WALK_LEN;
pub(crate) const PROC_SIZE: usize = 40;

/// Byte size of one `struct sstate` in the mmapped `.bss`.
pub(crate) const SSTATE_SIZE: usize = 128;
pub(crate) const SS_EPOCH: usize = 0;
pub(crate) const SS_INFLIGHT: usize = 8;
pub(crate) const SS_FLAGS: usize = 24;
pub(crate) const SS_EVENTS: usize = 40;
#[allow(dead_code)]
pub(crate) const SS_NS_GEN: usize = 56;
pub(crate) const SS_NS_INFLIGHT: usize = 64;
/// Offset of `level_mask` in `.bss`.
pub(crate) const BSS_LEVEL_MASK: usize = MAX_SBX * SSTATE_SIZE;
/// Offset of `muted_tracers[4]` in `.bss`.
pub(crate) const BSS_MUTED: usize = BSS_LEVEL_MASK + 4;
/// Number of `muted_tracers` slots.
pub(crate) const MUTED_SLOTS: usize = 4;
/// Offset of `min_level` in `.bss` (after `muted_tracers` and `restart_watch`).
pub(crate) const BSS_MIN_LEVEL: usize = BSS_MUTED + 4 * MUTED_SLOTS + 4;

fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = b.get(off..off + 4) {
        a.copy_from_slice(s);
    }
    u32::from_ne_bytes(a)
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(off..off + 8) {
        a.copy_from_slice(s);
    }
    u64::from_ne_bytes(a)
}

/// `struct ckey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct CKey {
    pub sbx: u32,
    pub slot: u8,
    pub kind: u8,
    pub a: u64,
    pub b: u64,
    pub c: u64,
}

impl CKey {
    pub fn parse(b: &[u8]) -> CKey {
        CKey {
            sbx: u32_at(b, 0),
            slot: b.get(4).copied().unwrap_or(0),
            kind: b.get(5).copied().unwrap_or(0),
            a: u64_at(b, 8),
            b: u64_at(b, 16),
            c: u64_at(b, 24),
        }
    }
}

/// `struct change`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Change {
    pub flags: u32,
    pub mode: u32,
    pub dev: u64,
    pub ino: u64,
}

impl Change {
    pub fn parse(b: &[u8]) -> Change {
        Change { flags: u32_at(b, 0), mode: u32_at(b, 4), dev: u64_at(b, 16), ino: u64_at(b, 24) }
    }
}

/// `struct prec`, decoded.
#[derive(Debug, Clone, Default)]
pub(crate) struct PathRec {
    pub have: u32,
    pub p1: String,
    pub p2: String,
    /// Path components from the root down (reversed from the leaf-first walk).
    pub walk: Vec<String>,
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

impl PathRec {
    pub fn parse(b: &[u8]) -> PathRec {
        let have = u32_at(b, 0);
        let walk_len = (u32_at(b, 4) as usize).min(WALK_LEN);
        let p1 = b.get(8..8 + PATH_LEN).map(cstr).unwrap_or_default();
        let p2 = b.get(8 + PATH_LEN..8 + 2 * PATH_LEN).map(cstr).unwrap_or_default();
        let walk_bytes = b.get(8 + 2 * PATH_LEN..8 + 2 * PATH_LEN + walk_len).unwrap_or(&[]);
        let mut walk: Vec<String> = walk_bytes
            .split(|&c| c == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect();
        walk.reverse();
        PathRec { have, p1, p2, walk }
    }
}

/// `struct proc`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcRec {
    pub sbx: u32,
    pub flags: u32,
    pub born_epoch: u64,
    pub died_epoch: u64,
    pub ran_epoch: u64,
    pub exec_epoch: u64,
}

impl ProcRec {
    pub fn parse(b: &[u8]) -> ProcRec {
        ProcRec {
            sbx: u32_at(b, 0),
            flags: u32_at(b, 4),
            born_epoch: u64_at(b, 8),
            died_epoch: u64_at(b, 16),
            ran_epoch: u64_at(b, 24),
            exec_epoch: u64_at(b, 32),
        }
    }

    pub fn encode(&self) -> [u8; PROC_SIZE] {
        let mut o = [0u8; PROC_SIZE];
        o[0..4].copy_from_slice(&self.sbx.to_ne_bytes());
        o[4..8].copy_from_slice(&self.flags.to_ne_bytes());
        o[8..16].copy_from_slice(&self.born_epoch.to_ne_bytes());
        o[16..24].copy_from_slice(&self.died_epoch.to_ne_bytes());
        o[24..32].copy_from_slice(&self.ran_epoch.to_ne_bytes());
        o[32..40].copy_from_slice(&self.exec_epoch.to_ne_bytes());
        o
    }
}

/// Kernel-internal `dev_t` (major << 20 | minor) split into (major, minor).
pub(crate) fn kdev_split(dev: u64) -> (u64, u64) {
    (dev >> 20, dev & 0xfffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_is_reversed_and_split() {
        let mut b = vec![0u8; PREC_SIZE];
        b[0..4].copy_from_slice(&(P_WALK | P_WALK_FULL).to_ne_bytes());
        let w = b"c.txt\0dir\0tmp\0";
        b[4..8].copy_from_slice(&(w.len() as u32).to_ne_bytes());
        b[8 + 2 * PATH_LEN..8 + 2 * PATH_LEN + w.len()].copy_from_slice(w);
        let r = PathRec::parse(&b);
        assert_eq!(r.walk, vec!["tmp", "dir", "c.txt"]);
    }

    #[test]
    fn kdev() {
        assert_eq!(kdev_split((8 << 20) | 3), (8, 3));
    }
}
