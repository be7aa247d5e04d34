//! The replay agent: keeps an OpenAI-style conversation, sends it to the LLM (through Crab's
//! proxy, or directly), runs the returned `bash` tool call in the sandbox through the exec API,
//! and appends the observation the way mini-swe-agent formats it.
//!
//! Commands run either as a fresh `bash -c` each (mini-swe-agent) or in one persistent bash
//! session (traces marked `shell_state`, so `cd` and `export` persist). The session is a bash
//! started in the background inside the sandbox, reading commands from a fifo it holds open
//! read-write (so it never sees end-of-file), its output appended to a file. Each command is
//! written to `cmd.sh`, and one line is fed to the fifo: `. cmd.sh </dev/null; echo $? > rc`.
//! The `rc` file is the sentinel: when it appears, the output file holds exactly that command's
//! output and `rc` its exit code. The session lives in `/run/crab-replay/` inside the sandbox:
//! part of the sandbox's state, checkpointed and restored with it like any user process. When
//! a recovery lost it (no process image), the next command finds it dead and starts a new one in
//! the initial working directory, as a restarted agent harness would.

use serde_json::{json, Value};

use crab_client::Client;
use crab_common::ApiError;

use super::llm::post_json;
use super::sandbox;

/// Where the persistent session lives inside the sandbox.
pub const SESSION_DIR: &str = "/run/crab-replay";

/// Longest observation kept in the conversation (mini-swe-agent keeps head and tail).
const MAX_OBSERVATION: usize = 10_000;

/// Exit code of the run script meaning "the session is gone".
const SESSION_GONE: i32 = 222;

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

/// Start the persistent session in `workdir` (replacing a dead one).
pub async fn start_session(client: &Client, sb: &str, workdir: &str) -> Result<(), ApiError> {
    let script = format!(
        "D={SESSION_DIR}; mkdir -p $D && rm -f $D/in $D/rc && mkfifo $D/in && : > $D/out && \
         cd {wd} 2>/dev/null || cd /; \
         bash --noprofile --norc 0<>$D/in >>$D/out 2>&1 & echo $! > $D/pid",
        wd = shell_quote(workdir)
    );
    sandbox::sh_ok(client, sb, &script, 30.0).await.map(|_| ())
}

const RUN_IN_SESSION: &str = r#"D=/run/crab-replay
P=$(cat $D/pid 2>/dev/null)
[ -n "$P" ] && kill -0 "$P" 2>/dev/null || exit 222
cat > $D/cmd.sh
: > $D/out
rm -f $D/rc $D/rc.tmp
echo ". $D/cmd.sh </dev/null; echo \$? > $D/rc.tmp; mv $D/rc.tmp $D/rc" > $D/in
while [ ! -e $D/rc ]; do
  kill -0 "$P" 2>/dev/null || { cat $D/out; exit 223; }
  sleep 0.01
done
cat $D/out
exit $(cat $D/rc)
"#;

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Run `command` in sandbox `sb`: a fresh `bash -c` in `workdir`, or in the persistent session.
pub async fn execute(
    client: &Client,
    sb: &str,
    command: &str,
    workdir: &str,
    persistent: bool,
    timeout_s: f64,
) -> Result<Observation, ApiError> {
    let out = if persistent {
        let run = || {
            sandbox::exec(
                client,
                sb,
                vec!["bash".into(), "-c".into(), RUN_IN_SESSION.into()],
                Some("/"),
                Some(command.as_bytes()),
                timeout_s,
            )
        };
        let mut out = run().await?;
        if out.code == SESSION_GONE {
            start_session(client, sb, workdir).await?;
            out = run().await?;
        }
        out
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
