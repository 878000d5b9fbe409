//! How a use case refuses: a typed error that says whose fault it was, with a stable code and a
//! message that says what to do. It knows nothing of HTTP; the API maps each kind to a status
//! (`crate::interfaces::api`), and the autoscaler records it as it is.

/// Why a scale operation (or a question about one) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// The request itself is wrong (a bad count, URL, timeout, model, or more GPUs than exist).
    #[error("{message}")]
    Invalid { code: &'static str, message: String },
    /// It names an operation or engine the fleet does not have.
    #[error("{message}")]
    Unknown { code: &'static str, message: String },
    /// The fleet's state does not allow it now (another operation runs, the operation ended).
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    /// Our fault: the request was fine and the manager could not carry it out.
    #[error("{message}")]
    Internal { code: &'static str, message: String },
}

impl OpError {
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid { code, message: message.into() }
    }
    pub fn unknown(code: &'static str, message: impl Into<String>) -> Self {
        Self::Unknown { code, message: message.into() }
    }
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::Conflict { code, message: message.into() }
    }
    pub fn internal(code: &'static str, message: impl Into<String>) -> Self {
        Self::Internal { code, message: message.into() }
    }

    /// The stable, machine-readable code (`invalid_num_replicas`, `operation_in_progress`...).
    pub fn code(&self) -> &'static str {
        match self {
            Self::Invalid { code, .. }
            | Self::Unknown { code, .. }
            | Self::Conflict { code, .. }
            | Self::Internal { code, .. } => code,
        }
    }

    /// The kind, in words: `invalid`, `unknown`, `conflict` or `internal`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid { .. } => "invalid",
            Self::Unknown { .. } => "unknown",
            Self::Conflict { .. } => "conflict",
            Self::Internal { .. } => "internal",
        }
    }
}
