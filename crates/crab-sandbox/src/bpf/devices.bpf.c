// SPDX-License-Identifier: GPL-2.0
//
// The sandbox device allowlist as a cgroup-v2 device program (BPF_PROG_TYPE_CGROUP_DEVICE),
// attached to every sandbox's cgroup so the policy holds on hosts without the cgroup-v1
// `devices` controller. It must match `profile::ALLOWED_DEVICES` (a unit test checks the
// list): null 1:3, zero 1:5, full 1:7, random 1:8, urandom 1:9, tty 5:0, ptmx 5:2, pts 136:*.
// Every access (mknod, read, write) to an allowed character device passes; everything else,
// every block device included, is refused (EPERM).
//
// Self-contained on purpose (no kernel or libbpf headers): the context is three u32s.

typedef unsigned int __u32;

struct bpf_cgroup_dev_ctx {
	__u32 access_type; // (access << 16) | type
	__u32 major;
	__u32 minor;
};

#define SEC(name) __attribute__((section(name), used))
#define BPF_DEVCG_DEV_CHAR 2

SEC("cgroup/dev")
int crab_devices(struct bpf_cgroup_dev_ctx *ctx)
{
	__u32 type = ctx->access_type & 0xFFFF;
	__u32 major = ctx->major;
	__u32 minor = ctx->minor;

	if (type != BPF_DEVCG_DEV_CHAR)
		return 0;
	if (major == 1)
		return minor == 3 || minor == 5 || minor == 7 || minor == 8 || minor == 9;
	if (major == 5)
		return minor == 0 || minor == 2;
	return major == 136;
}

char LICENSE[] SEC("license") = "GPL";
