// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* crab-inspector's BPF side: raw syscall and scheduler tracepoints (tp_btf) that keep, per registered sandbox
 * and per turn, the NET effect of the sandbox's processes on files (keyed by inode or by name)
 * and on its process set, in kernel maps that user space reads once at the turn boundary.
 *
 * Attribution: the current task's cgroup v2 id, or one of its ancestors' at the levels user space
 * registered (level_mask), is looked up in `cgmap`. Everything else returns after that lookup.
 *
 * Turn slots: every record goes to slot (epoch & 1) of its sandbox. User space closes a turn by
 * bumping the epoch, waiting until inflight[old slot] is 0, then draining the old slot. A handler
 * increments inflight[slot] before it re-checks the epoch, so no record can land in a slot that
 * user space has already drained (see enter_slot).
 *
 * Cancellation (create then delete = nothing) is allowed only when the delete hits the same key,
 * the object was created in this turn, and no namespace-changing call (rename, link, symlink,
 * mount...) started or was in flight in between (ns_gen / ns_inflight). Anything unsure stays
 * recorded: errors must only ever produce false "changed", never false "unchanged". */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "inspector.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define AT_FDCWD -100
#define AT_REMOVEDIR 0x200
#define AT_EMPTY_PATH 0x1000
#define RENAME_NOREPLACE 1
#define O_ACCMODE 3
#define O_CREAT 0100
#define O_TRUNC 01000
#define MAP_SHARED 0x01
#define MAP_SHARED_VALIDATE 0x03
#define MAP_TYPE 0x0f
#define PROT_WRITE 0x2
#define FMODE_CREATED 0x100000
#define S_IFMT 00170000
#define S_IFREG 0100000
#define S_IFDIR 0040000
#define S_IFLNK 0120000
#define PF_EXITING 0x00000004
#define VM_SHARED 0x00000008

#define OP_OPEN 1
#define OP_UNLINK 2
#define OP_MKDIR 4
#define OP_MKNOD 5
#define OP_SYMLINK 6
#define OP_LINK 7
#define OP_RENAME 8
#define OP_TRUNC 9
#define OP_META 10


#define FNV_OFF 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull
#define NO_ALIAS 0xff

/* ---- maps and globals ------------------------------------------------------------------- */

struct sstate sstates[MAX_SBX];
__u32 level_mask;  /* bit L set: some registered cgroup sits at level L */
/* Host processes (CRIU) whose work inside sandbox tasks, while those tasks are ptrace-controlled
 * by them, is not the sandbox's: a dump's parasite code and the restart of the syscalls the
 * dump interrupted. */
__u32 muted_tracers[4];
__u32 restart_watch; /* tasks in phase 1 or 2 below: sys_enter/exit look at them */
/* Lowest cgroup level of a registered sandbox (u32 max when none): tasks in shallower cgroups
 * are rejected with a few loads, before any hash lookup. */
__u32 min_level;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);   /* cgroup v2 id */
	__type(value, __u32); /* sandbox key */
} cgmap SEC(".maps");

/* Per sandbox and turn slot, an inner hash map of changes and one of path records; per sandbox
 * one of processes. User space creates them at attach and swaps in fresh ones when it drains a
 * slot, so reading a turn never walks other sandboxes' records, and one sandbox filling its maps
 * cannot make another's verdict conservative. */
struct changes_inner {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_CHANGES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct ckey);
	__type(value, struct change);
} changes_tmpl SEC(".maps"); /* instances only carry the full BTF of the inner maps */

struct paths_inner {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_CHANGES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct ckey);
	__type(value, struct prec);
} paths_tmpl SEC(".maps");

struct procs_inner {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PROCS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32); /* tgid */
	__type(value, struct proc);
} procs_tmpl SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, MAX_SBX * 2);
	__type(key, __u32); /* sbx * 2 + slot */
	__array(values, struct changes_inner);
} changes_of SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, MAX_SBX * 2);
	__type(key, __u32); /* sbx * 2 + slot */
	__array(values, struct paths_inner);
} paths_of SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, MAX_SBX);
	__type(key, __u32); /* sbx */
	__array(values, struct procs_inner);
} procs_of SEC(".maps");

struct pending {
	__u32 op;
	__u32 sbx;
	__s64 dfd1;
	__u64 p1;
	__s64 dfd2;
	__u64 p2;
	__u64 flags;
	__u64 gen;
	__u32 ns_busy; /* another namespace call was in flight at enter */
	__u32 is_nsop; /* this call counted itself in ns_inflight */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64); /* pid_tgid */
	__type(value, struct pending);
} pending SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct prec);
} scratch SEC(".maps");


/* ---- per-sandbox inner maps ------------------------------------------------------------- */

static __always_inline void *changes_map(const struct ckey *k)
{
	__u32 i = ((k->sbx & (MAX_SBX - 1)) << 1) | (k->slot & 1);
	return bpf_map_lookup_elem(&changes_of, &i);
}

static __always_inline void *paths_map(const struct ckey *k)
{
	__u32 i = ((k->sbx & (MAX_SBX - 1)) << 1) | (k->slot & 1);
	return bpf_map_lookup_elem(&paths_of, &i);
}

static __always_inline struct change *ch_lookup(const struct ckey *k)
{
	void *m = changes_map(k);
	return m ? bpf_map_lookup_elem(m, k) : NULL;
}

static __always_inline long ch_update(const struct ckey *k, const struct change *v, __u64 fl)
{
	void *m = changes_map(k);
	return m ? bpf_map_update_elem(m, k, v, fl) : -1;
}

static __always_inline void ch_delete(const struct ckey *k)
{
	void *m = changes_map(k);
	if (m)
		bpf_map_delete_elem(m, k);
}

static __always_inline void pa_update(const struct ckey *k, const struct prec *v)
{
	void *m = paths_map(k);
	if (m)
		bpf_map_update_elem(m, k, v, BPF_ANY);
}

static __always_inline void pa_delete(const struct ckey *k)
{
	void *m = paths_map(k);
	if (m)
		bpf_map_delete_elem(m, k);
}

static __always_inline void *procs_map(__u32 sbx)
{
	__u32 i = sbx & (MAX_SBX - 1);
	return bpf_map_lookup_elem(&procs_of, &i);
}

/* ---- attribution ------------------------------------------------------------------------ */

/* ---- CRIU's own activity inside sandbox tasks ------------------------------------------- */

/* Per thread, after a muted tracer stopped it inside a syscall: phase 1 = detached but not yet
 * back in the kernel, phase 2 = back in the interrupted syscall (restarted) and not yet
 * returned to user space. Only the `syscall` instruction ran in user space in between. */
struct tstate {
	__u64 saved_ip;
	__u32 phase;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct tstate);
} tstates SEC(".maps");

static __always_inline int traced_by_muted(struct task_struct *t)
{
	if (!t->ptrace)
		return 0;
	struct task_struct *tracer = t->parent;
	if (!tracer)
		return 0;
	__u32 tr = tracer->tgid;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		__u32 m = *(volatile __u32 *)&muted_tracers[i];
		if (m && m == tr)
			return 1;
	}
	return 0;
}

static __always_inline int sbx_of_current_any(__u32 *out);

/* The sandbox of the current task, unless a muted tracer (CRIU) is working inside it. */
static __always_inline int sbx_of_current(__u32 *out)
{
	if (traced_by_muted(bpf_get_current_task_btf()))
		return 0;
	return sbx_of_current_any(out);
}

