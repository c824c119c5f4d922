//! Programming time: how long from the source delivering the Services to
//! the data path answering for them, and from one endpoint change to the
//! data path sending new connections to the new endpoint.

use std::{
    io::Read,
    net::{SocketAddr, SocketAddrV4},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use testbed::agent_bed::NodeApiServer;
use testbed::netns::Netns;

use crate::{
    agent::{BenchAgent, parse_log},
    sock,
    stats::{Summary, percentile},
};

/// Pause between probes of the bulk measurement: the agent, not the
/// prober, should have the CPUs.
const BULK_PROBE_PAUSE: Duration = Duration::from_millis(2);
/// The pause grows with the wait, to this fraction of it: a mode that takes
/// minutes is timed to half a percent all the same, and uses few local
/// ports.
const BULK_PROBE_BACKOFF: u32 = 200;
/// The local ports the bulk measurement probes from, each at most once per
/// [`UNANSWERED_FLOW_LIFETIME`]; no other connection of the bench uses them
/// (the latency rounds bind ports from 2000 on, everything else takes the
/// kernel's ephemeral ports, from 32768). Why: a probe that is not answered
/// leaves an entry in the node's conntrack (SYN_SENT, and with no NAT: it
/// came before the rules), and the next connection of the same addresses
/// and ports matches that entry, is never NATed and goes unanswered until
/// the entry expires. Probing from ephemeral ports, a long programming wait
/// (the iptables mode at 10,000 Services: minutes, ~130 probes a second)
/// left such entries on every ephemeral port: the check after it and wrk's
/// new connections to the same Service hung on them.
const BULK_PROBE_PORTS: std::ops::Range<u16> = 100..2_000;
/// How long the node's conntrack keeps a flow whose SYN was never answered
/// (`nf_conntrack_tcp_timeout_syn_sent`, 120 s by default), and a margin.
const UNANSWERED_FLOW_LIFETIME: Duration = Duration::from_secs(150);
/// How long the data path may take, after the bulk measurement saw the last
/// Service answer, to answer every other address checked before the
/// latency rounds (a mode may still be at work: the agent's sync of the
/// iptables mode at 10,000 Services goes on after the last Service's rules
/// are in): new connections, each given [`CHECK_CONNECT_TIMEOUT`].
pub const CHECK_PATIENCE: Duration = Duration::from_secs(30);
pub const CHECK_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Pause between probes after an endpoint change (the resolution).
const CHANGE_PROBE_PAUSE: Duration = Duration::from_micros(200);
/// An agent whose syncs failed this often while the Services were being
/// programmed is not going to make it (e.g. a map too small): stop waiting.
const FAILED_SYNCS: usize = 5;
/// How often the bulk measurement reads the agent's log for failed syncs.
const LOG_CHECK_EVERY: u32 = 100;
/// How long one endpoint change may take before the run fails.
const CHANGE_PATIENCE: Duration = Duration::from_secs(60);

/// One connection: the answering pod's name, or why none answered.
pub fn probe(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    probe_from(0, addr, timeout)
}

/// [`probe`] from local port `port` (0: an ephemeral one).
fn probe_from(port: u16, addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    let mut stream = sock::connect_from(port, addr, timeout).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    std::io::Write::write_all(&mut stream, b"hello\n").map_err(|e| e.to_string())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(|e| e.to_string())?;
    match answer.trim() {
        "" => Err("closed without an answer".into()),
        name => Ok(name.to_owned()),
    }
}

/// Probes `addr` with new connections (each given `timeout`) until one is
/// answered, for at most `patience`: a connection that is not answered in
/// time means "not yet", not a failure. The error says how often it was
/// tried and the last reason.
pub fn probe_patiently(addr: SocketAddr, timeout: Duration, patience: Duration) -> Result<String, String> {
    let started = Instant::now();
    let mut tries = 0u32;
    loop {
        tries += 1;
        match probe(addr, timeout) {
            Ok(name) => return Ok(name),
            Err(e) if started.elapsed() >= patience => {
                return Err(format!(
                    "not answered in {:.1} s ({tries} connections, each given {timeout:?}; the last: {e})",
                    started.elapsed().as_secs_f64()
                ));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The bulk measurement's local ports ([`BULK_PROBE_PORTS`]), taken in
/// turn, none again within [`UNANSWERED_FLOW_LIFETIME`] of its last use.
struct ProbePorts {
    ports: std::ops::Range<u16>,
    next: u16,
    last_used: Vec<Option<Instant>>,
}

impl ProbePorts {
    fn new(ports: std::ops::Range<u16>) -> Self {
        Self {
            next: ports.start,
            last_used: vec![None; ports.len()],
            ports,
        }
    }

    /// The next port to probe from at `now`, or how long until it may be
    /// used (then ask again).
    fn take(&mut self, now: Instant) -> Result<u16, Duration> {
        let port = self.next;
        let slot = &mut self.last_used[usize::from(port - self.ports.start)];
        if let Some(used) = *slot {
            let free_at = used + UNANSWERED_FLOW_LIFETIME;
            if now < free_at {
                return Err(free_at - now);
            }
        }
        *slot = Some(now);
        self.next = if port + 1 >= self.ports.end {
            self.ports.start
        } else {
            port + 1
        };
        Ok(port)
    }
}

/// The pause after an unanswered probe, `waited` into the measurement.
fn bulk_pause(waited: Duration) -> Duration {
    BULK_PROBE_PAUSE.max(waited / BULK_PROBE_BACKOFF)
}

/// How the N Services were programmed, in seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Programming {
    /// From the agent's last completed list (its log) to the last Service
    /// answering: source delivered -> data path answers.
    pub delivered_to_answer_s: Option<f64>,
    /// From starting the process to the last Service answering.
    pub start_to_answer_s: f64,
    /// The agent's own measure of the sync that programmed them (its log).
    pub sync_s: Option<f64>,
    /// Set when the last Service did not answer: how long it was given (the
    /// timeout, or less when the agent's syncs kept failing).
    #[serde(default)]
    pub timed_out_after_s: Option<f64>,
}

impl Programming {
    /// Delivered -> answering, or at least the time given if it timed out
    /// (`true`: a lower bound).
    pub fn seconds(&self) -> Option<(f64, bool)> {
        match (self.delivered_to_answer_s, self.timed_out_after_s) {
            (Some(s), _) => Some((s, false)),
            (None, Some(t)) => Some((t, true)),
            (None, None) => None,
        }
    }
}

/// The middle of `repeats` by delivered -> answering (the upper one of an
/// even count), a repeat not programmed in time counting as the slowest;
/// None if none was measured.
pub fn median(repeats: &[Programming]) -> Option<Programming> {
    let mut measured: Vec<&Programming> = repeats.iter().filter(|p| p.seconds().is_some()).collect();
    let key = |p: &Programming| match p.seconds() {
        Some((s, false)) => s,
        _ => f64::INFINITY,
    };
    measured.sort_by(|a, b| key(a).total_cmp(&key(b)));
    measured.get(measured.len() / 2).map(|p| (*p).clone())
}

/// Waits (at most `patience` from the agent's start) until `last` answers
/// from `ns`, each probe given `probe_timeout`, then reads the agent's log
/// for when the Services were delivered and synced. Running out of
/// patience is a result too.
pub fn wait_programmed(
    agent: &mut BenchAgent,
    ns: &Netns,
    last: SocketAddrV4,
    services: usize,
    (probe_timeout, patience): (Duration, Duration),
) -> Result<Programming> {
    let mut attempts = 0u32;
    let mut ports = ProbePorts::new(BULK_PROBE_PORTS);
    let probing_since = Instant::now();
    let answered_at = loop {
        let port = match ports.take(Instant::now()) {
            Ok(port) => port,
            Err(wait) => {
                std::thread::sleep(wait);
                continue;
            }
        };
        let attempt = SystemTime::now();
        if ns.run_in(|| probe_from(port, last.into(), probe_timeout))?.is_ok() {
            break attempt;
        }
        agent.alive()?;
        attempts += 1;
        let failing =
            attempts.is_multiple_of(LOG_CHECK_EVERY) && parse_log(&agent.log_text()).sync_failures >= FAILED_SYNCS;
        if failing || agent.started_at.elapsed() > patience {
            return Ok(Programming {
                delivered_to_answer_s: None,
                start_to_answer_s: agent.started_at.elapsed().as_secs_f64(),
                sync_s: None,
                timed_out_after_s: Some(agent.started_at.elapsed().as_secs_f64()),
            });
        }
        std::thread::sleep(bulk_pause(probing_since.elapsed()));
    };
    let start_to_answer_s = seconds_between(agent.started, answered_at).unwrap_or(0.0);
    // The log line of the sync may be written just after the data path
    // answered: give it a moment.
    let mut facts = parse_log(&agent.log_text());
    for _ in 0..50 {
        if facts.first_sync_with(services as u64).is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        facts = parse_log(&agent.log_text());
    }
    Ok(Programming {
        delivered_to_answer_s: facts.delivered().and_then(|at| seconds_between(at, answered_at)),
        start_to_answer_s,
        sync_s: facts.first_sync_with(services as u64),
        timed_out_after_s: None,
    })
}

fn seconds_between(from: SystemTime, to: SystemTime) -> Option<f64> {
    to.duration_since(from).ok().map(|d| d.as_secs_f64())
}

/// One endpoint change at a time: p50/p99 (in milliseconds) over the changes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EndpointChange {
    pub services: usize,
    pub changes: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    /// Every change, in order, in milliseconds.
    pub samples_ms: Vec<f64>,
}

/// A pod an endpoint can move to: its address and the name it answers with.
#[derive(Clone, Copy, Debug)]
pub struct EndpointPod<'a> {
    pub ip: std::net::Ipv4Addr,
    pub name: &'a str,
}

/// Moves the single endpoint of the change Service (at `addr`) between
/// `pods[0]` and `pods[1]`, `changes` times: from the write to the API
/// server until a new connection from `ns` is answered by the new pod.
pub fn endpoint_changes(
    api: &NodeApiServer,
    ns: &Netns,
    addr: SocketAddrV4,
    pods: [EndpointPod<'_>; 2],
    services: usize,
    changes: usize,
    progress: &dyn Fn(&str),
) -> Result<EndpointChange> {
    // It starts on pods[0] (see `ServiceSet::objects`); make sure.
    ns.run_in(|| wait_for_pod(addr, pods[0].name, Instant::now()))?
        .context("the change Service before the first change")?;
    let mut samples_ms = Vec::with_capacity(changes);
    for i in 0..changes {
        let to = pods[(i + 1) % 2];
        let written = Instant::now();
        api.apply(&crate::services::change_slice(to.ip))?;
        let took = ns
            .run_in(|| wait_for_pod(addr, to.name, written))?
            .with_context(|| format!("endpoint change {} of {changes}", i + 1))?;
        samples_ms.push(took.as_secs_f64() * 1e3);
        if i % 10 == 9 {
            progress(&format!("endpoint change {}/{changes}", i + 1));
        }
    }
    let summary = Summary::of(&samples_ms).context("no changes")?;
    Ok(EndpointChange {
        services,
        changes,
        p50_ms: percentile(&samples_ms, 50.0).unwrap_or(f64::NAN),
        p99_ms: percentile(&samples_ms, 99.0).unwrap_or(f64::NAN),
        min_ms: summary.min,
        max_ms: summary.max,
        samples_ms,
    })
}

/// Probes `addr` with new connections until `pod` answers; returns the
/// time since `since`.
fn wait_for_pod(addr: SocketAddrV4, pod: &str, since: Instant) -> Result<Duration> {
    let mut last = String::new();
    while since.elapsed() < CHANGE_PATIENCE {
        match probe(addr.into(), Duration::from_millis(200)) {
            Ok(name) if name == pod => return Ok(since.elapsed()),
            Ok(name) => last = format!("answered by {name}"),
            Err(e) => last = e,
        }
        std::thread::sleep(CHANGE_PROBE_PAUSE);
    }
    bail!("{addr} not answered by {pod} within {CHANGE_PATIENCE:?} (last: {last})")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn took(delivered: Option<f64>, timed_out: Option<f64>) -> Programming {
        Programming {
            delivered_to_answer_s: delivered,
            start_to_answer_s: 1.0,
            sync_s: None,
            timed_out_after_s: timed_out,
        }
    }

    #[test]
    fn the_median_repeat_counts_one_not_programmed_in_time_as_the_slowest() {
        let fast = took(Some(0.21), None);
        let middle = took(Some(0.26), None);
        let slow = took(Some(0.40), None);
        let late = took(None, Some(300.0));
        assert_eq!(
            median(&[slow.clone(), fast.clone(), middle.clone()]),
            Some(middle.clone())
        );
        assert_eq!(
            median(&[late.clone(), fast.clone(), middle.clone()]),
            Some(middle.clone())
        );
        assert_eq!(
            median(&[fast.clone(), late.clone()]),
            Some(late),
            "an even count: the upper one"
        );
        assert_eq!(
            median(&[took(None, None), fast.clone()]),
            Some(fast),
            "unmeasured ones are left out"
        );
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn probe_ports_come_round_only_after_conntrack_forgot_them() {
        let mut ports = ProbePorts::new(100..103);
        let t0 = Instant::now();
        let taken: Vec<u16> = (0..3)
            .map(|i| ports.take(t0 + Duration::from_secs(i)).unwrap())
            .collect();
        assert_eq!(taken, [100, 101, 102]);
        // Port 100 again, but too early: wait until its flow is forgotten.
        let early = t0 + Duration::from_secs(10);
        assert_eq!(
            ports.take(early),
            Err(UNANSWERED_FLOW_LIFETIME - Duration::from_secs(10))
        );
        assert_eq!(ports.take(t0 + UNANSWERED_FLOW_LIFETIME), Ok(100));
        assert_eq!(ports.take(t0 + UNANSWERED_FLOW_LIFETIME), Err(Duration::from_secs(1)));
    }

    /// Probes as fast as the pacing allows (each failing at once, the worst
    /// case): within any conntrack lifetime they need fewer ports than the
    /// bulk measurement has, so it never has to wait for one; and the pause
    /// stays a small share of the time waited.
    #[test]
    fn bulk_probe_pacing_fits_the_ports() {
        let mut times = Vec::new();
        let mut t = Duration::ZERO;
        while t < Duration::from_secs(600) {
            times.push(t);
            t += bulk_pause(t);
        }
        let most_in_a_lifetime = times
            .iter()
            .enumerate()
            .map(|(i, start)| {
                times[i..]
                    .iter()
                    .take_while(|&&u| u < *start + UNANSWERED_FLOW_LIFETIME)
                    .count()
            })
            .max()
            .unwrap();
        assert!(
            most_in_a_lifetime < BULK_PROBE_PORTS.len(),
            "{most_in_a_lifetime} probes within {UNANSWERED_FLOW_LIFETIME:?}, {} ports",
            BULK_PROBE_PORTS.len()
        );
        assert_eq!(bulk_pause(Duration::from_millis(300)), BULK_PROBE_PAUSE);
        assert_eq!(bulk_pause(Duration::from_secs(100)), Duration::from_millis(500));
    }
}
