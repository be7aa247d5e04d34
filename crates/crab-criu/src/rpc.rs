//! The subset of CRIU's RPC protocol (`images/rpc.proto`, CRIU 4.2) that Crab speaks.
//!
//! This module owns the wire types only: hand-written `prost` message structs mirroring
//! `criu_req`, `criu_resp`, `criu_opts` and their helpers, with the same field numbers as the
//! upstream `.proto` (proto2), so no `protoc` is needed at build time. Fields Crab never sets are
//! left out; protobuf ignores unknown fields on decode, so responses carrying them still parse.
//! It also decodes CRIU's `stats-dump` / `stats-restore` image files (`images/stats.proto`).

/// `criu_req_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum ReqType {
    /// `EMPTY`.
    Empty = 0,
    /// `DUMP`.
    Dump = 1,
    /// `RESTORE`.
    Restore = 2,
    /// `CHECK`.
    Check = 3,
    /// `PRE_DUMP`.
    PreDump = 4,
    /// `PAGE_SERVER`.
    PageServer = 5,
    /// `NOTIFY`.
    Notify = 6,
    /// `CPUINFO_DUMP`.
    CpuinfoDump = 7,
    /// `CPUINFO_CHECK`.
    CpuinfoCheck = 8,
    /// `FEATURE_CHECK`.
    FeatureCheck = 9,
    /// `VERSION`.
    Version = 10,
    /// `WAIT_PID`.
    WaitPid = 11,
    /// `PAGE_SERVER_CHLD`.
    PageServerChld = 12,
    /// `SINGLE_PRE_DUMP`.
    SinglePreDump = 13,
}

/// `criu_cg_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum CgMode {
    /// `IGNORE`: leave cgroups alone.
    Ignore = 0,
    /// `CG_NONE`.
    None = 1,
    /// `PROPS`.
    Props = 2,
    /// `SOFT` (CRIU's default).
    Soft = 3,
    /// `FULL`.
    Full = 4,
    /// `STRICT`.
    Strict = 5,
    /// `DEFAULT`.
    Default = 6,
}

/// `criu_network_lock_method`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum NetworkLockMethod {
    /// `IPTABLES` (CRIU's default; absent on hosts without iptables).
    Iptables = 1,
    /// `NFTABLES`.
    Nftables = 2,
    /// `SKIP`: do not lock the network at all.
    Skip = 3,
}

/// `inherit_fd`: a file descriptor of the `criu swrk` process that replaces the restored
/// file matching `key` (e.g. `pipe:[1234]`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct InheritFd {
    /// The key, as CRIU prints it in its images / `--inherit-fd` syntax.
    #[prost(string, required, tag = "1")]
    pub key: String,
    /// The descriptor number in the `criu swrk` process.
    #[prost(int32, required, tag = "2")]
    pub fd: i32,
}

/// `cgroup_root`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CgroupRoot {
    /// Controller (absent: all).
    #[prost(string, optional, tag = "1")]
    pub ctrl: Option<String>,
    /// Path of the root.
    #[prost(string, required, tag = "2")]
    pub path: String,
}

/// `join_namespace`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct JoinNamespace {
    /// Namespace kind (`net`, `uts`, `ipc`...).
    #[prost(string, required, tag = "1")]
    pub ns: String,
    /// Path of the namespace file (`/proc/<pid>/ns/net`, a bind mount...).
    #[prost(string, required, tag = "2")]
    pub ns_file: String,
    /// Extra option.
    #[prost(string, optional, tag = "3")]
    pub extra_opt: Option<String>,
}