/* The sandbox of the current task. */
static __always_inline int sbx_of_current_any(__u32 *out)
{
	struct cgroup *dfl = bpf_get_current_task_btf()->cgroups->dfl_cgrp;
	if (!dfl || (__u32)dfl->level < *(volatile __u32 *)&min_level)
		return 0;
	__u64 cg = dfl->kn->id;
	__u32 *v = bpf_map_lookup_elem(&cgmap, &cg);
	if (v) {
		*out = *v & (MAX_SBX - 1);
		return 1;
	}
	__u32 mask = *(volatile __u32 *)&level_mask;
	if (!mask)
		return 0;
#pragma unroll
	for (int l = 1; l < 8; l++) {
		if (!(mask & (1u << l)))
			continue;
		__u64 a = bpf_get_current_ancestor_cgroup_id(l);
		if (!a)
			break;
		v = bpf_map_lookup_elem(&cgmap, &a);
		if (v) {
			*out = *v & (MAX_SBX - 1);
			return 1;
		}
	}
	return 0;
}

static __always_inline struct sstate *state_of(__u32 sbx)
{
	return &sstates[sbx & (MAX_SBX - 1)];
}

/* Joins the current turn's slot: returns the slot, with inflight[slot] held. */
static __always_inline __u32 enter_slot(struct sstate *s)
{
	__u64 e = *(volatile __u64 *)&s->epoch;
	__sync_fetch_and_add(&s->inflight[e & 1], 1);
	__u64 e2 = *(volatile __u64 *)&s->epoch;
	if (e2 != e) {
		__sync_fetch_and_add(&s->inflight[e & 1], -1);
		e = e2;
		__sync_fetch_and_add(&s->inflight[e & 1], 1);
	}
	return e & 1;
}

static __always_inline void leave_slot(struct sstate *s, __u32 slot)
{
	__sync_fetch_and_add(&s->inflight[slot & 1], -1);
}

static __always_inline void flag_slot(struct sstate *s, __u32 slot, __u64 f)
{
	__sync_fetch_and_or(&s->flags[slot & 1], f);
}

/* Sets a summary flag on the current turn of the sandbox. */
static __always_inline void flag_now(__u32 sbx, __u64 f)
{
	struct sstate *s = state_of(sbx);
	__u32 slot = enter_slot(s);
	flag_slot(s, slot, f);
	leave_slot(s, slot);
}

/* ---- kernel objects --------------------------------------------------------------------- */

static __always_inline struct file *fd_file(long fd)
{
	if (fd < 0)
		return NULL;
	/* BTF pointers: plain loads (with fault handling) instead of probe-read helper calls */
	struct task_struct *t = bpf_get_current_task_btf();
	struct fdtable *fdt = t->files->fdt;
	if (!fdt || (unsigned long)fd >= fdt->max_fds)
		return NULL;
	struct file *f = NULL;
	bpf_probe_read_kernel(&f, sizeof(f), &fdt->fd[fd]);
	return f;
}

static __always_inline int magic_ignored(unsigned long m)
{
	switch (m) {
	case 0x9fa0:     /* proc */
	case 0x62656572: /* sysfs */
	case 0x27e0eb:   /* cgroup v1 */
	case 0x63677270: /* cgroup2 */
	case 0x64626720: /* debugfs */
	case 0x74726163: /* tracefs */
	case 0x1cd1:     /* devpts */
	case 0x73636673: /* securityfs */
	case 0xcafe4a11: /* bpf fs */
	case 0x50495045: /* pipefs */
	case 0x534f434b: /* sockfs */
	case 0x09041934: /* anon inodes */
	case 0x6e736673: /* nsfs */
	case 0xf97cff8c: /* selinuxfs */
	case 0x42494e4d: /* binfmt_misc */
	case 0x62656570: /* configfs */
	case 0x65735543: /* fusectl */
	case 0x6165676c: /* pstore */
	case 0xde5e81e4: /* efivarfs */
	case 0x444d4142: /* dma-buf */
	case 0x5345434d: /* secretmem */
	case 0x50494446: /* pidfs */
	case 0x62646576: /* bdev */
		return 1;
	}
	return 0;
}

/* 1 when changes to this inode are persistent state (regular file, dir or symlink on a real fs,
 * still linked somewhere). Pipes, sockets, ttys, char and block devices, /proc, /sys, memfds and
 * unlinked files do not count. */
static __always_inline int inode_counts(struct inode *ino, __u32 *mode_out)
{
	if (!ino)
		return 0;
	__u32 mode = BPF_CORE_READ(ino, i_mode);
	__u32 fmt = mode & S_IFMT;
	if (fmt != S_IFREG && fmt != S_IFDIR && fmt != S_IFLNK)
		return 0;
	if (magic_ignored(BPF_CORE_READ(ino, i_sb, s_magic)))
		return 0;
	if (BPF_CORE_READ(ino, __i_nlink) == 0)
		return 0;
	*mode_out = mode;
	return 1;
}

/* Writes the names from `d` up to the process root, leaf first, NUL-separated, crossing mounts. */
static __always_inline void walk_path(struct vfsmount *vmnt, struct dentry *d, struct prec *r,
				      __u32 is_file)
{
	struct task_struct *t = (struct task_struct *)bpf_get_current_task();
	struct dentry *root_d = BPF_CORE_READ(t, fs, root.dentry);
	struct vfsmount *root_m = BPF_CORE_READ(t, fs, root.mnt);
	struct mount *m = (struct mount *)((char *)vmnt - bpf_core_field_offset(struct mount, mnt));
	__u32 off = 0;
	__u32 full = 0;
	for (int i = 0; i < WALK_DEPTH; i++) {
		if (d == root_d && vmnt == root_m) {
			full = 1;
			break;
		}
		struct dentry *mroot = BPF_CORE_READ(vmnt, mnt_root);
		if (d == mroot) {
			struct mount *parent = BPF_CORE_READ(m, mnt_parent);
			if (parent == m) {
				full = 1; /* top of this mount tree (other root): keep what we have */
				break;
			}
			d = BPF_CORE_READ(m, mnt_mountpoint);
			m = parent;
			vmnt = (struct vfsmount *)((char *)parent +
						   bpf_core_field_offset(struct mount, mnt));
			continue;
		}
		struct dentry *p = BPF_CORE_READ(d, d_parent);
		if (p == d) {
			full = 1;
			break;
		}
		if (off >= WALK_LEN / 2)
			break;
		const unsigned char *name = BPF_CORE_READ(d, d_name.name);
		long n = bpf_probe_read_kernel_str(&r->walk[off & (WALK_LEN / 2 - 1)], WALK_LEN / 2,
						   name);
		if (n <= 0)
			break;
		off += n;
		d = p;
	}
	r->walk_len = off;
	r->have |= P_WALK | (full ? P_WALK_FULL : 0) | (is_file ? P_WALK_IS_FILE : 0);
}

static __always_inline struct prec *scratch_rec(void)
{
	__u32 z = 0;
	struct prec *r = bpf_map_lookup_elem(&scratch, &z);
	if (r) {
		r->have = 0;
		r->walk_len = 0;
	}
	return r;
}

/* ---- recording ---------------------------------------------------------------------------- */

/* Merges `flags` into the change at `k` (slot already set), creating it (with its path record
 * from `r`, which may be NULL) when absent. Returns 0, or -1 when a map was full. */
