//! The seccomp filter of the default profile: Docker's default profile (moby
//! `profiles/seccomp/default.json`, copied to `seccomp/docker-default.json`) evaluated for
//! x86_64 and Crab's capability set, compiled to classic BPF with Firecracker's `seccompiler`.
//!
//! Refused syscalls return `EPERM` (Docker's `defaultErrnoRet`), so tools degrade instead of
//! dying; `clone3` returns `ENOSYS` so libc falls back to `clone`, whose flags the filter can
//! inspect (no new namespaces). x32 syscalls (the `__X32_SYSCALL_BIT` numbers) match no rule
//! and get `EPERM`; the ia32 entry (a foreign audit arch) is also answered `EPERM` instead of
//! seccompiler's default kill. The unconditional allowlist is generated (`table.rs`, by
//! `scripts/gen-seccomp-table.py`); the argument-filtered rules are below.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

mod table;

/// Namespace flags `clone` may not carry (Docker's mask 0x7E020000: NEWNS, NEWCGROUP,
/// NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET).
const CLONE_NS_MASK: u64 = 0x7E02_0000;
const EPERM: u32 = libc::EPERM as u32;
const ENOSYS: u32 = libc::ENOSYS as u32;

/// A seccomp filter that could not be built or installed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SeccompError(String);

fn e<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> SeccompError {
    move |x| SeccompError(format!("{what}: {x}"))
}

/// How many syscalls the filter allows unconditionally.
pub fn allowed_count() -> usize {
    table::ALLOW_X86_64.len()
}

fn cond(arg: u8, op: SeccompCmpOp, val: u64) -> Result<SeccompRule, SeccompError> {
    let c = SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, val).map_err(e("condition"))?;
    SeccompRule::new(vec![c]).map_err(e("rule"))
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    mismatch: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let f = SeccompFilter::new(rules, mismatch, matched, TargetArch::x86_64)
        .map_err(e("seccomp filter"))?;
    let mut prog: BpfProgram = f.try_into().map_err(e("compile seccomp filter"))?;
    // seccompiler's prologue kills a task calling through a foreign arch (ia32 int 0x80);
    // answer EPERM like every other refusal.
    if let Some(ins) = prog.get_mut(2) {
        if ins.code == 0x06 && ins.k == libc::SECCOMP_RET_KILL_PROCESS {
            ins.k = libc::SECCOMP_RET_ERRNO | EPERM;
        }
    }
    Ok(prog)
}

/// The two programs of the default profile: the allowlist (everything else EPERM) and the
/// `clone3` → ENOSYS override (installed second, so it wins for `clone3`).
pub fn programs() -> Result<[BpfProgram; 2], SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        table::ALLOW_X86_64.iter().map(|(_, nr)| (*nr, Vec::new())).collect();
    // socket: every family but AF_ALG (38) and AF_VSOCK (40).
    rules.insert(
        libc::SYS_socket,
        vec![
            cond(0, SeccompCmpOp::Lt, 38)?,
            cond(0, SeccompCmpOp::Eq, 39)?,
            cond(0, SeccompCmpOp::Gt, 40)?,
        ],
    );
    // personality: only the harmless personas Docker allows.
    rules.insert(
        libc::SYS_personality,
        [0u64, 8, 0x20000, 0x20008, 0xffff_ffff]
            .iter()
            .map(|v| cond(0, SeccompCmpOp::Eq, *v))
            .collect::<Result<_, _>>()?,
    );
    // clone: no namespace flags.
    rules.insert(libc::SYS_clone, vec![cond(0, SeccompCmpOp::MaskedEq(CLONE_NS_MASK), 0)?]);
    let allow = compile(rules, SeccompAction::Errno(EPERM), SeccompAction::Allow)?;
    let clone3 = compile(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(ENOSYS),
    )?;
    Ok([allow, clone3])
}

/// The default profile's filters, compiled (by the daemon, once) and carried to the helpers in
/// their spec: each program is the base64 of its `sock_filter` array (8 bytes per instruction:
/// code u16, jt u8, jf u8, k u32, little-endian), so an exec only decodes and installs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompiledFilters {
    /// The programs in installation order.
    pub programs: Vec<String>,
}

impl CompiledFilters {
    fn encode(progs: &[BpfProgram]) -> Self {
        let programs = progs
            .iter()
            .map(|p| {
                let mut b = Vec::with_capacity(p.len() * 8);
                for i in p {
                    b.extend_from_slice(&i.code.to_le_bytes());
                    b.push(i.jt);
                    b.push(i.jf);
                    b.extend_from_slice(&i.k.to_le_bytes());
                }
                base64::engine::general_purpose::STANDARD.encode(b)
            })
            .collect();
        CompiledFilters { programs }
    }

