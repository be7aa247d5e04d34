//! The sandbox file service through the real daemon (`/v1/sandboxes/{name}/files…`, root):
//! each operation; a hostile sandbox's symlinks (`/tmp/x -> /etc/shadow`, `/tmp/d -> /`, links
//! to a host canary) never make the service read or write a host file; a non-root user owns
//! what it writes; tens of MB round-trip by digest; missing paths and unknown sandboxes answer
//! their error codes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::process::{Command, Stdio};

use crab_client::Client;
use crab_common::files::{FileKind, FilesQuery};
use crab_common::ErrorCode;
use crab_testkit::daemon::{state_dir, unique, Sandbox};

fn client() -> Client {
    Client::new(state_dir().join("crab.sock"))
}

fn q(path: &str) -> FilesQuery {
    FilesQuery { path: Some(path.into()), ..Default::default() }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn sha256(data: &[u8]) -> String {
    let mut c =
        Command::new("sha256sum").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut stdin = c.stdin.take().unwrap();
    let data = data.to_vec();
    let feeder = std::thread::spawn(move || stdin.write_all(&data).unwrap());
    let out = c.wait_with_output().unwrap();
    feeder.join().unwrap();
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

fn tar_of(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in members {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, *data).unwrap();
    }
    b.into_inner().unwrap()
}

fn tar_names(tar: &[u8]) -> Vec<String> {
    let mut ar = tar::Archive::new(tar);
    ar.entries().unwrap().map(|e| e.unwrap().path().unwrap().display().to_string()).collect()
}

#[test]
fn each_operation_works() {
    crab_testkit::require_root!();
    let sb = Sandbox::new("t-files");
    let (c, n) = (client(), sb.name.clone());
    rt().block_on(async {
        // write (parents made, mode set) / read / stat
        let e = c
            .file_write(
                &n,
                &FilesQuery { mode: Some("750".into()), ..q("/work/a/b.txt") },
                b"hello\n".to_vec(),
            )
            .await
            .unwrap();
        assert_eq!((e.name.as_str(), e.kind, e.size, e.mode), ("b.txt", FileKind::File, 6, 0o750));
        assert_eq!(e.owner, "root");
        assert_eq!(c.file_read(&n, &q("/work/a/b.txt")).await.unwrap(), b"hello\n");
        let s = c.file_stat(&n, &q("/work/a")).await.unwrap();
        assert_eq!((s.kind, s.path.as_str()), (FileKind::Dir, "/work/a"));
        // relative paths are from the user's home
        c.file_write(&n, &q("rel.txt"), b"r".to_vec()).await.unwrap();
        assert_eq!(sb.sh_ok("cat /root/rel.txt"), "r");
        // list, with depth
        let l = c.file_list(&n, &q("/work")).await.unwrap();
        assert_eq!(l.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(), ["/work/a"]);
        let l = c.file_list(&n, &FilesQuery { depth: Some(2), ..q("/work") }).await.unwrap();
        assert_eq!(l.len(), 2, "{l:?}");
        // mkdir (parents), then again: already_exists
        assert_eq!(c.file_mkdir(&n, &q("/work/m/n")).await.unwrap().kind, FileKind::Dir);
        let e = c.file_mkdir(&n, &q("/work/m/n")).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::AlreadyExists, "{e:?}");
        // rename (making the destination's parents)
        let r = c
            .file_rename(&n, &FilesQuery { to: Some("/work/z/c.txt".into()), ..q("/work/a/b.txt") })
            .await
            .unwrap();
        assert_eq!(r.path, "/work/z/c.txt");
        assert_eq!(sb.sh_ok("cat /work/z/c.txt; ls /work/a | wc -l"), "hello\n0\n");
        // tar out: of the path (top member named after it) and of its contents
        let t = c.file_tar_out(&n, &q("/work/z")).await.unwrap();
        assert_eq!(tar_names(&t), ["z/", "z/c.txt"]);
        let t =
            c.file_tar_out(&n, &FilesQuery { contents: Some(true), ..q("/work/z") }).await.unwrap();
        assert!(tar_names(&t).contains(&"./c.txt".to_string()), "{:?}", tar_names(&t));
        // tar in, under a directory made for it
        let t = tar_of(&[("in/one.txt", b"1"), ("two.txt", b"22")]);
        c.file_tar_in(&n, &q("/work/t"), t).await.unwrap();
        assert_eq!(sb.sh_ok("cat /work/t/in/one.txt /work/t/two.txt"), "122");
        // remove (a tree)
        c.file_remove(&n, &q("/work")).await.unwrap();
        assert_eq!(sb.sh("test -e /work").2, 1);
    });
}