static __always_inline int upsert(struct sstate *s, struct ckey *k, __u32 flags, __u32 mode,
				  struct prec *r)
{
	struct change *c = ch_lookup(k);
	if (c) {
		if ((c->flags & flags) != flags)
			__sync_fetch_and_or(&c->flags, flags);
		return 0;
	}
	struct change nc = {};
	nc.flags = flags;
	nc.mode = mode;
	nc.gen = 0;
	nc.alias_kind = NO_ALIAS;
	if (r)
		pa_update(k, r);
	if (ch_update(k, &nc, BPF_NOEXIST) != 0) {
		/* EEXIST from a racing insert is fine: merge into it. */
		c = ch_lookup(k);
		if (c) {
			__sync_fetch_and_or(&c->flags, flags);
			return 0;
		}
		flag_slot(s, k->slot, S_OVERFLOW);
		return -1;
	}
	__sync_fetch_and_add(&s->events[k->slot & 1], 1);
	return 0;
}

/* A write or mapping that is no file change can still change *another* process's memory:
 * writing /proc/<pid>/mem, or mapping shared memory (memfd, shm, deleted files) writable, which
 * a long-lived process may share. Those set a process-level flag. */
static __always_inline void not_counted(__u32 sbx, struct file *f, struct inode *ino, __u32 flags)
{
	if (!ino)
		return;
	__u32 fmt = BPF_CORE_READ(ino, i_mode) & S_IFMT;
	if (fmt != S_IFREG)
		return;
	unsigned long magic = BPF_CORE_READ(ino, i_sb, s_magic);
	if (magic == 0x9fa0 /* proc */) {
		char name[4] = {};
		bpf_probe_read_kernel_str(name, sizeof(name),
					  BPF_CORE_READ(f, f_path.dentry, d_name.name));
		if (name[0] == 'm' && name[1] == 'e' && name[2] == 'm' && name[3] == 0)
			flag_now(sbx, S_FOREIGN_MEM);
		return;
	}
	if ((flags & C_MMAP) && !magic_ignored(magic))
		flag_now(sbx, S_SHM); /* shared writable mapping of an unlinked file (memfd...) */
}

/* A change through an open file (write, ftruncate, fchmod, shared mmap...). */
static __always_inline void record_file(__u32 sbx, struct file *f, __u32 flags)
{
	struct file *fb = bpf_core_cast(f, struct file);
	struct inode *ino = fb->f_inode;
	if (!ino)
		return;
	__u32 mode = ino->i_mode;
	__u32 fmt = mode & S_IFMT;
	struct super_block *sb = ino->i_sb;
	if ((fmt != S_IFREG && fmt != S_IFDIR && fmt != S_IFLNK) || magic_ignored(sb->s_magic) ||
	    ino->__i_nlink == 0) {
		not_counted(sbx, f, ino, flags);
		return;
	}
	struct sstate *s = state_of(sbx);
	struct ckey k = {};
	k.sbx = sbx;
	k.kind = K_INODE;
	k.a = sb->s_dev;
	k.b = ino->i_ino;
	__u32 slot = enter_slot(s);
	k.slot = slot;
	struct change *c = ch_lookup(&k);
	if (c) {
		if ((c->flags & flags) != flags)
			__sync_fetch_and_or(&c->flags, flags);
	} else {
		struct prec *r = scratch_rec();
		if (r)
			walk_path(BPF_CORE_READ(f, f_path.mnt), BPF_CORE_READ(f, f_path.dentry), r, 1);
		upsert(s, &k, flags | C_FD, mode, r);
	}
	leave_slot(s, slot);
}

/* A name that had a record in this turn (deleted, renamed away...) exists again: it is a
 * modification of what was there at the checkpoint, never cancellable. */
static __always_inline void revive(struct change *c, __u32 flags)
{
	__sync_fetch_and_and(&c->flags, ~C_DELETED);
	__sync_fetch_and_or(&c->flags, flags | C_MODIFIED | C_NOCANCEL);
}

/* An fd-based change. */
static __always_inline void record_fd(__u32 sbx, long fd, __u32 flags)
{
	struct file *f = fd_file(fd);
	if (f)
		record_file(sbx, f, flags);
}

/* mprotect(PROT_WRITE) of a shared file mapping makes it writable: count it like the mmap. */
struct vma_probe {
	struct file *file;
};

static long vma_cb(struct task_struct *task, struct vm_area_struct *vma, void *data)
{
	struct vma_probe *c = data;
	if (BPF_CORE_READ(vma, vm_flags) & VM_SHARED)
		c->file = BPF_CORE_READ(vma, vm_file);
	return 0;
}

/* ---- path-based calls: stash at enter, record at exit ------------------------------------ */

static __always_inline void stash(__u32 sbx, __u32 op, long dfd1, __u64 p1, long dfd2, __u64 p2,
				  __u64 flags, int nsop)
{
	struct sstate *s = state_of(sbx);
	struct pending pd = {};
	pd.op = op;
	pd.sbx = sbx;
	pd.dfd1 = dfd1;
	pd.p1 = p1;
	pd.dfd2 = dfd2;
	pd.p2 = p2;
	pd.flags = flags;
	if (nsop) {
		__sync_fetch_and_add(&s->ns_inflight, 1);
		__sync_fetch_and_add(&s->ns_gen, 1);
		pd.is_nsop = 1;
	}
	pd.ns_busy = *(volatile __u64 *)&s->ns_inflight > (__u64)(nsop ? 1 : 0);
	pd.gen = *(volatile __u64 *)&s->ns_gen;
	__u64 id = bpf_get_current_pid_tgid();
	if (bpf_map_update_elem(&pending, &id, &pd, BPF_ANY) != 0) {
		/* The exit will not find it: whatever this call does goes unrecorded. */
		flag_now(sbx, S_PENDING_LOST);
		if (nsop)
			__sync_fetch_and_add(&s->ns_inflight, -1);
	}
}

/* The directory a path is resolved from: `dfd`, the cwd, or the root for absolute paths. */
static __always_inline int base_dir(long dfd, int absolute, struct vfsmount **mnt,
				    struct dentry **d)
{
	struct task_struct *t = (struct task_struct *)bpf_get_current_task();
	if (absolute) {
		*mnt = BPF_CORE_READ(t, fs, root.mnt);
		*d = BPF_CORE_READ(t, fs, root.dentry);
	} else if (dfd == AT_FDCWD) {
		*mnt = BPF_CORE_READ(t, fs, pwd.mnt);
		*d = BPF_CORE_READ(t, fs, pwd.dentry);
	} else {
		struct file *f = fd_file(dfd);
		if (!f)
			return -1;
		*mnt = BPF_CORE_READ(f, f_path.mnt);
		*d = BPF_CORE_READ(f, f_path.dentry);
	}
	return *d ? 0 : -1;
}

struct hashes {
	__u64 full;
	__u64 leaf;
	__u32 len;   /* without NUL */
	__u32 slash; /* contains '/' */
};

static __always_inline void hash_str(const char *buf, struct hashes *h)
{
	__u64 full = FNV_OFF, leaf = FNV_OFF;
	__u32 len = 0, slash = 0;
	for (int i = 0; i < PATH_LEN; i++) {
		unsigned char c = buf[i];
		if (!c)
			break;
		len++;
		full = (full ^ c) * FNV_PRIME;
		if (c == '/') {
			slash = 1;
			leaf = FNV_OFF;
		} else {
			leaf = (leaf ^ c) * FNV_PRIME;
		}
	}
	h->full = full;
	h->leaf = leaf;
	h->len = len;
	h->slash = slash;
}

/* The key under which a path string names its object: (dir, leaf) when it has no '/', else
 * (base, whole string). Returns -1 when the base cannot be resolved. */
