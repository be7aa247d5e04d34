//! envd's messages (`process.Process`, `filesystem.Filesystem`) as typed structs in proto3's
//! JSON mapping: lowerCamelCase names, `bytes` as base64, enums by name (numbers accepted),
//! `int64` as strings, oneofs as one present field.

use std::collections::HashMap;

use serde::{Deserialize, Deserializer, Serialize};

/// `process.ProcessConfig`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessConfig {
    /// Program.
    pub cmd: String,
    /// Arguments.
    pub args: Vec<String>,
    /// Extra environment.
    pub envs: HashMap<String, String>,
    /// Working directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// `process.StartRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct StartRequest {
    /// What to run.
    pub process: Option<ProcessConfig>,
    /// A pseudo-terminal (not supported).
    pub pty: Option<serde_json::Value>,
    /// A tag to select the process by later.
    pub tag: Option<String>,
    /// Keep stdin open for `SendInput`.
    pub stdin: Option<bool>,
}

/// `process.ProcessSelector` (oneof `pid` | `tag`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessSelector {
    /// By pid.
    pub pid: Option<u32>,
    /// By tag.
    pub tag: Option<String>,
}

/// A request that names one process (`Connect`, `SendSignal`, `SendInput`, `CloseStdin`, `Update`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SelectRequest {
    /// Which process.
    pub process: Option<ProcessSelector>,
    /// `SendSignal`: the signal.
    #[serde(deserialize_with = "signal")]
    pub signal: Option<i32>,
    /// `SendInput`: the input.
    pub input: Option<serde_json::Value>,
}

/// `process.Signal` by name or number.
fn signal<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i32>, D::Error> {
    let v = Option::<serde_json::Value>::deserialize(d)?;
    Ok(match v {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::Number(n)) => n.as_i64().and_then(|n| i32::try_from(n).ok()),
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "SIGNAL_SIGKILL" => Some(9),
            "SIGNAL_SIGTERM" => Some(15),
            "SIGNAL_UNSPECIFIED" => Some(0),
            _ => return Err(serde::de::Error::custom(format!("unknown signal {s:?}"))),
        },
        Some(other) => return Err(serde::de::Error::custom(format!("bad signal {other}"))),
    })
}

/// `process.ProcessEvent`: one of start, data, end, keepalive.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    /// The process started.
    Start {
        /// Its pid (the front door's process handle).
        pid: u32,
    },
    /// Output.
    Data(DataEvent),
    /// The process ended.
    End(EndEvent),
    /// Nothing happened (keeps proxies from closing an idle stream).
    Keepalive {},
}

/// `process.ProcessEvent.DataEvent` (oneof stdout | stderr), base64.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    /// Standard output bytes, base64.
    Stdout(String),
    /// Standard error bytes, base64.
    Stderr(String),
}

/// `process.ProcessEvent.EndEvent`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    /// Exit code (`-1` when killed).
    pub exit_code: i32,
    /// Whether it exited by itself.
    pub exited: bool,
    /// `exit status N` or `signal: killed`.
    pub status: String,
    /// What failed, when it did not run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `process.StartResponse` / `process.ConnectResponse`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventResponse {
    /// The event.
    pub event: ProcessEvent,
}

/// `process.ProcessInfo`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessInfo {
    /// What runs.
    pub config: ProcessConfig,
    /// Its handle.
    pub pid: u32,
    /// Its tag.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// `process.ListResponse`.
#[derive(Debug, Clone, Serialize)]
pub struct ListResponse {
    /// Running processes.
    pub processes: Vec<ProcessInfo>,
}

/// A request with one path (`Stat`, `MakeDir`, `Remove`, `ListDir`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PathRequest {
    /// The path.
    pub path: String,
    /// `ListDir`: how deep (0 = 1).
    pub depth: u32,
}

/// `filesystem.MoveRequest`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MoveRequest {
    /// From.
    pub source: String,
    /// To.
    pub destination: String,
}

/// `filesystem.FileType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FileType {
    /// Unknown.
    #[serde(rename = "FILE_TYPE_UNSPECIFIED")]
    Unspecified,
    /// A regular file.
    #[serde(rename = "FILE_TYPE_FILE")]
    File,
    /// A directory.
    #[serde(rename = "FILE_TYPE_DIRECTORY")]
    Directory,
    /// A symbolic link.
    #[serde(rename = "FILE_TYPE_SYMLINK")]
    Symlink,
}

impl FileType {
    /// The `/files` upload answer's spelling.
    pub fn short(self) -> &'static str {
        match self {
            FileType::File => "file",
            FileType::Directory => "dir",
            FileType::Symlink => "symlink",
            FileType::Unspecified => "",
        }
    }
}

/// `filesystem.EntryInfo`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    /// Base name.
    pub name: String,
    /// Kind (of the link itself for a symlink to a non-directory; of the target otherwise).
    #[serde(rename = "type")]
    pub kind: FileType,
    /// Absolute path.
    pub path: String,
    /// Size in bytes (`int64`: a string in JSON).
    #[serde(serialize_with = "as_string")]
    pub size: i64,
    /// Permission bits.
    pub mode: u32,
    /// `-rw-r--r--`.
    pub permissions: String,
    /// Owner name.
    pub owner: String,
    /// Group name.
    pub group: String,
    /// Last modification, RFC 3339.
    pub modified_time: String,
    /// Target of a symlink.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// Whether it is a symlink.
    pub is_symlink: bool,
}

fn as_string<S: serde::Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&v.to_string())
}

/// An answer with one entry (`Stat`, `MakeDir`, `Move`).
#[derive(Debug, Clone, Serialize)]
pub struct EntryResponse {
    /// The entry.
    pub entry: EntryInfo,
}

/// `filesystem.ListDirResponse`.
#[derive(Debug, Clone, Serialize)]
pub struct ListDirResponse {
    /// The entries.
    pub entries: Vec<EntryInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_as_proto_json() {
        let s = |e: ProcessEvent| serde_json::to_string(&EventResponse { event: e }).expect("json");
        assert_eq!(s(ProcessEvent::Start { pid: 3 }), r#"{"event":{"start":{"pid":3}}}"#);
        assert_eq!(
            s(ProcessEvent::Data(DataEvent::Stdout("aGk=".into()))),
            r#"{"event":{"data":{"stdout":"aGk="}}}"#
        );
        assert_eq!(
            s(ProcessEvent::End(EndEvent {
                exit_code: 2,
                exited: true,
                status: "exit status 2".into(),
                error: None
            })),
            r#"{"event":{"end":{"exitCode":2,"exited":true,"status":"exit status 2"}}}"#
        );
        assert_eq!(s(ProcessEvent::Keepalive {}), r#"{"event":{"keepalive":{}}}"#);
    }

    #[test]
    fn requests_parse_from_the_sdk_json() {
        let r: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false}"#,
        )
        .expect("start");
        let p = r.process.expect("process");
        assert_eq!(p.args[2], "echo hi");
        assert_eq!(p.envs["A"], "1");
        let k: SelectRequest =
            serde_json::from_str(r#"{"process":{"pid":7},"signal":"SIGNAL_SIGKILL"}"#)
                .expect("sig");
        assert_eq!(k.signal, Some(9));
        assert_eq!(k.process.and_then(|p| p.pid), Some(7));
        let n: SelectRequest = serde_json::from_str(r#"{"signal":15}"#).expect("num");
        assert_eq!(n.signal, Some(15));
        assert!(serde_json::from_str::<SelectRequest>(r#"{"signal":"SIGHUP"}"#).is_err());
    }
}
