//! The replay's persistent session against the real daemon (root): it writes nothing into the
//! sandbox and its own shell is the sandbox's declared harness, so a turn of `true` through it
//! is a `skip`; `cd`, `export` and shell variables persist across turns and across a restore
//! (the daemon re-creates the session's pipes, the agent re-attaches); what the agent runs
//! through it (a file, a background loop) still counts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_bench::replay::{agent, sandbox};
use crab_client::Client;
use crab_testkit::daemon::{state_dir, Sandbox};
use serde_json::Value;

/// The current turn's raw inspector verdict (without closing it).
async fn peek(client: &Client, sb: &str) -> Value {
    client
        .call::<(), Value>(hyper::Method::GET, &format!("/v1/sandboxes/{sb}/inspect"), None)
        .await
        .expect("inspect")
}

/// Close the turn with an `auto` checkpoint (the daemon's turn policy on the inspector's
/// verdict: e.g. the init reaping a child alone is no process change); its kind.
async fn verdict(client: &Client, sb: &str) -> Value {
    let p = sandbox::checkpoint(client, sb, "auto", 0, 0).await.expect("auto checkpoint");
    serde_json::json!({"kind": p.kind})
}

async fn run(client: &Client, sb: &str, cmd: &str) -> agent::Observation {
    agent::execute(client, sb, cmd, "/root", true, 30.0).await.expect("command in the session")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_writes_nothing_and_keeps_shell_state() {
    crab_testkit::require_root!();
    let sb = Sandbox::with_args("rsess", &["--harness-cmd", agent::SESSION_HARNESS]);
    let name = sb.name.clone();
    let client = Client::new(state_dir().join("crab.sock"));
    agent::start_session(&client, &name, "/root").await.expect("start the session");

    let o = run(&client, &name, "cd /tmp && export CRAB_T=42 && V=7; pwd").await;
    assert_eq!(o.code, 0, "{}", o.content);
    assert!(o.content.contains("/tmp"), "{}", o.content);
    assert!(agent::take_state_changed(&name).await, "cd/export/assignment changed the shell");
    sandbox::checkpoint(&client, &name, "full", 0, 0).await.expect("base checkpoint");

    // A turn that does nothing through the session is a skip: no file, no process.
    let o = run(&client, &name, "true").await;
    assert_eq!(o.code, 0);
    let raw = peek(&client, &name).await;
    assert!(
        !raw["processes"]["harness_ran"].as_array().unwrap().is_empty(),
        "the session's shell ran but is not reported as harness: {raw}"
    );
    assert!(raw["changeset"].as_array().unwrap().is_empty(), "{raw}");
    let v = verdict(&client, &name).await;
    assert_eq!(v["kind"], "skip", "a turn of `true` through the session: {v} (raw {raw})");
    assert!(!agent::take_state_changed(&name).await, "`true` changed the shell's state?");
    for (cmd, what) in
        [("V=8", "a variable"), ("f() { :; }", "a function"), ("set -o noglob", "an option")]
    {
        run(&client, &name, cmd).await;
        assert!(agent::take_state_changed(&name).await, "{what} changed: not seen");
    }
    run(&client, &name, "V=7; set +o noglob; unset -f f").await;
    agent::take_state_changed(&name).await;
    verdict(&client, &name).await;

    // State persists; streams, exit codes and non-ASCII commands come through exactly.
    let o = run(&client, &name, "echo \"$PWD $CRAB_T $V héllo\"; echo oops >&2; false").await;
    assert_eq!(o.code, 1, "{}", o.content);
    assert!(o.content.contains("/tmp 42 7 héllo\noops\n"), "{}", o.content);
    // Errors name the command's own line, not how many the session has read.
    let o = run(&client, &name, "nosuchcommand").await;
    assert!(o.content.contains("line 1: nosuchcommand"), "{}", o.content);
    verdict(&client, &name).await;

    // What the agent does through the session still counts.
    run(&client, &name, "echo x > /root/f").await;
    assert_eq!(verdict(&client, &name).await["kind"], "fs");
    run(&client, &name, "(while :; do sleep 0.1; done) &").await;
    verdict(&client, &name).await; // its birth
                                   // A turn long enough for the loop to run (its `sleep 0.1`s end and begin again).
    run(&client, &name, "sleep 0.5").await;
    let v = verdict(&client, &name).await;
    assert!(
        ["process", "full"].contains(&v["kind"].as_str().unwrap()),
        "the agent's loop ran: {v}"
    );

    // Across a fault and a restore the same shell comes back, attached again.
    sandbox::checkpoint(&client, &name, "full", 1, 0).await.expect("checkpoint");
    sandbox::kill_all(&name).await.expect("kill the sandbox's processes");
    sandbox::restore(&client, &name).await.expect("restore");
    let o = run(&client, &name, "echo \"$PWD $CRAB_T $V\"; cat /root/f").await;
    assert_eq!(o.code, 0, "{}", o.content);
    assert!(
        o.content.contains("/tmp 42 7\nx\n"),
        "the restored session lost its state: {}",
        o.content
    );
    agent::end_session(&name).await;
}

/// A point taken the moment the session has started holds a working session: the prelude was
/// read by the shell (not left in the daemon's pipe, which no dump holds), so the restored shell
/// has its functions and is in the session's directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_point_taken_as_the_session_starts_restores_a_working_session() {
    crab_testkit::require_root!();
    let sb = Sandbox::with_args("rsess0", &["--harness-cmd", agent::SESSION_HARNESS]);
    let name = sb.name.clone();
    let client = Client::new(state_dir().join("crab.sock"));
    agent::start_session(&client, &name, "/root").await.expect("start the session");
    sandbox::checkpoint(&client, &name, "full", 0, 0).await.expect("checkpoint at the start");
    sandbox::kill_all(&name).await.expect("kill the sandbox's processes");
    sandbox::restore(&client, &name).await.expect("restore");
    let o = run(&client, &name, "type -t __crab_read; pwd").await;
    assert_eq!(o.code, 0, "{}", o.content);
    assert!(
        o.content.contains("function\n/root"),
        "the restored session lacks its prelude: {}",
        o.content
    );
    agent::end_session(&name).await;
}
