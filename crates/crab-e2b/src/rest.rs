//! E2B's control-plane JSON (the `api.e2b.dev` OpenAPI shapes the SDK's generated client
//! parses): requests the SDK sends and the answers it reads.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// `POST /v2/sandboxes` (`NewSandboxV2`); fields Crab does not implement are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NewSandbox {
    /// Template (a Crab image) or snapshot id.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Seconds until the sandbox is killed (or paused with `autoPause`).
    pub timeout: Option<u64>,
    /// Pause instead of kill at the timeout.
    pub auto_pause: Option<bool>,
    /// Free-form labels.
    pub metadata: Option<HashMap<String, String>>,
    /// Environment of every command.
    pub env_vars: Option<HashMap<String, String>>,
    /// Internet access (`false` → a sandbox without network).
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
}

/// A created, connected or forked sandbox (`Sandbox`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Created {
    /// Template it came from.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Its id (the Crab sandbox name).
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Always `crab`.
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// The envd protocol version Crab answers as.
    pub envd_version: String,
    /// The per-sandbox token envd calls must carry as `X-Access-Token`.
    pub envd_access_token: String,
}

/// `GET /sandboxes/{id}` (`SandboxDetail`) and the items of `GET /v2/sandboxes` (`ListedSandbox`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Detail {
    /// Template.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Id.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Always `crab`.
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// RFC 3339.
    pub started_at: String,
    /// RFC 3339: when the timeout fires.
    pub end_at: String,
    /// envd version.
    pub envd_version: String,
    /// CPUs (the host's; Crab limits are opt-in).
    pub cpu_count: u32,
    /// Memory in MiB.
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    /// Disk in MiB.
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    /// `running` or `paused`.
    pub state: String,
    /// Labels.
    pub metadata: HashMap<String, String>,
    /// Token (detail only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
}

/// `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Deserialize)]
pub struct TimeoutRequest {
    /// Seconds from now.
    pub timeout: u64,
}

/// `POST /v2/sandboxes/{id}/connect`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ConnectRequest {
    /// New timeout, seconds (only ever extends a running sandbox's).
    pub timeout: Option<u64>,
}

/// `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct SnapshotRequest {
    /// A name for the snapshot.
    pub name: Option<String>,
    /// `true` (default): memory too → a `full` point; `false`: files only → an `fs` point.
    pub memory: Option<bool>,
}

/// The answer of a snapshot (`SnapshotInfo`).
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotInfo {
    /// The id `Sandbox.create` accepts as a template.
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    /// Names given.
    pub names: Vec<String>,
}

/// `POST /sandboxes/{id}/fork`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ForkRequest {
    /// Timeout of each child, seconds.
    pub timeout: Option<u64>,
    /// How many children (default 1).
    pub count: Option<u32>,
}

/// One child of a fork.
#[derive(Debug, Clone, Serialize)]
pub struct ForkResult {
    /// The child, when it started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Created>,
    /// Why it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiErrorBody>,
}

/// `POST /sandboxes/{id}/pause`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct PauseRequest {
    /// `false` asks for a files-only pause (refused: Crab pauses keep processes).
    pub memory: Option<bool>,
}

/// E2B's error body (`Error`): the HTTP status again and a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiErrorBody {
    /// HTTP status.
    pub code: u16,
    /// What went wrong and what to do.
    pub message: String,
}
