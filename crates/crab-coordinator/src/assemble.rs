//! Whole answers assembled from an upstream's stream.
//!
//! When the host parks sandboxes, the proxy asks the upstream to stream an answer the agent
//! asked for whole (`ProxyConfig::stream_whole_answers`): the stream's head is the early
//! signal that wakes a parked sandbox while the model is still generating, and the agent gets
//! the whole answer it asked for, assembled here from the stream's events. Two shapes are
//! known: OpenAI's chat completion chunks (`/v1/chat/completions`: content, refusal,
//! reasoning, tool calls, logprobs, usage, per choice) and Anthropic's message events
//! (`/v1/messages`: text, tool use, thinking and its signature, citations, stop reason,
//! usage). Anything else — an event that is not the shape's JSON, a stream that ends before
//! its end marker — is an [`AssembleError`]; an error event in the stream becomes the
//! upstream's error answer ([`AssembleError::Upstream`]). Nothing here trusts the upstream's
//! bytes beyond parsing them: sizes are bounded by the proxy's response limit before they
//! get here.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

/// Why a stream could not be made into a whole answer.
#[derive(Debug, thiserror::Error)]
pub enum AssembleError {
    /// The stream carried an error event: the answer is that error, with this status.
    #[error("the upstream's stream carried an error (HTTP {status} equivalent)")]
    Upstream {
        /// The status the upstream gives the same error on a whole answer.
        status: u16,
        /// The error's JSON body.
        body: Value,
    },
    /// An event's data is not the JSON the provider's stream carries.
    #[error("event {index} of the upstream's stream is not {shape}: {reason}")]
    Malformed {
        /// The event's position in the stream, from 0.
        index: usize,
        /// What it should have been.
        shape: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The stream ended before its end marker (`[DONE]`, `message_stop`).
    #[error("the upstream's stream ended before its {marker} (a broken-off answer)")]
    Incomplete {
        /// The marker that did not come.
        marker: &'static str,
    },
}

/// One server-sent event: its type (`event:`) and its data lines joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, empty when there was none.
    pub event: String,
    /// The `data:` lines, joined by newlines.
    pub data: String,
}

/// The events of a whole `text/event-stream` body, as the WHATWG parsing rules read them: lines
/// end in CRLF, LF or CR; a blank line dispatches; `:` starts a comment; a field's value loses
/// one leading space; an event without data is dropped.
pub fn sse_events(body: &[u8]) -> Vec<SseEvent> {
    let text = String::from_utf8_lossy(body);
    let mut out = Vec::new();
    let (mut event, mut data, mut has_data) = (String::new(), String::new(), false);
    let mut rest: &str = &text;
    loop {
        let (line, next) = match rest.find(['\r', '\n']) {
            Some(i) => {
                let skip = if rest[i..].starts_with("\r\n") { 2 } else { 1 };
                (&rest[..i], Some(&rest[i + skip..]))
            }
            None => (rest, None),
        };
        if line.is_empty() {
            if has_data {
                out.push(SseEvent { event: std::mem::take(&mut event), data: data.clone() });
            }
            event.clear();
            data.clear();
            has_data = false;
        } else if !line.starts_with(':') {
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match field {
                "event" => event = value.to_string(),
                "data" => {
                    if has_data {
                        data.push('\n');
                    }
                    data.push_str(value);
                    has_data = true;
                }
                _ => {}
            }
        }
        match next {
            Some(n) => rest = n,
            // A last event without its blank line is not dispatched (the spec drops it).
            None => break,
        }
    }
    out
}

fn parse(
    index: usize,
    shape: &'static str,
    data: &str,
) -> Result<Map<String, Value>, AssembleError> {
    match serde_json::from_str::<Value>(data) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(AssembleError::Malformed { index, shape, reason: "not a JSON object".into() }),
        Err(e) => Err(AssembleError::Malformed { index, shape, reason: e.to_string() }),
    }
}

fn append(slot: &mut Option<String>, v: Option<&Value>) {
    if let Some(s) = v.and_then(Value::as_str) {
        slot.get_or_insert_with(String::new).push_str(s);
    }
}

fn str_or_null(s: Option<String>) -> Value {
    s.map_or(Value::Null, Value::String)
}

