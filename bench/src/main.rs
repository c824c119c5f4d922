//! `xproxy-bench`: the measurements behind `cargo xtask bench` (which builds
//! the release binaries and runs this one as root).
//!
//! `xproxy-bench run [--modes ...] [--services ...] [--quick]` measures
//! every mode through the real agent on a simulated node
//! ([`topology`]): first-packet latency ([`latency`]), programming time
//! ([`programming`]), throughput with wrk ([`throughput`]), memory
//! ([`memory`]) and the programs' per-packet cost ([`perpacket`]); it
//! writes `bench/results/<date>-<host>.json` ([`results`]), a Markdown
//! report ([`report`]) and SVG charts ([`charts`]).
//! `xproxy-bench report FILE.json` renders the report and charts of a
//! results file again.

mod agent;
mod charts;
#[cfg(test)]
mod fixture;
mod latency;
mod maglev_scale;
mod memory;
mod packet_cost;
mod perpacket;
mod placement;
mod plan;
mod program_time;
mod programming;
mod progress;
mod report;
mod results;
mod runner;
mod server;
mod services;
mod sock;
mod stats;
mod throughput;
mod topology;

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    time::Instant,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

use crate::{
    plan::{Plan, RunOptions},
    progress::Progress,
    results::{Machine, Results},
};

#[derive(Parser, Debug)]
#[command(name = "xproxy-bench", about = "Benchmarks every xproxy mode side by side")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Measure (as root) and write the results, the report and the charts.
    Run(Box<RunOptions>),
    /// Render the report and the charts of a results file again.
    Report {
        /// A `bench/results/*.json` file; the report and charts go next to it.
        file: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Run(options) => run(&options),
        Command::Report { file } => rerender(&file),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xproxy-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace this binary was built in (the results go to its `bench/results`).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// `xproxy` next to this binary (both are built into `target/release`).
fn default_xproxy() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this binary")?;
    Ok(exe.with_file_name("xproxy"))
}

fn run(options: &RunOptions) -> Result<()> {
    if !testbed::privileged::is_root() {
        bail!("the bench creates network namespaces and loads eBPF programs: run it as root");
    }
    let plan = Plan::from_options(options)?;
    let xproxy = match &options.xproxy {
        Some(path) => path.clone(),
        None => default_xproxy()?,
    };
    if !xproxy.is_file() {
        bail!(
            "no agent binary at {} (cargo build --release -p proxy-userspace)",
            xproxy.display()
        );
    }
    let root = workspace_root();
    let out_dir = options.out.clone().unwrap_or_else(|| root.join("bench/results"));
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let machine = Machine::detect(&root);

    let started = Instant::now();
    let progress = Progress::new(runner::steps(&plan));
    progress.say(&format!(
        "modes {:?}, Services {:?}{}; agent {}",
        plan.modes,
        plan.services,
        if plan.quick { " (quick)" } else { "" },
        xproxy.display()
    ));
    let runner = runner::Runner::new(&plan, &xproxy, &progress)?;
    let outcome = runner.run();
    progress.finish();

    let results = Results {
        schema: results::SCHEMA,
        machine,
        parameters: runner.parameters(),
        modes: outcome.modes,
        scale: outcome.scale,
        per_packet: outcome.per_packet,
        timings: progress.timings(),
    };
    let stem = if plan.quick {
        format!("{}-quick", results.machine.file_stem())
    } else {
        results.machine.file_stem()
    };
    let written = write_outputs(&results, &out_dir, &stem)?;
    eprintln!("xproxy-bench: done in {:.0} s", started.elapsed().as_secs_f64());
    for path in written {
        eprintln!("xproxy-bench: wrote {}", path.display());
    }
    let errors = results.errors();
    if !errors.is_empty() {
        bail!("{} part(s) failed:\n  {}", errors.len(), errors.join("\n  "));
    }
    Ok(())
}

/// Writes the results, the charts and the report; returns their paths.
fn write_outputs(results: &Results, dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
    let json = dir.join(format!("{stem}.json"));
    results.write(&json)?;
    let mut written = vec![json];
    written.extend(render(results, dir, stem)?);
    Ok(written)
}

/// The charts and the report of `results`, next to each other in `dir`.
fn render(results: &Results, dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let mut shown = Vec::new();
    for chart in charts::render_all(results)? {
        let file = format!("{stem}-{}.svg", chart.suffix);
        let path = dir.join(&file);
        std::fs::write(&path, &chart.svg).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
        shown.push(report::Chart {
            title: chart.title,
            file,
        });
    }
    let path = dir.join(format!("{stem}.md"));
    std::fs::write(&path, report::render(results, &shown)).with_context(|| format!("writing {}", path.display()))?;
    written.push(path);
    Ok(written)
}

fn rerender(file: &Path) -> Result<()> {
    let results = Results::read(file)?;
    let dir = file.parent().unwrap_or(Path::new("."));
    let stem = file
        .file_stem()
        .and_then(|s| s.to_str())
        .context("a results file name")?;
    for path in render(&results, dir, stem)? {
        println!("{}", path.display());
    }
    Ok(())
}
