/* Shared layout of the inspector's BPF maps and global data. Owned by crab-inspector; the Rust
 * side mirrors these structs in src/abi.rs (sizes are asserted there). Keep both in sync. */
#ifndef CRAB_INSPECTOR_H
#define CRAB_INSPECTOR_H

#define MAX_SBX 256          /* sandbox keys are 0..MAX_SBX-1 (power of two) */
#define PATH_LEN 256         /* bytes kept of a path string given to a syscall */
#define WALK_LEN 512         /* bytes of a leaf-first, NUL-separated dentry walk */
#define WALK_DEPTH 20        /* dentries (and mount crossings) walked at most */
#define MAX_CHANGES 8192     /* change records per sandbox and turn (more: conservative) */
#define MAX_PROCS 4096       /* tracked processes per sandbox (more: conservative) */

/* change flags (struct change.flags) */
#define C_CREATED (1u << 0)      /* the object was created in this turn (exactly known) */
#define C_MODIFIED (1u << 1)     /* contents written / truncated / fallocated / mmapped shared */
#define C_META (1u << 2)         /* mode, owner, xattr or times changed */
#define C_DELETED (1u << 3)      /* a name was removed (unlink, rmdir) */
#define C_RENAMED (1u << 4)      /* the name is the target of a rename (prec.p2 = from) */
#define C_LINKED (1u << 5)       /* the name is a new hard link */
#define C_DIR (1u << 6)          /* mkdir / rmdir */
#define C_SYMLINK (1u << 7)      /* symlink creation */
#define C_NODE (1u << 8)         /* mknod */
#define C_NOCANCEL (1u << 9)     /* may not be cancelled by a later unlink */
#define C_MMAP (1u << 10)        /* shared writable mapping */
#define C_FD (1u << 11)          /* recorded from an fd (inode key) */

/* key kinds */
#define K_INODE 0  /* a = dev, b = ino */
#define K_NAME 1   /* a = parent dir dev, b = parent dir ino, c = hash(leaf name) */
#define K_GIVEN 2  /* a = base dir dev, b = base dir ino, c = hash(path as given) */

/* prec.have */
#define P_P1 (1u << 0)
#define P_P2 (1u << 1)
#define P_WALK (1u << 2)        /* walk holds the file (inode key) or base dir (name keys) */
#define P_WALK_FULL (1u << 3)   /* the walk reached the process root */
#define P_P1_TRUNC (1u << 4)
#define P_P2_TRUNC (1u << 5)
#define P_WALK_IS_FILE (1u << 6)

/* per-slot summary flags (struct sstate.flags[slot]) */
#define S_OVERFLOW (1ull << 0)     /* the change map was full: an update was lost */
#define S_UNTRACKABLE (1ull << 1)  /* io_uring_setup or similar */
#define S_MOUNT (1ull << 2)        /* mount-family call */
#define S_NS (1ull << 3)           /* chroot, pivot_root, unshare, setns */
#define S_FOREIGN_MEM (1ull << 4)  /* ptrace / process_vm_writev */
#define S_PENDING_LOST (1ull << 5) /* the pending-syscall map was full */
#define S_PROC_OVERFLOW (1ull << 6)/* the process map was full */
#define S_PATH_FAULT (1ull << 7)   /* a path could not be read after a successful call */
#define S_FS_UNKNOWN (1ull << 8)   /* an fs change whose object could not be resolved */
#define S_PROC_EVENT (1ull << 9)   /* any process birth/death/exec (stats only) */
#define S_PROC_STATE (1ull << 11) /* IPC objects, hostname, another process's limits/scheduling */
#define S_SHM (1ull << 10)         /* shared memory mapped writable (memfd, shm, deleted file) */

/* process flags (struct proc.flags) */
#define PR_DEAD (1u << 0)

struct ckey {
	__u32 sbx;
	__u8 slot;
	__u8 kind;
	__u16 pad;
	__u64 a;
	__u64 b;
	__u64 c;
};

struct change {
	__u32 flags;
	__u32 mode;      /* i_mode when known */
	__u64 gen;       /* ns_gen when created (cancellation guard) */
	__u64 dev;       /* inode of a created name, when known */
	__u64 ino;
	__u64 alias_a;   /* the other name key of a created file (kind in alias_kind) */
	__u64 alias_b;
	__u64 alias_c;
	__u32 alias_kind;/* 0xff = none */
	__u32 pad;
};

struct prec {
	__u32 have;
	__u32 walk_len;
	char p1[PATH_LEN];
	char p2[PATH_LEN];
	char walk[WALK_LEN];
};

struct sstate {
	__u64 epoch;        /* turn number, written by user space only */
	__u64 inflight[2];  /* handlers recording into slot 0/1 */
	__u64 flags[2];     /* S_* of the turn recorded in slot 0/1 */
	__u64 events[2];    /* recorded fs events per slot (statistics) */
	__u64 ns_gen;       /* bumped around every namespace-changing call */
	__u64 ns_inflight;  /* namespace-changing calls in flight */
	__u64 pad[7];       /* one 128-byte line per sandbox */
};

struct proc {
	__u32 sbx;
	__u32 flags;
	__u64 born_epoch;   /* 0 = existed when the sandbox was attached */
	__u64 died_epoch;
	__u64 ran_epoch;
	__u64 exec_epoch;
};

#endif