#[test]
fn missing_paths_and_unknown_sandboxes_are_named() {
    crab_testkit::require_root!();
    let sb = Sandbox::new("t-files-err");
    let (c, n) = (client(), sb.name.clone());
    rt().block_on(async {
        for e in [
            c.file_read(&n, &q("/no/such/file")).await.unwrap_err(),
            c.file_stat(&n, &q("/no/such/file")).await.unwrap_err(),
            c.file_remove(&n, &q("/no/such/file")).await.unwrap_err(),
            c.file_tar_out(&n, &q("/no/such/file")).await.unwrap_err(),
        ] {
            assert_eq!(e.code, ErrorCode::NotFound, "{e:?}");
            assert!(e.message.contains("/no/such/file") && !e.hint.is_empty(), "{e:?}");
        }
        let e = c.file_read(&n, &q("/etc")).await.unwrap_err();
        assert!(
            e.code == ErrorCode::InvalidRequest && e.message.contains("is a directory"),
            "{e:?}"
        );
        let e = c.file_list(&n, &q("/etc/hostname")).await.unwrap_err();
        assert!(e.message.contains("not a directory"), "{e:?}");
        let e = c.file_read(&n, &q("/etc/a\0b")).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidRequest, "{e:?}");
        let e = c
            .file_read(&n, &FilesQuery { user: Some("no-such-user".into()), ..q("/etc/hostname") })
            .await
            .unwrap_err();
        assert!(e.code == ErrorCode::InvalidRequest && e.message.contains("no user"), "{e:?}");
        let gone = unique("no-such-sandbox");
        let e = c.file_read(&gone, &q("/etc/hostname")).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::SandboxNotFound, "{e:?}");
        let e = c.file_write(&gone, &q("/tmp/x"), b"x".to_vec()).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::SandboxNotFound, "{e:?}");
    });
}

