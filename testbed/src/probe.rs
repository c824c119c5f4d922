//! The probe engine: requests sent from inside a namespace of a bed, what
//! they must observe (every backend answering, counted per backend;
//! rejections at once; an outcome per request, compared with what the same
//! requests did without a proxy), and a list of checks that reports every
//! failure at once instead of stopping at the first. Shared by the
//! end-to-end tests of the programs, of the agent in every mode, of two
//! nodes, and by the agent's own tests.

use std::{
    collections::BTreeMap,
    fmt::Display,
    io,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    time::{Duration, Instant},
};

use anyhow::{Result, anyhow, bail, ensure};

use crate::{
    netns::{self, Netns},
    topology::{BACKENDS, NODE_IP, TARGET_PORT, Topology},
};

/// The transport of a probe (and of a Service port in [`crate::fixtures`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// As the Kubernetes API spells it.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }
}

/// Requests per "every backend answers" check: with 3 equally likely
/// backends, the chance that one never answers 60 requests is
/// 3 * (2/3)^60 < 1e-10.
pub const REQUESTS: usize = 60;
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A rejection must arrive much sooner than this...
pub const REJECT_TIMEOUT: Duration = Duration::from_secs(5);
/// ...namely within this.
pub const REJECT_AT_ONCE: Duration = Duration::from_secs(1);
/// Where [`check_non_service`] expects a server in the node namespace
/// answering "node" (start it with `topo.node.serve_tcp(NODE_SERVER_PORT, "node")`).
pub const NODE_SERVER_PORT: u16 = 8080;
/// How long a request of [`observe`] waits: long enough for any answer in
/// the beds, short because some get none.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

pub const PROTOCOLS: [Protocol; 2] = [Protocol::Tcp, Protocol::Udp];

pub fn proto_name(protocol: Protocol) -> &'static str {
    protocol.name()
}

/// The backends' names (what they answer with).
pub fn backend_names() -> Vec<&'static str> {
    BACKENDS.iter().map(|(name, _)| *name).collect()
}

/// One request in the calling thread's namespace: a TCP connection or a UDP
/// datagram; the answer without surrounding whitespace.
pub fn request(protocol: Protocol, addr: impl Into<SocketAddr>, timeout: Duration) -> io::Result<String> {
    let addr = addr.into();
    match protocol {
        Protocol::Tcp => netns::tcp_request(addr, timeout),
        Protocol::Udp => netns::udp_request(addr, timeout),
    }
}

/// [`request`] from the local address `source` (`None`: the one the route
/// picks), for a second client in one namespace.
pub fn request_from(
    source: Option<Ipv4Addr>,
    protocol: Protocol,
    addr: impl Into<SocketAddr>,
    timeout: Duration,
) -> io::Result<String> {
    let addr = addr.into();
    let (Some(source), SocketAddr::V4(addr)) = (source, addr) else {
        return match source {
            None => request(protocol, addr, timeout),
            Some(source) => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("source {source} is IPv4, {addr} is not"),
            )),
        };
    };
    match protocol {
        Protocol::Tcp => netns::tcp_request_from_addr(source, addr, timeout),
        Protocol::Udp => netns::udp_request_from_addr(source, addr, timeout),
    }
}

/// Sends `count` requests from `from` to `addr`: every one must be
/// answered, only by `backends`, and each of `backends` must answer.
/// Returns the answers per backend.
pub fn expect_backends(
    from: &Netns,
    protocol: Protocol,
    addr: impl Into<SocketAddr>,
    backends: &[&str],
    count: usize,
) -> Result<String> {
    expect_backends_from(from, None, protocol, addr, backends, count)
}