static __always_inline int name_key(long dfd, const char *buf, struct hashes *h, struct ckey *k,
				    struct vfsmount **bm, struct dentry **bd, int *on_ignored_fs)
{
	int absolute = buf[0] == '/';
	if (base_dir(dfd, absolute, bm, bd) != 0)
		return -1;
	struct inode *bi = BPF_CORE_READ(*bd, d_inode);
	if (!bi)
		return -1;
	k->a = BPF_CORE_READ(bi, i_sb, s_dev);
	k->b = BPF_CORE_READ(bi, i_ino);
	if (h->slash) {
		k->kind = K_GIVEN;
		k->c = h->full;
		*on_ignored_fs = 0;
	} else {
		k->kind = K_NAME;
		k->c = h->leaf;
		*on_ignored_fs = magic_ignored(BPF_CORE_READ(bi, i_sb, s_magic));
	}
	return 0;
}

static __always_inline void fill_base_walk(struct prec *r, int relative, struct vfsmount *bm,
					   struct dentry *bd)
{
	if (relative)
		walk_path(bm, bd, r, 0);
}

/* Reads a user path into r->p1 (which = 1) or r->p2 (which = 2). Returns bytes incl. NUL. */
static __always_inline long read_path(struct prec *r, __u64 uptr, int which)
{
	if (!uptr)
		return 0;
	long n;
	if (which == 1) {
		n = bpf_probe_read_user_str(r->p1, PATH_LEN, (const void *)uptr);
		if (n > 0) {
			r->have |= P_P1;
			if (n >= PATH_LEN)
				r->have |= P_P1_TRUNC;
		}
	} else {
		n = bpf_probe_read_user_str(r->p2, PATH_LEN, (const void *)uptr);
		if (n > 0) {
			r->have |= P_P2;
			if (n >= PATH_LEN)
				r->have |= P_P2_TRUNC;
		}
	}
	return n;
}

/* open/creat that returned `fd`: record a creation (exactly known through FMODE_CREATED) or a
 * truncation. */
static __always_inline void record_open(struct pending *pd, long fd, struct sstate *s, __u32 slot)
{
	struct file *f = fd_file(fd);
	if (!f)
		return;
	struct inode *ino = BPF_CORE_READ(f, f_inode);
	__u32 mode = 0;
	if (!inode_counts(ino, &mode))
		return;
	__u32 fmode = BPF_CORE_READ(f, f_mode);
	struct ckey ik = {};
	ik.sbx = pd->sbx;
	ik.slot = slot;
	ik.kind = K_INODE;
	ik.a = BPF_CORE_READ(ino, i_sb, s_dev);
	ik.b = BPF_CORE_READ(ino, i_ino);
	struct vfsmount *fm = BPF_CORE_READ(f, f_path.mnt);
	struct dentry *fd_d = BPF_CORE_READ(f, f_path.dentry);
	if (!(fmode & FMODE_CREATED)) {
		if (pd->flags & O_TRUNC) {
			struct change *c = ch_lookup(&ik);
			if (c) {
				__sync_fetch_and_or(&c->flags, C_MODIFIED);
				return;
			}
			struct prec *r = scratch_rec();
			if (r)
				walk_path(fm, fd_d, r, 1);
			upsert(s, &ik, C_MODIFIED | C_FD, mode, r);
		}
		return;
	}
	/* Created. Canonical name key: (parent dir inode, hash(d_name)). */
	struct prec *r = scratch_rec();
	if (!r) {
		flag_slot(s, slot, S_FS_UNKNOWN);
		return;
	}
	__u32 nocancel = pd->ns_busy ? C_NOCANCEL : 0;
	struct dentry *parent = BPF_CORE_READ(fd_d, d_parent);
	struct inode *pino = BPF_CORE_READ(parent, d_inode);
	const unsigned char *dname = BPF_CORE_READ(fd_d, d_name.name);
	/* hash d_name using p2 as a buffer */
	long dn = bpf_probe_read_kernel_str(r->p2, PATH_LEN, dname);
	struct hashes dh = {};
	if (dn > 0)
		hash_str(r->p2, &dh);
	else
		nocancel = C_NOCANCEL;
	struct ckey nk = {};
	nk.sbx = pd->sbx;
	nk.slot = slot;
	nk.kind = K_NAME;
	nk.a = BPF_CORE_READ(pino, i_sb, s_dev);
	nk.b = BPF_CORE_READ(pino, i_ino);
	nk.c = dh.leaf;
	/* The path as given (alias key when it has '/', and it names the same leaf). */
	r->have = 0;
	long pn = read_path(r, pd->p1, 1);
	struct ckey gk = {};
	int have_alias = 0;
	if (pn > 0 && !(r->have & P_P1_TRUNC)) {
		struct hashes gh = {};
		hash_str(r->p1, &gh);
		if (gh.slash && gh.leaf == dh.leaf) {
			struct vfsmount *bm;
			struct dentry *bd;
			int ign = 0;
			gk.sbx = pd->sbx;
			gk.slot = slot;
			if (name_key(pd->dfd1, r->p1, &gh, &gk, &bm, &bd, &ign) == 0)
				have_alias = 1;
		}
	} else {
		nocancel = C_NOCANCEL;
	}
	walk_path(fm, fd_d, r, 1);
	struct change nc = {};
	nc.flags = C_CREATED | nocancel;
	nc.mode = mode;
	nc.gen = pd->gen;
	nc.dev = ik.a;
	nc.ino = ik.b;
	nc.alias_kind = NO_ALIAS;
	if (have_alias) {
		nc.alias_kind = gk.kind;
		nc.alias_a = gk.a;
		nc.alias_b = gk.b;
		nc.alias_c = gk.c;
	}
	/* A name recorded earlier in this turn (e.g. deleted, then created again) was not free at
	 * the checkpoint: merge, never start a cancellable creation over it. */
	struct change *prev = ch_lookup(&nk);
	struct change *prev_alias = have_alias ? ch_lookup(&gk) : NULL;
	int had_prev = 0, had_alias = 0;
	if (prev_alias) {
		revive(prev_alias, 0);
		had_alias = 1;
		nc.flags |= C_NOCANCEL;
	}
	if (prev) {
		revive(prev, 0);
		prev->dev = ik.a;
		prev->ino = ik.b;
		had_prev = 1;
	} else {
		pa_update(&nk, r);
		if (ch_update(&nk, &nc, BPF_NOEXIST) != 0) {
			flag_slot(s, slot, S_OVERFLOW);
			return;
		}
	}
	__sync_fetch_and_add(&s->events[slot & 1], 1);
	if (have_alias) {
		nc.alias_kind = K_NAME;
		nc.alias_a = nk.a;
		nc.alias_b = nk.b;
		nc.alias_c = nk.c;
		if (had_alias || had_prev || ch_update(&gk, &nc, BPF_NOEXIST) != 0) {
			/* without the alias a later unlink by this path just won't cancel */
		} else {
			pa_update(&gk, r);
		}
	}
	/* The inode itself: created (writes will merge C_MODIFIED into it). */
	struct change ic = {};
	ic.flags = C_CREATED | C_FD | nocancel;
	ic.mode = mode;
	ic.gen = pd->gen;
	ic.alias_kind = NO_ALIAS;
	pa_update(&ik, r);
	if (ch_update(&ik, &ic, BPF_ANY) != 0)
		flag_slot(s, slot, S_OVERFLOW);
}

static __always_inline void delete_key(__u32 kind, __u64 a, __u64 b, __u64 c, __u32 sbx,
				       __u32 slot)
{
	struct ckey k = {};
	k.sbx = sbx;
	k.slot = slot;
	k.kind = kind;
	k.a = a;
	k.b = b;
	k.c = c;
	ch_delete(&k);
	pa_delete(&k);
}