#[derive(Default)]
struct ToolCall {
    id: Option<String>,
    kind: Option<String>,
    name: Option<String>,
    arguments: String,
}

#[derive(Default)]
struct Choice {
    role: Option<String>,
    content: Option<String>,
    refusal: Option<String>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    tool_calls: BTreeMap<u64, ToolCall>,
    function_call: Option<(Option<String>, String)>,
    finish_reason: Value,
    logprobs: Option<Map<String, Value>>,
}

/// An OpenAI `chat.completion` from the `chat.completion.chunk` events of its stream (which
/// must end with `[DONE]`).
pub fn openai_chat(events: &[SseEvent]) -> Result<Value, AssembleError> {
    const SHAPE: &str = "a chat.completion.chunk";
    let mut top = Map::new();
    let mut usage = Value::Null;
    let mut choices: BTreeMap<u64, Choice> = BTreeMap::new();
    let mut done = false;
    for (i, e) in events.iter().enumerate() {
        if e.data.trim() == "[DONE]" {
            done = true;
            break;
        }
        let chunk = parse(i, SHAPE, &e.data)?;
        if let Some(err) = chunk.get("error") {
            return Err(AssembleError::Upstream { status: 500, body: json!({ "error": err }) });
        }
        for k in ["id", "created", "model", "system_fingerprint", "service_tier"] {
            if let Some(v) = chunk.get(k).filter(|v| !v.is_null()) {
                top.entry(k.to_string()).or_insert_with(|| v.clone());
            }
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            usage = u.clone();
        }
        let Some(list) = chunk.get("choices") else { continue };
        let list = list.as_array().ok_or_else(|| AssembleError::Malformed {
            index: i,
            shape: SHAPE,
            reason: "`choices` is not a list".into(),
        })?;
        for c in list {
            let idx = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            let ch = choices.entry(idx).or_default();
            if let Some(d) = c.get("delta") {
                if let Some(r) = d.get("role").and_then(Value::as_str) {
                    ch.role = Some(r.to_string());
                }
                append(&mut ch.content, d.get("content"));
                append(&mut ch.refusal, d.get("refusal"));
                append(&mut ch.reasoning_content, d.get("reasoning_content"));
                append(&mut ch.reasoning, d.get("reasoning"));
                for tc in d.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                    let n = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
                    let t = ch.tool_calls.entry(n).or_default();
                    if let Some(v) = tc.get("id").and_then(Value::as_str) {
                        t.id = Some(v.to_string());
                    }
                    if let Some(v) = tc.get("type").and_then(Value::as_str) {
                        t.kind = Some(v.to_string());
                    }
                    if let Some(f) = tc.get("function") {
                        if let Some(v) = f.get("name").and_then(Value::as_str) {
                            t.name.get_or_insert_with(String::new).push_str(v);
                        }
                        if let Some(v) = f.get("arguments").and_then(Value::as_str) {
                            t.arguments.push_str(v);
                        }
                    }
                }
                if let Some(f) = d.get("function_call") {
                    let fc = ch.function_call.get_or_insert_with(|| (None, String::new()));
                    if let Some(v) = f.get("name").and_then(Value::as_str) {
                        fc.0.get_or_insert_with(String::new).push_str(v);
                    }
                    if let Some(v) = f.get("arguments").and_then(Value::as_str) {
                        fc.1.push_str(v);
                    }
                }
            }
            if let Some(f) = c.get("finish_reason").filter(|f| !f.is_null()) {
                ch.finish_reason = f.clone();
            }
            if let Some(Value::Object(lp)) = c.get("logprobs") {
                let acc = ch.logprobs.get_or_insert_with(Map::new);
                for (k, v) in lp {
                    match (acc.get_mut(k), v) {
                        (Some(Value::Array(a)), Value::Array(more)) => {
                            a.extend(more.iter().cloned())
                        }
                        _ => {
                            acc.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
        }
    }
    if !done {
        return Err(AssembleError::Incomplete { marker: "`data: [DONE]`" });
    }
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|(index, c)| {
            let mut m = Map::new();
            m.insert("role".into(), Value::String(c.role.unwrap_or_else(|| "assistant".into())));
            m.insert("content".into(), str_or_null(c.content));
            m.insert("refusal".into(), str_or_null(c.refusal));
            if let Some(r) = c.reasoning_content {
                m.insert("reasoning_content".into(), Value::String(r));
            }
            if let Some(r) = c.reasoning {
                m.insert("reasoning".into(), Value::String(r));
            }
            if !c.tool_calls.is_empty() {
                let calls = c
                    .tool_calls
                    .into_values()
                    .map(|t| {
                        json!({
                            "id": t.id,
                            "type": t.kind.unwrap_or_else(|| "function".into()),
                            "function": {"name": t.name, "arguments": t.arguments},
                        })
                    })
                    .collect();
                m.insert("tool_calls".into(), Value::Array(calls));
            }
            if let Some((name, arguments)) = c.function_call {
                m.insert("function_call".into(), json!({"name": name, "arguments": arguments}));
            }
            json!({
                "index": index,
                "message": Value::Object(m),
                "logprobs": c.logprobs.map_or(Value::Null, Value::Object),
                "finish_reason": c.finish_reason,
            })
        })
        .collect();
    let mut out = Map::new();
    out.insert("id".into(), top.remove("id").unwrap_or(Value::Null));
    out.insert("object".into(), Value::String("chat.completion".into()));
    out.insert("created".into(), top.remove("created").unwrap_or(Value::Null));
    out.insert("model".into(), top.remove("model").unwrap_or(Value::Null));
    out.insert("choices".into(), Value::Array(choices));
    if !usage.is_null() {
        out.insert("usage".into(), usage);
    }
    out.extend(top);
    Ok(Value::Object(out))
}

/// The HTTP status Anthropic answers a whole request with for an error of this type.
fn anthropic_status(kind: Option<&str>) -> u16 {
    match kind {
        Some("invalid_request_error") => 400,
        Some("authentication_error") => 401,
        Some("permission_error") => 403,
        Some("not_found_error") => 404,
        Some("request_too_large") => 413,
        Some("rate_limit_error") => 429,
        Some("overloaded_error") => 529,
        _ => 500,
    }
}

/// An Anthropic `message` from the events of its stream (`message_start`, content blocks and
/// their deltas, `message_delta`; it must end with `message_stop`).
pub fn anthropic_message(events: &[SseEvent]) -> Result<Value, AssembleError> {
    const SHAPE: &str = "an Anthropic message event";
    let mut message: Option<Map<String, Value>> = None;
    // Each block with the partial JSON of a tool use's input.
    let mut blocks: BTreeMap<u64, (Map<String, Value>, String)> = BTreeMap::new();
    let mut stopped = false;
    for (i, e) in events.iter().enumerate() {
        let ev = parse(i, SHAPE, &e.data)?;
        let kind = ev.get("type").and_then(Value::as_str).unwrap_or(e.event.as_str());
        let malformed = |reason: &str| AssembleError::Malformed {
            index: i,
            shape: SHAPE,
            reason: reason.to_string(),
        };
        let block_index =
            || ev.get("index").and_then(Value::as_u64).ok_or_else(|| malformed("no block index"));
        match kind {
            "message_start" => match ev.get("message") {
                Some(Value::Object(m)) => message = Some(m.clone()),
                _ => return Err(malformed("message_start without its message")),
            },
            "content_block_start" => {
                let Some(Value::Object(b)) = ev.get("content_block") else {
                    return Err(malformed("content_block_start without its block"));
                };
                blocks.insert(block_index()?, (b.clone(), String::new()));
            }
            "content_block_delta" => {
                let (b, partial) = blocks
                    .get_mut(&block_index()?)
                    .ok_or_else(|| malformed("a delta of a block that did not start"))?;
                let d =
                    ev.get("delta").ok_or_else(|| malformed("a block delta without its delta"))?;
                let text_of = |k: &str| d.get(k).and_then(Value::as_str).unwrap_or("");
                let mut add = |field: &str, s: &str| {
                    let cur =
                        b.entry(field.to_string()).or_insert_with(|| Value::String(String::new()));
                    match cur {
                        Value::String(c) => c.push_str(s),
                        other => *other = Value::String(s.to_string()),
                    }
                };
                match d.get("type").and_then(Value::as_str) {
                    Some("text_delta") => add("text", text_of("text")),
                    Some("thinking_delta") => add("thinking", text_of("thinking")),
                    Some("signature_delta") => {
                        b.insert("signature".into(), Value::String(text_of("signature").into()));
                    }
                    Some("input_json_delta") => partial.push_str(text_of("partial_json")),
                    Some("citations_delta") => {
                        if let Some(c) = d.get("citation") {
                            let list = b.entry("citations").or_insert_with(|| Value::Array(vec![]));
                            match list {
                                Value::Array(a) => a.push(c.clone()),
                                other => *other = Value::Array(vec![c.clone()]),
                            }
                        }
                    }
                    _ => return Err(malformed("a block delta of an unknown type")),
                }
            }
            "content_block_stop" => {
                let (b, partial) = blocks
                    .get_mut(&block_index()?)
                    .ok_or_else(|| malformed("the stop of a block that did not start"))?;
                if !partial.is_empty() {
                    let input: Value = serde_json::from_str(partial)
                        .map_err(|e| malformed(&format!("a tool use's input is not JSON: {e}")))?;
                    b.insert("input".into(), input);
                    partial.clear();
                }
            }
            "message_delta" => {
                let m = message
                    .as_mut()
                    .ok_or_else(|| malformed("message_delta before message_start"))?;
                if let Some(Value::Object(d)) = ev.get("delta") {
                    for (k, v) in d {
                        m.insert(k.clone(), v.clone());
                    }
                }
                if let Some(Value::Object(u)) = ev.get("usage") {
                    let usage = m.entry("usage").or_insert_with(|| Value::Object(Map::new()));
                    if let Value::Object(acc) = usage {
                        for (k, v) in u {
                            acc.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
            "message_stop" => {
                stopped = true;
                break;
            }
            "ping" => {}
            "error" => {
                let status = anthropic_status(
                    ev.get("error").and_then(|x| x.get("type")).and_then(Value::as_str),
                );
                return Err(AssembleError::Upstream { status, body: Value::Object(ev) });
            }
            // New event types are ignored, as Anthropic asks of stream readers.
            _ => {}
        }
    }
    if !stopped {
        return Err(AssembleError::Incomplete { marker: "`message_stop` event" });
    }
    let mut m = message.ok_or(AssembleError::Incomplete { marker: "`message_start` event" })?;
    m.insert(
        "content".into(),
        Value::Array(blocks.into_values().map(|(b, _)| Value::Object(b)).collect()),
    );
    Ok(Value::Object(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sse(events: &[&str]) -> Vec<u8> {
        events.iter().map(|e| format!("data: {e}\n\n")).collect::<String>().into_bytes()
    }

    #[test]
    fn sse_lines_comments_and_multiline_data() {
        let body = b": keep-alive\r\nevent: a\r\ndata: one\r\ndata:two\r\n\r\ndata: x\rid: 3\r\rretry\nevent: lonely\n\ndata: cut";
        let ev = sse_events(body);
        assert_eq!(
            ev,
            vec![
                SseEvent { event: "a".into(), data: "one\ntwo".into() },
                SseEvent { event: "".into(), data: "x".into() },
            ],
            "the event without data and the last one without its blank line are dropped"
        );
    }

    #[test]
    fn openai_content_tool_calls_usage_and_choices() {
        let body = sse(&[
            r#"{"id":"c1","object":"chat.completion.chunk","created":7,"model":"m","system_fingerprint":"fp","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
            r#"{"id":"c1","created":7,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"},"logprobs":{"content":[{"token":"Hel"}]}}]}"#,
            r#"{"id":"c1","created":7,"model":"m","choices":[{"index":0,"delta":{"content":"lo ✓"},"logprobs":{"content":[{"token":"lo ✓"}]}},{"index":1,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"t1","type":"function","function":{"name":"bash","arguments":"{\"cmd\":"}}]}}]}"#,
            r#"{"id":"c1","created":7,"model":"m","choices":[{"index":1,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"ls\"}"}}]}}]}"#,
            r#"{"id":"c1","created":7,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"},{"index":1,"delta":{},"finish_reason":"tool_calls"}]}"#,
            r#"{"id":"c1","created":7,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
            "[DONE]",
        ]);
        let v = openai_chat(&sse_events(&body)).expect("assembles");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["id"], "c1");
        assert_eq!(v["system_fingerprint"], "fp");
        assert_eq!(v["usage"]["total_tokens"], 7);
        let c0 = &v["choices"][0];
        assert_eq!(c0["message"]["content"], "Hello ✓");
        assert_eq!(c0["message"]["role"], "assistant");
        assert_eq!(c0["finish_reason"], "stop");
        assert_eq!(c0["logprobs"]["content"].as_array().map(Vec::len), Some(2));
        let c1 = &v["choices"][1];
        assert_eq!(c1["message"]["content"], Value::Null);
        assert_eq!(c1["message"]["tool_calls"][0]["function"]["arguments"], r#"{"cmd":"ls"}"#);
        assert_eq!(c1["message"]["tool_calls"][0]["id"], "t1");
        assert_eq!(c1["finish_reason"], "tool_calls");
    }

    #[test]
    fn openai_broken_off_error_and_garbage_are_errors() {
        let cut = sse(&[r#"{"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}"#]);
        assert!(matches!(openai_chat(&sse_events(&cut)), Err(AssembleError::Incomplete { .. })));
        let err = sse(&[r#"{"error":{"message":"boom","type":"server_error"}}"#]);
        match openai_chat(&sse_events(&err)) {
            Err(AssembleError::Upstream { status, body }) => {
                assert_eq!(status, 500);
                assert_eq!(body["error"]["message"], "boom");
            }
            other => panic!("{other:?}"),
        }
        let junk = sse(&["not json", "[DONE]"]);
        assert!(matches!(
            openai_chat(&sse_events(&junk)),
            Err(AssembleError::Malformed { index: 0, .. })
        ));
    }

    #[test]
    fn anthropic_text_thinking_and_tool_use() {
        let ev = |t: &str, d: &str| format!("event: {t}\ndata: {d}\n\n");
        let body = [
            ev("message_start", r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":10,"output_tokens":1}}}"#),
            ev("ping", r#"{"type":"ping"}"#),
            ev("content_block_start", r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}"#),
            ev("content_block_delta", r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hmm"}}"#),
            ev("content_block_delta", r#"{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"sig"}}"#),
            ev("content_block_stop", r#"{"type":"content_block_stop","index":0}"#),
            ev("content_block_start", r#"{"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}"#),
            ev("content_block_delta", r#"{"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Let me "}}"#),
            ev("content_block_delta", r#"{"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"look."}}"#),
            ev("content_block_stop", r#"{"type":"content_block_stop","index":1}"#),
            ev("content_block_start", r#"{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"tu1","name":"bash","input":{}}}"#),
            ev("content_block_delta", r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"cmd\": \"l"}}"#),
            ev("content_block_delta", r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"s\"}"}}"#),
            ev("content_block_stop", r#"{"type":"content_block_stop","index":2}"#),
            ev("message_delta", r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":42}}"#),
            ev("message_stop", r#"{"type":"message_stop"}"#),
        ]
        .concat();
        let v = anthropic_message(&sse_events(body.as_bytes())).expect("assembles");
        assert_eq!(v["id"], "msg_1");
        assert_eq!(v["stop_reason"], "tool_use");
        assert_eq!(v["usage"]["input_tokens"], 10);
        assert_eq!(v["usage"]["output_tokens"], 42);
        assert_eq!(v["content"][0]["thinking"], "hmm");
        assert_eq!(v["content"][0]["signature"], "sig");
        assert_eq!(v["content"][1]["text"], "Let me look.");
        assert_eq!(v["content"][2]["input"]["cmd"], "ls");
    }

    #[test]
    fn anthropic_error_event_keeps_its_status_and_a_cut_stream_is_incomplete() {
        let body = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
        match anthropic_message(&sse_events(body.as_bytes())) {
            Err(AssembleError::Upstream { status, body }) => {
                assert_eq!(status, 529);
                assert_eq!(body["error"]["message"], "Overloaded");
            }
            other => panic!("{other:?}"),
        }
        let cut = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"content\":[]}}\n\n";
        assert!(matches!(
            anthropic_message(&sse_events(cut.as_bytes())),
            Err(AssembleError::Incomplete { .. })
        ));
    }
}