/// [`expect_backends`] from the local address `source` of `from` (`None`:
/// the one the route picks).
pub fn expect_backends_from(
    from: &Netns,
    source: Option<Ipv4Addr>,
    protocol: Protocol,
    addr: impl Into<SocketAddr>,
    backends: &[&str],
    count: usize,
) -> Result<String> {
    let addr = addr.into();
    let answers = from.run_in(|| -> Result<Vec<String>> {
        let mut answers = Vec::with_capacity(count);
        for i in 0..count {
            let started = Instant::now();
            match request_from(source, protocol, addr, REQUEST_TIMEOUT) {
                Ok(answer) => answers.push(answer),
                Err(e) => bail!(
                    "request {} of {count} failed after {:?}: {e} ({} answered before: {answers:?})",
                    i + 1,
                    started.elapsed(),
                    answers.len()
                ),
            }
        }
        Ok(answers)
    })??;
    let mut counts: BTreeMap<&str, usize> = backends.iter().map(|name| (*name, 0)).collect();
    for answer in &answers {
        match counts.get_mut(answer.as_str()) {
            Some(n) => *n += 1,
            None => bail!("answer {answer:?} is not one of {backends:?} (answers: {answers:?})"),
        }
    }
    let missing: Vec<_> = counts.iter().filter(|(_, n)| **n == 0).map(|(name, _)| *name).collect();
    ensure!(
        missing.is_empty(),
        "{missing:?} never answered in {count} requests: {counts:?}"
    );
    Ok(format!("{count} answers {counts:?}"))
}

/// [`expect_backends`] with [`REQUESTS`] requests and all three backends.
pub fn expect_all_backends(from: &Netns, protocol: Protocol, addr: impl Into<SocketAddr>) -> Result<String> {
    expect_backends(from, protocol, addr, &backend_names(), REQUESTS)
}

/// The Service has no backends: the connection (TCP) or the connected
/// socket's receive (UDP, after an ICMP port unreachable) must fail with
/// ECONNREFUSED, at once.
pub fn expect_refused(from: &Netns, protocol: Protocol, addr: impl Into<SocketAddr>) -> Result<String> {
    expect_rejected(from, protocol, addr, io::ErrorKind::ConnectionRefused)
}

/// The request must fail with an error of `kind`, at once.
pub fn expect_rejected(
    from: &Netns,
    protocol: Protocol,
    addr: impl Into<SocketAddr>,
    kind: io::ErrorKind,
) -> Result<String> {
    let addr = addr.into();
    let (result, elapsed) = from.run_in(|| {
        let started = Instant::now();
        let result = match protocol {
            Protocol::Tcp => netns::tcp_connect(addr, REJECT_TIMEOUT).map(|s| format!("connected: {s:?}")),
            Protocol::Udp => netns::udp_request(addr, REJECT_TIMEOUT).map(|a| format!("answer {a:?}")),
        };
        (result, started.elapsed())
    })?;
    match result {
        Err(e) if e.kind() == kind => {
            ensure!(
                elapsed < REJECT_AT_ONCE,
                "{kind:?}, but only after {elapsed:?} (expected < {REJECT_AT_ONCE:?})"
            );
            Ok(format!("{kind:?} after {elapsed:?}"))
        }
        Err(e) => Err(anyhow!("expected {kind:?}, got \"{e}\" after {elapsed:?}")),
        Ok(what) => Err(anyhow!("expected {kind:?}, got {what}")),
    }
}

/// Makes the namespace pick local ports from `first..first + 10000` for
/// new connections and sockets: flows opened after this never share a
/// 5-tuple with one opened before (whose conntrack entry, with or without
/// a NAT, would decide where the packets go).
pub fn fresh_ports(ns: &Netns, first: u16) -> Result<()> {
    fresh_port_range(ns, first, 10_000)
}

/// [`fresh_ports`] from `first..first + count`, for tests with more stages
/// than 10000-port ranges fit.
pub fn fresh_port_range(ns: &Netns, first: u16, count: u16) -> Result<()> {
    let last = count.checked_sub(1).and_then(|n| first.checked_add(n));
    let Some(last) = last.filter(|_| first >= 1024) else {
        bail!("no port range of {count} from {first}");
    };
    // Kubernetes' advice for nodes whose ephemeral range overlaps the
    // NodePort range: reserve it. The ebpf programs no longer need it for
    // the node's connections to Services (they find a reply's conntrack
    // entry before they look for a frontend; see the packet test
    // replies_to_a_node_port_numbered_source_port_are_replies), but a
    // connection from, say, port 30791 to anything else, which they do not
    // track, still gets its replies to NODE_IP:30791 taken for NodePort
    // traffic (the kernel modes' NAT rules see only a connection's first
    // packet and do not).
    ns.sysctl("net.ipv4.ip_local_reserved_ports", "30000-32767")?;
    ns.sysctl("net.ipv4.ip_local_port_range", &format!("{first} {last}"))
}