/* A successful path-based call other than open. */
static __always_inline void record_path(struct pending *pd, struct sstate *s, __u32 slot)
{
	struct prec *r = scratch_rec();
	if (!r) {
		flag_slot(s, slot, S_FS_UNKNOWN);
		return;
	}
	if (!pd->p1) {
		/* utimensat(fd, NULL, ...) = futimens: the call acts on dfd itself */
		if (pd->op == OP_META)
			record_fd(pd->sbx, pd->dfd1, C_META);
		else
			flag_slot(s, slot, S_FS_UNKNOWN);
		return;
	}
	long n = read_path(r, pd->p1, 1);
	if (n <= 0) {
		flag_slot(s, slot, S_PATH_FAULT | S_FS_UNKNOWN);
		return;
	}
	if (n == 1) {
		/* "" : an AT_EMPTY_PATH call on dfd itself */
		if (pd->op == OP_META)
			record_fd(pd->sbx, pd->dfd1, C_META);
		else
			flag_slot(s, slot, S_FS_UNKNOWN);
		return;
	}
	if (pd->op == OP_RENAME || pd->op == OP_LINK || pd->op == OP_SYMLINK)
		read_path(r, pd->p2, 2);
	struct hashes h = {};
	hash_str(r->p1, &h);
	struct ckey k = {};
	k.sbx = pd->sbx;
	k.slot = slot;
	struct vfsmount *bm = NULL;
	struct dentry *bd = NULL;
	int ign = 0;
	if (name_key(pd->dfd1, r->p1, &h, &k, &bm, &bd, &ign) != 0) {
		flag_slot(s, slot, S_FS_UNKNOWN);
		return;
	}
	if (ign)
		return; /* a single name inside /proc, /sys, cgroupfs... */
	int relative = r->p1[0] != '/';
	__u32 trunc = (r->have & P_P1_TRUNC) ? C_NOCANCEL : 0;

	switch (pd->op) {
	case OP_UNLINK: {
		__u32 dir = (pd->flags & AT_REMOVEDIR) ? C_DIR : 0;
		struct change *c = ch_lookup(&k);
		if (c && (c->flags & C_CREATED) && !(c->flags & C_NOCANCEL) && !trunc &&
		    c->gen == *(volatile __u64 *)&s->ns_gen &&
		    *(volatile __u64 *)&s->ns_inflight == 0) {
			/* Created in this turn and nothing could have re-pointed the name: net
			 * nothing. Drop the name, its alias and the inode record. */
			__u32 ak = c->alias_kind;
			__u64 aa = c->alias_a, ab = c->alias_b, ac = c->alias_c;
			__u64 dev = c->dev, ino = c->ino;
			ch_delete(&k);
			pa_delete(&k);
			if (ak != NO_ALIAS)
				delete_key(ak, aa, ab, ac, pd->sbx, slot);
			if (dev || ino) {
				/* only the record of the inode created in this turn (inode numbers
				 * can repeat across btrfs subvolumes) */
				struct ckey ik = {};
				ik.sbx = pd->sbx;
				ik.slot = slot;
				ik.kind = K_INODE;
				ik.a = dev;
				ik.b = ino;
				struct change *ic = ch_lookup(&ik);
				if (ic && (ic->flags & C_CREATED))
					delete_key(K_INODE, dev, ino, 0, pd->sbx, slot);
			}
			return;
		}
		fill_base_walk(r, relative, bm, bd);
		upsert(s, &k, C_DELETED | dir | trunc, 0, r);
		return;
	}
	case OP_MKDIR:
	case OP_MKNOD:
	case OP_SYMLINK: {
		__u32 what = pd->op == OP_MKDIR ? C_DIR : (pd->op == OP_MKNOD ? C_NODE : C_SYMLINK);
		struct change *c = ch_lookup(&k);
		if (c) {
			/* re-created after a delete in this turn: it is now a modification */
			revive(c, what);
			return;
		}
		fill_base_walk(r, relative, bm, bd);
		struct change nc = {};
		nc.flags = C_CREATED | what | trunc | (pd->ns_busy ? C_NOCANCEL : 0);
		/* symlink counts itself in ns_gen: compare against the value after its exit */
		nc.gen = pd->op == OP_SYMLINK ? pd->gen + 1 : pd->gen;
		nc.alias_kind = NO_ALIAS;
		pa_update(&k, r);
		if (ch_update(&k, &nc, BPF_NOEXIST) != 0)
			flag_slot(s, slot, S_OVERFLOW);
		else
			__sync_fetch_and_add(&s->events[slot & 1], 1);
		return;
	}
	case OP_LINK: {
		struct change *c = ch_lookup(&k);
		if (c) {
			revive(c, C_LINKED);
			return;
		}
		fill_base_walk(r, relative, bm, bd);
		upsert(s, &k, C_CREATED | C_LINKED | C_NOCANCEL, 0, r);
		return;
	}
	case OP_RENAME: {
		__u64 odev = 0, oino = 0;
		/* The source was created in this turn, cancellably, and no name-changing call ran
		 * between its creation and this rename. */
		int fresh = 0;
		/* The source name: a record of it is superseded by the rename record. */
		if (r->have & P_P2) {
			struct hashes h2 = {};
			hash_str(r->p2, &h2);
			struct ckey ok = {};
			ok.sbx = pd->sbx;
			ok.slot = slot;
			struct vfsmount *om;
			struct dentry *od;
			int oign = 0;
			if (name_key(pd->dfd2, r->p2, &h2, &ok, &om, &od, &oign) == 0) {
				struct change *oc = ch_lookup(&ok);
				if (oc) {
					/* The rename record below supersedes the source name's. */
					if (oc->flags & C_CREATED) {
						trunc |= C_CREATED; /* moved a file created in this turn */
						fresh = !(oc->flags & C_NOCANCEL) &&
							oc->gen + 1 == pd->gen;
					}
					odev = oc->dev;
					oino = oc->ino;
					__u32 ak = oc->alias_kind;
					__u64 aa = oc->alias_a, ab = oc->alias_b, ac = oc->alias_c;
					ch_delete(&ok);
					pa_delete(&ok);
					if (ak != NO_ALIAS)
						delete_key(ak, aa, ab, ac, pd->sbx, slot);
				}
			}
		}
		fill_base_walk(r, relative, bm, bd);
		struct change *c = ch_lookup(&k);
		if (c) {
			revive(c, C_RENAMED);
			c->dev = odev;
			c->ino = oino;
			pa_update(&k, r);
			return;
		}
		/* RENAME_NOREPLACE succeeded: the target name did not exist. A fresh source moved
		 * to a free name, with no other name-changing call in flight, is a creation of the
		 * target: a later unlink by the same key cancels it (and the inode's record), as for
		 * a file created under that name. (An earlier removal of the name in this turn, by
		 * any key, keeps its own record.) Plain rename(2) may have replaced an existing
		 * file: that stays uncancellable. */
		if (fresh && pd->flags == RENAME_NOREPLACE && !pd->ns_busy &&
		    !(trunc & C_NOCANCEL) && !(r->have & P_P2_TRUNC) &&
		    *(volatile __u64 *)&s->ns_gen == pd->gen &&
		    *(volatile __u64 *)&s->ns_inflight == 1) {
			struct change nc = {};
			nc.flags = C_CREATED | C_RENAMED;
			nc.gen = pd->gen + 1; /* the value after this call's exit (finish_nsop) */
			nc.dev = odev;
			nc.ino = oino;
			nc.alias_kind = NO_ALIAS;
			pa_update(&k, r);
			if (ch_update(&k, &nc, BPF_NOEXIST) == 0) {
				__sync_fetch_and_add(&s->events[slot & 1], 1);
				return;
			}
		}
		upsert(s, &k, C_RENAMED | C_NOCANCEL | trunc, 0, r);
		c = ch_lookup(&k);
		if (c) {
			/* the moved inode, so that its own record folds into this one */
			c->dev = odev;
			c->ino = oino;
		}
		return;
	}
	case OP_TRUNC:
		fill_base_walk(r, relative, bm, bd);
		upsert(s, &k, C_MODIFIED | trunc, 0, r);
		return;
	case OP_META:
		fill_base_walk(r, relative, bm, bd);
		upsert(s, &k, C_META | trunc, 0, r);
		return;
	}
}