/// `criu_opts`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Opts {
    /// Descriptor (in the caller, opened by CRIU through `/proc/<caller>/fd/N`) of the images
    /// directory.
    #[prost(int32, required, tag = "1")]
    pub images_dir_fd: i32,
    /// Root of the tree to dump.
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
    /// Keep the tree running after a dump.
    #[prost(bool, optional, tag = "3")]
    pub leave_running: Option<bool>,
    /// Allow external unix sockets.
    #[prost(bool, optional, tag = "4")]
    pub ext_unix_sk: Option<bool>,
    /// Dump / restore established TCP connections.
    #[prost(bool, optional, tag = "5")]
    pub tcp_established: Option<bool>,
    /// Allow device files that CRIU cannot dump natively.
    #[prost(bool, optional, tag = "6")]
    pub evasive_devices: Option<bool>,
    /// The tree is a shell job (its session / pgid leader is outside).
    #[prost(bool, optional, tag = "7")]
    pub shell_job: Option<bool>,
    /// Dump / restore file locks.
    #[prost(bool, optional, tag = "8")]
    pub file_locks: Option<bool>,
    /// Log verbosity, 0..=4.
    #[prost(int32, optional, tag = "9")]
    pub log_level: Option<i32>,
    /// Log file name, relative to the work directory (no `/` allowed).
    #[prost(string, optional, tag = "10")]
    pub log_file: Option<String>,
    /// Send NOTIFY messages at the phases where CRIU would run action scripts.
    #[prost(bool, optional, tag = "12")]
    pub notify_scripts: Option<bool>,
    /// Root directory of the restored tree.
    #[prost(string, optional, tag = "13")]
    pub root: Option<String>,
    /// Clear soft-dirty bits at the dump (`--track-mem`), for later incremental dumps.
    #[prost(bool, optional, tag = "15")]
    pub track_mem: Option<bool>,
    /// Descriptor (in the caller) of the work directory (logs, stats).
    #[prost(int32, optional, tag = "17")]
    pub work_dir_fd: Option<i32>,
    /// Allow link remapping of deleted-but-open files.
    #[prost(bool, optional, tag = "18")]
    pub link_remap: Option<bool>,
    /// Legacy cgroup management switch.
    #[prost(bool, optional, tag = "24")]
    pub manage_cgroups: Option<bool>,
    /// Cgroup roots.
    #[prost(message, repeated, tag = "25")]
    pub cg_root: Vec<CgroupRoot>,
    /// Restore the root task as a sibling of `criu swrk`, i.e. as a child of the caller.
    #[prost(bool, optional, tag = "26")]
    pub rst_sibling: Option<bool>,
    /// Descriptors to substitute for restored files.
    #[prost(message, repeated, tag = "27")]
    pub inherit_fd: Vec<InheritFd>,
    /// Treat mounts not in the image's tree as external automatically.
    #[prost(bool, optional, tag = "28")]
    pub auto_ext_mnt: Option<bool>,
    /// External mounts may share with the host.
    #[prost(bool, optional, tag = "29")]
    pub ext_sharing: Option<bool>,
    /// External mounts may be masters.
    #[prost(bool, optional, tag = "30")]
    pub ext_masters: Option<bool>,
    /// Mount points to skip.
    #[prost(string, repeated, tag = "31")]
    pub skip_mnt: Vec<String>,
    /// File systems to allow.
    #[prost(string, repeated, tag = "32")]
    pub enable_fs: Vec<String>,
    /// Cgroup management mode.
    #[prost(enumeration = "CgMode", optional, tag = "34")]
    pub manage_cgroups_mode: Option<i32>,
    /// Largest size of deleted-but-open files to carry in the image (default 1 MiB).
    #[prost(uint32, optional, tag = "35")]
    pub ghost_limit: Option<u32>,
    /// External resources (`mnt[/path]:key`, `unix[ino]`, `net[ino]:key`...).
    #[prost(string, repeated, tag = "37")]
    pub external: Vec<String>,
    /// Namespaces to create empty (clone flags).
    #[prost(uint32, optional, tag = "38")]
    pub empty_ns: Option<u32>,
    /// Namespaces to join instead of restoring.
    #[prost(message, repeated, tag = "39")]
    pub join_ns: Vec<JoinNamespace>,
    /// Cgroup (v1 freezer or v2 directory) to freeze the tree with instead of ptrace.
    #[prost(string, optional, tag = "44")]
    pub freeze_cgroup: Option<String>,
    /// Seconds CRIU waits for the tree to freeze.
    #[prost(uint32, optional, tag = "45")]
    pub timeout: Option<u32>,
    /// Skip in-flight (not yet accepted) TCP connections.
    #[prost(bool, optional, tag = "46")]
    pub tcp_skip_in_flight: Option<bool>,
    /// Do not fail on sysctls that cannot be set.
    #[prost(bool, optional, tag = "47")]
    pub weak_sysctls: Option<bool>,
    /// Restore orphaned pty masters and hand them to the caller.
    #[prost(bool, optional, tag = "50")]
    pub orphan_pts_master: Option<bool>,
    /// Close established TCP connections on restore.
    #[prost(bool, optional, tag = "52")]
    pub tcp_close: Option<bool>,
    /// LSM profile of the restored tree.
    #[prost(string, optional, tag = "53")]
    pub lsm_profile: Option<String>,
    /// Network lock method.
    #[prost(enumeration = "NetworkLockMethod", optional, tag = "64")]
    pub network_lock: Option<i32>,
    /// Compatibility mode for mount-namespace restore.
    #[prost(bool, optional, tag = "65")]
    pub mntns_compat_mode: Option<bool>,
    /// Skip the permission check on restored files.
    #[prost(bool, optional, tag = "66")]
    pub skip_file_rwx_check: Option<bool>,
}