/// How one request ended, coarsely enough to compare runs: what a request
/// does without any proxy is the baseline the scenarios compare with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Answered(String),
    /// ECONNREFUSED (a TCP RST, or an ICMP port unreachable for UDP).
    Refused,
    /// Nothing came back within the timeout.
    NoAnswer,
    /// Any other error, by kind.
    Failed(String),
}

impl Outcome {
    pub fn of(result: io::Result<String>) -> Self {
        match result {
            Ok(answer) => Outcome::Answered(answer),
            Err(e) => match e.kind() {
                io::ErrorKind::ConnectionRefused => Outcome::Refused,
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Outcome::NoAnswer,
                other => Outcome::Failed(format!("{other:?}")),
            },
        }
    }
}

/// One request from `from` to `addr`, waiting at most `timeout`.
pub fn outcome(from: &Netns, protocol: Protocol, addr: impl Into<SocketAddr>, timeout: Duration) -> Result<Outcome> {
    let addr = addr.into();
    Ok(Outcome::of(from.run_in(|| request(protocol, addr, timeout))?))
}

/// Expects a single request from `from` to `addr` to end as `expected`.
pub fn expect_outcome(
    from: &Netns,
    protocol: Protocol,
    addr: impl Into<SocketAddr>,
    expected: &Outcome,
) -> Result<String> {
    expect_outcome_from(from, None, protocol, addr, expected)
}

/// [`expect_outcome`] from the local address `source` of `from` (`None`:
/// the one the route picks).
pub fn expect_outcome_from(
    from: &Netns,
    source: Option<Ipv4Addr>,
    protocol: Protocol,
    addr: impl Into<SocketAddr>,
    expected: &Outcome,
) -> Result<String> {
    let addr = addr.into();
    let got = Outcome::of(from.run_in(|| request_from(source, protocol, addr, REQUEST_TIMEOUT))?);
    ensure!(got == *expected, "expected {expected:?}, got {got:?}");
    Ok(format!("{got:?}"))
}

/// Collects the outcome of every check so one failure does not hide the
/// others; [`Checks::finish`] panics if any failed.
pub struct Checks {
    label: String,
    failures: Vec<String>,
}

impl Checks {
    pub fn new(label: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            failures: Vec::new(),
        }
    }

    pub fn check(&mut self, what: &str, result: Result<String>) {
        match result {
            Ok(detail) => eprintln!("[{}] ok: {what}: {detail}", self.label),
            Err(e) => {
                eprintln!("[{}] FAILED: {what}: {e:#}", self.label);
                self.failures.push(format!("{what}: {e:#}"));
            }
        }
    }

    /// Whether every check so far passed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// The failures so far, one a line.
    pub fn failures(&self) -> String {
        self.failures.join("\n  ")
    }

    /// Panics if a check failed.
    pub fn finish(self) {
        assert!(
            self.failures.is_empty(),
            "[{}] {} check(s) failed:\n  {}",
            self.label,
            self.failures.len(),
            self.failures.join("\n  ")
        );
    }
}

