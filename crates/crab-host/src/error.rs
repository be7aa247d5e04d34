//! [`HostError`]: what an [`crate::Action`] failed with, carrying the API's stable error code
//! from the layer that failed (a full pool during a restore stays `pool_full`).

use crab_common::{ApiError, ErrorCode};

/// Why an action failed. Wraps the [`ApiError`] of the layer that failed, so its code, message
/// and hint reach the front door unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}", .0.message, if .0.hint.is_empty() { String::new() } else { format!(" (hint: {})", .0.hint) })]
pub struct HostError(pub ApiError);

impl HostError {
    /// The stable code.
    pub fn code(&self) -> ErrorCode {
        self.0.code
    }

    /// The API error to render.
    pub fn into_api(self) -> ApiError {
        self.0
    }

    /// An internal error.
    pub fn internal(message: impl Into<String>) -> Self {
        HostError(ApiError::internal(message))
    }

    /// A malformed request.
    pub fn invalid(message: impl Into<String>, hint: impl Into<String>) -> Self {
        HostError(ApiError::invalid(message, hint))
    }
}

/// Across the proxy's seam ([`crab_coordinator::TurnHooks`]) unchanged: code, message, hint.
impl From<HostError> for crab_coordinator::HookError {
    fn from(e: HostError) -> Self {
        crab_coordinator::HookError(e.0)
    }
}

impl From<crab_coordinator::HookError> for HostError {
    fn from(e: crab_coordinator::HookError) -> Self {
        HostError(e.0)
    }
}

impl From<ApiError> for HostError {
    fn from(e: ApiError) -> Self {
        HostError(e)
    }
}

impl From<crab_sandbox::SandboxError> for HostError {
    fn from(e: crab_sandbox::SandboxError) -> Self {
        HostError(e.into())
    }
}

impl From<crab_checkpoint::CheckpointError> for HostError {
    fn from(e: crab_checkpoint::CheckpointError) -> Self {
        HostError(e.to_api())
    }
}

impl From<crab_inspector::InspectorError> for HostError {
    fn from(e: crab_inspector::InspectorError) -> Self {
        HostError(e.to_api())
    }
}
