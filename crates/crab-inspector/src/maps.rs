//! Raw access to the BPF maps and the mmapped `.bss` of the loaded object: a batch dump that
//! reports every error (libbpf-rs's batch iterator silently stops on errors, which could hide a
//! change), and atomic accessors for the per-sandbox turn state shared with the BPF programs.

use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU32, AtomicU64};

use libbpf_rs::libbpf_sys;
use libbpf_rs::{MapCore, MapFlags, MapHandle};

use crate::abi::{BSS_LEVEL_MASK, BSS_MIN_LEVEL, BSS_MUTED, MAX_SBX, MUTED_SLOTS, SSTATE_SIZE};
use crate::error::InspectorError;

/// All (key, value) pairs of a hash map, as two flat byte vectors and a count.
#[derive(Debug, Default)]
pub(crate) struct Dump {
    pub keys: Vec<u8>,
    pub values: Vec<u8>,
    pub key_size: usize,
    pub value_size: usize,
    pub count: usize,
}

impl Dump {
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.keys
            .chunks_exact(self.key_size.max(1))
            .zip(self.values.chunks_exact(self.value_size.max(1)))
    }
}

/// Reads a whole hash map with BPF_MAP_LOOKUP_BATCH.
pub(crate) fn dump(map: &MapHandle, name: &'static str) -> Result<Dump, InspectorError> {
    let key_size = map.key_size() as usize;
    let value_size = map.value_size() as usize;
    let mut out = Dump { key_size, value_size, ..Default::default() };
    let mut batch: u32 = 1024;
    let mut token_in: u64 = 0;
    let mut first = true;
    let opts = libbpf_sys::bpf_map_batch_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_map_batch_opts>() as _,
        elem_flags: 0,
        flags: 0,
    };
    loop {
        let mut keys = vec![0u8; key_size * batch as usize];
        let mut values = vec![0u8; value_size * batch as usize];
        let mut count = batch;
        let mut token_out: u64 = 0;
        let in_ptr: *mut std::ffi::c_void =
            if first { std::ptr::null_mut() } else { (&raw mut token_in).cast() };
        // SAFETY: the buffers hold `batch` keys and values of the map's sizes, `count` says so,
        // the batch tokens are 8 bytes (the hash map's token is a u32 bucket index) and `opts`
        // is a properly sized options struct; the fd is a valid map fd borrowed from `map`.
        let ret = unsafe {
            libbpf_sys::bpf_map_lookup_batch(
                map.as_fd().as_raw_fd(),
                in_ptr,
                (&raw mut token_out).cast(),
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                &mut count,
                &opts,
            )
        };
        let errno = if ret < 0 { -ret } else { 0 };
        if errno == libc::ENOSPC && count == 0 {
            // a bucket holds more elements than fit: retry this step with a bigger batch
            batch = batch.saturating_mul(4);
            continue;
        }
        if errno != 0 && errno != libc::ENOENT {
            if errno == libc::EINTR {
                continue;
            }
            return Err(InspectorError::MapSyscall {
                syscall: "BPF_MAP_LOOKUP_BATCH",
                map: name,
                source: std::io::Error::from_raw_os_error(errno),
            });
        }
        let n = count as usize;
        out.keys.extend_from_slice(&keys[..n * key_size]);
        out.values.extend_from_slice(&values[..n * value_size]);
        out.count += n;
        if errno == libc::ENOENT {
            break;
        }
        token_in = token_out;
        first = false;
    }
    Ok(out)
}

/// Creates an inner hash map for one sandbox (see `*_inner` in the BPF source).
pub(crate) fn create_inner(
    name: &'static str,
    key_size: usize,
    value_size: usize,
    max_entries: u32,
    no_prealloc: bool,
) -> Result<MapHandle, InspectorError> {
    let opts = libbpf_sys::bpf_map_create_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as _,
        map_flags: if no_prealloc { libbpf_sys::BPF_F_NO_PREALLOC } else { 0 },
        ..Default::default()
    };
    MapHandle::create(
        libbpf_rs::MapType::Hash,
        Some(name),
        key_size as u32,
        value_size as u32,
        max_entries,
        &opts,
    )
    .map_err(|e| InspectorError::MapSyscall {
        syscall: "BPF_MAP_CREATE",
        map: name,
        source: std::io::Error::other(e.to_string()),
    })
}

