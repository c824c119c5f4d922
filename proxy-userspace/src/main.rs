//! `xproxy`: the node agent. `run` keeps the data path equal to what the API
//! server (or a manifest directory) says; `status` shows the live data path;
//! `cleanup` removes what xproxy installed (`--scope kube-proxy`: the
//! rules under kube-proxy's names); `trace` runs one synthetic packet
//! through the live programs.

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use proxy_userspace::{
    cmd::{self, Failure},
    config::{DEFAULT_PIN_PATH, Logging, Mode, RunFlags},
};

#[derive(Parser)]
#[command(
    name = "xproxy",
    version,
    about = "Kubernetes Service data plane in eBPF (a kube-proxy replacement)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent in the foreground. SIGTERM/SIGINT stop it and leave the
    /// data path in place, like kube-proxy; only `cleanup` removes it.
    Run(Box<RunFlags>),
    /// Show the live services, backends and flow counts, read back from
    /// what the mode in use programmed (any mode: one table).
    Status {
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// The mode to read back; by default the one found programmed.
        #[arg(long, value_enum)]
        mode: Option<Mode>,
        /// Print the table as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove what xproxy installed: by default what carries its own names
    /// (the ebpf mode's programs, maps and SNAT chain, the nftables mode's
    /// table); `--scope kube-proxy` the rules under kube-proxy's names.
    Cleanup {
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_PATH)]
        pin_path: PathBuf,
        /// `own`: xproxy's names only. `kube-proxy`: the iptables, IPVS and
        /// userspace modes' rules, which carry kube-proxy's names, so a
        /// kube-proxy's KUBE-* chains and ipsets and every IPVS virtual
        /// server on the host go too, as with `kube-proxy --cleanup`
        /// (leaves the ebpf data path alone). `all`: both.
        #[arg(long, value_enum, default_value = "own")]
        scope: cmd::cleanup::Scope,
    },
    /// Run one synthetic packet through the live eBPF programs and show the
    /// verdict, the backend and the rewritten headers; changes no state.
    Trace(Box<cmd::trace::Flags>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run(_)) {
        // `run` sets logging up from its configuration.
        cmd::logging::init(Logging::default(), None);
    }
    let result = match cli.command {
        Command::Run(flags) => cmd::run::run(&flags),
        Command::Status { pin_path, mode, json } => cmd::status::status(&cmd::status::Options { pin_path, mode, json }),
        Command::Cleanup { pin_path, scope } => cmd::cleanup::cleanup(&pin_path, scope),
        Command::Trace(flags) => cmd::trace::trace(&flags),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure { code, error }) => {
            eprintln!("xproxy: {error:#}");
            ExitCode::from(code as u8)
        }
    }
}
