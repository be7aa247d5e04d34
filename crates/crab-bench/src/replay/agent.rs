//! The replay agent: keeps an OpenAI-style conversation, sends it to the LLM (through Crab's
//! proxy, or directly), runs the returned `bash` tool call in the sandbox through the exec API,
//! and appends the observation the way mini-swe-agent formats it.
//!
//! Commands run either as a fresh `bash -c` each (mini-swe-agent) or in one persistent bash
//! session (traces marked `shell_state`, so `cd` and `export` persist). The session writes
//! nothing into the sandbox (the instrument must not create the effects it measures): it is a
//! bash held by the daemon through an exec session — its stdin a pipe fed through
//! `POST .../exec/{session}/stdin`, its stdout and stderr streamed back — re-parented to the
//! sandbox's init and started under the argv[0] `crab-replay-session`, which the replay's
//! sandboxes declare as their harness (`--harness-cmd`), so its own running never makes a
//! turn a process turn, while every dump still holds it. Each command's bytes are read by the
//! shell's `read -N` (never parsed as part of the stream) and evaluated with stdin from
//! `/dev/null`; a sentinel printed after it on stdout (with the exit code) and on stderr marks
//! its end on each stream. It is part of the sandbox's state, checkpointed and restored with it
//! like any user process: after a restore the daemon hands its re-created pipes back and the
//! agent attaches to them. When a recovery lost it (no process image), the next command finds
//! it gone and starts a new one in the initial working directory, as a restarted agent harness
//! would.

use base64::Engine as _;
use serde_json::{json, Value};

use crab_client::Client;
use crab_common::api::ExecFrame;
use crab_common::ApiError;

use super::llm::post_json;
use super::sandbox;

/// Longest observation kept in the conversation (mini-swe-agent keeps head and tail).
const MAX_OBSERVATION: usize = 10_000;

/// The bash tool as offered to the LLM.
fn tools() -> Value {
    json!([{
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }])
}

/// The first messages of every replayed conversation.
pub fn initial_conversation(traj_id: &str, workdir: &str) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You are a helpful assistant that can interact with a computer shell. Reply with one bash tool call per turn."}),
        json!({"role": "user", "content": format!("Replay of trajectory {traj_id}. Your working directory is {workdir}.")}),
    ]
}

/// Number of turns a conversation has completed (assistant messages in it).
pub fn turns_in(conv: &[Value]) -> usize {
    conv.iter().filter(|m| m.get("role").and_then(|r| r.as_str()) == Some("assistant")).count()
}

/// One LLM answer.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The assistant message to append.
    pub message: Value,
    /// The command of its tool call, if any.
    pub command: Option<String>,
    /// Id of the tool call.
    pub call_id: String,
    /// Time the LLM itself spent (its `x-replay-llm-ms`), ms.
    pub llm_ms: f64,
    /// Round trip as seen by the agent, ms.
    pub wall_ms: f64,
    /// Crab's proxy's breakdown of the time it added, when it went through the proxy.
    pub held: Option<crab_common::stats::Breakdown>,
}

/// Send `conv` to the chat-completions endpoint `url` as run `run`.
pub async fn ask(url: &str, run: &str, conv: &[Value]) -> Result<Answer, ApiError> {
    let t = std::time::Instant::now();
    let body = json!({"model": "crab-replay", "user": run, "messages": conv, "tools": tools()});
    let a = post_json(url, &[("x-crab-replay-run", run)], &body).await?;
    let wall_ms = t.elapsed().as_secs_f64() * 1e3;
    if a.status != 200 {
        return Err(ApiError::new(
            crab_common::ErrorCode::Upstream,
            format!("the LLM at {url} answered {}: {}", a.status, String::from_utf8_lossy(&a.body)),
            "check that the replay LLM is the daemon's --upstream-openai",
        ));
    }
    let v: Value = serde_json::from_slice(&a.body)
        .map_err(|e| ApiError::internal(format!("undecodable LLM answer from {url}: {e}")))?;
    let message = v["choices"][0]["message"].clone();
    if message.is_null() {
        return Err(ApiError::internal(format!("LLM answer without a message: {v}")));
    }
    let call = &message["tool_calls"][0];
    let call_id = call["id"].as_str().unwrap_or("call").to_string();
    let command = call["function"]["arguments"]
        .as_str()
        .and_then(|s| serde_json::from_str::<Value>(s).ok())
        .and_then(|args| args["command"].as_str().map(str::to_string));
    Ok(Answer { message, command, call_id, llm_ms: a.llm_ms.unwrap_or(0.0), wall_ms, held: a.held })
}

