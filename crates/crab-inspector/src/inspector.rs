//! [`Inspector`]: loads the BPF object once per host, registers sandboxes by cgroup, and at each
//! turn boundary reads one sandbox's turn state (summary words in the mmapped `.bss`, its slot of
//! the change map, its processes) into a [`Verdict`], resetting the turn when asked to.

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use libbpf_rs::skel::{OpenSkel as _, Skel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle, OpenObject};
use serde::Serialize;

use crate::abi::{
    kdev_split, CKey, Change, PathRec, ProcRec, CHANGE_SIZE, CKEY_SIZE, MAX_SBX, MUTED_SLOTS,
    PREC_SIZE, PROC_SIZE, PR_DEAD, SS_EPOCH, SS_EVENTS, SS_FLAGS, SS_INFLIGHT, SS_NS_INFLIGHT,
    S_FOREIGN_MEM, S_FS_UNKNOWN, S_MOUNT, S_NS, S_OVERFLOW, S_PATH_FAULT, S_PENDING_LOST,
    S_PROC_OVERFLOW, S_PROC_STATE, S_SHM, S_UNTRACKABLE,
};
use crab_common::CheckpointKind;

use crate::error::InspectorError;
use crate::maps::{self, Bss};
use crate::pool::{KeyPool, Outer, SandboxMaps};
use crate::procfs;
use crate::skel::{InspectorSkel, InspectorSkelBuilder};
use crate::verdict::{build_changeset, decide, ChangeOp, TurnFacts, Verdict};

/// How long `take` waits for handlers still recording into the closing turn.
const QUIESCE_LIMIT: Duration = Duration::from_millis(200);

/// What [`Inspector::attach`] registered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SandboxHandle {
    /// Sandbox name.
    pub sandbox: String,
    /// Key of the sandbox in the BPF maps (0..256).
    pub key: u32,
    /// cgroup v2 id (inode number of the cgroup directory).
    pub cgroup_id: u64,
    /// Level of the cgroup below the cgroup2 root.
    pub level: u32,
    /// Processes found in the cgroup tree at attach time (the first baseline).
    pub initial_processes: usize,
}

/// Run statistics of one BPF program (counted only while `kernel.bpf_stats_enabled` is 1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProgramStats {
    /// Program name.
    pub name: String,
    /// Number of runs.
    pub run_count: u64,
    /// Total run time in ns.
    pub run_time_ns: u64,
}

/// Counters of one sandbox's current turn (cheap, no map iteration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TurnStats {
    /// Turn number.
    pub turn: u64,
    /// Distinct fs records created in this turn so far.
    pub fs_records: u64,
    /// Raw summary flags of the turn (see `src/bpf/inspector.h`).
    pub flags: u64,
}

#[derive(Debug)]
struct Reg {
    handle: SandboxHandle,
    /// Reasons carried into the next verdict (e.g. a turn that did not quiesce).
    carry: Vec<String>,
    /// Epoch of turn 1 (sandbox keys are reused; their epochs only grow).
    first_epoch: u64,
    maps: SandboxMaps,
    /// The sandbox's declared harness ([`Inspector::set_harness`]).
    harness: Option<crate::harness::Harness>,
    /// Changes under harness paths were left out since the last turn that took a snapshot.
    harness_dirty: bool,
    /// The sandbox's cgroup directory (its processes, for a new baseline after a repair).
    cgroup_dir: PathBuf,
}

struct Loaded {
    _skel: InspectorSkel<'static>,
    _links: Vec<Link>,
    progs: Vec<(String, OwnedFd)>,
}

// SAFETY: after loading, the skeleton is only kept alive (never used through shared references
// from several threads; all map access goes through owned MapHandles and the atomics in `Bss`).
// libbpf's Object is itself Send + Sync in libbpf-rs.
unsafe impl Send for Loaded {}

struct Inner {
    bss: Bss,
    cgmap: MapHandle,
    sandboxes: HashMap<String, Reg>,
    keys: KeyPool,
    level_refs: [u32; 32],
    // Dropped last: the bss mapping belongs to it.
    loaded: Loaded,
}