static __always_inline void finish_nsop(struct pending *pd)
{
	if (pd->is_nsop) {
		struct sstate *s = state_of(pd->sbx);
		__sync_fetch_and_add(&s->ns_gen, 1);
		__sync_fetch_and_add(&s->ns_inflight, -1);
	}
}

static __always_inline int handle_exit(long ret)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct pending *pp = bpf_map_lookup_elem(&pending, &id);
	if (!pp)
		return 0;
	struct pending pd = *pp;
	bpf_map_delete_elem(&pending, &id);
	if (ret < 0) {
		finish_nsop(&pd);
		return 0;
	}
	struct sstate *s = state_of(pd.sbx);
	__u32 slot = enter_slot(s);
	if (pd.op == OP_OPEN)
		record_open(&pd, ret, s, slot);
	else
		record_path(&pd, s, slot);
	leave_slot(s, slot);
	finish_nsop(&pd);
	return 0;
}

/* ---- syscall dispatch ------------------------------------------------------------------- */
/* One BTF raw tracepoint on sys_enter and one on sys_exit serve every syscall. A perf-based
 * syscalls:sys_enter_* tracepoint costs ~0.2 us of tracing machinery per hooked call before the
 * program even runs; the raw tracepoint costs a few tens of ns on every syscall and the switch
 * below returns at once for the ones not watched. Syscall numbers are x86-64's. */
#if !defined(__TARGET_ARCH_x86)
#error "the syscall numbers below are x86-64's"
#endif

#define TS_COMPAT 0x0002
#define X32_SYSCALL_BIT 0x40000000

#define NR_write 1
#define NR_open 2
#define NR_mmap 9
#define NR_mprotect 10
#define NR_shmat 30
#define SHM_RDONLY 010000
#define NR_ioctl 16
#define NR_pwrite64 18
#define NR_writev 20
#define NR_sendfile 40
#define NR_truncate 76
#define NR_ftruncate 77
#define NR_rename 82
#define NR_mkdir 83
#define NR_rmdir 84
#define NR_creat 85
#define NR_link 86
#define NR_unlink 87
#define NR_symlink 88
#define NR_chmod 90
#define NR_fchmod 91
#define NR_chown 92
#define NR_fchown 93
#define NR_lchown 94
#define NR_ptrace 101
#define NR_utime 132
#define NR_mknod 133
#define NR_pivot_root 155
#define NR_chroot 161
#define NR_acct 163
#define NR_mount 165
#define NR_umount2 166
#define NR_setxattr 188
#define NR_lsetxattr 189
#define NR_fsetxattr 190
#define NR_removexattr 197
#define NR_lremovexattr 198
#define NR_fremovexattr 199
#define NR_io_setup 206
#define NR_utimes 235
#define NR_openat 257
#define NR_mkdirat 258
#define NR_mknodat 259
#define NR_fchownat 260
#define NR_futimesat 261
#define NR_unlinkat 263
#define NR_renameat 264
#define NR_linkat 265
#define NR_symlinkat 266
#define NR_fchmodat 268
#define NR_unshare 272
#define NR_splice 275
#define NR_utimensat 280
#define NR_fallocate 285
#define NR_pwritev 296
#define NR_open_by_handle_at 304
#define NR_setns 308
#define NR_process_vm_writev 311
#define NR_renameat2 316
#define NR_copy_file_range 326
#define NR_pwritev2 328
#define NR_io_uring_setup 425
#define NR_open_tree 428
#define NR_move_mount 429
#define NR_fsmount 432
#define NR_openat2 437
#define NR_mount_setattr 442
#define NR_fchmodat2 452
#define NR_setxattrat 463
#define NR_removexattrat 466
#define NR_open_tree_attr 467
/* System V and POSIX IPC (IPC namespace state, dumped with the processes) */
#define NR_shmget 29
#define NR_shmctl 31
#define NR_semget 64
#define NR_semop 65
#define NR_semctl 66
#define NR_msgget 68
#define NR_msgsnd 69
#define NR_msgrcv 70
#define NR_msgctl 71
#define NR_semtimedop 220
#define NR_mq_open 240
#define NR_mq_unlink 241
#define NR_mq_timedsend 242
#define NR_mq_timedreceive 243
/* state of another process or of the sandbox's namespaces */
#define NR_setpriority 141
#define NR_sched_setparam 142
#define NR_sched_setscheduler 144
#define NR_sethostname 170
#define NR_setdomainname 171
#define NR_sched_setaffinity 203
#define NR_ioprio_set 251
#define NR_prlimit64 302
#define NR_sched_setattr 314

/* ioctls that change file contents or attributes: reflink clones, chattr. */
#define FICLONE 0x40049409u
#define FICLONERANGE 0x4020940du
#define FS_IOC_SETFLAGS 0x40086602u
#define FS_IOC32_SETFLAGS 0x40046602u
#define FS_IOC_FSSETXATTR 0x401c5820u

#define R0 (regs->di)
#define R1 (regs->si)
#define R2 (regs->dx)
#define R3 (regs->r10)
#define R4 (regs->r8)
#define I(x) ((long)(int)(x)) /* int arguments: the register's upper half is undefined */

static __always_inline void mark_ran(__u32 sbx, __u32 tgid, int exec);

/* First kernel entry of a task a muted tracer let go: the restart of the interrupted syscall
 * (same syscall instruction) does not count as running; anything else does. */
static __always_inline void restart_enter(struct task_struct *cur, struct pt_regs *regs)
{
	struct tstate *ts = bpf_task_storage_get(&tstates, cur, 0, 0);
	if (!ts || ts->phase != 1 || traced_by_muted(cur))
		return;
	if (regs->ip == ts->saved_ip) {
		ts->phase = 2;
		return;
	}
	ts->phase = 0;
	__sync_fetch_and_add(&restart_watch, -1);
	__u32 sbx;
	if (sbx_of_current(&sbx))
		mark_ran(sbx, bpf_get_current_pid_tgid() >> 32, 0);
}

/* Return to user space ends phase 2 (normal accounting from here). */
static __always_inline void restart_exit(struct task_struct *cur)
{
	struct tstate *ts = bpf_task_storage_get(&tstates, cur, 0, 0);
	if (!ts || ts->phase != 2)
		return;
	ts->phase = 0;
	__sync_fetch_and_add(&restart_watch, -1);
}

