//! The subcommands of the `xproxy` binary, and their exit codes.

pub mod cleanup;
pub mod logging;
mod node_setup;
pub mod run;
pub mod status;
pub mod trace;

/// Exit codes, so scripts can tell failures apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitCode {
    /// Anything not listed below.
    Error = 1,
    /// Invalid configuration file or flags.
    BadConfig = 2,
    /// Not root / missing capabilities, or bpffs not mounted.
    NoPrivileges = 3,
    // 4 was "API server unreachable at start-up": the agent now waits for
    // it (a node may boot before its control plane); the number stays
    // unused so that scripts reading the others keep their meaning.
    /// A named interface does not exist.
    NoInterface = 5,
    /// The requested mode is not available on this build or kernel.
    ModeUnavailable = 6,
}

/// An error with the exit code it should end the process with.
#[derive(Debug)]
pub struct Failure {
    pub code: ExitCode,
    pub error: anyhow::Error,
}

impl Failure {
    pub fn new(code: ExitCode, error: impl Into<anyhow::Error>) -> Self {
        Self {
            code,
            error: error.into(),
        }
    }
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Self {
        Self {
            code: ExitCode::Error,
            error,
        }
    }
}

/// Extension to attach an exit code to any error on the way up.
pub trait WithExitCode<T> {
    fn exit_code(self, code: ExitCode) -> Result<T, Failure>;
}

impl<T, E: Into<anyhow::Error>> WithExitCode<T> for Result<T, E> {
    fn exit_code(self, code: ExitCode) -> Result<T, Failure> {
        self.map_err(|e| Failure::new(code, e))
    }
}

pub fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}
