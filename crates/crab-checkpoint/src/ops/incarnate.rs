//! The incarnation code restore and fork share: CRIU's restore options for a sandbox (its
//! root, cgroups, masked paths, network namespace) and the restore of a point's processes
//! into them.

use super::*;

/// The nice value a restore's CRIU runs at: someone waits for every restore (a wake holds an
/// answer, a fork or restore its caller), while dumps are background work hidden behind the
/// agents' LLM waits. On this two-core host a wake beside a first turn's dumps and their
/// hashing took 2–4 times its time alone (issue 31); at -5 the CPU's scheduler gives the
/// restore three times a dump thread's share. The restored tasks set their own nice back
/// before they resume (`crab-criu`'s test), so no sandbox code runs at it.
const RESTORE_NICE: i32 = -5;

impl Checkpointer {
    pub(super) fn restore_opts(
        &self,
        images: &Path,
        log: PathBuf,
        root: &Path,
        cgroups: Vec<PathBuf>,
        profile: &crab_sandbox::profile::SecurityProfile,
        net: NetMode,
    ) -> RestoreOpts {
        let mut o = RestoreOpts::new(images, log);
        if fresh_netns(net, profile) {
            // See `fresh_netns`: CRIU makes the namespace empty, the hook sets it up.
            o.empty_ns = libc::CLONE_NEWNET as u32;
        }
        o.log_level = self.cfg.criu_log_level;
        o.root = Some(root.to_path_buf());
        // The init must outlive the daemon, as a freshly started one does: let it be
        // re-parented away from us when `criu swrk` exits.
        o.sibling = false;
        o.tcp_established = true;
        o.ext_unix_sk = true;
        o.file_locks = true;
        // CRIU's network lock keeps packets from outside away from TCP connections while they
        // are half restored. A namespace CRIU makes empty for this restore (`fresh_netns`)
        // has only `lo` and no way in — no interface, and no task of it runs before the
        // restore completes — so the lock guards nothing there; it cost an nftables table
        // added and removed through libnftables, 15–35 ms of CRIU's restore under load
        // (its log, issue 15). Replayed namespaces (`nat`, `--privileged`) keep it.
        o.network_lock = Some(if fresh_netns(net, profile) {
            NetworkLockMethod::Skip
        } else {
            NetworkLockMethod::Nftables
        });
        o.manage_cgroups = Some(CgroupMode::Ignore);
        o.join_cgroups = cgroups;
        // The default profile gives every sandbox its own cgroup namespace; CRIU does not
        // restore it with unmanaged cgroups, so criu swrk makes one after joining the groups.
        o.cgroup_ns = !profile.privileged;
        o.nice = RESTORE_NICE;
        o
    }

    /// The `external` entries a restore or fork of `sandbox` needs for its masked directories
    /// and, user-namespaced, its device nodes: dumps declare the masked directories external
    /// (`profile::MASKED_MOUNT_KEY`), and they come back as read-only binds of the daemon's
    /// empty tmpfs, mounted here if it is not (unused by images dumped before that, which
    /// still hold the tmpfs); the device nodes come back as binds of the host's
    /// (`profile::DEVICE_MOUNT_PREFIX`). None for `--privileged`.
    pub(super) fn masked_external(
        &self,
        sandbox: &str,
        profile: &crab_sandbox::profile::SecurityProfile,
    ) -> Result<Vec<String>> {
        if profile.privileged {
            return Ok(Vec::new());
        }
        let src = self.rt.state().masked();
        crab_sandbox::profile::ensure_masked_source(&src).map_err(sandbox_err(sandbox))?;
        let mut out = vec![crab_sandbox::profile::masked_restore_external(&src)];
        if profile.userns.is_some() {
            out.extend(crab_sandbox::profile::device_restore_externals());
        }
        Ok(out)
    }

