//! Boots the guest under qemu, streams its serial console and reads the
//! results.
//!
//! qemu runs with software emulation (`-accel tcg`; KVM guests crash on
//! these machines), no network card and no reboot, so the guest's
//! `poweroff -f` (or a panic, with `panic=-1`) ends qemu. Every console line
//! is echoed with a `vm| ` prefix and written to the log; [`Parser`] turns
//! the markers of [`init`] and libtest's `test result:` and `... FAILED`
//! lines into an [`Outcome`].

use std::{
    fmt::Write as _,
    fs,
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use base64::Engine as _;

use super::init;
use crate::command;

/// The guest's kernel command line. A panic powers the guest off
/// (`panic=-1` with qemu's `-no-reboot`). A CPU stuck for a minute
/// (twice `watchdog_thresh`) is a panic too, with every CPU's stack on the
/// console: a hung kernel then fails its run at once, and says where,
/// instead of idling until the timeout. `loglevel=5` lets those stacks
/// (printed at the default level) through and keeps the boot's
/// informational lines off the console.
const KERNEL_COMMAND_LINE: &str =
    "console=ttyS0 panic=-1 loglevel=5 softlockup_panic=1 softlockup_all_cpu_backtrace=1 watchdog_thresh=30";

pub struct Boot<'a> {
    pub kernel: &'a Path,
    pub initrd: &'a Path,
    pub memory_mib: u32,
    pub timeout: Duration,
    /// The whole console output goes here.
    pub log: &'a Path,
}

/// Boots, streams the console until qemu exits or `timeout` passes, and
/// returns what the guest reported.
pub fn boot(boot: &Boot) -> Result<Outcome> {
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-accel", "tcg", "-smp", "2", "-m"])
        .arg(boot.memory_mib.to_string())
        .arg("-kernel")
        .arg(boot.kernel)
        .arg("-initrd")
        .arg(boot.initrd)
        .args([
            "-append",
            KERNEL_COMMAND_LINE,
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let text = command::describe(&cmd);
    eprintln!("xtask: running {text}");
    let started = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("failed to start `{text}`"))?;
    let stdout = child.stdout.take().context("qemu's stdout")?;

    let (lines, received) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut stdout = BufReader::new(stdout);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match stdout.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if lines.send(printable(&String::from_utf8_lossy(&buf))).is_err() {
                        break;
                    }
                }
            }
        }
    });

    let mut log = fs::File::create(boot.log).with_context(|| format!("cannot create {}", boot.log.display()))?;
    let mut parser = Parser::default();
    let deadline = started + boot.timeout;
    let mut timed_out = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match received.recv_timeout(left) {
            Ok(line) => {
                println!("vm| {line}");
                let _ = writeln!(log, "{line}");
                parser.line(&line, started.elapsed());
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                timed_out = true;
                eprintln!(
                    "xtask vm: no power-off after {} s: killing qemu",
                    boot.timeout.as_secs()
                );
                let _ = child.kill();
                break;
            }
        }
    }
    let status = child.wait().with_context(|| format!("waiting for `{text}`"))?;
    let _ = reader.join();
    let mut outcome = parser.finish(started.elapsed());
    outcome.timed_out = timed_out;
    outcome.qemu_failed = (!timed_out && !status.success()).then(|| status.to_string());
    Ok(outcome)
}

/// `line` without terminal escape sequences (SeaBIOS clears the screen) and
/// control characters.
fn printable(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                // ESC [ parameters final-byte, or ESC and one character.
                if chars.next_if_eq(&'[').is_some() {
                    while chars.next().is_some_and(|c| !('@'..='~').contains(&c)) {}
                } else {
                    chars.next();
                }
            }
            '\t' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// One step the guest ran (a test executable or a check).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Step {
    pub name: String,
    /// None: the guest never reported its end.
    pub exit: Option<i32>,
    /// Summed over the `test result:` lines (libtest prints one per harness).
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    /// How many `test result:` lines there were.
    pub results: u32,
    /// Tests libtest reported as `... FAILED`.
    pub failures: Vec<String>,
    /// Host time between the markers.
    pub seconds: f64,
    started: Duration,
}

impl Step {
    fn ok(&self) -> bool {
        self.exit == Some(0) && self.failed == 0
    }
}

