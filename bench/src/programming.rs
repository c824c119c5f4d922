//! Programming time: how long from the source delivering the Services to
//! the data path answering for them, and from one endpoint change to the
//! data path sending new connections to the new endpoint.

use std::{
    io::Read,
    net::SocketAddrV4,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use testbed::netns::Netns;
use xproxy_tests::agent_harness::NodeApiServer;

use crate::{
    agent::{BenchAgent, parse_log},
    sock,
    stats::{Summary, percentile},
};

/// A probe of a Service that is not programmed yet gets no answer at all
/// (its ClusterIP is routed out of the node and dropped): give up on it
/// this soon and try again.
const PROBE_TIMEOUT: Duration = Duration::from_millis(5);
/// Pause between probes of the bulk measurement: the agent, not the
/// prober, should have the CPUs.
const BULK_PROBE_PAUSE: Duration = Duration::from_millis(2);
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
pub fn probe(addr: SocketAddrV4, timeout: Duration) -> Result<String, String> {
    let mut stream = sock::connect_from(0, addr, timeout).map_err(|e| e.to_string())?;
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

/// Waits (at most `patience` from the agent's start) until `last` answers
/// from `ns`, then reads the agent's log for when the Services were
/// delivered and synced. Running out of patience is a result too.
pub fn wait_programmed(
    agent: &mut BenchAgent,
    ns: &Netns,
    last: SocketAddrV4,
    services: usize,
    patience: Duration,
) -> Result<Programming> {
    let mut attempts = 0u32;
    let answered_at = loop {
        let attempt = SystemTime::now();
        if ns.run_in(|| probe(last, PROBE_TIMEOUT))?.is_ok() {
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
        std::thread::sleep(BULK_PROBE_PAUSE);
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
        match probe(addr, Duration::from_millis(200)) {
            Ok(name) if name == pod => return Ok(since.elapsed()),
            Ok(name) => last = format!("answered by {name}"),
            Err(e) => last = e,
        }
        std::thread::sleep(CHANGE_PROBE_PAUSE);
    }
    bail!("{addr} not answered by {pod} within {CHANGE_PATIENCE:?} (last: {last})")
}
