//! How an envd call becomes a command in the sandbox: the user switch (`setpriv` to E2B's
//! `user` account unless the call asks for root) and the programs behind envd's
//! processes ([`launch`], [`follow`], [`signal`]): each command runs detached from the exec that
//! started it, under a supervisor shell that keeps its output in files and its exit status in a
//! file of its own directory under [`ENVD_DIR`], so it outlives the exec stream (a daemon
//! restart, a pause) and is dumped with the sandbox by CRIU (`docs/e2b.md`, "Processes").

/// The account commands run as when the call names none (E2B's templates' default user).
pub const DEFAULT_USER: &str = "user";

/// The user an envd call runs as: `Authorization: Basic base64("name:")`, else [`DEFAULT_USER`].
pub fn user_from_basic(header: Option<&str>) -> Result<String, String> {
    use base64::Engine;
    let Some(h) = header else { return Ok(DEFAULT_USER.to_string()) };
    let b64 = h
        .strip_prefix("Basic ")
        .ok_or_else(|| "Authorization must be `Basic base64(user:)`".to_string())?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| "Authorization: the Basic credentials are not base64".to_string())?;
    let s = String::from_utf8(raw).map_err(|_| "Authorization: user is not UTF-8".to_string())?;
    let user = s.split(':').next().unwrap_or("").to_string();
    check_user(&user)?;
    Ok(if user.is_empty() { DEFAULT_USER.to_string() } else { user })
}

/// A user name usable on a command line (POSIX portable names).
pub fn check_user(user: &str) -> Result<(), String> {
    if user.len() > 32
        || !user.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        || user.starts_with('-')
    {
        return Err(format!("invalid user name {user:?}"));
    }
    Ok(())
}

/// The home directory of `user` (E2B's convention: `/root` or `/home/<user>`).
pub use crab_common::files::home_of;