/// A hostile sandbox points links at host paths. Every path is resolved inside the sandbox:
/// reads answer the sandbox's own files, writes and extractions land in the sandbox, and the
/// host's files are neither returned nor changed.
#[test]
fn a_hostile_sandbox_cannot_reach_host_files() {
    crab_testkit::require_root!();
    let sb = Sandbox::new("t-files-hostile");
    let (c, n) = (client(), sb.name.clone());
    let canary = std::env::temp_dir().join(unique("crab-files-canary"));
    std::fs::write(&canary, b"host canary\n").unwrap();
    let canary_s = canary.display().to_string();
    let host_shadow = std::fs::read("/etc/shadow").unwrap();
    sb.sh_ok(&format!(
        "echo sandbox-shadow > /etc/shadow; ln -s /etc/shadow /tmp/x; ln -s / /tmp/d; \
         mkdir -p $(dirname {canary_s}); ln -s {canary_s} /tmp/c"
    ));
    rt().block_on(async {
        // Reads through the links answer the sandbox's files.
        assert_eq!(c.file_read(&n, &q("/tmp/x")).await.unwrap(), b"sandbox-shadow\n");
        assert_eq!(c.file_read(&n, &q("/tmp/d/etc/shadow")).await.unwrap(), b"sandbox-shadow\n");
        let e = c.file_read(&n, &q("/tmp/c")).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound, "the host canary was reachable: {e:?}");
        let t =
            c.file_tar_out(&n, &FilesQuery { follow: Some(true), ..q("/tmp/x") }).await.unwrap();
        let mut ar = tar::Archive::new(&t[..]);
        let mut entry = ar.entries().unwrap().next().unwrap().unwrap();
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut got).unwrap();
        assert_eq!(got, b"sandbox-shadow\n");
        // Writes through the links land in the sandbox.
        c.file_write(&n, &q("/tmp/c"), b"written\n".to_vec()).await.unwrap();
        c.file_write(&n, &q(&format!("/tmp/d{canary_s}")), b"written2\n".to_vec()).await.unwrap();
        c.file_write(&n, &q("/tmp/d/etc/shadow"), b"sandbox-shadow-2\n".to_vec()).await.unwrap();
        c.file_rename(&n, &FilesQuery { to: Some("/tmp/d/etc/moved".into()), ..q("/tmp/x") })
            .await
            .unwrap();
        // An archive with a link out and a member through it, extracted under a link to /.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "esc", "/etc").unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_size(5);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "esc/crab-files-escaped", &b"evil\n"[..]).unwrap();
        let _ = c.file_tar_in(&n, &q("/tmp/d/tmp"), b.into_inner().unwrap()).await;
    });
    assert_eq!(std::fs::read(&canary).unwrap(), b"host canary\n", "the host canary changed");
    assert_eq!(
        std::fs::read("/etc/shadow").unwrap(),
        host_shadow,
        "the host's /etc/shadow changed"
    );
    assert!(!std::path::Path::new("/etc/crab-files-escaped").exists());
    assert!(!std::path::Path::new("/etc/moved").exists());
    std::fs::remove_file(&canary).unwrap();
}

#[test]
fn a_user_owns_what_it_writes() {
    crab_testkit::require_root!();
    let sb = Sandbox::new("t-files-user");
    sb.sh_ok("useradd -m bob");
    let (c, n) = (client(), sb.name.clone());
    let bob = |p: &str| FilesQuery { user: Some("bob".into()), ..q(p) };
    rt().block_on(async {
        let e = c.file_write(&n, &bob("notes/x.txt"), b"mine".to_vec()).await.unwrap();
        assert_eq!(
            (e.path.as_str(), e.owner.as_str(), e.group.as_str()),
            ("/home/bob/notes/x.txt", "bob", "bob")
        );
        assert_eq!(
            sb.sh_ok("stat -c %U:%G /home/bob/notes /home/bob/notes/x.txt"),
            "bob:bob\nbob:bob\n"
        );
        c.file_tar_in(&n, &bob("/home/bob/t"), tar_of(&[("f", b"1")])).await.unwrap();
        assert_eq!(sb.sh_ok("stat -c %U /home/bob/t/f"), "bob\n");
        let e = c.file_write(&n, &bob("/root/nope"), b"x".to_vec()).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
        let e = c.file_read(&n, &bob("/etc/shadow")).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    });
}

#[test]
fn a_large_file_round_trips_by_digest() {
    crab_testkit::require_root!();
    let sb = Sandbox::new("t-files-big");
    let (c, n) = (client(), sb.name.clone());
    // 40 MiB that do not compress to nothing.
    let mut data = Vec::with_capacity(40 << 20);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while data.len() < 40 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(&x.to_le_bytes());
    }
    let digest = sha256(&data);
    rt().block_on(async {
        let e = c.file_write(&n, &q("/work/big.bin"), data.clone()).await.unwrap();
        assert_eq!(e.size, data.len() as u64);
        let back = c.file_read(&n, &q("/work/big.bin")).await.unwrap();
        assert_eq!(sha256(&back), digest);
        let t = c.file_tar_out(&n, &q("/work/big.bin")).await.unwrap();
        c.file_tar_in(&n, &q("/work/copy"), t).await.unwrap();
    });
    assert_eq!(
        sb.sh_ok("sha256sum < /work/big.bin").split_whitespace().next(),
        Some(digest.as_str())
    );
    assert_eq!(
        sb.sh_ok("sha256sum < /work/copy/big.bin").split_whitespace().next(),
        Some(digest.as_str())
    );
}
