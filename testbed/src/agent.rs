//! An `xproxy` process running inside a node namespace, as the demo, the
//! agent tests and the benchmarks start it.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{Context, Result};

use crate::netns::{self, Netns};

/// `xproxy run ARGS --pin-path PIN` in `node`'s network namespace (only the
/// network namespace: the pins land on the host's bpffs). Dropping it
/// stops the process (SIGTERM) and removes the data path (`xproxy cleanup`,
/// also in the node's namespace: cleanup removes rules and tables of every
/// mode, which must never touch the host's).
pub struct AgentProcess {
    child: Option<Child>,
    xproxy: PathBuf,
    pin_path: PathBuf,
    node_ns: PathBuf,
    /// Environment for every `xproxy` this runs (the agent, its cleanup).
    env: Vec<(String, String)>,
}

impl AgentProcess {
    /// Starts the agent; `args` follow `xproxy run` (without `--pin-path`).
    /// Its output goes to `log` if given, else to this process's stderr.
    pub fn start(xproxy: &Path, node: &Netns, pin_path: &Path, args: &[String], log: Option<&Path>) -> Result<Self> {
        Self::start_with_env(xproxy, node, pin_path, args, log, Vec::new())
    }

    /// [`Self::start`] with `env` added to the agent's environment (and its
    /// cleanup's), e.g. a `PATH` that picks an iptables backend.
    pub fn start_with_env(
        xproxy: &Path,
        node: &Netns,
        pin_path: &Path,
        args: &[String],
        log: Option<&Path>,
        env: Vec<(String, String)>,
    ) -> Result<Self> {
        let mut agent = Self {
            child: None,
            xproxy: xproxy.to_owned(),
            pin_path: pin_path.to_owned(),
            node_ns: node.path().to_owned(),
            env,
        };
        agent.restart(args, log)?;
        Ok(agent)
    }

    /// Starts the agent again on the same data path after it was stopped
    /// ([`Self::stop`]): the new process adopts the pinned maps and links.
    pub fn restart(&mut self, args: &[String], log: Option<&Path>) -> Result<()> {
        anyhow::ensure!(self.child.is_none(), "the agent is still running");
        let mut cmd = netns::command_in(&self.node_ns, &self.xproxy)?;
        cmd.arg("run")
            .args(args)
            .arg("--pin-path")
            .arg(&self.pin_path)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        if let Some(log) = log {
            let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
            cmd.stdout(file.try_clone()?).stderr(file);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.xproxy.display()))?;
        self.child = Some(child);
        Ok(())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn pin_path(&self) -> &Path {
        &self.pin_path
    }

    /// `xproxy status` of this agent's data path.
    pub fn status(&self) -> Result<String> {
        netns::run(
            Command::new(&self.xproxy)
                .arg("status")
                .arg("--pin-path")
                .arg(&self.pin_path),
        )
    }

    /// Sends `signal` and waits for the process to end; the data path stays.
    pub fn stop(&mut self, signal: i32) -> Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("the agent is not running")?;
        // SAFETY: kill has no memory preconditions; the pid is our child's.
        unsafe { libc::kill(child.id() as i32, signal) };
        child.wait().context("waiting for the agent to exit")
    }

    /// Whether the process has exited (and with what).
    pub fn try_exit_status(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => Ok(child.try_wait()?),
            None => Ok(None),
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if self.child.is_some()
            && let Err(e) = self.stop(libc::SIGTERM)
        {
            eprintln!("warning: stopping the agent: {e:#}");
        }
        match netns::command_in(&self.node_ns, &self.xproxy) {
            Ok(mut cmd) => {
                // The node namespace is the bed's own: every mode's rules go.
                let cleanup = cmd
                    .envs(self.env.iter().map(|(k, v)| (k, v)))
                    .args(["cleanup", "--scope", "all", "--pin-path"])
                    .arg(&self.pin_path);
                if let Err(e) = netns::run(cleanup) {
                    eprintln!("warning: xproxy cleanup in the node failed: {e:#}");
                }
            }
            // The node is gone, and its rules with it; only the pins are left.
            Err(_) => {
                if self.pin_path.exists()
                    && let Err(e) = std::fs::remove_dir_all(&self.pin_path)
                {
                    eprintln!("warning: removing {}: {e}", self.pin_path.display());
                }
            }
        }
    }
}