SEC("tp_btf/sys_enter")
int BPF_PROG(sys_enter_all, struct pt_regs *regs, long id)
{
	long fd = -1, d1 = AT_FDCWD, d2 = -1;
	__u32 fl = 0, op = 0, nsop = 0;
	__u64 p1 = 0, p2 = 0, xf = 0, flag = 0;
	__u32 sbx;

	struct task_struct *cur = bpf_get_current_task_btf();
	if (*(volatile __u32 *)&restart_watch)
		restart_enter(cur, regs);

	/* 32-bit (ia32) and x32 system calls use other numbers: not followed, so a sandbox
	 * process making them makes its turn conservative. */
	if ((cur->thread_info.status & TS_COMPAT) || (id & X32_SYSCALL_BIT)) {
		if (sbx_of_current(&sbx))
			flag_now(sbx, S_UNTRACKABLE);
		return 0;
	}

	switch (id) {
	case NR_write:
	case NR_pwrite64:
	case NR_writev:
	case NR_pwritev:
	case NR_pwritev2:
	case NR_sendfile:
	case NR_fallocate:
	case NR_ftruncate:
		fd = I(R0);
		fl = C_MODIFIED;
		goto fd_op;
	case NR_copy_file_range:
	case NR_splice:
		fd = I(R2);
		fl = C_MODIFIED;
		goto fd_op;
	case NR_fchmod:
	case NR_fchown:
	case NR_fsetxattr:
	case NR_fremovexattr:
		fd = I(R0);
		fl = C_META;
		goto fd_op;
	case NR_ioctl: {
		__u32 cmd = (__u32)R1;
		if (cmd == FICLONE || cmd == FICLONERANGE)
			fl = C_MODIFIED;
		else if (cmd == FS_IOC_SETFLAGS || cmd == FS_IOC32_SETFLAGS ||
			 cmd == FS_IOC_FSSETXATTR)
			fl = C_META;
		else
			return 0;
		fd = I(R0);
		goto fd_op;
	}
	case NR_mmap: {
		__u64 type = R3 & MAP_TYPE;
		if (!(R2 & PROT_WRITE) || (type != MAP_SHARED && type != MAP_SHARED_VALIDATE))
			return 0;
		/* Conservative: a shared writable mapping of a file counts as a modification. */
		fd = I(R4);
		fl = C_MODIFIED | C_MMAP;
		goto fd_op;
	}
	case NR_mprotect: {
		/* mprotect(PROT_WRITE) of a shared file mapping: count it like the mmap. Only the
		 * mapping at the start address is checked (ranges rarely span mappings). */
		if (!(R2 & PROT_WRITE))
			return 0;
		if (!sbx_of_current(&sbx))
			return 0;
		struct vma_probe c = {};
		bpf_find_vma(bpf_get_current_task_btf(), R0, vma_cb, &c, 0);
		if (c.file)
			record_file(sbx, c.file, C_MODIFIED | C_MMAP);
		return 0;
	}
	case NR_shmat:
		if (R2 & SHM_RDONLY)
			return 0;
		flag = S_SHM;
		goto flag_op;
	case NR_io_uring_setup:
	case NR_io_setup: /* native AIO writes bypass the write syscalls */
	case NR_acct:     /* the kernel then writes the accounting file */
		flag = S_UNTRACKABLE;
		goto flag_op;
	case NR_mount:
	case NR_umount2:
	case NR_move_mount:
	case NR_fsmount:
	case NR_mount_setattr:
	case NR_open_tree:
	case NR_open_tree_attr:
		flag = S_MOUNT;
		goto flag_op;
	case NR_pivot_root:
	case NR_chroot:
	case NR_unshare:
	case NR_setns:
		flag = S_NS;
		goto flag_op;
	case NR_process_vm_writev:
	case NR_ptrace:
		flag = S_FOREIGN_MEM;
		goto flag_op;
	case NR_shmget:
	case NR_shmctl:
	case NR_semget:
	case NR_semop:
	case NR_semctl:
	case NR_semtimedop:
	case NR_msgget:
	case NR_msgsnd:
	case NR_msgrcv:
	case NR_msgctl:
	case NR_mq_open:
	case NR_mq_unlink:
	case NR_mq_timedsend:
	case NR_mq_timedreceive:
	case NR_sethostname:
	case NR_setdomainname:
		flag = S_PROC_STATE;
		goto flag_op;
	case NR_sched_setparam:
	case NR_sched_setscheduler:
	case NR_sched_setaffinity:
	case NR_sched_setattr:
		if (I(R0) == 0) /* itself: it is running */
			return 0;
		flag = S_PROC_STATE;
		goto flag_op;
	case NR_setpriority:
	case NR_ioprio_set:
		if (I(R1) == 0)
			return 0;
		flag = S_PROC_STATE;
		goto flag_op;
	case NR_prlimit64:
		if (I(R0) == 0 || R2 == 0) /* itself, or only reading */
			return 0;
		flag = S_PROC_STATE;
		goto flag_op;

	case NR_open:
		p1 = R0;
		xf = R1;
		goto open_op;
	case NR_openat:
		d1 = I(R0);
		p1 = R1;
		xf = R2;
		goto open_op;
	case NR_creat:
		p1 = R0;
		xf = O_CREAT | O_TRUNC | 1;
		goto open_op;
	case NR_openat2:
		d1 = I(R0);
		p1 = R1;
		bpf_probe_read_user(&xf, sizeof(xf), (void *)R2);
		goto open_op;
	case NR_open_by_handle_at:
		d1 = I(R0);
		xf = R2;
		goto open_op;

	case NR_unlink:
		op = OP_UNLINK;
		p1 = R0;
		goto path_op;
	case NR_rmdir:
		op = OP_UNLINK;
		p1 = R0;
		xf = AT_REMOVEDIR;
		goto path_op;
	case NR_unlinkat:
		op = OP_UNLINK;
		d1 = I(R0);
		p1 = R1;
		xf = R2;
		goto path_op;
	case NR_mkdir:
		op = OP_MKDIR;
		p1 = R0;
		goto path_op;
	case NR_mkdirat:
		op = OP_MKDIR;
		d1 = I(R0);
		p1 = R1;
		goto path_op;
	case NR_mknod:
		op = OP_MKNOD;
		p1 = R0;
		goto path_op;
	case NR_mknodat:
		op = OP_MKNOD;
		d1 = I(R0);
		p1 = R1;
		goto path_op;
	case NR_symlink:
		op = OP_SYMLINK;
		p1 = R1;
		p2 = R0;
		nsop = 1;
		goto path_op;
	case NR_symlinkat:
		op = OP_SYMLINK;
		d1 = I(R1);
		p1 = R2;
		p2 = R0;
		nsop = 1;
		goto path_op;
	case NR_link:
		op = OP_LINK;
		p1 = R1;
		d2 = AT_FDCWD;
		p2 = R0;
		nsop = 1;
		goto path_op;
	case NR_linkat:
		op = OP_LINK;
		d1 = I(R2);
		p1 = R3;
		d2 = I(R0);
		p2 = R1;
		xf = R4;
		nsop = 1;
		goto path_op;
	case NR_rename:
		op = OP_RENAME;
		p1 = R1;
		d2 = AT_FDCWD;
		p2 = R0;
		nsop = 1;
		goto path_op;
	case NR_renameat2:
		xf = R4; /* RENAME_* flags */
		/* fall through */
	case NR_renameat:
		op = OP_RENAME;
		d1 = I(R2);
		p1 = R3;
		d2 = I(R0);
		p2 = R1;
		nsop = 1;
		goto path_op;
	case NR_truncate:
		op = OP_TRUNC;
		p1 = R0;
		goto path_op;
	case NR_chmod:
	case NR_chown:
	case NR_lchown:
	case NR_setxattr:
	case NR_lsetxattr:
	case NR_removexattr:
	case NR_lremovexattr:
	case NR_utime:
	case NR_utimes:
		op = OP_META;
		p1 = R0;
		goto path_op;
	case NR_fchmodat:
	case NR_fchmodat2:
	case NR_fchownat:
	case NR_setxattrat:
	case NR_removexattrat:
	case NR_futimesat:
	case NR_utimensat:
		op = OP_META;
		d1 = I(R0);
		p1 = R1;
		goto path_op;
	default:
		return 0;
	}

fd_op:
	if (!sbx_of_current(&sbx))
		return 0;
	record_fd(sbx, fd, fl);
	return 0;

flag_op:
	if (!sbx_of_current(&sbx))
		return 0;
	if (flag & (S_MOUNT | S_NS))
		__sync_fetch_and_add(&state_of(sbx)->ns_gen, 1);
	flag_now(sbx, flag);
	return 0;

open_op:
	/* only opens that may create or truncate need their exit */
	if (!(xf & (O_CREAT | O_TRUNC)))
		return 0;
	op = OP_OPEN;
path_op:
	if (!sbx_of_current(&sbx))
		return 0;
	stash(sbx, op, d1, p1, d2, p2, xf, nsop);
	return 0;
}

