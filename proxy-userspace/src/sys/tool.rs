//! Running the kernel's command-line tools: one helper that runs a tool
//! (optionally with input piped to its stdin) and turns a failure into an
//! error naming the command and what it printed.

use std::{
    io::Write,
    process::{Command, Output, Stdio},
};

use anyhow::{Context, Result, bail};

/// Runs `program` with `args` and returns what it printed; failing to
/// start it is an error (naming `package`, which installs it), its exit
/// status is the caller's to judge.
pub fn run(program: &str, args: &[&str], package: &str) -> Result<Output> {
    Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} (is {package} installed?)"))
}

/// Runs `program` with `args`, `input` piped to its stdin, and returns
/// what it printed on stderr (stdout is dropped). An error if it cannot
/// start, or if it fails: the message names the command, its status, what
/// it printed and, if `show_input` finds the failed input line in its
/// stderr, the input around that line.
pub fn pipe(program: &str, args: &[&str], input: &str, show_input: impl Fn(&str) -> Option<usize>) -> Result<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program}"))?;
    // A tool that stops reading early (a syntax error) closes the pipe: its
    // status and stderr say more than the broken pipe does.
    let written = child
        .stdin
        .take()
        .with_context(|| format!("no stdin for {program}"))?
        .write_all(input.as_bytes());
    let out = child
        .wait_with_output()
        .with_context(|| format!("waiting for {program}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        let around = show_input(&stderr).map_or_else(String::new, |line| lines_around(input, line));
        bail!(
            "{program} {} failed ({}): {}{around}",
            args.join(" "),
            out.status,
            stderr.trim()
        );
    }
    written.with_context(|| format!("writing to {program}"))?;
    Ok(stderr)
}

/// Fails if `program --version` does not run (naming `package`).
pub fn check_runs(program: &str, package: &str) -> Result<()> {
    let out = run(program, &["--version"], package)?;
    if !out.status.success() {
        bail!(
            "{program} --version failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `out`'s stdout as text; an error naming `program` if it failed.
pub fn stdout_of(program: &str, args: &[&str], out: Output) -> Result<String> {
    if !out.status.success() {
        bail!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("{program} printed invalid UTF-8"))
}

/// The line number a tool's `stderr` gives right after `marker` (`line `
/// for iptables-restore and ipset, `/dev/stdin:` for nft), if any.
pub fn line_after(stderr: &str, marker: &str) -> Option<usize> {
    stderr
        .split(marker)
        .skip(1)
        .find_map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
}

/// The lines of `input` around line `line` (1-based), the line marked,
/// as kube-proxy logs a failed restore; empty if `input` has no such line.
pub fn lines_around(input: &str, line: usize) -> String {
    let lines: Vec<&str> = input.lines().collect();
    let first = line.saturating_sub(3);
    let last = (line + 2).min(lines.len());
    let shown: Vec<String> = (first..last)
        .map(|i| format!("{}{:>6}: {}", if i + 1 == line { "=>" } else { "  " }, i + 1, lines[i]))
        .collect();
    if shown.is_empty() {
        return String::new();
    }
    format!("\ninput around line {line}:\n{}", shown.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn piped_input_reaches_the_tool_and_failures_show_it() {
        assert_eq!(pipe("sh", &["-c", "cat >&2"], "hello", |_| None).unwrap(), "hello");
        let error = pipe(
            "sh",
            &["-c", "cat >/dev/null; echo 'line 2: bad' >&2; exit 3"],
            "a\nb\nc\n",
            |stderr| line_after(stderr, "line "),
        )
        .unwrap_err();
        let message = format!("{error:#}");
        assert!(
            message.contains("sh -c") && message.contains("line 2: bad"),
            "{message}"
        );
        assert!(message.contains("=>     2: b"), "{message}");
        assert!(pipe("/nonexistent/tool", &[], "", |_| None).is_err());
    }

    #[test]
    fn a_missing_tool_names_its_package() {
        let error = check_runs("/nonexistent/tool", "the tool package").unwrap_err();
        assert!(format!("{error:#}").contains("is the tool package installed?"));
        assert!(check_runs("true", "coreutils").is_ok());
    }

    #[test]
    fn finds_the_line_a_tool_complained_about() {
        assert_eq!(line_after("iptables-restore: line 3 failed", "line "), Some(3));
        let nft = "/dev/stdin:4:5-9: Error: Could not process rule";
        assert_eq!(line_after(nft, "/dev/stdin:"), Some(4));
        let ipset = "ipset v7.17: Error in line 3: The set with the given name does not exist";
        assert_eq!(line_after(ipset, "line "), Some(3));
        assert_eq!(line_after("something else", "line "), None);
    }

    #[test]
    fn lines_around_marks_the_line() {
        let shown = lines_around("a\nb\nc\nd\ne\nf\n", 4);
        assert!(shown.contains("=>     4: d") && shown.contains("       2: b") && shown.contains("       5: e"));
        assert!(!shown.contains("1: a"), "{shown}");
        assert_eq!(lines_around("a\n", 9), "");
    }
}