/// Result of running one command.
#[derive(Debug, Clone)]
pub struct Observation {
    /// The tool message content.
    pub content: String,
    /// Exit code.
    pub code: i32,
    /// Wall time, ms.
    pub ms: f64,
}

fn format_observation(code: i32, out: &[u8]) -> String {
    let text = String::from_utf8_lossy(out);
    let body = if text.chars().count() > MAX_OBSERVATION {
        let head: String = text.chars().take(MAX_OBSERVATION / 2).collect();
        let tail: Vec<char> = text.chars().rev().take(MAX_OBSERVATION / 2).collect();
        let tail: String = tail.into_iter().rev().collect();
        format!("{head}\n[... output truncated ...]\n{tail}")
    } else {
        text.into_owned()
    };
    format!("<returncode>{code}</returncode>\n<output>\n{body}</output>")
}

/// argv[0] of the persistent session's shell: what the sandbox's harness pattern
/// ([`SESSION_HARNESS`]) names.
pub const SESSION_ARGV0: &str = "crab-replay-session";

/// The harness pattern of every replay sandbox: the persistent session's shell (its running
/// alone is the instrument's, not the agent's; what it runs is the agent's).
pub const SESSION_HARNESS: &str = "^crab-replay-session ";

/// Name of the session's exec (its `stdin_session`).
const SESSION_NAME: &str = "replay";

/// The sentinel the session prints after each command: on stdout followed by the exit code
/// and a newline, on stderr followed by a newline. No command prints it.
const SENTINEL: &str = "\u{1e}crab-replay-end-7f3c9a";

/// How long a command that started a background job is given for that job's first output
/// before its sentinel: a terminal harness reads the screen some time after the command, so a
/// job's immediate output (`command not found`, a server's start-up error) is part of what the
/// agent saw — and without a wait whether it lands before or after the sentinel is a race,
/// which made fault-free runs of the same trajectory disagree.
const JOB_SETTLE_S: &str = "0.5";

/// Shell functions defined once per session: `__crab_read N` reads the next N bytes of the
/// session's stdin (bytes: in the C locale) into `__crab_c`; `__crab_end RC` waits
/// [`JOB_SETTLE_S`] when the command started a background job (`$!` moved), prints the
/// shell's state (working directory, umask, variables, functions, aliases, options, traps,
/// jobs) after a `SENTINEL~` marker, then the sentinels.
fn session_prelude() -> String {
    format!(
        "__crab_read() {{ local LC_ALL=C; IFS= read -r -N \"$1\" __crab_c; }}\n\
         __crab_end() {{ [ \"${{!-}}\" = \"$__crab_b\" ] || sleep {JOB_SETTLE_S}; printf '%s~' '{SENTINEL}'; \
         {{ pwd; umask; declare -p; declare -f; alias; set -o; shopt -p; trap -p; jobs -p; }} 2>/dev/null; \
         printf '%s:%d\\n' '{SENTINEL}' \"$1\"; printf '%s\\n' '{SENTINEL}' >&2; }}\n"
    )
}

/// One command as written to the session's stdin: its bytes are read by `__crab_read` (never
/// parsed as part of the stream), then sourced in the session's shell from a here-string on fd
/// 3 with stdin from `/dev/null`, so `cd`, `export` and shell variables persist and error
/// messages name the command's own line (`line 1:`), not the session's input line. `$!` is
/// kept in `__crab_b` first, so `__crab_end` knows whether the command started a job.
fn session_input(command: &str) -> Vec<u8> {
    let mut v = format!("__crab_read {}\n", command.len()).into_bytes();
    v.extend_from_slice(command.as_bytes());
    v.extend_from_slice(
        b"\n__crab_b=${!-}; . /dev/fd/3 3<<<\"$__crab_c\" </dev/null; __crab_end $?\n",
    );
    v
}

/// Variables whose values change by themselves (or with the sentinel's own call): not state.
const DYNAMIC: &[&str] = &[
    "BASH_ARGC",
    "BASH_ARGV",
    "BASH_COMMAND",
    "BASH_LINENO",
    "BASH_SOURCE",
    "BASHPID",
    "EPOCHREALTIME",
    "EPOCHSECONDS",
    "FUNCNAME",
    "HISTCMD",
    "LINENO",
    "PIPESTATUS",
    "RANDOM",
    "SECONDS",
    "SRANDOM",
    "_",
    "__crab_b",
    "__crab_c",
];