/// Traffic that is no Service's passes untouched: the client pings the
/// node and reaches a server in it ([`NODE_SERVER_PORT`]) and a pod
/// directly; the client pod pings a backend.
pub fn check_non_service(topo: &Topology, checks: &mut Checks) {
    checks.check(
        "client pings NODE_IP",
        topo.client
            .ping(NODE_IP, REQUEST_TIMEOUT)
            .and_then(|r| Ok(format!("rtt {:?}", r?))),
    );
    checks.check(
        "client TCP to a server in the node namespace",
        topo.client
            .tcp_request(SocketAddrV4::new(NODE_IP, NODE_SERVER_PORT), REQUEST_TIMEOUT)
            .and_then(|r| {
                let answer = r?;
                ensure!(answer == "node", "answered {answer:?}, expected \"node\"");
                Ok(answer)
            }),
    );
    let pod = &topo.backends[0];
    checks.check(
        &format!("client TCP straight to {} (routed by the node)", pod.name),
        topo.client
            .tcp_request(SocketAddrV4::new(pod.ip, TARGET_PORT), REQUEST_TIMEOUT)
            .and_then(|r| {
                let answer = r?;
                ensure!(answer == pod.name, "answered {answer:?}, expected {:?}", pod.name);
                Ok(answer)
            }),
    );
    checks.check(
        &format!("client pod pings {}", pod.name),
        topo.client_pod
            .ns
            .ping(pod.ip, REQUEST_TIMEOUT)
            .and_then(|r| Ok(format!("rtt {:?}", r?))),
    );
}

/// How a request ended, for failure messages.
pub fn error_kind(e: &io::Error) -> String {
    format!("{:?}: {e}", e.kind())
}

/// Whether `answer` is the name of a backend of the one-node bed.
pub fn is_backend_name(answer: &str) -> bool {
    BACKENDS.iter().any(|(name, _)| *name == answer)
}

/// Expects `addr` to refuse a TCP connection from `from` at once
/// (ECONNREFUSED: a reject by the programs or the node's kernel).
pub fn refused(from: &Netns, addr: SocketAddrV4) -> Result<(), String> {
    match from.run_in(|| netns::tcp_connect(addr, Duration::from_millis(500))) {
        Err(e) => Err(format!("{e:#}")),
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(()),
        Ok(Err(e)) => Err(format!("{addr}: expected ECONNREFUSED, got {}", error_kind(&e))),
        Ok(Ok(_)) => Err(format!("{addr} accepted the connection")),
    }
}

/// Expects a TCP request from `from` to `addr` to be answered by a backend
/// of the one-node bed.
pub fn answers(from: &Netns, addr: SocketAddrV4) -> Result<String, String> {
    match from.run_in(|| netns::tcp_request(addr, Duration::from_millis(500))) {
        Err(e) => Err(format!("{e:#}")),
        Ok(Ok(name)) if is_backend_name(&name) => Ok(name),
        Ok(Ok(other)) => Err(format!("{addr} answered {other:?}")),
        Ok(Err(e)) => Err(format!("{addr}: {}", error_kind(&e))),
    }
}

// ---------------------------------------------------------------------------
// Stages: local ports of their own.

/// Local ports for the stages' flows of [`Stages`]: the tests keep their
/// fixed local ports outside this range.
pub const STAGE_PORTS: std::ops::Range<u16> = 10_000..60_000;

/// Hands each of `count` stages of a test a range of local ports of its own for the
/// client, the client pod and the node: no request of a stage shares a
/// 5-tuple (and so a conntrack entry, whose NAT would decide where the
/// packets go) with one of an earlier stage.
pub struct Stages {
    next: u16,
    width: u16,
}

impl Stages {
    pub fn new(count: usize) -> Self {
        let span = usize::from(STAGE_PORTS.end - STAGE_PORTS.start);
        // Even, so each range starts even and ends odd, as the kernel likes.
        let width = u16::try_from(span / count.max(1)).unwrap_or(u16::MAX) & !1;
        Self {
            next: STAGE_PORTS.start,
            width,
        }
    }

    /// Makes the client, the client pod and the node open flows from the
    /// next range from now on.
    pub fn next(&mut self, topo: &Topology) -> Result<()> {
        ensure!(
            self.next <= STAGE_PORTS.end - self.width,
            "more stages than port ranges planned"
        );
        for ns in [&topo.client, &topo.client_pod.ns, &topo.node] {
            fresh_port_range(ns, self.next, self.width)?;
        }
        self.next += self.width;
        Ok(())
    }
}

/// Where a probe of the one-node bed is sent from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// The client outside the node ([`crate::topology::CLIENT_IP`]).
    Client,
    /// The pod that is no backend ([`crate::topology::CLIENT_POD`]).
    ClientPod,
    /// A process of the node itself.
    Node,
}