/// The host's inspector: one per daemon. Thread-safe; calls are serialized internally.
pub struct Inspector {
    inner: Mutex<Inner>,
    programs: usize,
}

impl std::fmt::Debug for Inspector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inspector").field("programs", &self.programs).finish_non_exhaustive()
    }
}

fn bpf_err(
    stage: &'static str,
    what: Option<String>,
) -> impl FnOnce(libbpf_rs::Error) -> InspectorError {
    move |source| InspectorError::Bpf { stage, what, source }
}

impl Inspector {
    /// Loads and attaches the BPF programs. Fails with a clear error when not root or when the
    /// kernel lacks BPF tracepoint support.
    pub fn load() -> Result<Self, InspectorError> {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        if uid != 0 {
            return Err(InspectorError::NotRoot { uid });
        }
        // The skeleton borrows its OpenObject for its whole life; the daemon loads once, so a
        // leaked box is the simplest owner.
        let open_obj: &'static mut MaybeUninit<OpenObject> =
            Box::leak(Box::new(MaybeUninit::uninit()));
        let open = InspectorSkelBuilder::default().open(open_obj).map_err(bpf_err("open", None))?;
        let mut skel = open.load().map_err(bpf_err("load", None))?;
        let mut links = Vec::new();
        let mut progs = Vec::new();
        for p in skel.object().progs_mut() {
            let name = p.name().to_string_lossy().into_owned();
            if let Ok(fd) = p.as_fd().try_clone_to_owned() {
                progs.push((name.clone(), fd));
            }
            links.push(p.attach().map_err(bpf_err("attach", Some(name)))?);
        }
        let programs = links.len();
        let handle = |m: &libbpf_rs::MapMut<'_>, name: &str| {
            MapHandle::try_from(m).map_err(bpf_err("map dup", Some(name.to_string())))
        };
        let cgmap = handle(&skel.maps.cgmap, "cgmap")?;
        let changes_of = handle(&skel.maps.changes_of, "changes_of")?;
        let paths_of = handle(&skel.maps.paths_of, "paths_of")?;
        let procs_of = handle(&skel.maps.procs_of, "procs_of")?;
        check_size(
            &handle(&skel.maps.changes_tmpl, "changes")?,
            "changes",
            CKEY_SIZE,
            CHANGE_SIZE,
        )?;
        check_size(&handle(&skel.maps.paths_tmpl, "paths")?, "paths", CKEY_SIZE, PREC_SIZE)?;
        check_size(&handle(&skel.maps.procs_tmpl, "procs")?, "procs", 4, PROC_SIZE)?;
        check_bss_layout()?;
        let bss_ref = skel.maps.bss_data.take().ok_or_else(|| InspectorError::Bpf {
            stage: "mmap",
            what: Some(".bss".into()),
            source: libbpf_rs::Error::from(std::io::Error::other("the .bss map is not mmapped")),
        })?;
        // SAFETY: the reference came from the skeleton's mmapped .bss; the skeleton is stored in
        // `Inner::loaded`, declared after `bss`, so the mapping outlives every use of it.
        let bss = unsafe { Bss::new(std::ptr::from_mut(bss_ref).cast::<u8>()) };
        tracing::info!(programs, "inspector loaded");
        Ok(Inspector {
            inner: Mutex::new(Inner {
                bss,
                cgmap,
                sandboxes: HashMap::new(),
                keys: KeyPool::new(MAX_SBX as u32, Outer { changes_of, paths_of, procs_of })?,
                level_refs: [0; 32],
                loaded: Loaded { _skel: skel, _links: links, progs },
            }),
            programs,
        })
    }

    /// Run counts and times of the BPF programs (enable `kernel.bpf_stats_enabled` to count).
    pub fn program_stats(&self) -> Result<Vec<ProgramStats>, InspectorError> {
        let g = self.lock()?;
        let mut out = Vec::new();
        for (name, fd) in &g.loaded.progs {
            let mut info = libbpf_rs::libbpf_sys::bpf_prog_info::default();
            let mut len = std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_prog_info>() as u32;
            // SAFETY: `info` is a properly sized, writable bpf_prog_info and `len` says so; the
            // fd is a valid program fd owned by `g`.
            let rc = unsafe {
                libbpf_rs::libbpf_sys::bpf_prog_get_info_by_fd(
                    fd.as_raw_fd(),
                    std::ptr::from_mut(&mut info),
                    &mut len,
                )
            };
            if rc != 0 {
                return Err(InspectorError::MapSyscall {
                    syscall: "BPF_OBJ_GET_INFO_BY_FD",
                    map: "program",
                    source: std::io::Error::from_raw_os_error(-rc),
                });
            }
            out.push(ProgramStats {
                name: name.clone(),
                run_count: info.run_cnt,
                run_time_ns: info.run_time_ns,
            });
        }
        Ok(out)
    }

    /// Declares `pid` (a CRIU process run by the host) as a tracer whose work inside sandbox
    /// tasks is not the sandboxes': while a task is ptrace-controlled by it (a dump's parasite)
    /// nothing is recorded for it, and the restart of the syscall the dump interrupted does not
    /// count as the task running. Without this, every process dump makes the next turn a
    /// process turn. Mute before that process touches the tasks (e.g. the `criu swrk` pid as
    /// soon as it is spawned, before sending it a request). At most 4 at once.
    pub fn mute_tracer(&self, pid: u32) -> Result<(), InspectorError> {
        let g = self.lock()?;
        for i in 0..MUTED_SLOTS {
            if g.bss.muted_tracer(i).load(Ordering::SeqCst) == pid {
                return Ok(());
            }
        }
        for i in 0..MUTED_SLOTS {
            if g.bss
                .muted_tracer(i)
                .compare_exchange(0, pid, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                return Ok(());
            }
        }
        Err(InspectorError::TooManyTracers { max: MUTED_SLOTS })
    }

    /// Undoes [`Inspector::mute_tracer`].
    pub fn unmute_tracer(&self, pid: u32) {
        if let Ok(g) = self.lock() {
            for i in 0..MUTED_SLOTS {
                let _ = g.bss.muted_tracer(i).compare_exchange(
                    pid,
                    0,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
            }
        }
    }

    /// Number of attached BPF programs.
    pub fn programs(&self) -> usize {
        self.programs
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>, InspectorError> {
        self.inner.lock().map_err(|_| InspectorError::Poisoned)
    }

    /// Starts tracking the sandbox whose cgroup v2 directory is `cgroup_dir` (its descendants
    /// included). The processes already in it form the first baseline; turn 1 starts now.
    pub fn attach(
        &self,
        sandbox: &str,
        cgroup_dir: &Path,
    ) -> Result<SandboxHandle, InspectorError> {
        let (cgroup_id, level) = procfs::cgroup_id_and_level(cgroup_dir)?;
        let mut g = self.lock()?;
        if g.sandboxes.contains_key(sandbox) {
            return Err(InspectorError::AlreadyAttached(sandbox.to_string()));
        }
        let (key, sm) = g.keys.take()?.ok_or(InspectorError::TooManySandboxes { max: MAX_SBX })?;
        g.attach_key(sandbox, key, sm, cgroup_id, level, cgroup_dir)
    }

    /// Stops tracking a sandbox and drops its state. Unknown names are ignored.
    pub fn detach(&self, sandbox: &str) {
        let Ok(mut g) = self.lock() else { return };
        if let Some(reg) = g.sandboxes.remove(sandbox) {
            g.detach_key(&reg.handle);
            // The maps stay installed in the outer maps: emptied, they serve the next attach.
            g.keys.put_ready(reg.handle.key, reg.maps);
        }
    }

    /// Declare (or, with `None`, clear) the harness of an attached sandbox: from its next
    /// verdict on, harness processes that ran and changes under harness paths are left out
    /// (see `harness.rs`).
    pub fn set_harness(
        &self,
        sandbox: &str,
        harness: Option<crate::harness::Harness>,
    ) -> Result<(), InspectorError> {
        let mut g = self.lock()?;
        let reg = g
            .sandboxes
            .get_mut(sandbox)
            .ok_or_else(|| InspectorError::NotAttached(sandbox.to_string()))?;
        reg.harness = harness;
        Ok(())
    }

    /// The names of the attached sandboxes.
    pub fn sandboxes(&self) -> Vec<String> {
        self.lock().map(|g| g.sandboxes.keys().cloned().collect()).unwrap_or_default()
    }

    /// Cheap counters of the current turn.
    pub fn stats(&self, sandbox: &str) -> Result<TurnStats, InspectorError> {
        let g = self.lock()?;
        let reg = g.reg(sandbox)?;
        let k = reg.handle.key;
        let e = g.bss.sstate(k, SS_EPOCH).load(Ordering::SeqCst);
        let slot = (e & 1) as usize;
        Ok(TurnStats {
            turn: e + 1 - reg.first_epoch,
            fs_records: g.bss.sstate(k, SS_EVENTS + 8 * slot).load(Ordering::SeqCst),
            flags: g.bss.sstate(k, SS_FLAGS + 8 * slot).load(Ordering::SeqCst),
        })
    }

    /// The verdict of the current (open) turn, without resetting it.
    pub fn peek(&self, sandbox: &str) -> Result<Verdict, InspectorError> {
        let mut g = self.lock()?;
        g.verdict(sandbox, false)
    }

    /// The verdict of the current turn, closing it: call when the checkpoint is taken. The next
    /// turn starts empty and its process baseline is the live set now.
    pub fn take(&self, sandbox: &str) -> Result<Verdict, InspectorError> {
        let mut g = self.lock()?;
        g.verdict(sandbox, true)
    }
}

/// The `.bss` offsets user space writes must match the compiled object's.
fn check_bss_layout() -> Result<(), InspectorError> {
    use crate::abi::{BSS_LEVEL_MASK, BSS_MIN_LEVEL, BSS_MUTED, SSTATE_SIZE};
    use crate::skel::types::{bss, sstate};
    let ok = std::mem::size_of::<sstate>() == SSTATE_SIZE
        && std::mem::offset_of!(bss, level_mask) == BSS_LEVEL_MASK
        && std::mem::offset_of!(bss, muted_tracers) == BSS_MUTED
        && std::mem::offset_of!(bss, min_level) == BSS_MIN_LEVEL;
    if ok {
        Ok(())
    } else {
        Err(InspectorError::Bpf {
            stage: "layout check",
            what: Some(".bss".into()),
            source: libbpf_rs::Error::from(std::io::Error::other(
                "the BPF object's global data layout differs from src/abi.rs",
            )),
        })
    }
}

fn check_size(m: &MapHandle, name: &str, k: usize, v: usize) -> Result<(), InspectorError> {
    if m.key_size() as usize != k || m.value_size() as usize != v {
        return Err(InspectorError::Bpf {
            stage: "layout check",
            what: Some(name.to_string()),
            source: libbpf_rs::Error::from(std::io::Error::other(format!(
                "key/value sizes {}/{} differ from the expected {k}/{v}",
                m.key_size(),
                m.value_size()
            ))),
        });
    }
    Ok(())
}

fn flag_reasons(flags: u64, facts: &mut TurnFacts) {
    let c = &mut facts.conservative_reasons;
    if flags & S_OVERFLOW != 0 {
        c.push("the change map was full: a file change may be missing".into());
    }
    if flags & S_UNTRACKABLE != 0 {
        c.push(
            "io_uring_setup, io_setup (AIO), acct or 32-bit/x32 system calls were used: not traced"
                .into(),
        );
    }
    if flags & S_MOUNT != 0 {
        c.push("a mount-family call changed the mount table".into());
    }
    if flags & S_NS != 0 {
        c.push("chroot/pivot_root/unshare/setns changed namespaces".into());
    }
    if flags & S_PENDING_LOST != 0 {
        c.push("the pending-syscall map was full: a path call went unrecorded".into());
    }
    if flags & S_PROC_OVERFLOW != 0 {
        c.push("the process map was full: a process change may be missing".into());
    }
    if flags & S_PROC_STATE != 0 {
        facts.proc_reasons.push(
            "IPC objects, the hostname, or another process's limits or scheduling were changed"
                .into(),
        );
    }
    if flags & S_SHM != 0 {
        facts.proc_reasons.push(
            "shared memory (memfd, SysV shm or an unlinked file) was mapped writable: another process's memory may have changed".into(),
        );
    }
    if flags & S_FOREIGN_MEM != 0 {
        facts.proc_reasons.push(
            "ptrace, process_vm_writev or /proc/<pid>/mem may have changed process memory".into(),
        );
    }
    if flags & (S_FS_UNKNOWN | S_PATH_FAULT) != 0 {
        facts.fs_reasons.push("a file change whose path could not be read".into());
    }
}

impl Inner {
    fn reg(&self, sandbox: &str) -> Result<&Reg, InspectorError> {
        self.sandboxes.get(sandbox).ok_or_else(|| InspectorError::NotAttached(sandbox.to_string()))
    }

    fn set_level_mask(&self) {
        let mut mask = 0u32;
        for (l, &n) in self.level_refs.iter().enumerate() {
            if n > 0 && (1..8).contains(&l) {
                mask |= 1 << l;
            }
        }
        let min = self.level_refs.iter().position(|&n| n > 0).map_or(u32::MAX, |l| l as u32);
        self.bss.min_level().store(min, Ordering::SeqCst);
        self.bss.level_mask().store(mask, Ordering::SeqCst);
    }

    fn attach_key(
        &mut self,
        sandbox: &str,
        key: u32,
        sm: SandboxMaps,
        cgroup_id: u64,
        level: u32,
        dir: &Path,
    ) -> Result<SandboxHandle, InspectorError> {
        let s = &self.bss;
        let epoch = s.sstate(key, SS_EPOCH).load(Ordering::SeqCst).max(1);
        s.sstate(key, SS_EPOCH).store(epoch, Ordering::SeqCst);
        for slot in 0..2 {
            s.sstate(key, SS_FLAGS + 8 * slot).store(0, Ordering::SeqCst);
            s.sstate(key, SS_EVENTS + 8 * slot).store(0, Ordering::SeqCst);
        }
        s.sstate(key, SS_NS_INFLIGHT).store(0, Ordering::SeqCst);
        // `sm` is installed in the outer maps and empty (see `pool`). Baseline: the processes
        // there now; BPF starts attributing once the cgroup id is in cgmap (and keeps what it
        // added: NO_EXIST).
        if let Err(e) = maps::update(
            &self.cgmap,
            "cgmap",
            &cgroup_id.to_ne_bytes(),
            &key.to_ne_bytes(),
            MapFlags::ANY,
        ) {
            self.keys.put_ready(key, sm);
            return Err(e);
        }
        if level >= 8 {
            tracing::warn!(
                sandbox,
                level,
                "cgroup deeper than 7 levels: only its own processes are attributed, not descendants'"
            );
        }
        if let Some(r) = self.level_refs.get_mut(level as usize) {
            *r += 1;
        }
        self.set_level_mask();
        let handle = SandboxHandle {
            sandbox: sandbox.to_string(),
            key,
            cgroup_id,
            level,
            initial_processes: 0,
        };
        let pids = match procfs::cgroup_tree_pids(dir) {
            Ok(p) => p,
            Err(e) => {
                self.detach_key(&handle);
                self.keys.put_ready(key, sm);
                return Err(e);
            }
        };
        let handle = SandboxHandle { initial_processes: pids.len(), ..handle };
        record_baseline(&sm, key, &pids);
        self.sandboxes.insert(
            sandbox.to_string(),
            Reg {
                handle: handle.clone(),
                carry: Vec::new(),
                maps: sm,
                first_epoch: epoch,
                harness: None,
                harness_dirty: false,
                cgroup_dir: dir.to_path_buf(),
            },
        );
        tracing::info!(sandbox, key, cgroup_id, level, "sandbox attached to the inspector");
        Ok(handle)
    }

    /// Checks that what [`Inspector::attach`] registered for `h` is still in the kernel: its
    /// cgroup id in `cgmap`, pointing at its key (a process that can call `bpf(2)` — a
    /// `--privileged` sandbox, or one that escaped — could delete it, and every later turn
    /// would then look unchanged). Missing or altered: put it back and say what was found.
    fn check_registration(&self, h: &SandboxHandle) -> Option<String> {
        let cg = h.cgroup_id.to_ne_bytes();
        let found = match self.cgmap.lookup(&cg, MapFlags::ANY) {
            Ok(Some(v)) if v.len() >= 4 => {
                let mut b = [0u8; 4];
                b.copy_from_slice(&v[..4]);
                let k = u32::from_ne_bytes(b);
                if k == h.key {
                    return None;
                }
                format!("cgroup id {} maps to key {k}, not {}", h.cgroup_id, h.key)
            }
            Ok(_) => format!("cgroup id {} was removed from the cgroup map", h.cgroup_id),
            Err(e) => {
                format!("the cgroup map entry of cgroup id {} is unreadable: {e}", h.cgroup_id)
            }
        };
        if let Err(e) = maps::update(&self.cgmap, "cgmap", &cg, &h.key.to_ne_bytes(), MapFlags::ANY)
        {
            tracing::error!(sandbox = %h.sandbox, error = %e, "could not repair the inspector's cgroup map entry");
        }
        Some(found)
    }

    fn detach_key(&mut self, h: &SandboxHandle) {
        if let Err(e) = self.cgmap.delete(&h.cgroup_id.to_ne_bytes()) {
            tracing::warn!(sandbox = %h.sandbox, error = %e, "cgroup id was not registered");
        }
        if let Some(r) = self.level_refs.get_mut(h.level as usize) {
            *r = r.saturating_sub(1);
        }
        self.set_level_mask();
    }

    fn verdict(&mut self, sandbox: &str, close: bool) -> Result<Verdict, InspectorError> {
        let mut reg = self
            .sandboxes
            .remove(sandbox)
            .ok_or_else(|| InspectorError::NotAttached(sandbox.to_string()))?;
        let r = self.verdict_of(&mut reg, sandbox, close);
        self.sandboxes.insert(sandbox.to_string(), reg);
        r
    }

    fn verdict_of(
        &mut self,
        reg: &mut Reg,
        sandbox: &str,
        close: bool,
    ) -> Result<Verdict, InspectorError> {
        let key = reg.handle.key;
        let mut carry = reg.carry.clone();
        if let Some(what) = self.check_registration(&reg.handle) {
            let m = format!(
                "the inspector's registration of this sandbox was altered ({what}); changes since the last boundary may have gone unrecorded"
            );
            tracing::warn!(
                security_event = true,
                sandbox,
                cgroup_id = reg.handle.cgroup_id,
                key,
                %what,
                "inspector registration tampered with: repaired, verdict full"
            );
            if !close {
                // A peek repairs it; the turn's closing verdict must still say so.
                reg.carry.push(m.clone());
            }
            carry.push(m);
            // Processes born while unregistered have no record: the next time one runs it
            // would count as entering from outside (born in a later turn, which then could
            // not be a file-only checkpoint). This verdict is full and its point holds them:
            // they are the new baseline.
            match procfs::cgroup_tree_pids(&reg.cgroup_dir) {
                Ok(pids) => record_baseline(&reg.maps, key, &pids),
                Err(e) => {
                    tracing::warn!(sandbox, error = %e, "could not list the sandbox's processes after the repair")
                }
            }
        }
        let bss = &self.bss;
        let epoch_w = bss.sstate(key, SS_EPOCH);
        let e = if close {
            epoch_w.fetch_add(1, Ordering::SeqCst)
        } else {
            epoch_w.load(Ordering::SeqCst)
        };
        let slot = (e & 1) as u8;
        let mut next_carry = Vec::new();
        if close {
            // Wait until no handler is still recording into the closing slot.
            let inflight = bss.sstate(key, SS_INFLIGHT + 8 * slot as usize);
            let start = Instant::now();
            let mut spins = 0u32;
            while inflight.load(Ordering::SeqCst) != 0 {
                if start.elapsed() > QUIESCE_LIMIT {
                    let m = "BPF handlers were still recording at the turn boundary".to_string();
                    carry.push(m.clone());
                    next_carry.push(m);
                    break;
                }
                spins += 1;
                if spins > 1000 {
                    std::thread::sleep(Duration::from_micros(50));
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        let flags_w = bss.sstate(key, SS_FLAGS + 8 * slot as usize);
        let flags =
            if close { flags_w.swap(0, Ordering::SeqCst) } else { flags_w.load(Ordering::SeqCst) };
        if close {
            bss.sstate(key, SS_EVENTS + 8 * slot as usize).store(0, Ordering::SeqCst);
        }

        // The turn's file records.
        let si = slot as usize;
        let d = maps::dump(&reg.maps.changes[si], "changes")?;
        let mut entries: Vec<(CKey, Change, Option<PathRec>)> = Vec::new();
        for (k, v) in d.iter() {
            let ck = CKey::parse(k);
            let rec = match reg.maps.paths[si].lookup(k, MapFlags::ANY) {
                Ok(Some(b)) => Some(PathRec::parse(&b)),
                Ok(None) => None,
                Err(e) => {
                    tracing::debug!(error = %e, "path record lookup failed");
                    None
                }
            };
            entries.push((ck, Change::parse(v), rec));
        }
        if close && d.count > 0 {
            // Drained (no handler can be recording into this slot now): empty it. Deleting is
            // much cheaper than swapping in new inner maps, whose update waits for an RCU grace
            // period (~15 ms each).
            maps::delete_all(&reg.maps.changes[si], "changes", &d)?;
            maps::delete_all(&reg.maps.paths[si], "paths", &d)?;
        }
        let mut facts = TurnFacts { changeset: build_changeset(&entries), ..Default::default() };
        facts.conservative_reasons.append(&mut carry);
        flag_reasons(flags, &mut facts);

        // Processes.
        let p = maps::dump(&reg.maps.procs, "procs")?;
        let mut long_lived: Vec<u32> = Vec::new();
        let mut lineage: HashMap<u32, crate::harness::Lineage> = HashMap::new();
        let mut gc: Vec<Vec<u8>> = Vec::new();
        for (k, v) in p.iter() {
            let pr = ProcRec::parse(v);
            if pr.sbx != key {
                continue;
            }
            let mut kb = [0u8; 4];
            kb.copy_from_slice(&k[..4]);
            let pid = u32::from_ne_bytes(kb);
            let dead = pr.flags & PR_DEAD != 0;
            let died_by_end = dead && pr.died_epoch <= e;
            if pr.born_epoch == e {
                if !died_by_end {
                    facts.processes.born.push(pid);
                }
            } else if pr.born_epoch < e {
                if dead && pr.died_epoch == e {
                    facts.processes.died.push(pid);
                } else if !died_by_end {
                    lineage.insert(
                        pid,
                        crate::harness::Lineage {
                            born_epoch: pr.born_epoch,
                            exec_epoch: pr.exec_epoch,
                        },
                    );
                    if pr.ran_epoch.max(pr.exec_epoch) >= e {
                        facts.processes.ran.push(pid);
                    } else {
                        long_lived.push(pid);
                    }
                }
            }
            if close && died_by_end {
                gc.push(k.to_vec());
            }
        }
        if close {
            maps::delete_keys(&reg.maps.procs, "procs", gc.iter().map(Vec::as_slice))?;
        }
        // A process running continuously since before the turn has not been switched out yet.
        for &pid in &long_lived {
            if procfs::state(pid) == Some('R') {
                facts.processes.ran.push(pid);
            }
        }
        long_lived.retain(|p| !facts.processes.ran.contains(p));
        if let Some(h) = &reg.harness {
            harness_split(h, &mut facts, &lineage);
        }
        mapped_file_checks(&mut facts, &long_lived);
        facts.processes.born.sort_unstable();
        facts.processes.died.sort_unstable();
        facts.processes.ran.sort_unstable();

        if close {
            reg.carry = next_carry;
        }
        let dirty = reg.harness_dirty || facts.processes.harness_path_changes > 0;
        let mut v = decide(sandbox, e + 1 - reg.first_epoch, facts);
        if dirty && v.kind == CheckpointKind::Process {
            // A dump pairs with the newest snapshot; the harness's files changed since it
            // (left out of the verdicts), and CRIU refuses an open file whose size moved.
            v.kind = CheckpointKind::Full;
            v.reasons.push(
                "files under the harness paths changed since the last snapshot: the dump takes a new one"
                    .into(),
            );
        }
        if close {
            reg.harness_dirty =
                dirty && !matches!(v.kind, CheckpointKind::Fs | CheckpointKind::Full);
        }
        Ok(v)
    }
}

/// Move the harness processes out of `ran` (keeping them for the mapped-file rules, which
/// they obey like any process that ran) and drop exact changes under harness paths (a rename
/// counts unless both its ends are covered).
fn harness_split(
    h: &crate::harness::Harness,
    facts: &mut TurnFacts,
    lineage: &HashMap<u32, crate::harness::Lineage>,
) {
    if h.has_cmd() {
        let ran = std::mem::take(&mut facts.processes.ran);
        for pid in ran {
            match lineage.get(&pid) {
                Some(l) if crate::harness::is_harness(h, pid, *l) => {
                    facts.processes.harness_ran.push(pid)
                }
                _ => facts.processes.ran.push(pid),
            }
        }
    }
    let before = facts.changeset.len();
    facts.changeset.retain(|c| {
        let covered = c.exact && h.covers_path(&c.path);
        let from_covered = match &c.op {
            ChangeOp::Rename { from } => h.covers_path(from),
            _ => true,
        };
        !(covered && from_covered)
    });
    facts.processes.harness_path_changes = before - facts.changeset.len();
}

/// Mapped-file rules, read from /proc at the boundary:
/// - a long-lived process that maps a file changed in this turn is a process change (CRIU could
///   not restore it against the old file);
/// - a deleted or renamed path while a long-lived process maps a deleted file, likewise;
/// - a process that ran while holding a shared writable file mapping may have written the file
///   through memory: a file change.
fn mapped_file_checks(facts: &mut TurnFacts, idle: &[u32]) {
    let changed: HashSet<(u64, u64, u64)> = facts
        .changeset
        .iter()
        .filter_map(|c| c.inode)
        .map(|(dev, ino)| {
            let (ma, mi) = kdev_split(dev);
            (ma, mi, ino)
        })
        .collect();
    let removes =
        facts.changeset.iter().any(|c| matches!(c.op, ChangeOp::Delete | ChangeOp::Rename { .. }));
    let fs_changed = !facts.changeset.is_empty();
    let ran = facts.processes.ran.clone();
    for &pid in ran.iter().chain(idle.iter()) {
        let is_ran = ran.contains(&pid);
        if !is_ran && !fs_changed {
            continue;
        }
        let Some(m) = procfs::mappings(pid) else { continue };
        if is_ran {
            if let Some(p) = m.shared_writable.first() {
                facts
                    .fs_reasons
                    .push(format!("pid {pid} ran with a shared writable mapping of {p}"));
            }
        }
        if !is_ran && fs_changed {
            if let Some(hit) = m.inodes.iter().find(|i| changed.contains(i)) {
                facts.proc_reasons.push(format!(
                    "pid {pid} maps a file changed in this turn (dev {}:{} ino {})",
                    hit.0, hit.1, hit.2
                ));
            } else if removes && !m.deleted.is_empty() {
                facts.proc_reasons.push(format!(
                    "pid {pid} maps a deleted file ({}) and this turn removed paths",
                    m.deleted[0]
                ));
            }
        }
    }
}

/// Records `pids` as processes that were there before the turns being tracked (born in no
/// turn). Keeps any record BPF already made (`NO_EXIST`).
fn record_baseline(sm: &SandboxMaps, key: u32, pids: &[u32]) {
    let rec =
        ProcRec { sbx: key, flags: 0, born_epoch: 0, died_epoch: 0, ran_epoch: 0, exec_epoch: 0 };
    for pid in pids {
        if let Err(e) = sm.procs.update(&pid.to_ne_bytes(), &rec.encode(), MapFlags::NO_EXIST) {
            if e.kind() != libbpf_rs::ErrorKind::AlreadyExists {
                tracing::warn!(pid, error = %e, "could not record a baseline process");
            }
        }
    }
}