    /// The network part of a restore of sandbox `name` (network `net`, profile `profile`) into
    /// `opts`: a replayed `nat` network gets the `external` naming the veth's new host end;
    /// the answer sets up a namespace CRIU makes empty (its hook) and wires the replayed veth
    /// once the processes run ([`RestoreNet::finish`]). For in-place restores and fork branches
    /// alike.
    pub(super) fn restore_net<'a>(
        &'a self,
        name: &'a str,
        net: NetMode,
        profile: &'a crab_sandbox::profile::SecurityProfile,
        opts: &mut RestoreOpts,
    ) -> Result<RestoreNet<'a>> {
        let fresh = fresh_netns(net, profile);
        let nat = net == NetMode::Nat;
        if nat && !fresh {
            // CRIU recreates eth0's veth pair with a new host end; wired by `finish`.
            opts.external
                .push(self.rt.nat().prepare_restore(name, None).map_err(sandbox_err(name))?);
        }
        Ok(RestoreNet { rt: &self.rt, name, profile, fresh, nat })
    }

    /// The processes of a restore whose root is in place: CRIU's images of `m`, or a fresh
    /// init when `m` has none. Returns the init's pid and whether processes were restored.
    pub(super) fn restore_procs(
        &self,
        sandbox: &str,
        m: &Manifest,
        criu: Option<&Criu>,
        store: &Store,
        rootfs: &Path,
        rec: &SandboxRecord,
    ) -> Result<(u32, bool)> {
        let cg = self.rt.cgroup(sandbox);
        let (pid, restored) = match (&m.procs, criu) {
            (Some(p), Some(criu)) => {
                cg.create_for(&rec.limits, &rec.profile).map_err(cg_err(sandbox))?;
                // criu swrk joins this cgroup: frozen, it would hang there.
                ensure_thawed(&cg, sandbox)?;
                let log = self.log_dir(sandbox)?.join(format!("{}-restore-{}.log", p.id, now_ms()));
                let paths = cgroup_paths(&cg);
                let cgroups = std::iter::once(paths.v2).chain(paths.v1).collect();
                let mut opts = self.restore_opts(
                    &store.proc_dir(p.id),
                    log,
                    rootfs,
                    cgroups,
                    &rec.profile,
                    rec.net,
                );
                opts.external.extend(self.masked_external(sandbox, &rec.profile)?);
                let net = self.restore_net(sandbox, rec.net, &rec.profile, &mut opts)?;
                // Exec sessions' pipes to the daemon come back as new pipes it holds (the
                // client re-attaches): without them a restored shell would read end-of-file
                // and its children write into pipes nobody reads.
                let wiring = self.rt.sessions().prepare_restore(sandbox).unwrap_or_else(|e| {
                    tracing::warn!(sandbox, error = %e, "exec sessions not re-wired");
                    Default::default()
                });
                for (key, fd) in &wiring.inherit {
                    opts.inherit_fd.push(crab_criu::InheritFd {
                        key: key.clone(),
                        fd: std::os::fd::AsRawFd::as_raw_fd(fd),
                    });
                }
                let hostname = rec.hostname.clone();
                let r = criu.restore_with(&opts, |n| {
                    net.hook(&n)?;
                    // A branch restored to its origin point carries its source's UTS name.
                    if n.phase == phase::POST_RESTORE {
                        if let Some(pid) = n.pid {
                            set_hostname_of(pid, &hostname)?;
                        }
                    }
                    Ok(())
                })?;
                let pid = u32::try_from(r.pid).unwrap_or(0);
                if !wiring.inherit.is_empty() {
                    let pids = cg.pids().unwrap_or_default();
                    let n = self.rt.sessions().finish_restore(sandbox, wiring, &pids);
                    tracing::debug!(sandbox, sessions = n, "exec sessions re-wired");
                }
                net.finish(pid)?;
                (pid, true)
            }
            _ => {
                let (pid, _) = self
                    .rt
                    .start_init(sandbox, rec.net, &rec.limits, rec.profile)
                    .map_err(sandbox_err(sandbox))?;
                (pid, false)
            }
        };
        if process_start_time(pid).is_none() {
            return Err(CheckpointError::Sandbox {
                sandbox: sandbox.to_owned(),
                message: format!("the restored init {pid} died right after the restore"),
            });
        }
        Ok((pid, restored))
    }
}

/// What a restore does about its sandbox's network ([`Checkpointer::restore_net`]).
pub(super) struct RestoreNet<'a> {
    rt: &'a Runtime,
    name: &'a str,
    profile: &'a crab_sandbox::profile::SecurityProfile,
    /// CRIU makes the namespace empty (`fresh_netns`) and the hook sets it up.
    fresh: bool,
    /// A `nat` sandbox: its veth is attached by the hook (`fresh`) or wired by `finish`.
    nat: bool,
}

impl RestoreNet<'_> {
    /// The `setup-namespaces` part of a restore hook: set up the empty network namespace CRIU
    /// made (`lo` up, the ping range, and a user-namespaced `nat` sandbox's veth pair with the
    /// lease's address and routes, before any socket is restored).
    pub(super) fn hook(&self, n: &crab_criu::Notify) -> std::result::Result<(), String> {
        if self.fresh && n.phase == phase::SETUP_NAMESPACES {
            let pid = n.pid.ok_or("setup-namespaces without the root task's pid")?;
            let ping = crab_sandbox::profile::ping_range(self.profile);
            crab_sandbox::spawn::set_up_private_netns(pid as u32, ping)?;
            if self.nat {
                self.rt
                    .nat()
                    .attach(self.name, pid as u32)
                    .map_err(|e| format!("attach the nat network: {e}"))?;
            }
        }
        Ok(())
    }

    /// After the processes run (root task `pid`): wire a replayed `nat` veth.
    pub(super) fn finish(&self, pid: u32) -> Result<()> {
        if self.nat && !self.fresh {
            self.rt.nat().finish_restore(self.name, pid).map_err(sandbox_err(self.name))?;
        }
        Ok(())
    }
}
