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

/// wrk's `--timeout`: a request not answered in this time counts as a
/// timeout error (wrk goes on with the others).
const WRK_TIMEOUT: Duration = Duration::from_secs(2);
/// Before its threads start, wrk checks the address with one blocking
/// connect of its own, which waits out the kernel's SYN retries when the
/// SYN is not answered (`tcp_syn_retries` = 6: 127 s) and then fails by
/// itself ("unable to connect"). The bench waits that long and a bit more,
/// so a wrk that ends gets its own error reported; only one that really
/// hangs is killed.
const WRK_START_CHECK: Duration = Duration::from_secs(135);
/// How long the address may take to answer a new connection before wrk is
/// started at all (a mode may still be at work): an address that does not
/// answer then fails at once, with why, instead of wrk's start-up check
/// waiting minutes.
const ANSWER_PATIENCE: Duration = Duration::from_secs(10);

/// How long one wrk run may take: its duration, a request in flight at the
/// end waiting out the timeout, and the start-up check.
fn wrk_deadline(options: &WrkOptions) -> Duration {
    Duration::from_secs(options.duration_s) + WRK_TIMEOUT + WRK_START_CHECK
}

/// `rounds` runs of `wrk` from `ns` against `http://addr/`.
pub fn measure(ns: &Netns, addr: SocketAddrV4, keep_alive: bool, options: &WrkOptions) -> Result<Throughput> {
    ns.run_in(|| crate::programming::probe_patiently(addr.into(), Duration::from_secs(1), ANSWER_PATIENCE))?
        .map_err(|e| anyhow::anyhow!("{addr} from {} before wrk: {e}", ns.name()))?;
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
        .arg(format!("{}s", WRK_TIMEOUT.as_secs()));
    if !keep_alive {
        cmd.args(["-H", "Connection: close"]);
    }
    cmd.arg(format!("http://{addr}/"));
    let output = run_with_deadline(cmd, wrk_deadline(options)).with_context(|| format!("wrk against {addr}"))?;
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
            bail!("wrk still ran after {deadline:?}: killed");
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

    #[test]
    fn wrk_may_outlast_its_duration_by_its_timeout_and_start_up_check() {
        let options = WrkOptions {
            threads: 1,
            connections: 32,
            duration_s: 3,
            rounds: 2,
        };
        let deadline = wrk_deadline(&options);
        // The kernel's SYN retries of wrk's start-up connect: 1+2+4+...+64 s.
        let syn_retries: u64 = (0..7).map(|i| 1 << i).sum();
        assert!(deadline > Duration::from_secs(options.duration_s + syn_retries) + WRK_TIMEOUT);
        assert!(deadline < Duration::from_secs(300));
    }
}