    fn decode(&self) -> Result<Vec<BpfProgram>, SeccompError> {
        self.programs
            .iter()
            .map(|s| {
                let b = base64::engine::general_purpose::STANDARD
                    .decode(s)
                    .map_err(e("decode compiled seccomp filter"))?;
                if b.is_empty() || b.len() % 8 != 0 {
                    return Err(SeccompError(format!(
                        "compiled seccomp filter has {} bytes, not a whole number of instructions",
                        b.len()
                    )));
                }
                Ok(b.chunks_exact(8)
                    .map(|c| seccompiler::sock_filter {
                        code: u16::from_le_bytes([c[0], c[1]]),
                        jt: c[2],
                        jf: c[3],
                        k: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
                    })
                    .collect())
            })
            .collect()
    }
}

/// The default profile's filters, compiled on the first call of this process and cached.
pub fn compiled() -> Result<&'static CompiledFilters, SeccompError> {
    static CACHE: OnceLock<CompiledFilters> = OnceLock::new();
    if let Some(c) = CACHE.get() {
        return Ok(c);
    }
    let c = CompiledFilters::encode(&programs()?);
    Ok(CACHE.get_or_init(|| c))
}

/// Install the default profile's filters on the calling thread (sets `no_new_privs`): the
/// precompiled `filters` from the spec when given, else compiled here.
pub fn install(filters: Option<&CompiledFilters>) -> Result<(), SeccompError> {
    let progs = match filters {
        Some(f) => f.decode()?,
        None => programs()?.to_vec(),
    };
    for p in progs {
        seccompiler::apply_filter(&p).map_err(e("seccomp(SECCOMP_SET_MODE_FILTER)"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated table matches the copy of Docker's profile: every name it allows
    /// unconditionally for our capability set is in the table, or known not to exist on x86_64,
    /// or one of the hand-written argument rules.
    #[test]
    fn table_covers_docker_profile() {
        let prof: serde_json::Value =
            serde_json::from_str(include_str!("seccomp/docker-default.json")).expect("json");
        let first = &prof["syscalls"][0];
        assert_eq!(first["action"], "SCMP_ACT_ALLOW");
        for n in first["names"].as_array().expect("names") {
            let n = n.as_str().expect("name");
            let known = table::ALLOW_X86_64.iter().any(|(t, _)| *t == n)
                || table::NOT_ON_X86_64.contains(&n)
                || ["socket", "personality", "clone", "clone3"].contains(&n);
            assert!(known, "{n} from docker-default.json is missing from table.rs");
        }
        for denied in [
            "bpf",
            "mount",
            "umount2",
            "unshare",
            "setns",
            "keyctl",
            "add_key",
            "request_key",
            "kexec_load",
            "init_module",
            "finit_module",
            "delete_module",
            "perf_event_open",
            "reboot",
            "swapon",
            "swapoff",
            "settimeofday",
            "clock_settime",
            "open_by_handle_at",
            "userfaultfd",
            "pivot_root",
            "move_mount",
            "fsopen",
            "open_tree",
            "iopl",
            "ioperm",
            "acct",
            "syslog",
            "quotactl",
        ] {
            assert!(!table::ALLOW_X86_64.iter().any(|(t, _)| *t == denied), "{denied} allowed");
        }
        assert!(table::ALLOW_X86_64.iter().any(|(t, _)| *t == "chroot"));
    }

    #[test]
    fn programs_compile() {
        let [a, b] = programs().expect("compile");
        assert!(a.len() > 300 && a.len() < u16::MAX as usize, "{}", a.len());
        assert!(!b.is_empty());
        assert_eq!(a[2].k, libc::SECCOMP_RET_ERRNO | EPERM);
    }

    #[test]
    fn compiled_filters_round_trip() {
        let progs = programs().expect("compile");
        let c = compiled().expect("compiled");
        let back = c.decode().expect("decode");
        assert_eq!(back.len(), 2);
        for (a, b) in progs.iter().zip(&back) {
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert_eq!((x.code, x.jt, x.jf, x.k), (y.code, y.jt, y.jf, y.k));
            }
        }
        let bad = CompiledFilters { programs: vec!["AAAA".into()] };
        assert!(bad.decode().is_err(), "3 bytes are not an instruction");
    }
}