/// Everything the guest reported.
#[derive(Debug, Default)]
pub struct Outcome {
    pub kernel: Option<String>,
    pub modprobe_failed: Vec<String>,
    pub steps: Vec<Step>,
    /// `/init` reached its end.
    pub done: bool,
    pub timed_out: bool,
    /// The guest kernel's panic message (`softlockup: hung tasks`), and
    /// the step it cut short.
    pub kernel_panic: Option<(String, Option<String>)>,
    /// qemu's exit status when it was not a success.
    pub qemu_failed: Option<String>,
    pub seconds: f64,
    /// Files the guest handed out ([`init::FILE`]): name and bytes, or why
    /// they could not be read.
    pub files: Vec<(String, Result<Vec<u8>, String>)>,
}

impl Outcome {
    /// The lines printed on the host after the run.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "xtask vm: guest kernel {} ({:.1} s in qemu)",
            self.kernel.as_deref().unwrap_or("unknown (it never reported)"),
            self.seconds
        );
        for module in &self.modprobe_failed {
            let _ = writeln!(s, "xtask vm:   modprobe {module} FAILED");
        }
        let width = self.steps.iter().map(|step| step.name.len()).max().unwrap_or(0);
        for step in &self.steps {
            let verdict = match step.exit {
                None => "UNFINISHED",
                Some(_) if step.ok() => "ok",
                Some(_) => "FAILED",
            };
            let exit = step.exit.map_or("-".to_owned(), |code| code.to_string());
            let counts = if step.results > 0 {
                format!(
                    "{} passed, {} failed, {} ignored",
                    step.passed, step.failed, step.ignored
                )
            } else {
                "no libtest result".to_owned()
            };
            let _ = writeln!(
                s,
                "xtask vm:   {:width$}  {verdict:10}  exit {exit:3}  {counts}  ({:.1} s)",
                step.name, step.seconds
            );
            for failure in &step.failures {
                let _ = writeln!(s, "xtask vm:     failed: {failure}");
            }
        }
        if self.timed_out {
            let _ = writeln!(s, "xtask vm:   TIMED OUT");
        }
        if let Some((message, _)) = &self.kernel_panic {
            let _ = writeln!(
                s,
                "xtask vm:   KERNEL PANIC: {message} (the stacks are in the console log)"
            );
        }
        s
    }

    /// Why the run failed, or None if every expected step passed.
    pub fn problem(&self, expected: &[&str]) -> Option<String> {
        let mut problems = Vec::new();
        if let Some((message, step)) = &self.kernel_panic {
            problems.push(match step {
                Some(step) => format!("the guest kernel panicked during {step}: {message}"),
                None => format!("the guest kernel panicked: {message}"),
            });
        } else if self.timed_out {
            let running = self.steps.iter().find(|step| step.exit.is_none());
            problems.push(match running {
                Some(step) => format!("the VM timed out during {}", step.name),
                None => "the VM timed out".to_owned(),
            });
        } else if !self.done {
            problems.push(match &self.qemu_failed {
                Some(status) => format!("qemu failed ({status}) before the guest finished"),
                None => "the guest stopped before running every step (see the console log)".to_owned(),
            });
        }
        if self.kernel.is_none() {
            problems.push("the guest never reported its kernel".to_owned());
        }
        if !self.modprobe_failed.is_empty() {
            problems.push(format!("modprobe failed: {}", self.modprobe_failed.join(", ")));
        }
        for step in &self.steps {
            if step.exit.is_some() && !step.ok() {
                problems.push(format!("{} failed", step.name));
            }
        }
        for name in expected {
            if !self.steps.iter().any(|step| step.name == *name) && self.done {
                problems.push(format!("{name} never ran"));
            }
        }
        (!problems.is_empty()).then(|| problems.join("; "))
    }
}

/// Reads console lines into an [`Outcome`].
#[derive(Default)]
pub struct Parser {
    outcome: Outcome,
    current: Option<Step>,
    /// A file being handed out: its name and base64 text so far.
    file: Option<(String, String)>,
}