/// A digest of the shell state `__crab_end` printed, without its self-changing variables.
fn state_digest(state: &[u8]) -> [u8; 32] {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    for line in String::from_utf8_lossy(state).lines() {
        if let Some(rest) = line.strip_prefix("declare ") {
            let name = rest.split_whitespace().nth(1).unwrap_or("");
            let name = name.split('=').next().unwrap_or("");
            if DYNAMIC.contains(&name) {
                continue;
            }
        }
        h.update(line.as_bytes());
        h.update(b"\n");
    }
    h.finalize().into()
}

/// A persistent session: a shell in the sandbox held by the daemon through an exec session
/// (its stdin fed by the stdin route, its output streamed back); nothing of it is written into
/// the sandbox. Its shell is a child of the sandbox's init (so dumps hold it) and the session's
/// pipes come back with a restore, picked up again by attaching.
pub(crate) struct Session {
    pub(crate) frames: tokio::sync::mpsc::UnboundedReceiver<ExecFrame>,
    task: tokio::task::JoinHandle<()>,
    ended: bool,
    /// Digest of the shell's state after its last command.
    state: Option<[u8; 32]>,
    /// Its digest at the last [`take_state_changed`].
    checkpointed: Option<[u8; 32]>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One sandbox's session (locked for a whole command; sandboxes do not wait for each other).
type Slot = std::sync::Arc<tokio::sync::Mutex<Option<Session>>>;

fn slot(sb: &str) -> Slot {
    static S: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, Slot>>> =
        std::sync::OnceLock::new();
    let mut m = S.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    m.entry(sb.to_string()).or_default().clone()
}

/// Follow the exec stream at `path` (`body`: its request) in a task of its own.
pub(crate) fn follow(client: &Client, path: String, body: Value) -> Session {
    let (tx, frames) = tokio::sync::mpsc::unbounded_channel();
    let client = client.clone();
    let task = tokio::spawn(async move {
        let err_tx = tx.clone();
        let r = client
            .stream(&path, &body, |f: ExecFrame| {
                let _ = tx.send(f);
            })
            .await;
        if let Err(error) = r {
            let _ = err_tx.send(ExecFrame::Error { error });
        }
    });
    Session { frames, task, ended: false, state: None, checkpointed: None }
}

async fn write_stdin(client: &Client, sb: &str, data: &[u8]) -> Result<(), ApiError> {
    write_session_stdin(client, sb, SESSION_NAME, data).await
}

/// Write `data` to the stdin of exec session `session` of sandbox `sb`.
pub(crate) async fn write_session_stdin(
    client: &Client,
    sb: &str,
    session: &str,
    data: &[u8],
) -> Result<(), ApiError> {
    let body = json!({"d": base64::engine::general_purpose::STANDARD.encode(data)});
    let _: Value = client
        .call(hyper::Method::POST, &format!("/v1/sandboxes/{sb}/exec/{session}/stdin"), Some(&body))
        .await?;
    Ok(())
}

/// Start the persistent session in `workdir` (replacing an earlier one of this sandbox).
pub async fn start_session(client: &Client, sb: &str, workdir: &str) -> Result<(), ApiError> {
    let slot = slot(sb);
    let mut g = slot.lock().await;
    // Dropping an earlier one closes its stream: the daemon kills whatever holds its pipes.
    *g = None;
    let launch = format!(
        "cd {wd} 2>/dev/null || cd /; \
         (exec setsid bash -c 'exec -a {SESSION_ARGV0} bash --noprofile --norc') <&0 &",
        wd = shell_quote(workdir)
    );
    let mut req = sandbox::exec_request(vec!["bash".into(), "-c".into(), launch], Some("/"), None);
    req.stdin_session = Some(SESSION_NAME.into());
    let body = serde_json::to_value(&req)
        .map_err(|e| ApiError::internal(format!("encoding the session's exec: {e}")))?;
    *g = Some(follow(client, format!("/v1/sandboxes/{sb}/exec"), body));
    drop(g);
    // The session's name is registered before the exec's stream answers; a write that comes
    // before the exec's helper started waits in the pipe.
    let mut tries = 0;
    loop {
        match write_stdin(client, sb, session_prelude().as_bytes()).await {
            Ok(()) => break,
            Err(e) if tries < 50 && e.message.contains("no open exec session") => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e),
        }
    }
    // Until the shell has read the prelude it sits only in the daemon's pipe, which no dump
    // holds: a point taken then would bring back a shell without `__crab_read`, in the wrong
    // directory. One empty command through the session returns once the shell ran it all.
    match run_in_session(client, sb, ":", SESSION_START_TIMEOUT_S).await? {
        SessionRun::Done(o) if !o.timed_out => Ok(()),
        SessionRun::Done(_) => Err(ApiError::internal(format!(
            "the session shell of sandbox {sb} did not answer its first command within \
             {SESSION_START_TIMEOUT_S} s (is the sandbox overloaded or its bash missing?)"
        ))),
        SessionRun::Gone(_) => Err(ApiError::internal(format!(
            "the session shell of sandbox {sb} exited as it started (does the image have bash?)"
        ))),
    }
}

