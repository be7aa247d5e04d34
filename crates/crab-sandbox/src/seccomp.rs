//! The seccomp filter of the default profile: Docker's default profile (moby
//! `profiles/seccomp/default.json`, copied to `seccomp/docker-default.json`) evaluated for
//! x86_64 and Crab's capability set, compiled to classic BPF with libseccomp (the library
//! Docker and runc use), as one binary-search program.
//!
//! Refused syscalls return `EPERM` (Docker's `defaultErrnoRet`), so tools degrade instead of
//! dying; `clone3` returns `ENOSYS` so libc falls back to `clone`, whose flags the filter can
//! inspect (no new namespaces). x32 syscalls (the `__X32_SYSCALL_BIT` numbers) and the ia32
//! entry (a foreign audit arch) are answered `EPERM` too. The unconditional allowlist is
//! generated (`table.rs`, by `scripts/gen-seccomp-table.py`); the argument-filtered rules are
//! below.
//!
//! Why libseccomp and its binary tree (`SCMP_FLTATR_CTL_OPTIMIZE` 2): the kernel's cost of
//! *attaching* a filter grows with the instructions each syscall number runs through, because
//! it emulates the filter for every syscall number to fill its action cache. seccompiler's
//! linear program (≈ 1,600 instructions for this profile) cost ≈ 1.5–4 ms per `execve`'d
//! command; the tree runs a few dozen instructions per number (`max_path` in the tests).

use std::io::{Read, Seek};
use std::sync::OnceLock;

use base64::Engine as _;
use libseccomp::{ScmpAction, ScmpArgCompare, ScmpCompareOp, ScmpFilterContext, ScmpSyscall};
use serde::{Deserialize, Serialize};

mod table;

/// Namespace flags `clone` may not carry (Docker's mask 0x7E020000: NEWNS, NEWCGROUP,
/// NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET).
const CLONE_NS_MASK: u64 = 0x7E02_0000;
const EPERM: i32 = libc::EPERM;

/// btrfs ioctls that need no capability and that a sandbox must not call (issue 33): a
/// subvolume or snapshot made inside a sandbox's root is outside its quota (the qgroup of the
/// root), outside every checkpoint (a snapshot does not descend into nested subvolumes), and
/// makes the root undeletable; `SUBVOL_SETFLAGS` could make the root itself read-only. Values
/// from `linux/btrfs.h` (`_IOW(0x94, nr, size)`): SNAP_CREATE, SUBVOL_CREATE, SNAP_DESTROY,
/// SNAP_CREATE_V2, SUBVOL_CREATE_V2, SUBVOL_SETFLAGS, SNAP_DESTROY_V2.
pub const BTRFS_SUBVOL_IOCTLS: [u64; 7] =
    [0x5000_9401, 0x5000_940e, 0x5000_940f, 0x5000_9417, 0x5000_9418, 0x4008_941a, 0x5000_943f];
const ENOSYS: i32 = libc::ENOSYS;

/// One classic-BPF instruction (the kernel's `struct sock_filter`).
pub type Insn = libc::sock_filter;

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

fn arg0(op: ScmpCompareOp, val: u64) -> ScmpArgCompare {
    ScmpArgCompare::new(0, op, val)
}

