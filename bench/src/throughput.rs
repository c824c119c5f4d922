//! Requests per second with a real load generator: `wrk` (Debian's
//! package), started inside the client's (NodePort) or the client pod's
//! (ClusterIP) namespace against the pods' HTTP server, with new
//! connections per request (`Connection: close`) or kept alive.

use std::{net::SocketAddrV4, process::Command, time::Duration};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use testbed::netns::Netns;

use crate::stats::Summary;

/// How `wrk` is run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WrkOptions {
    pub threads: usize,
    pub connections: usize,
    pub duration_s: u64,
    pub rounds: usize,
}

/// One `wrk` run's result.
#[derive(Clone, Debug, PartialEq)]
pub struct WrkRun {
    pub requests_per_s: f64,
    pub requests: u64,
    /// Socket errors (connect, read, write, timeout) and non-2xx answers.
    pub errors: u64,
}

/// Requests/s over the rounds, and the errors seen.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    pub requests_per_s: Summary,
    pub errors: u64,
    pub requests: u64,
}

/// Whether `wrk` can be run.
pub fn wrk_available() -> bool {
    Command::new("wrk")
        .arg("--version")
        .output()
        .is_ok_and(|o| !o.stdout.is_empty() || !o.stderr.is_empty())
}

/// `rounds` runs of `wrk` from `ns` against `http://addr/`.
pub fn measure(ns: &Netns, addr: SocketAddrV4, keep_alive: bool, options: &WrkOptions) -> Result<Throughput> {
    let mut rates = Vec::new();
    let mut errors = 0;
    let mut requests = 0;
    for _ in 0..options.rounds {
        let run = run_wrk(ns, addr, keep_alive, options)?;
        rates.push(run.requests_per_s);
        errors += run.errors;
        requests += run.requests;
    }
    Ok(Throughput {
        requests_per_s: Summary::of(&rates).context("no wrk rounds")?,
        errors,
        requests,
    })
}

fn run_wrk(ns: &Netns, addr: SocketAddrV4, keep_alive: bool, options: &WrkOptions) -> Result<WrkRun> {
    let mut cmd = ns.command("wrk")?;
    cmd.arg(format!("-t{}", options.threads))
        .arg(format!("-c{}", options.connections))
        .arg(format!("-d{}s", options.duration_s))
        .arg("--timeout")
        .arg("2s");
    if !keep_alive {
        cmd.args(["-H", "Connection: close"]);
    }
    cmd.arg(format!("http://{addr}/"));
    let deadline = Duration::from_secs(options.duration_s + 30);
    let output = run_with_deadline(cmd, deadline).with_context(|| format!("wrk against {addr}"))?;
    parse_wrk(&output).with_context(|| format!("reading wrk's output:\n{output}"))
}

fn run_with_deadline(mut cmd: Command, deadline: Duration) -> Result<String> {
    let started = std::time::Instant::now();
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("starting wrk (apt-get install wrk)")?;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("wrk still ran after {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!("wrk failed ({}): {text}", output.status);
    }
    Ok(text)
}

/// Reads `Requests/sec:`, the request count and the error lines of wrk's
/// report.
pub fn parse_wrk(text: &str) -> Result<WrkRun> {
    let mut rate = None;
    let mut requests = None;
    let mut errors = 0;
    for line in text.lines().map(str::trim) {
        if let Some(value) = line.strip_prefix("Requests/sec:") {
            rate = value.trim().parse::<f64>().ok();
        } else if line.contains("requests in") {
            requests = line.split_whitespace().next().and_then(|n| n.parse::<u64>().ok());
        } else if let Some(list) = line.strip_prefix("Socket errors:") {
            errors += list
                .split(',')
                .filter_map(|part| part.split_whitespace().last()?.parse::<u64>().ok())
                .sum::<u64>();
        } else if let Some(count) = line.strip_prefix("Non-2xx or 3xx responses:") {
            errors += count.trim().parse::<u64>().unwrap_or(0);
        }
    }
    match (rate, requests) {
        (Some(requests_per_s), Some(requests)) => Ok(WrkRun {
            requests_per_s,
            requests,
            errors,
        }),
        _ => bail!("no `Requests/sec:` or request count"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wrk_reports() {
        let text = "\
Running 3s test @ http://10.96.0.10:80/
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.23ms  300.00us   5.00ms   70.00%
    Req/Sec    25.10k     1.20k   27.00k    80.00%
  75300 requests in 3.00s, 6.10MB read
  Socket errors: connect 0, read 12, write 0, timeout 3
  Non-2xx or 3xx responses: 2
Requests/sec:  25100.33
Transfer/sec:      2.03MB
";
        let run = parse_wrk(text).expect("a report");
        assert_eq!(run.requests_per_s, 25100.33);
        assert_eq!(run.requests, 75300);
        assert_eq!(run.errors, 17);
        assert!(parse_wrk("wrk: unable to connect").is_err());
    }
}