/// How long a new session's shell may take to run its prelude and first empty command.
const SESSION_START_TIMEOUT_S: f64 = 30.0;

/// Output of one command in the session, or why there is none.
enum SessionRun {
    Done(sandbox::ExecOutput),
    /// The session is gone (not there, or it died during the command: `partial` output).
    Gone(Option<sandbox::ExecOutput>),
}

/// Where the sentinel ends a stream's output in `buf`: on stdout `SENTINEL:<code>\n` (`with_code`),
/// on stderr `SENTINEL\n`; (its offset, the code).
fn take_sentinel(buf: &[u8], with_code: bool) -> Option<(usize, i32)> {
    let mut tok = SENTINEL.as_bytes().to_vec();
    tok.push(if with_code { b':' } else { b'\n' });
    let at = buf.windows(tok.len()).position(|w| w == tok.as_slice())?;
    if !with_code {
        return Some((at, 0));
    }
    let rest = &buf[at + tok.len()..];
    let nl = rest.iter().position(|b| *b == b'\n')?;
    let code = std::str::from_utf8(&rest[..nl]).ok()?.parse().ok()?;
    Some((at, code))
}

async fn run_in_session(
    client: &Client,
    sb: &str,
    command: &str,
    timeout_s: f64,
) -> Result<SessionRun, ApiError> {
    let slot = slot(sb);
    let mut g = slot.lock().await;
    let mut attached = false;
    if g.is_none() {
        // Gone (it died, or was never started here) — unless a restore brought it back,
        // waiting to be attached: try that first.
        let (_, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut dead = Session {
            frames: rx,
            task: tokio::spawn(async {}),
            ended: true,
            state: None,
            checkpointed: None,
        };
        dead.ended = true;
        *g = Some(dead);
    }
    let s = loop {
        let Some(s) = g.as_mut() else { return Ok(SessionRun::Gone(None)) };
        // What background processes printed since the last command belongs to no command.
        while let Ok(f) = s.frames.try_recv() {
            if matches!(f, ExecFrame::Exit { .. } | ExecFrame::Error { .. }) {
                s.ended = true;
            }
        }
        if !s.ended {
            break s;
        }
        if attached {
            *g = None;
            return Ok(SessionRun::Gone(None));
        }
        // Its stream ended (the sandbox was killed, or restored): a restore brings the
        // session's pipes back for attaching; otherwise it is gone.
        let path = format!("/v1/sandboxes/{sb}/exec/{SESSION_NAME}/attach");
        let checkpointed = s.checkpointed;
        *s = follow(client, path, json!({}));
        // The restored shell's state is the restore point's.
        (s.state, s.checkpointed) = (checkpointed, checkpointed);
        attached = true;
        // An attach that finds nothing answers an error at once.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let t = std::time::Instant::now();
    match write_stdin(client, sb, &session_input(command)).await {
        Ok(()) => {}
        // It ended between the frames read above and this write (its shell exited).
        Err(e) if e.code == crab_common::ErrorCode::Conflict => {
            *g = None;
            return Ok(SessionRun::Gone(None));
        }
        Err(e) => return Err(e),
    }
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let (mut got_out, mut got_err) = (None, None);
    let mut state: Option<[u8; 32]> = None;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs_f64(timeout_s);
    let b64 = base64::engine::general_purpose::STANDARD;
    let finish = |out: Vec<u8>, err: Vec<u8>, code: i32, timed_out: bool| {
        let output = sandbox::merge(&out, &err);
        sandbox::ExecOutput {
            output,
            stdout: out,
            stderr: err,
            code,
            timed_out,
            ms: t.elapsed().as_secs_f64() * 1e3,
        }
    };
    while got_out.is_none() || got_err.is_none() {
        let f = match tokio::time::timeout_at(deadline, s.frames.recv()).await {
            Err(_) => {
                // Timed out: drop the session (the daemon kills what holds its pipes); the
                // next command starts a new one, as a harness would.
                *g = None;
                return Ok(SessionRun::Done(finish(out, err, 124, true)));
            }
            Ok(f) => f,
        };
        match f {
            Some(ExecFrame::Stdout { d }) if got_out.is_none() => {
                out.extend(b64.decode(d).unwrap_or_default());
                if let Some((at, code)) = take_sentinel(&out, true) {
                    let tok = SENTINEL.as_bytes();
                    let mark = out[..at]
                        .windows(tok.len() + 1)
                        .rposition(|w| w[..tok.len()] == *tok && w[tok.len()] == b'~');
                    let cut = mark.unwrap_or(at);
                    if let Some(m) = mark {
                        state = Some(state_digest(&out[m + tok.len() + 1..at]));
                    }
                    out.truncate(cut);
                    got_out = Some(code);
                }
            }
            Some(ExecFrame::Stderr { d }) if got_err.is_none() => {
                err.extend(b64.decode(d).unwrap_or_default());
                if let Some((at, _)) = take_sentinel(&err, false) {
                    err.truncate(at);
                    got_err = Some(());
                }
            }
            Some(ExecFrame::Stdout { .. } | ExecFrame::Stderr { .. }) => {}
            Some(ExecFrame::Exit { .. } | ExecFrame::Error { .. }) | None => {
                *g = None;
                return Ok(SessionRun::Gone(Some(finish(out, err, SESSION_DIED, false))));
            }
        }
    }
    s.state = state;
    Ok(SessionRun::Done(finish(out, err, got_out.unwrap_or(0), false)))
}

/// Whether the shell state of sandbox `sb`'s session (working directory, variables, functions,
/// options, traps, jobs) changed since the last call; the next call compares with now. The
/// session's shell is the replay sandboxes' harness, so its running alone never calls for a
/// dump: a turn that changed its state must ask for one (the replay then takes `full`
/// instead of `auto`). A session never asked about, or whose state is unknown, has changed.
pub async fn take_state_changed(sb: &str) -> bool {
    let slot = slot(sb);
    let mut g = slot.lock().await;
    let Some(s) = g.as_mut() else { return false };
    let changed = s.state.is_none() || s.state != s.checkpointed;
    s.checkpointed = s.state;
    changed
}

/// Exit code reported when the session died during a command (it ran `exit`, or was killed).
const SESSION_DIED: i32 = 223;

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Run `command` in sandbox `sb`: a fresh `bash -c` in `workdir`, or in the persistent session
/// (started again in `workdir` when it is gone, as a restarted agent harness would).
pub async fn execute(
    client: &Client,
    sb: &str,
    command: &str,
    workdir: &str,
    persistent: bool,
    timeout_s: f64,
) -> Result<Observation, ApiError> {
    let out = if persistent {
        match run_in_session(client, sb, command, timeout_s).await? {
            SessionRun::Done(o) | SessionRun::Gone(Some(o)) => o,
            SessionRun::Gone(None) => {
                start_session(client, sb, workdir).await?;
                match run_in_session(client, sb, command, timeout_s).await? {
                    SessionRun::Done(o) | SessionRun::Gone(Some(o)) => o,
                    SessionRun::Gone(None) => {
                        return Err(ApiError::internal(format!(
                            "the persistent session of sandbox {sb} died as it started"
                        )))
                    }
                }
            }
        }
    } else {
        sandbox::exec(
            client,
            sb,
            vec!["bash".into(), "-c".into(), command.into()],
            Some(workdir),
            None,
            timeout_s,
        )
        .await?
    };
    Ok(Observation {
        content: format_observation(out.code, &out.output),
        code: out.code,
        ms: out.ms,
    })
}

/// Forget sandbox `sb`'s session (it is being removed).
pub async fn end_session(sb: &str) {
    *slot(sb).lock().await = None;
}

/// The tool message for `obs`.
pub fn tool_message(call_id: &str, obs: &Observation) -> Value {
    json!({"role": "tool", "tool_call_id": call_id, "content": obs.content})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_and_turns() {
        let s = format_observation(0, b"hi\n");
        assert_eq!(s, "<returncode>0</returncode>\n<output>\nhi\n</output>");
        let big = vec![b'x'; 30_000];
        let s = format_observation(1, &big);
        assert!(s.contains("truncated") && s.len() < 11_000);
        let mut c = initial_conversation("t", "/root");
        assert_eq!(turns_in(&c), 0);
        c.push(json!({"role": "assistant", "content": null}));
        assert_eq!(turns_in(&c), 1);
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
    }
}