/// The default profile as a libseccomp filter context (not loaded).
fn context() -> Result<ScmpFilterContext, SeccompError> {
    let mut f = ScmpFilterContext::new(ScmpAction::Errno(EPERM)).map_err(e("seccomp_init"))?;
    f.set_act_badarch(ScmpAction::Errno(EPERM)).map_err(e("seccomp badarch action"))?;
    f.set_ctl_optimize(2).map_err(e("seccomp binary-tree optimization"))?;
    let allow = |f: &mut ScmpFilterContext, nr: i64, cmp: &[ScmpArgCompare]| {
        let sc = ScmpSyscall::from(nr as i32);
        if cmp.is_empty() {
            f.add_rule(ScmpAction::Allow, sc)
        } else {
            f.add_rule_conditional(ScmpAction::Allow, sc, cmp)
        }
        .map(drop)
        .map_err(|x| SeccompError(format!("seccomp rule for syscall {nr}: {x}")))
    };
    for (_, nr) in table::ALLOW_X86_64 {
        allow(&mut f, *nr, &[])?;
    }
    // socket: every family but AF_ALG (38) and AF_VSOCK (40) (rules of one syscall are ORed).
    for c in [
        arg0(ScmpCompareOp::Less, 38),
        arg0(ScmpCompareOp::Equal, 39),
        arg0(ScmpCompareOp::Greater, 40),
    ] {
        allow(&mut f, libc::SYS_socket, &[c])?;
    }
    // personality: only the harmless personas Docker allows.
    for v in [0u64, 8, 0x20000, 0x20008, 0xffff_ffff] {
        allow(&mut f, libc::SYS_personality, &[arg0(ScmpCompareOp::Equal, v)])?;
    }
    // clone: no namespace flags.
    allow(&mut f, libc::SYS_clone, &[arg0(ScmpCompareOp::MaskedEqual(CLONE_NS_MASK), 0)])?;
    f.add_rule(ScmpAction::Errno(ENOSYS), ScmpSyscall::from(libc::SYS_clone3 as i32))
        .map_err(e("seccomp rule for clone3"))?;
    Ok(f)
}

/// The second program: everything allowed but `ioctl` with a btrfs subvolume request
/// ([`BTRFS_SUBVOL_IOCTLS`]). A program of its own because libseccomp lets an unconditional
/// `ALLOW` of a syscall (Docker's profile allows `ioctl` whole) override any argument rule of
/// that syscall in the same filter, and an `ERRNO(EPERM)` rule cannot be added to a filter
/// whose default action is that same `ERRNO(EPERM)`. The kernel runs both (the stricter
/// answer wins); every syscall but `ioctl` is a constant `ALLOW` here, which the kernel's
/// action cache answers without running it. The kernel reads the request as an `unsigned
/// int`, so only its low 32 bits are compared (a set upper half must not slip past).
fn ioctl_context() -> Result<ScmpFilterContext, SeccompError> {
    let mut f = ScmpFilterContext::new(ScmpAction::Allow).map_err(e("seccomp_init (ioctl)"))?;
    // A foreign architecture is the first program's to refuse.
    f.set_act_badarch(ScmpAction::Allow).map_err(e("seccomp badarch action (ioctl)"))?;
    for req in BTRFS_SUBVOL_IOCTLS {
        f.add_rule_conditional(
            ScmpAction::Errno(EPERM),
            ScmpSyscall::from(libc::SYS_ioctl as i32),
            &[ScmpArgCompare::new(1, ScmpCompareOp::MaskedEqual(0xffff_ffff), req)],
        )
        .map_err(|x| SeccompError(format!("seccomp rule for ioctl {req:#x}: {x}")))?;
    }
    Ok(f)
}

/// The default profile's programs, in installation order: Docker's profile (everything not
/// allowed gets EPERM, `clone3` ENOSYS), then the btrfs `ioctl` rule ([`ioctl_context`]).
pub fn programs() -> Result<Vec<Vec<Insn>>, SeccompError> {
    Ok(vec![export(&context()?)?, export(&ioctl_context()?)?])
}