/// Points slot `idx` of an array-of-maps at `inner`.
pub(crate) fn set_inner(
    outer: &MapHandle,
    name: &'static str,
    idx: u32,
    inner: &MapHandle,
) -> Result<(), InspectorError> {
    let fd = inner.as_fd().as_raw_fd() as u32;
    update(outer, name, &idx.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
}

/// Deletes the keys of `d` from `map` (one BPF_MAP_DELETE_BATCH, falling back to one delete per
/// key when a key is already gone).
pub(crate) fn delete_all(
    map: &MapHandle,
    name: &'static str,
    d: &Dump,
) -> Result<(), InspectorError> {
    if d.count == 0 {
        return Ok(());
    }
    let keys = &d.keys[..d.count * d.key_size];
    if map.delete_batch(keys, d.count as u32, MapFlags::ANY, MapFlags::ANY).is_ok() {
        return Ok(());
    }
    delete_keys(map, name, keys.chunks_exact(d.key_size.max(1)))
}

/// Deletes keys, ignoring those already gone.
pub(crate) fn delete_keys<'a>(
    map: &MapHandle,
    name: &'static str,
    keys: impl Iterator<Item = &'a [u8]>,
) -> Result<(), InspectorError> {
    for k in keys {
        if let Err(e) = map.delete(k) {
            if e.kind() != libbpf_rs::ErrorKind::NotFound {
                return Err(InspectorError::MapSyscall {
                    syscall: "BPF_MAP_DELETE_ELEM",
                    map: name,
                    source: std::io::Error::other(e.to_string()),
                });
            }
        }
    }
    Ok(())
}

/// Inserts or replaces one element.
pub(crate) fn update(
    map: &MapHandle,
    name: &'static str,
    key: &[u8],
    value: &[u8],
    flags: MapFlags,
) -> Result<(), InspectorError> {
    map.update(key, value, flags).map_err(|e| InspectorError::MapSyscall {
        syscall: "BPF_MAP_UPDATE_ELEM",
        map: name,
        source: std::io::Error::other(e.to_string()),
    })
}

/// The mmapped `.bss` of the loaded object.
#[derive(Debug)]
pub(crate) struct Bss {
    base: *mut u8,
}

// SAFETY: the pointer refers to the object's mmapped global data, which lives as long as the
// object (owned next to it by `Inner`) and is only ever accessed through atomics.
unsafe impl Send for Bss {}
// SAFETY: as above; all accesses are atomic.
unsafe impl Sync for Bss {}

impl Bss {
    /// # Safety
    /// `base` must point to the mmapped `.bss` of the inspector object, which must outlive
    /// this value.
    pub unsafe fn new(base: *mut u8) -> Bss {
        Bss { base }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= BSS_LEVEL_MASK);
        // SAFETY: `off` is 8-aligned and inside the sstates array of the mmapped `.bss`
        // (asserted by callers through the sbx < MAX_SBX check), which is page aligned and
        // outlives `self`; the BPF side accesses these words atomically or by aligned loads.
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast::<u64>()) }
    }

    /// A u64 field of the sandbox's `struct sstate`.
    pub fn sstate(&self, sbx: u32, field: usize) -> &AtomicU64 {
        let sbx = (sbx as usize) % MAX_SBX;
        self.u64_at(sbx * SSTATE_SIZE + field)
    }

    /// Slot `i` of the `muted_tracers` global.
    pub fn muted_tracer(&self, i: usize) -> &AtomicU32 {
        let i = i % MUTED_SLOTS;
        // SAFETY: `muted_tracers` is a u32[4] right after `level_mask` in `.bss` (4-aligned),
        // `i` < 4, and the mapping outlives `self`.
        unsafe { AtomicU32::from_ptr(self.base.add(BSS_MUTED + 4 * i).cast::<u32>()) }
    }

    /// The `min_level` global.
    pub fn min_level(&self) -> &AtomicU32 {
        // SAFETY: `min_level` is a 4-aligned u32 at BSS_MIN_LEVEL in `.bss` (checked against
        // the skeleton's layout by the layout test), which outlives `self`.
        unsafe { AtomicU32::from_ptr(self.base.add(BSS_MIN_LEVEL).cast::<u32>()) }
    }

    /// The `level_mask` global.
    pub fn level_mask(&self) -> &AtomicU32 {
        // SAFETY: `level_mask` is a 4-aligned u32 right after the sstates array in `.bss`,
        // which outlives `self`.
        unsafe { AtomicU32::from_ptr(self.base.add(BSS_LEVEL_MASK).cast::<u32>()) }
    }
}