impl Place {
    pub fn ns(self, topo: &Topology) -> &Netns {
        match self {
            Place::Client => &topo.client,
            Place::ClientPod => &topo.client_pod.ns,
            Place::Node => &topo.node,
        }
    }
}

// ---------------------------------------------------------------------------
// Baselines: what requests do without a proxy, compared later.

/// One request of a baseline, from a place `P` of a bed (which namespace
/// that is, the caller says when the probes are sent).
#[derive(Clone, Copy, Debug)]
pub struct Probe<P> {
    pub from: P,
    pub protocol: Protocol,
    pub to: SocketAddr,
    /// To a Service's frontend: without a proxy nothing answers it.
    pub service: bool,
}

impl<P: std::fmt::Debug> Display for Probe<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?} -> {}", self.protocol.name(), self.from, self.to)
    }
}

/// Sends every probe once, all at the same time, each from the namespace
/// `ns` names for its place, waiting at most [`PROBE_TIMEOUT`].
pub fn observe<'a, P: Copy + Sync>(
    probes: &[Probe<P>],
    ns: impl Fn(P) -> Result<&'a Netns> + Sync,
) -> Result<Vec<Outcome>> {
    let ns = &ns;
    std::thread::scope(|scope| {
        let handles: Vec<_> = probes
            .iter()
            .map(|p| scope.spawn(move || outcome(ns(p.from)?, p.protocol, p.to, PROBE_TIMEOUT)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a probe thread panicked")))
            .collect()
    })
}

/// What every probe did without a proxy.
pub struct Baseline<P> {
    probes: Vec<Probe<P>>,
    outcomes: Vec<Outcome>,
}

impl<P: Copy + Sync + std::fmt::Debug> Baseline<P> {
    /// Sends `probes` (see [`observe`]) and keeps their outcomes. Fails
    /// unless the bed is sane: no Service answers without a proxy,
    /// everything else does.
    pub fn take<'a>(label: &str, probes: Vec<Probe<P>>, ns: impl Fn(P) -> Result<&'a Netns> + Sync) -> Result<Self> {
        let outcomes = observe(&probes, ns)?;
        for (probe, outcome) in probes.iter().zip(&outcomes) {
            eprintln!("[{label}] without a proxy: {probe}: {outcome:?}");
            let answered = matches!(outcome, Outcome::Answered(_));
            ensure!(
                answered != probe.service,
                "the test bed without a proxy: {probe} ended {outcome:?}"
            );
        }
        Ok(Self { probes, outcomes })
    }

    /// Ok if every probe ends as without a proxy; else the ones that did not.
    pub fn same<'a>(&self, ns: impl Fn(P) -> Result<&'a Netns> + Sync) -> Result<String> {
        self.same_where(|_| true, ns)
    }

    /// Ok if the probes to what is no Service's end as without a proxy.
    pub fn same_beside_services<'a>(&self, ns: impl Fn(P) -> Result<&'a Netns> + Sync) -> Result<String> {
        self.same_where(|p| !p.service, ns)
    }

    fn same_where<'a>(
        &self,
        chosen: impl Fn(&Probe<P>) -> bool,
        ns: impl Fn(P) -> Result<&'a Netns> + Sync,
    ) -> Result<String> {
        let (probes, baseline): (Vec<Probe<P>>, Vec<&Outcome>) = self
            .probes
            .iter()
            .zip(&self.outcomes)
            .filter(|(p, _)| chosen(p))
            .map(|(p, o)| (*p, o))
            .unzip();
        let now = observe(&probes, ns)?;
        let differ: Vec<String> = probes
            .iter()
            .zip(baseline.into_iter().zip(&now))
            .filter(|(_, (before, now))| before != now)
            .map(|(p, (before, now))| format!("{p}: {now:?}, without a proxy {before:?}"))
            .collect();
        ensure!(differ.is_empty(), "\n    {}", differ.join("\n    "));
        Ok(format!("{} requests end as without a proxy", probes.len()))
    }
}