fn export(f: &ScmpFilterContext) -> Result<Vec<Insn>, SeccompError> {
    // SAFETY: memfd_create with a NUL-terminated name and no flags beyond CLOEXEC.
    let fd = unsafe { libc::memfd_create(c"crab-seccomp".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(SeccompError(format!(
            "memfd_create for the seccomp export: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: fd was just returned by memfd_create and is owned by nothing else.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    f.export_bpf(&file).map_err(e("seccomp_export_bpf"))?;
    let mut b = Vec::new();
    file.rewind().map_err(e("rewind the seccomp export"))?;
    file.read_to_end(&mut b).map_err(e("read the seccomp export"))?;
    decode_insns(&b)
}

fn decode_insns(b: &[u8]) -> Result<Vec<Insn>, SeccompError> {
    if b.is_empty() || !b.len().is_multiple_of(8) || b.len() / 8 > usize::from(u16::MAX) {
        return Err(SeccompError(format!(
            "seccomp program has {} bytes, not 1 to 65535 whole instructions",
            b.len()
        )));
    }
    Ok(b.chunks_exact(8)
        .map(|c| Insn {
            code: u16::from_ne_bytes([c[0], c[1]]),
            jt: c[2],
            jf: c[3],
            k: u32::from_ne_bytes([c[4], c[5], c[6], c[7]]),
        })
        .collect())
}

/// The default profile's filters, compiled (by the daemon, once) and carried to the helpers in
/// their spec: each program is the base64 of its `sock_filter` array (8 bytes per instruction:
/// code u16, jt u8, jf u8, k u32, in the host's byte order), so an exec only decodes and
/// installs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompiledFilters {
    /// The programs in installation order.
    pub programs: Vec<String>,
}

impl CompiledFilters {
    fn encode(progs: &[Vec<Insn>]) -> Self {
        let programs = progs
            .iter()
            .map(|p| {
                let mut b = Vec::with_capacity(p.len() * 8);
                for i in p {
                    b.extend_from_slice(&i.code.to_ne_bytes());
                    b.push(i.jt);
                    b.push(i.jf);
                    b.extend_from_slice(&i.k.to_ne_bytes());
                }
                base64::engine::general_purpose::STANDARD.encode(b)
            })
            .collect();
        CompiledFilters { programs }
    }

    /// Each program's raw `sock_filter` array, as installed and as the kernel hands it back
    /// (`PTRACE_SECCOMP_GET_FILTER`, so as CRIU dumps it into `seccomp.img`).
    pub fn program_bytes(&self) -> Result<Vec<Vec<u8>>, SeccompError> {
        self.programs
            .iter()
            .map(|s| {
                base64::engine::general_purpose::STANDARD
                    .decode(s)
                    .map_err(e("decode compiled seccomp filter"))
            })
            .collect()
    }

    fn decode(&self) -> Result<Vec<Vec<Insn>>, SeccompError> {
        self.programs
            .iter()
            .map(|s| {
                let b = base64::engine::general_purpose::STANDARD
                    .decode(s)
                    .map_err(e("decode compiled seccomp filter"))?;
                decode_insns(&b)
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

/// Install the default profile's filters on the calling thread, after setting `no_new_privs`
/// (required for an unprivileged filter, and part of the profile): the precompiled `filters`
/// from the spec when given, else compiled here.
pub fn install(filters: Option<&CompiledFilters>) -> Result<(), SeccompError> {
    let progs = match filters {
        Some(f) => f.decode()?,
        None => programs()?,
    };
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(SeccompError(format!(
            "prctl(PR_SET_NO_NEW_PRIVS): {}",
            std::io::Error::last_os_error()
        )));
    }
    for p in progs {
        let len = u16::try_from(p.len())
            .map_err(|_| SeccompError(format!("seccomp program of {} instructions", p.len())))?;
        let prog = libc::sock_fprog { len, filter: p.as_ptr().cast_mut() };
        // SAFETY: `prog` points at `p`, a live array of `len` instructions, for the duration of
        // the call; the kernel copies the program.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0,
                &prog as *const libc::sock_fprog,
            )
        };
        if rc != 0 {
            return Err(SeccompError(format!(
                "seccomp(SECCOMP_SET_MODE_FILTER, {len} instructions): {}",
                std::io::Error::last_os_error()
            )));
        }
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

    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    const AUDIT_ARCH_I386: u32 = 0x4000_0003;
    const X32_BIT: u32 = 0x4000_0000;

    /// Run a classic-BPF seccomp program on (arch, nr, args) the way the kernel does; returns
    /// the action and how many instructions ran. Only the opcodes libseccomp emits.
    fn run(p: &[Insn], arch: u32, nr: u32, args: [u64; 6]) -> (u32, usize) {
        let mut data = [0u32; 16];
        data[0] = nr;
        data[1] = arch;
        for (i, a) in args.iter().enumerate() {
            data[4 + 2 * i] = *a as u32;
            data[5 + 2 * i] = (*a >> 32) as u32;
        }
        let (mut acc, mut x, mut mem) = (0u32, 0u32, [0u32; 16]);
        let (mut pc, mut steps) = (0usize, 0usize);
        loop {
            let i = p[pc];
            steps += 1;
            pc += 1;
            let k = i.k;
            let src = if i.code & 0x08 != 0 { x } else { k };
            match i.code {
                0x20 => acc = data[(k / 4) as usize], // ld [k]
                0x00 => acc = k,                      // ld #k
                0x60 => acc = mem[k as usize],        // ld M[k]
                0x61 => x = mem[k as usize],          // ldx M[k]
                0x01 => x = k,                        // ldx #k
                0x02 => mem[k as usize] = acc,        // st M[k]
                0x03 => mem[k as usize] = x,          // stx M[k]
                0x54 | 0x5c => acc &= src,            // and
                0x44 | 0x4c => acc |= src,            // or
                0x07 => x = acc,                      // tax
                0x87 => acc = x,                      // txa
                0x05 => pc += k as usize,             // ja
                0x15 | 0x1d | 0x25 | 0x2d | 0x35 | 0x3d | 0x45 | 0x4d => {
                    let t = match i.code & 0xf0 {
                        0x10 => acc == src,
                        0x20 => acc > src,
                        0x30 => acc >= src,
                        _ => acc & src != 0,
                    };
                    pc += usize::from(if t { i.jt } else { i.jf });
                }
                0x06 => return (k, steps),   // ret #k
                0x16 => return (acc, steps), // ret a
                c => panic!("opcode {c:#x} at {} not modelled", pc - 1),
            }
        }
    }

    fn act(p: &[Insn], nr: i64, args: [u64; 6]) -> u32 {
        run(p, AUDIT_ARCH_X86_64, nr as u32, args).0
    }

    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
    const DENY: u32 = libc::SECCOMP_RET_ERRNO | EPERM as u32;

    #[test]
    fn program_decides_like_the_profile() {
        let progs = programs().expect("compile");
        assert_eq!(progs.len(), 2);
        let p = &progs[0];
        let z = [0u64; 6];
        for (name, nr) in table::ALLOW_X86_64 {
            assert_eq!(act(p, *nr, z), ALLOW, "{name} ({nr}) must be allowed");
        }
        for nr in [
            libc::SYS_bpf,
            libc::SYS_mount,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_keyctl,
            libc::SYS_perf_event_open,
            libc::SYS_init_module,
            libc::SYS_kexec_load,
            libc::SYS_open_by_handle_at,
            libc::SYS_userfaultfd,
            libc::SYS_reboot,
            libc::SYS_swapon,
            libc::SYS_settimeofday,
        ] {
            assert_eq!(act(p, nr, z), DENY, "syscall {nr} must get EPERM");
        }
        assert_eq!(act(p, libc::SYS_clone3, z), libc::SECCOMP_RET_ERRNO | ENOSYS as u32);
        // ioctl: everything but btrfs subvolume creation, snapshot, deletion and flags, with
        // or without bits in the request's upper half (the kernel ignores them).
        // The kernel's answer: the stricter of the two programs'.
        let both = |nr: i64, args: [u64; 6]| {
            let (a, b) = (act(&progs[0], nr, args), act(&progs[1], nr, args));
            if a == ALLOW {
                b
            } else {
                a
            }
        };
        let ioctl = |req: u64| both(libc::SYS_ioctl, [3, req, 0, 0, 0, 0]);
        assert_eq!((ioctl(0x5401), ioctl(0x5413), ioctl(0xc020_660b)), (ALLOW, ALLOW, ALLOW));
        for req in BTRFS_SUBVOL_IOCTLS {
            assert_eq!(ioctl(req), DENY, "ioctl {req:#x} must get EPERM");
            assert_eq!(ioctl(req | 0xdead_0000_0000_0000), DENY, "ioctl {req:#x} with high bits");
        }
        assert_eq!(ioctl(0x9408), ALLOW, "BTRFS_IOC_SYNC stays allowed");
        // The second program allows every other syscall, on any architecture.
        for (name, nr) in table::ALLOW_X86_64 {
            assert_eq!(act(&progs[1], *nr, z), ALLOW, "{name} ({nr}) must pass the ioctl program");
        }
        assert_eq!(run(&progs[1], AUDIT_ARCH_I386, 54, z).0, ALLOW);
        // socket: AF_INET yes, AF_ALG (38) and AF_VSOCK (40) no, AF_XDP-ish 39 and 44 yes.
        let sock = |fam: u64| act(p, libc::SYS_socket, [fam, 1, 0, 0, 0, 0]);
        assert_eq!(
            (sock(2), sock(38), sock(39), sock(40), sock(44)),
            (ALLOW, DENY, ALLOW, DENY, ALLOW)
        );
        // clone: a thread yes, a new user or pid namespace no.
        let clone = |flags: u64| act(p, libc::SYS_clone, [flags, 0, 0, 0, 0, 0]);
        assert_eq!(clone(0x003d_0f00), ALLOW);
        assert_eq!(clone(libc::CLONE_NEWUSER as u64 | 0x11), DENY);
        assert_eq!(clone(libc::CLONE_NEWPID as u64), DENY);
        let pers = |v: u64| act(p, libc::SYS_personality, [v, 0, 0, 0, 0, 0]);
        assert_eq!(
            (pers(0), pers(8), pers(0xffff_ffff), pers(0x0040_0000)),
            (ALLOW, ALLOW, ALLOW, DENY)
        );
        // x32 numbers and the ia32 entry: EPERM, not a kill.
        assert_eq!(run(p, AUDIT_ARCH_X86_64, X32_BIT | 39, z).0, DENY);
        assert_eq!(run(p, AUDIT_ARCH_I386, 0, z).0, DENY);
    }

    /// What makes attaching cheap: every syscall number runs through a few dozen instructions
    /// (a binary search), not the whole program (the kernel emulates every number at attach).
    #[test]
    fn every_path_is_short() {
        let progs = programs().expect("compile");
        assert!(progs[1].len() <= 24, "the ioctl program has {} instructions", progs[1].len());
        let p = &progs[0];
        let max = (0..600u32).map(|nr| run(p, AUDIT_ARCH_X86_64, nr, [0; 6]).1).max().unwrap_or(0);
        eprintln!("seccomp program: {} instructions, longest path {max}", p.len());
        assert!(max <= 40, "longest path {max} instructions (program {} long)", p.len());
    }

    #[test]
    fn compiled_filters_round_trip() {
        let progs = programs().expect("compile");
        let c = compiled().expect("compiled");
        let back = c.decode().expect("decode");
        assert_eq!(back.len(), progs.len());
        for (a, b) in progs.iter().zip(&back) {
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert_eq!((x.code, x.jt, x.jf, x.k), (y.code, y.jt, y.jf, y.k));
            }
        }
        // The raw arrays (what CRIU dumps) are the same instructions, 8 bytes each.
        let raw = c.program_bytes().expect("bytes");
        assert_eq!(raw.len(), progs.len());
        for (a, r) in progs.iter().zip(&raw) {
            assert_eq!(r.len(), a.len() * 8);
            assert_eq!(decode_insns(r).expect("decode").len(), a.len());
        }
        let bad = CompiledFilters { programs: vec!["AAAA".into()] };
        assert!(bad.decode().is_err(), "3 bytes are not an instruction");
    }
}
