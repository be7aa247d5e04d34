//! Soft-dirty page tracking: whether this kernel has it, and what a pagemap says with it.
//!
//! With `CONFIG_MEM_SOFT_DIRTY`, writing `4` to `/proc/<pid>/clear_refs` clears the soft-dirty
//! bit (bit 55) of every page of the process in `/proc/<pid>/pagemap`, and the next write to a
//! page sets it again. That is what CRIU's `--track-mem` and incremental (parent-image) dumps
//! need, and what would let a process that ran but dirtied no page skip its dump. Kernels
//! without the option accept the `clear_refs` write and simply never set the bit, so the only
//! honest test is a probe: clear, write a page, read its pagemap entry ([`probe`]). The
//! decision itself ([`decide`], [`dirty_pages`]) is a pure function of the recorded entries,
//! unit-tested on entries recorded on kernels with and without the option.

use std::fs::OpenOptions;
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};

/// Bit 55 of a pagemap entry: the page was written since the last soft-dirty clear.
pub const PM_SOFT_DIRTY: u64 = 1 << 55;
/// Bit 62: the page is swapped out.
pub const PM_SWAP: u64 = 1 << 62;
/// Bit 63: the page is present in RAM.
pub const PM_PRESENT: u64 = 1 << 63;

/// Whether soft-dirty tracking works here, and why (not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoftDirty {
    /// Soft-dirty tracking works: incremental dumps and "dirtied no page" are possible.
    pub available: bool,
    /// What the probe saw.
    pub reason: String,
}

/// The decision from a probe: `clear` is the result of writing `4` to `clear_refs`,
/// `after_clear` the probe page's pagemap entry right after it, `after_write` the entry after
/// one byte of the page was written.
pub fn decide(clear: Result<(), String>, after_clear: u64, after_write: u64) -> SoftDirty {
    let no = |reason: String| SoftDirty { available: false, reason };
    if let Err(e) = clear {
        return no(format!("writing 4 to /proc/self/clear_refs failed: {e}"));
    }
    if after_write & (PM_PRESENT | PM_SWAP) == 0 {
        return no("the probe page is not present in /proc/self/pagemap".into());
    }
    if after_clear & PM_SOFT_DIRTY != 0 {
        return no("clear_refs 4 did not clear the pagemap soft-dirty bit".into());
    }
    if after_write & PM_SOFT_DIRTY == 0 {
        return no(
            "a written page never shows the pagemap soft-dirty bit: the kernel is built without CONFIG_MEM_SOFT_DIRTY"
                .into(),
        );
    }
    SoftDirty { available: true, reason: "clear_refs 4 and the pagemap soft-dirty bit work".into() }
}

/// Pages of a pagemap range that were written since the last clear (present or swapped, with
/// the soft-dirty bit). Only meaningful where [`probe`] says tracking is available.
pub fn dirty_pages(entries: &[u64]) -> usize {
    entries.iter().filter(|&&e| e & (PM_PRESENT | PM_SWAP) != 0 && e & PM_SOFT_DIRTY != 0).count()
}

/// Most pages [`process_dirty_pages`] scans in one process (16 GiB of address space): a
/// process with more mapped is reported as unscannable (so: dirty), never partly scanned.
pub const MAX_SCAN_PAGES: u64 = 4 << 20;

/// The user-space address ranges (`start`, `end`) of a `/proc/<pid>/maps` text; kernel
/// addresses (`[vsyscall]`) and unparsable lines are left out.
pub fn parse_maps(text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter_map(|l| {
            let range = l.split_whitespace().next()?;
            let (a, b) = range.split_once('-')?;
            let (a, b) = (u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?);
            (a < b && b <= 0x8000_0000_0000).then_some((a, b))
        })
        .collect()
}

/// Pages of process `pid` (a host pid) written since its soft-dirty bits were last cleared
/// (by a dump with [`crate::DumpOpts::track_mem`]), over its whole address space: every
/// mapping's pagemap entries, [`dirty_pages`] of them. An error when the process is gone or
/// maps more than [`MAX_SCAN_PAGES`]. Only meaningful where [`probe`] says tracking works.
pub fn process_dirty_pages(pid: u32) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt as _;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let ranges = parse_maps(&maps);
    let page = page_size();
    let pages: u64 = ranges.iter().map(|(a, b)| (b - a) / page).sum();
    if pages > MAX_SCAN_PAGES {
        return Err(std::io::Error::other(format!(
            "process {pid} maps {pages} pages, more than the {MAX_SCAN_PAGES} scanned"
        )));
    }
    let f = std::fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let mut dirty = 0;
    let mut buf = Vec::new();
    for (a, b) in ranges {
        let n = usize::try_from((b - a) / page).map_err(std::io::Error::other)?;
        buf.resize(n * 8, 0);
        f.read_exact_at(&mut buf, a / page * 8)?;
        let entries: Vec<u64> = buf
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        dirty += dirty_pages(&entries);
    }
    Ok(dirty)
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).unwrap_or(4096).max(4096)
}

fn pagemap_entry(addr: usize) -> std::io::Result<u64> {
    let mut f = std::fs::File::open("/proc/self/pagemap")?;
    let page = page_size() as usize;
    f.seek(SeekFrom::Start((addr / page * 8) as u64))?;
    let mut b = [0u8; 8];
    f.read_exact(&mut b)?;
    Ok(u64::from_ne_bytes(b))
}