/// `criu_features`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Features {
    /// Memory tracking (soft-dirty) works.
    #[prost(bool, optional, tag = "1")]
    pub mem_track: Option<bool>,
    /// Lazy pages (userfaultfd) work.
    #[prost(bool, optional, tag = "2")]
    pub lazy_pages: Option<bool>,
    /// The pidfd store works.
    #[prost(bool, optional, tag = "3")]
    pub pidfd_store: Option<bool>,
}

/// `criu_req`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Req {
    /// Request type.
    #[prost(enumeration = "ReqType", required, tag = "1")]
    pub r#type: i32,
    /// Options of a dump / restore / check.
    #[prost(message, optional, tag = "2")]
    pub opts: Option<Opts>,
    /// Answer to a NOTIFY: whether the caller's action succeeded.
    #[prost(bool, optional, tag = "3")]
    pub notify_success: Option<bool>,
    /// Keep the connection open for more requests.
    #[prost(bool, optional, tag = "4")]
    pub keep_open: Option<bool>,
    /// Features to query (FEATURE_CHECK).
    #[prost(message, optional, tag = "5")]
    pub features: Option<Features>,
    /// Pid for WAIT_PID.
    #[prost(uint32, optional, tag = "6")]
    pub pid: Option<u32>,
}

/// `criu_dump_resp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DumpResp {
    /// Whether this process was restored from the dump it just requested (self-dump only).
    #[prost(bool, optional, tag = "1")]
    pub restored: Option<bool>,
}

/// `criu_restore_resp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RestoreResp {
    /// Host pid of the restored root task.
    #[prost(int32, required, tag = "1")]
    pub pid: i32,
}

/// `criu_notify`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NotifyMsg {
    /// The action-script name (`post-dump`, `setup-namespaces`, ...).
    #[prost(string, optional, tag = "1")]
    pub script: Option<String>,
    /// Pid the action concerns (root task on restore), when any.
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
}

/// `criu_version`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct VersionMsg {
    /// Major number.
    #[prost(int32, required, tag = "1")]
    pub major_number: i32,
    /// Minor number.
    #[prost(int32, required, tag = "2")]
    pub minor_number: i32,
    /// Git id of a development build.
    #[prost(string, optional, tag = "3")]
    pub gitid: Option<String>,
    /// Sub-level.
    #[prost(int32, optional, tag = "4")]
    pub sublevel: Option<i32>,
    /// Extra number.
    #[prost(int32, optional, tag = "5")]
    pub extra: Option<i32>,
    /// Release name.
    #[prost(string, optional, tag = "6")]
    pub name: Option<String>,
}

/// `criu_resp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Resp {
    /// Type of the request this answers (or NOTIFY).
    #[prost(enumeration = "ReqType", required, tag = "1")]
    pub r#type: i32,
    /// Whether the request succeeded.
    #[prost(bool, required, tag = "2")]
    pub success: bool,
    /// Dump details.
    #[prost(message, optional, tag = "3")]
    pub dump: Option<DumpResp>,
    /// Restore details.
    #[prost(message, optional, tag = "4")]
    pub restore: Option<RestoreResp>,
    /// Notification (type NOTIFY).
    #[prost(message, optional, tag = "5")]
    pub notify: Option<NotifyMsg>,
    /// errno of the failure.
    #[prost(int32, optional, tag = "7")]
    pub cr_errno: Option<i32>,
    /// Features (FEATURE_CHECK).
    #[prost(message, optional, tag = "8")]
    pub features: Option<Features>,
    /// Error message of the failure.
    #[prost(string, optional, tag = "9")]
    pub cr_errmsg: Option<String>,
    /// Version (VERSION).
    #[prost(message, optional, tag = "10")]
    pub version: Option<VersionMsg>,
    /// Exit status (WAIT_PID).
    #[prost(int32, optional, tag = "11")]
    pub status: Option<i32>,
}

