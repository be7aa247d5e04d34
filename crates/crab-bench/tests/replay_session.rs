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

async fn verdict(client: &Client, sb: &str) -> Value {
    client
        .call::<(), Value>(hyper::Method::POST, &format!("/v1/sandboxes/{sb}/inspect"), None)
        .await
        .expect("inspect")
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
    sandbox::checkpoint(&client, &name, "full", 0, 0).await.expect("base checkpoint");

    // A turn that does nothing through the session is a skip: no file, no process.
    let o = run(&client, &name, "true").await;
    assert_eq!(o.code, 0);
    let v = verdict(&client, &name).await;
    assert_eq!(v["kind"], "skip", "a turn of `true` through the session: {v}");
    assert!(
        !v["processes"]["harness_ran"].as_array().unwrap().is_empty(),
        "the session's shell ran but is not reported as harness: {v}"
    );

    // State persists; streams, exit codes and non-ASCII commands come through exactly.
    let o = run(&client, &name, "echo \"$PWD $CRAB_T $V héllo\"; echo oops >&2; false").await;
    assert_eq!(o.code, 1, "{}", o.content);
    assert!(o.content.contains("/tmp 42 7 héllo\noops\n"), "{}", o.content);
    verdict(&client, &name).await;

    // What the agent does through the session still counts.
    run(&client, &name, "echo x > /root/f").await;
    assert_eq!(verdict(&client, &name).await["kind"], "fs");
    run(&client, &name, "(while :; do sleep 0.1; done) &").await;
    verdict(&client, &name).await; // its birth
    run(&client, &name, "true").await;
    let v = verdict(&client, &name).await;
    assert_eq!(v["kind"], "process", "the agent's background loop ran: {v}");

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