/// Probes this process: clears its soft-dirty bits, writes one page, reads its entry back.
pub fn probe() -> SoftDirty {
    let mut page = vec![0u8; 2 * 4096];
    let addr = page.as_mut_ptr() as usize;
    let addr = (addr + 4095) & !4095;
    let off = addr - page.as_ptr() as usize;
    page[off] = 1; // fault it in
    let clear = OpenOptions::new()
        .write(true)
        .open("/proc/self/clear_refs")
        .and_then(|mut f| f.write_all(b"4"))
        .map_err(|e| e.to_string());
    let after_clear = match pagemap_entry(addr) {
        Ok(v) => v,
        Err(e) => {
            return SoftDirty {
                available: false,
                reason: format!("reading /proc/self/pagemap failed: {e}"),
            }
        }
    };
    // SAFETY: `off` is inside `page`; a volatile write so the store is not optimised away.
    unsafe { std::ptr::write_volatile(page.as_mut_ptr().add(off), 2) };
    let after_write = pagemap_entry(addr).unwrap_or(0);
    let r = decide(clear, after_clear, after_write);
    tracing::debug!(after_clear, after_write, available = r.available, "soft-dirty probe");
    std::hint::black_box(&page);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    // Entries recorded on this project's hosts (6.18, CONFIG_MEM_SOFT_DIRTY unset): present,
    // exclusively mapped, never soft-dirty, before and after the clear and the write.
    const NO_SD_AFTER_CLEAR: u64 = 0xa100_0000_004a_c083;
    const NO_SD_AFTER_WRITE: u64 = 0xa100_0000_004a_c083;
    // The same page on a kernel with soft-dirty: bit 55 cleared by clear_refs 4, set by the
    // write (entries as a distribution kernel reports them for root).
    const SD_AFTER_CLEAR: u64 = 0xa100_0000_0012_3456;
    const SD_AFTER_WRITE: u64 = 0xa180_0000_0012_3456;

    #[test]
    fn kernel_without_soft_dirty_is_unavailable() {
        let r = decide(Ok(()), NO_SD_AFTER_CLEAR, NO_SD_AFTER_WRITE);
        assert!(!r.available, "{r:?}");
        assert!(r.reason.contains("CONFIG_MEM_SOFT_DIRTY"), "{r:?}");
    }

    #[test]
    fn kernel_with_soft_dirty_is_available() {
        let r = decide(Ok(()), SD_AFTER_CLEAR, SD_AFTER_WRITE);
        assert!(r.available, "{r:?}");
    }

    #[test]
    fn a_clear_that_does_not_clear_or_fails_is_unavailable() {
        assert!(!decide(Ok(()), SD_AFTER_WRITE, SD_AFTER_WRITE).available);
        assert!(!decide(Err("EINVAL".into()), SD_AFTER_CLEAR, SD_AFTER_WRITE).available);
        assert!(!decide(Ok(()), 0, 0).available, "page not present");
    }

    #[test]
    fn dirty_pages_counts_present_or_swapped_soft_dirty_pages() {
        let swapped_dirty = PM_SWAP | PM_SOFT_DIRTY | 0x1234;
        let absent_dirty_bit = PM_SOFT_DIRTY; // not present: nothing to dump
        let e = [SD_AFTER_CLEAR, SD_AFTER_WRITE, swapped_dirty, absent_dirty_bit, 0];
        assert_eq!(dirty_pages(&e), 2);
        assert_eq!(dirty_pages(&[NO_SD_AFTER_CLEAR, SD_AFTER_CLEAR]), 0);
    }

    #[test]
    fn maps_ranges_are_user_space_only() {
        // Recorded from a python3 on this host (trimmed).
        let maps = "\
55d0c8a00000-55d0c8a2b000 r--p 00000000 00:1f 3149 /usr/bin/python3.11
55d0c8a2b000-55d0c8d0e000 r-xp 0002b000 00:1f 3149 /usr/bin/python3.11
55d0ca1b1000-55d0ca2c9000 rw-p 00000000 00:00 0 [heap]
7f1c2c000000-7f1c2c021000 rw-p 00000000 00:00 0
7ffd3a5e6000-7ffd3a607000 rw-p 00000000 00:00 0 [stack]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]
garbage line
";
        let r = parse_maps(maps);
        assert_eq!(r.len(), 5, "{r:?}");
        assert_eq!(r[2], (0x55d0_ca1b_1000, 0x55d0_ca2c_9000));
        assert!(r.iter().all(|(_, b)| *b <= 0x8000_0000_0000));
    }

    /// Scanning this very process works (whatever the bits say on this kernel), and a gone
    /// process is an error, never "nothing dirty".
    #[test]
    fn a_live_process_is_scanned_and_a_gone_one_is_an_error() {
        let me = std::process::id();
        assert!(process_dirty_pages(me).is_ok());
        assert!(process_dirty_pages(u32::MAX - 1).is_err());
    }

    /// The probe on this host agrees with the kernel's configuration where it is readable.
    #[test]
    fn probe_agrees_with_the_kernel_config() {
        let r = probe();
        let rel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let cfg =
            std::fs::read_to_string(format!("/boot/config-{}", rel.trim())).ok().or_else(|| {
                let out =
                    std::process::Command::new("zcat").arg("/proc/config.gz").output().ok()?;
                String::from_utf8(out.stdout).ok().filter(|s| !s.is_empty())
            });
        if let Some(cfg) = cfg {
            let on = cfg.lines().any(|l| l.trim() == "CONFIG_MEM_SOFT_DIRTY=y");
            assert_eq!(r.available, on, "{r:?}");
        }
        // Without a readable config the probe's own answer is all there is; it must be one.
        assert!(!r.reason.is_empty());
    }
}