/// argv that runs `argv` as `user` with `envs` (for root: as is; the envs go in the exec's
/// own environment). Other users get a fresh login environment (`setpriv --reset-env`: HOME,
/// USER, SHELL, PATH from their passwd entry) plus `envs`.
pub fn as_user(
    user: &str,
    envs: &[(String, String)],
    argv: Vec<String>,
) -> (Vec<String>, Vec<String>) {
    let kv: Vec<String> = envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if user == "root" {
        let mut env = vec!["HOME=/root".to_string(), "USER=root".to_string()];
        env.extend(kv);
        return (argv, env);
    }
    let mut cmd: Vec<String> = [
        "setpriv",
        &format!("--reuid={user}"),
        &format!("--regid={user}"),
        "--init-groups",
        "--reset-env",
        "--",
        "env",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    cmd.extend(kv);
    cmd.extend(argv);
    (cmd, Vec::new())
}

/// Where each envd process keeps its files inside the sandbox: `<ENVD_DIR>/<id>/` holds `pid`
/// (the supervisor's pid: the E2B pid), `cpid` (the command's), `out` and `err` (everything it
/// printed) and `exit` (its exit status, once it exited); a process started with stdin also
/// has the FIFO `in` (its stdin, held open by a `sleep` whose pid is in `inpid` until
/// `CloseStdin`).
pub const ENVD_DIR: &str = "/run/crab-envd";

/// The supervisor (`$1` = its directory, then the command's argv). It prints its pid (the
/// header line), runs the command in a session of its own with stdout and stderr through
/// `tee -p` (which survives the exec stream going away: it keeps writing the files), writes
/// the exit status, and writes it to its descriptor 4 (the launcher's pipe).
const SUPERVISOR: &str = r#"d=$1; in=$2; shift 2
umask 022
i=/dev/null
if [ -n "$in" ]; then
  mkfifo -m 600 "$d/in" || exit 125
  sleep infinity >"$d/in" </dev/null 3>&- 4>&- & echo $! >"$d/inpid"
  i=$d/in
fi
echo $$ >"$d/pid"
echo $$
{ { setsid "$@" <"$i" 3>&- 4>&- & echo $! >"$d/cpid"; wait $!; echo $? >"$d/exit"; } 2>&1 1>&3 3>&- 4>&- | tee -p -a "$d/err" >&2 3>&- 4>&-; } 3>&1 | tee -p -a "$d/out" 4>&-
[ -n "$in" ] && read k <"$d/inpid" && kill "$k" 2>/dev/null
read c <"$d/exit"
echo "$c" >&4"#;

/// Start a process: remove the directories of processes already reported ended (`$2`), make
/// its directory (0700), start the supervisor detached (a child of the sandbox's init, so CRIU
/// dumps it and the exec's end does not kill it) with the write end of a pipe, and end with the
/// status the supervisor writes there (255 when it died without one).
const LAUNCH: &str = r#"d=$1; gc=$2; in=$3; shift 3
for t in setsid tee tail; do command -v $t >/dev/null || { echo "crab: $t is not installed in this sandbox (E2B commands need util-linux and coreutils)" >&2; exit 127; }; done
[ -n "$gc" ] && (rm -rf $gc </dev/null >/dev/null 2>&1 &)
mkdir -p -m 700 "$d" || { echo "crab: cannot create $d" >&2; exit 125; }
exec 3>&1
c=$( (setsid sh -c "$SUP" crab-envd-run "$d" "$in" "$@" 4>&1 1>&3 3>&- </dev/null &) )
[ -n "$c" ] && exit "$c"
exit 255"#;

/// Watch a process started earlier (`$1` its directory, `$2` its pid): the header line says
/// `PID running` (then its output from now on, and its exit status as this program's) or
/// `PID ended [STATUS]`.
const FOLLOW: &str = r#"d=$1; p=$2
if [ -d "$d" ] && [ ! -s "$d/exit" ] && grep -qaF -- "$d" "/proc/$p/cmdline" 2>/dev/null; then
  echo "$p running"
  tail -q -s 0.1 --pid="$p" -c 0 -f "$d/out" 2>/dev/null & a=$!
  { tail -q -s 0.1 --pid="$p" -c 0 -f "$d/err" 2>/dev/null; } >&2 & b=$!
  wait $a $b
  if read c <"$d/exit" && [ -n "$c" ]; then exit "$c"; fi
  exit 255
fi
if read c <"$d/exit" 2>/dev/null && [ -n "$c" ]; then echo "$p ended $c"; else echo "$p ended"; fi"#;

/// A process's directory name is this front door's: `<ENVD_DIR>/<hex>`.
pub fn is_envd_dir(d: &str) -> bool {
    d.strip_prefix(ENVD_DIR)
        .and_then(|r| r.strip_prefix('/'))
        .is_some_and(|h| !h.is_empty() && h.len() <= 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// argv (run as root) that starts `argv` as an envd process in `dir` (with a stdin that
/// [`send_input`] writes and [`close_input`] closes when `stdin`, else `/dev/null`), first
/// removing the directories `gc` (of processes already reported ended). Its stdout starts with
/// the header line `PID`.
pub fn launch(dir: &str, gc: &[String], stdin: bool, argv: Vec<String>) -> Vec<String> {
    let gc: Vec<&str> = gc.iter().map(String::as_str).filter(|d| is_envd_dir(d)).collect();
    let mut v = vec![
        "/bin/sh".to_string(),
        "-c".to_string(),
        format!("SUP='{}'\n{LAUNCH}", SUPERVISOR.replace('\'', r"'\''")),
        "crab-envd".to_string(),
        dir.to_string(),
        gc.join(" "),
        if stdin { "1" } else { "" }.to_string(),
    ];
    v.extend(argv);
    v
}

/// argv (run as root) that writes its stdin to the stdin of the envd process in `dir`; 44 when
/// it was started without one or closed it. Opened read-write, so it never blocks on a
/// process that stopped reading.
pub fn send_input(dir: &str) -> Vec<String> {
    sh(r#"[ -p "$1/in" ] && [ -s "$1/inpid" ] || exit 44; exec cat 1<>"$1/in""#, &[dir])
}

/// argv (run as root) that closes the stdin of the envd process in `dir` (its reader sees the
/// end of file once what was sent is read); 44 when it has none (left).
pub fn close_input(dir: &str) -> Vec<String> {
    sh(
        r#"[ -p "$1/in" ] && read k <"$1/inpid" 2>/dev/null && [ -n "$k" ] || exit 44; kill "$k" 2>/dev/null; : >"$1/inpid""#,
        &[dir],
    )
}

/// argv (run as root) that watches the envd process `pid` of `dir` (see [`FOLLOW`]).
pub fn follow(dir: &str, pid: u32) -> Vec<String> {
    sh(FOLLOW, &[dir, &pid.to_string()])
}

/// argv (run as root) that sends `signal` (`KILL`, `TERM`) to the process group of the
/// command of the envd process in `dir`; 44 when it has no command pid.
pub fn signal(dir: &str, signal: &str) -> Vec<String> {
    sh(
        r#"read c <"$1/cpid" 2>/dev/null && [ -n "$c" ] || exit 44; kill -s "$2" -- "-$c" 2>/dev/null || kill -s "$2" "$c" 2>/dev/null; exit 0"#,
        &[dir, signal],
    )
}

fn sh(script: &str, args: &[&str]) -> Vec<String> {
    let mut v =
        vec!["/bin/sh".to_string(), "-c".to_string(), script.to_string(), "crab-e2b".to_string()];
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_user() {
        assert_eq!(user_from_basic(None).as_deref(), Ok("user"));
        assert_eq!(user_from_basic(Some("Basic cm9vdDo=")).as_deref(), Ok("root"));
        assert!(user_from_basic(Some("Bearer x")).is_err());
        // "a b:" has a space: refused rather than passed to setpriv.
        assert!(user_from_basic(Some("Basic YSBiOg==")).is_err());
    }

    #[test]
    fn users_switch_with_setpriv() {
        let (argv, env) = as_user("user", &[("A".into(), "1".into())], vec!["id".into()]);
        assert_eq!(argv[0], "setpriv");
        assert!(argv.contains(&"A=1".to_string()));
        assert_eq!(argv.last().map(String::as_str), Some("id"));
        assert!(env.is_empty());
        let (argv, env) = as_user("root", &[("A".into(), "1".into())], vec!["id".into()]);
        assert_eq!(argv, vec!["id".to_string()]);
        assert!(env.contains(&"A=1".to_string()));
    }

    /// The envd programs run here with the host's own sh and coreutils: a start says its pid,
    /// then the output (stdout and stderr apart), and ends with the exit status; a follow of a
    /// running process streams from now on and ends with its status; a signal reaches the
    /// command, not the supervisor, which records the status; a follow of an ended process says
    /// so with its status.
    #[test]
    #[allow(clippy::unwrap_used)]
    fn envd_programs_run_detached_and_keep_the_status() {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};
        let root = std::env::temp_dir().join(format!("crab-envd-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let run = |argv: Vec<String>| Command::new(&argv[0]).args(&argv[1..]).output().unwrap();
        let d1 = root.join("a1").display().to_string();
        let argv = |s: &str| vec!["sh".to_string(), "-c".to_string(), s.to_string()];
        let o = run(launch(&d1, &[], false, argv("echo out; echo err >&2; exit 3")));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let (pid, rest) = out.split_once('\n').unwrap();
        let pid: u32 = pid.parse().unwrap();
        assert_eq!(rest, "out\n");
        assert_eq!(String::from_utf8_lossy(&o.stderr), "err\n");
        assert_eq!(o.status.code(), Some(3));
        let o = run(follow(&d1, pid));
        assert_eq!(String::from_utf8_lossy(&o.stdout), format!("{pid} ended 3\n"));
        // A long one, followed by a second stream, then killed through `signal`.
        let d2 = root.join("a2").display().to_string();
        let a =
            launch(&d2, std::slice::from_ref(&d1), false, argv("echo first; sleep 60; echo never"));
        let mut start = Command::new(&a[0]).args(&a[1..]).stdout(Stdio::piped()).spawn().unwrap();
        let mut lines = BufReader::new(start.stdout.take().unwrap()).lines();
        let pid: u32 = lines.next().unwrap().unwrap().parse().unwrap();
        assert_eq!(lines.next().unwrap().unwrap(), "first");
        let f = follow(&d2, pid);
        let mut fol = Command::new(&f[0]).args(&f[1..]).stdout(Stdio::piped()).spawn().unwrap();
        let mut flines = BufReader::new(fol.stdout.take().unwrap()).lines();
        assert_eq!(flines.next().unwrap().unwrap(), format!("{pid} running"));
        let o = run(signal(&d2, "KILL"));
        assert_eq!(o.status.code(), Some(0), "{o:?}");
        assert_eq!(start.wait().unwrap().code(), Some(137));
        assert!(flines.next().is_none(), "the follow printed after the kill");
        assert_eq!(fol.wait().unwrap().code(), Some(137));
        assert_eq!(std::fs::read_to_string(format!("{d2}/out")).unwrap(), "first\n");
        // stdin: what is sent reaches the command; closing it ends `cat`.
        let d3 = root.join("a3").display().to_string();
        let a = launch(&d3, &[], true, argv("cat; echo done"));
        let mut start = Command::new(&a[0]).args(&a[1..]).stdout(Stdio::piped()).spawn().unwrap();
        let mut lines = BufReader::new(start.stdout.take().unwrap()).lines();
        lines.next().unwrap().unwrap();
        let feed = |argv: Vec<String>, data: &[u8]| {
            use std::io::Write;
            let mut c =
                Command::new(&argv[0]).args(&argv[1..]).stdin(Stdio::piped()).spawn().unwrap();
            match c.stdin.take().unwrap().write_all(data) {
                Ok(()) => {}
                // A program that refuses the input (exit 44) may be gone before it reads it;
                // what was delivered is checked on the receiving side.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                Err(e) => panic!("feeding {argv:?}: {e}"),
            }
            c.wait().unwrap().code()
        };
        assert_eq!(feed(send_input(&d3), b"hello\n"), Some(0));
        assert_eq!(lines.next().unwrap().unwrap(), "hello");
        assert_eq!(run(close_input(&d3)).status.code(), Some(0));
        assert_eq!(lines.next().unwrap().unwrap(), "done");
        assert_eq!(start.wait().unwrap().code(), Some(0));
        assert_eq!(feed(send_input(&d2), b"x"), Some(44), "a process without stdin");
        // The gc list names only this front door's directories: d1 is not one, so it stays.
        assert!(std::path::Path::new(&d1).exists());
        assert!(is_envd_dir("/run/crab-envd/0a1b"));
        assert!(!is_envd_dir("/run/crab-envd/../etc") && !is_envd_dir("/run/crab-envd/"));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