/// `dump_stats_entry` (times in microseconds). Every field is read as optional so that a
/// partial or future entry still decodes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DumpStatsEntry {
    /// Time to freeze the tree.
    #[prost(uint32, optional, tag = "1")]
    pub freezing_time: Option<u32>,
    /// Time the tree stayed frozen.
    #[prost(uint32, optional, tag = "2")]
    pub frozen_time: Option<u32>,
    /// Time to collect memory.
    #[prost(uint32, optional, tag = "3")]
    pub memdump_time: Option<u32>,
    /// Time to write memory.
    #[prost(uint32, optional, tag = "4")]
    pub memwrite_time: Option<u32>,
    /// Pages scanned.
    #[prost(uint64, optional, tag = "5")]
    pub pages_scanned: Option<u64>,
    /// Pages skipped because the parent image had them.
    #[prost(uint64, optional, tag = "6")]
    pub pages_skipped_parent: Option<u64>,
    /// Pages written.
    #[prost(uint64, optional, tag = "7")]
    pub pages_written: Option<u64>,
}

/// `restore_stats_entry` (times in microseconds).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RestoreStatsEntry {
    /// Pages compared.
    #[prost(uint64, optional, tag = "1")]
    pub pages_compared: Option<u64>,
    /// Pages skipped thanks to copy-on-write.
    #[prost(uint64, optional, tag = "2")]
    pub pages_skipped_cow: Option<u64>,
    /// Time to fork the tree.
    #[prost(uint32, optional, tag = "3")]
    pub forking_time: Option<u32>,
    /// Time of the whole restore.
    #[prost(uint32, optional, tag = "4")]
    pub restore_time: Option<u32>,
    /// Pages restored.
    #[prost(uint64, optional, tag = "5")]
    pub pages_restored: Option<u64>,
}

/// `stats_entry`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StatsEntry {
    /// Dump statistics.
    #[prost(message, optional, tag = "1")]
    pub dump: Option<DumpStatsEntry>,
    /// Restore statistics.
    #[prost(message, optional, tag = "2")]
    pub restore: Option<RestoreStatsEntry>,
}

/// `IMG_SERVICE_MAGIC`: first word of service images such as `stats-dump`.
const IMG_SERVICE_MAGIC: u32 = 0x5510_5940;

/// Decode a CRIU stats image (`stats-dump`, `stats-restore`): magic word(s), then one
/// length-prefixed (`u32` little endian) `stats_entry`. `None` when the bytes do not parse.
pub fn decode_stats_image(bytes: &[u8]) -> Option<StatsEntry> {
    use prost::Message as _;
    let word = |at: usize| -> Option<u32> {
        let b = bytes.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    // Service images carry IMG_SERVICE_MAGIC then the image's own magic; older layouts only
    // the latter.
    let start = if word(0)? == IMG_SERVICE_MAGIC { 8 } else { 4 };
    let len = usize::try_from(word(start)?).ok()?;
    let body = bytes.get(start + 4..start + 4 + len)?;
    StatsEntry::decode(body).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn request_round_trips_and_uses_upstream_tags() {
        let req = Req {
            r#type: ReqType::Dump as i32,
            opts: Some(Opts {
                images_dir_fd: 7,
                pid: Some(42),
                network_lock: Some(NetworkLockMethod::Nftables as i32),
                external: vec!["mnt[/x]:y".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        let bytes = req.encode_to_vec();
        // field 1 (type), varint 1
        assert_eq!(&bytes[..2], &[0x08, 0x01]);
        let back = Req::decode(bytes.as_slice()).unwrap();
        assert_eq!(back, req);
        let opts = back.opts.unwrap();
        assert_eq!(opts.network_lock(), NetworkLockMethod::Nftables);
        // network_lock = 64 encodes as a two-byte key: (64 << 3) | 0 = 512 -> 0x80 0x04.
        let enc =
            Opts { images_dir_fd: 0, network_lock: Some(2), ..Default::default() }.encode_to_vec();
        assert_eq!(enc, vec![0x08, 0x00, 0x80, 0x04, 0x02]);
    }

    #[test]
    fn stats_image_decodes() {
        let entry = StatsEntry {
            dump: Some(DumpStatsEntry { frozen_time: Some(1234), ..Default::default() }),
            restore: None,
        };
        let body = entry.encode_to_vec();
        let mut img = Vec::new();
        img.extend_from_slice(&IMG_SERVICE_MAGIC.to_le_bytes());
        img.extend_from_slice(&0x5709_3306u32.to_le_bytes());
        img.extend_from_slice(&u32::try_from(body.len()).unwrap().to_le_bytes());
        img.extend_from_slice(&body);
        assert_eq!(decode_stats_image(&img), Some(entry));
        assert_eq!(decode_stats_image(&img[..6]), None);
    }
}