impl Parser {
    pub fn line(&mut self, line: &str, at: Duration) {
        if let Some(marker) = line.find(init::MARK).map(|at| line[at + init::MARK.len()..].trim()) {
            self.marker(marker, at);
            return;
        }
        if let Some(message) = line.split("Kernel panic - not syncing: ").nth(1) {
            let step = self.current.as_ref().map(|step| step.name.clone());
            self.outcome
                .kernel_panic
                .get_or_insert((message.trim().to_owned(), step));
            return;
        }
        if let Some((_, text)) = self.file.as_mut() {
            // A kernel message on the console is no base64 line: skip it.
            let line = line.trim();
            if line.bytes().all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b)) {
                text.push_str(line);
            }
            return;
        }
        let Some(step) = self.current.as_mut() else { return };
        let line = line.trim();
        if let Some(result) = line.strip_prefix("test result: ") {
            step.results += 1;
            step.passed += count(result, "passed");
            step.failed += count(result, "failed");
            step.ignored += count(result, "ignored");
        } else if let Some(test) = line
            .strip_prefix("test ")
            .and_then(|rest| rest.strip_suffix(" ... FAILED"))
        {
            step.failures.push(test.to_owned());
        }
    }

    fn marker(&mut self, marker: &str, at: Duration) {
        let (kind, rest) = marker.split_once(' ').unwrap_or((marker, ""));
        let rest = rest.trim();
        match kind {
            init::KERNEL => self.outcome.kernel = Some(rest.to_owned()),
            init::MODPROBE_FAILED => self.outcome.modprobe_failed.push(rest.to_owned()),
            init::BEGIN => {
                self.close(at);
                self.current = Some(Step {
                    name: rest.to_owned(),
                    started: at,
                    ..Step::default()
                });
            }
            init::END => {
                let (name, code) = rest.rsplit_once(' ').unwrap_or((rest, ""));
                if let Some(step) = self.current.as_mut().filter(|step| step.name == name) {
                    step.exit = Some(code.parse().unwrap_or(-1));
                }
                self.close(at);
            }
            init::DONE => {
                self.close(at);
                self.outcome.done = true;
            }
            init::FILE => self.file = Some((rest.to_owned(), String::new())),
            init::FILE_END => {
                if let Some((name, text)) = self.file.take() {
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(text)
                        .map_err(|e| format!("not base64: {e}"));
                    self.outcome.files.push((name, bytes));
                }
            }
            _ => {}
        }
    }

    fn close(&mut self, at: Duration) {
        if let Some(mut step) = self.current.take() {
            step.seconds = (at - step.started).as_secs_f64();
            self.outcome.steps.push(step);
        }
    }

    pub fn finish(mut self, at: Duration) -> Outcome {
        self.close(at);
        self.outcome.seconds = at.as_secs_f64();
        self.outcome
    }
}