SEC("tp_btf/sys_exit")
int BPF_PROG(sys_exit_all, struct pt_regs *regs, long ret)
{
	if (*(volatile __u32 *)&restart_watch)
		restart_exit(bpf_get_current_task_btf());
	switch (regs->orig_ax) {
	case NR_open:
	case NR_openat:
	case NR_creat:
	case NR_openat2:
	case NR_open_by_handle_at:
	case NR_unlink:
	case NR_rmdir:
	case NR_unlinkat:
	case NR_mkdir:
	case NR_mkdirat:
	case NR_mknod:
	case NR_mknodat:
	case NR_symlink:
	case NR_symlinkat:
	case NR_link:
	case NR_linkat:
	case NR_rename:
	case NR_renameat:
	case NR_renameat2:
	case NR_truncate:
	case NR_chmod:
	case NR_chown:
	case NR_lchown:
	case NR_setxattr:
	case NR_lsetxattr:
	case NR_removexattr:
	case NR_lremovexattr:
	case NR_utime:
	case NR_utimes:
	case NR_fchmodat:
	case NR_fchmodat2:
	case NR_fchownat:
	case NR_setxattrat:
	case NR_removexattrat:
	case NR_futimesat:
	case NR_utimensat:
		return handle_exit(ret);
	}
	return 0;
}

/* ---- processes ---------------------------------------------------------------------------- */

static __always_inline void mark_ran(__u32 sbx, __u32 tgid, int exec)
{
	struct sstate *s = state_of(sbx);
	__u32 slot = enter_slot(s);
	__u64 e = *(volatile __u64 *)&s->epoch;
	void *pm = procs_map(sbx);
	if (!pm) {
		leave_slot(s, slot);
		return;
	}
	struct proc *p = bpf_map_lookup_elem(pm, &tgid);
	if (p) {
		if (p->ran_epoch != e)
			p->ran_epoch = e;
		if (exec)
			p->exec_epoch = e;
	} else {
		/* Entered the sandbox from outside (moved into its cgroup): born now. */
		struct proc np = {};
		np.sbx = sbx;
		np.born_epoch = e;
		np.ran_epoch = e;
		if (bpf_map_update_elem(pm, &tgid, &np, BPF_NOEXIST) != 0 &&
		    !bpf_map_lookup_elem(pm, &tgid))
			flag_slot(s, slot, S_PROC_OVERFLOW);
	}
	leave_slot(s, slot);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(on_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	/* The last switch-out of an exiting task comes after sched_process_exit: ignore it. */
	if (prev->flags & PF_EXITING)
		return 0;
	if (traced_by_muted(prev)) {
		/* Stopped by CRIU: remember where the task's own syscall was interrupted (the
		 * first stop; later ones are the parasite's). */
		struct tstate *ts = bpf_task_storage_get(&tstates, prev, 0,
							 BPF_LOCAL_STORAGE_GET_F_CREATE);
		if (ts && ts->phase == 0) {
			struct pt_regs *r = (struct pt_regs *)bpf_task_pt_regs(prev);
			if (r && (long)r->orig_ax >= 0) {
				ts->saved_ip = r->ip;
				ts->phase = 1;
				__sync_fetch_and_add(&restart_watch, 1);
			}
		}
		return 0;
	}
	if (!preempt) {
		struct tstate *ts = bpf_task_storage_get(&tstates, prev, 0, 0);
		if (ts && ts->phase) {
			if (ts->phase == 2)
				return 0; /* asleep again in the restarted syscall */
			/* left phase 1 without re-entering the kernel by a syscall: count it */
			ts->phase = 0;
			__sync_fetch_and_add(&restart_watch, -1);
		}
	}
	__u32 sbx;
	if (!sbx_of_current(&sbx))
		return 0;
	mark_ran(sbx, bpf_get_current_pid_tgid() >> 32, 0);
	return 0;
}

SEC("tp_btf/sched_process_fork")
int BPF_PROG(on_fork, struct task_struct *parent, struct task_struct *child)
{
	__u32 sbx;
	if (!sbx_of_current(&sbx))
		return 0;
	__u32 pid = BPF_CORE_READ(child, pid);
	__u32 tgid = BPF_CORE_READ(child, tgid);
	if (pid != tgid) {
		mark_ran(sbx, tgid, 0); /* a new thread changes its process */
		return 0;
	}
	struct sstate *s = state_of(sbx);
	__u32 slot = enter_slot(s);
	struct proc np = {};
	np.sbx = sbx;
	np.born_epoch = *(volatile __u64 *)&s->epoch;
	np.ran_epoch = np.born_epoch;
	void *pm = procs_map(sbx);
	if (!pm || bpf_map_update_elem(pm, &tgid, &np, BPF_ANY) != 0)
		flag_slot(s, slot, S_PROC_OVERFLOW);
	flag_slot(s, slot, S_PROC_EVENT);
	leave_slot(s, slot);
	return 0;
}

SEC("tp_btf/sched_process_exec")
int BPF_PROG(on_exec, struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
{
	__u32 sbx;
	if (!sbx_of_current(&sbx))
		return 0;
	mark_ran(sbx, bpf_get_current_pid_tgid() >> 32, 1);
	return 0;
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(on_exit_task, struct task_struct *task, bool group_dead)
{
	if (*(volatile __u32 *)&restart_watch) {
		struct tstate *ts = bpf_task_storage_get(&tstates, task, 0, 0);
		if (ts && ts->phase) {
			ts->phase = 0;
			__sync_fetch_and_add(&restart_watch, -1);
		}
	}
	__u64 id = bpf_get_current_pid_tgid();
	struct pending *pp = bpf_map_lookup_elem(&pending, &id);
	if (pp) {
		struct pending pd = *pp;
		bpf_map_delete_elem(&pending, &id);
		finish_nsop(&pd);
	}
	if (!group_dead)
		return 0;
	__u32 sbx;
	if (!sbx_of_current_any(&sbx))
		return 0;
	__u32 tgid = id >> 32;
	struct sstate *s = state_of(sbx);
	__u32 slot = enter_slot(s);
	__u64 e = *(volatile __u64 *)&s->epoch;
	void *pm = procs_map(sbx);
	struct proc *p = pm ? bpf_map_lookup_elem(pm, &tgid) : NULL;
	if (p) {
		if (p->born_epoch == e && p->born_epoch != 0) {
			/* born and gone within the turn: nothing */
			bpf_map_delete_elem(pm, &tgid);
		} else {
			p->died_epoch = e;
			p->flags |= PR_DEAD;
		}
	}
	flag_slot(s, slot, S_PROC_EVENT);
	leave_slot(s, slot);
	return 0;
}