/// The number before `word` in `ok. 3 passed; 1 failed; ...`.
fn count(result: &str, word: &str) -> u64 {
    result
        .split(';')
        .filter_map(|part| {
            let mut words = part.split_whitespace().rev();
            if words.next()? != word {
                return None;
            }
            words.next()?.parse::<u64>().ok()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(lines: &[&str]) -> Outcome {
        let mut parser = Parser::default();
        for (i, line) in lines.iter().enumerate() {
            parser.line(line, Duration::from_secs(i as u64));
        }
        parser.finish(Duration::from_secs(lines.len() as u64))
    }

    #[test]
    fn drops_escape_sequences() {
        assert_eq!(
            printable("\u{1b}c\u{1b}[?7l\u{1b}[2J\u{1b}[0mSeaBIOS (version 1.16)\r\n"),
            "SeaBIOS (version 1.16)"
        );
        assert_eq!(printable("a\tb\r\n"), "a\tb");
    }

    #[test]
    fn counts_libtest_results() {
        assert_eq!(
            count(
                "ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s",
                "passed"
            ),
            12
        );
        assert_eq!(count("FAILED. 3 passed; 2 failed; 0 ignored", "failed"), 2);
        assert_eq!(count("FAILED. 3 passed; 2 failed; 0 ignored", "ignored"), 0);
    }

    #[test]
    fn reads_steps_between_markers() {
        let outcome = feed(&[
            "[    0.9] random kernel line",
            "XPROXY-VM: KERNEL 6.1.0-54-cloud-amd64",
            "XPROXY-VM: MODPROBE-FAILED act_bpf",
            "XPROXY-VM: BEGIN ipvsadm -Ln",
            "IP Virtual Server version 1.2.1 (size=4096)",
            "XPROXY-VM: END ipvsadm -Ln 0",
            "XPROXY-VM: BEGIN packet",
            "running 3 tests",
            "test a ... ok",
            "test b ... FAILED",
            "test c ... ok",
            "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s",
            "XPROXY-VM: END packet 101",
            "XPROXY-VM: BEGIN verifier",
            "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s",
            "XPROXY-VM: END verifier 0",
            "XPROXY-VM: DONE",
        ]);
        assert_eq!(outcome.kernel.as_deref(), Some("6.1.0-54-cloud-amd64"));
        assert_eq!(outcome.modprobe_failed, ["act_bpf"]);
        assert!(outcome.done);
        assert_eq!(outcome.steps.len(), 3);
        assert_eq!(outcome.steps[0].name, "ipvsadm -Ln");
        assert_eq!(outcome.steps[0].exit, Some(0));
        assert!(outcome.steps[0].ok());
        let packet = &outcome.steps[1];
        assert_eq!((packet.passed, packet.failed, packet.exit), (2, 1, Some(101)));
        assert_eq!(packet.failures, ["b"]);
        assert!(outcome.steps[2].ok());
        let problem = outcome.problem(&["packet", "verifier"]).expect("a failure");
        assert!(problem.contains("modprobe failed: act_bpf"), "{problem}");
        assert!(problem.contains("packet failed"), "{problem}");
        assert!(!problem.contains("verifier"), "{problem}");
    }

    #[test]
    fn reads_files_handed_out_in_base64() {
        let outcome = feed(&[
            "XPROXY-VM: BEGIN bench",
            "xproxy-bench: done",
            "XPROXY-VM: END bench 0",
            "XPROXY-VM: FILE results.json",
            // "{\"a\": 1}\n" in two lines, a kernel message in between.
            "eyJhIj",
            "[   12.5] random: crng init done",
            "ogMX0K",
            "XPROXY-VM: FILE-END",
            "XPROXY-VM: FILE broken.json",
            "@@@@",
            "e",
            "XPROXY-VM: FILE-END",
            "XPROXY-VM: DONE",
        ]);
        assert_eq!(outcome.steps.len(), 1);
        assert!(outcome.steps[0].ok());
        assert_eq!(outcome.files.len(), 2);
        assert_eq!(outcome.files[0].0, "results.json");
        assert_eq!(outcome.files[0].1.as_deref(), Ok(&b"{\"a\": 1}\n"[..]));
        assert_eq!(outcome.files[1].0, "broken.json");
        assert!(outcome.files[1].1.is_err());
    }

    #[test]
    fn an_unfinished_step_is_a_failure() {
        let mut outcome = feed(&[
            "XPROXY-VM: KERNEL 6.1.0-54-cloud-amd64",
            "XPROXY-VM: BEGIN fuzz",
            "running 3 tests",
        ]);
        assert_eq!(outcome.steps[0].exit, None);
        outcome.timed_out = true;
        let problem = outcome.problem(&["fuzz"]).expect("a failure");
        assert!(problem.contains("timed out during fuzz"), "{problem}");
        assert!(outcome.summary().contains("UNFINISHED"));
    }

    #[test]
    fn a_kernel_panic_names_the_step_it_cut_short() {
        let outcome = feed(&[
            "XPROXY-VM: KERNEL 6.1.0-54-cloud-amd64",
            "XPROXY-VM: BEGIN modes:switching",
            "test switching_modes_with_cleanup_between ... [  549.0] watchdog: BUG: soft lockup - CPU#1 stuck for 60s! [in-xn1:4964]",
            "[  549.1] Kernel panic - not syncing: softlockup: hung tasks",
            "[  549.2] Kernel Offset: disabled",
        ]);
        let problem = outcome.problem(&["modes:switching"]).expect("a failure");
        assert_eq!(
            problem,
            "the guest kernel panicked during modes:switching: softlockup: hung tasks"
        );
        assert!(outcome.summary().contains("KERNEL PANIC: softlockup: hung tasks"));
    }

    #[test]
    fn a_clean_run_has_no_problem() {
        let outcome = feed(&[
            "XPROXY-VM: KERNEL 6.1.0-54-cloud-amd64",
            "XPROXY-VM: BEGIN verifier",
            "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s",
            "XPROXY-VM: END verifier 0",
            "XPROXY-VM: DONE",
        ]);
        assert_eq!(outcome.problem(&["verifier"]), None);
        assert_eq!(
            outcome.problem(&["verifier", "packet"]).as_deref(),
            Some("packet never ran")
        );
    }
}
