//! One bench run: every mode at every number of Services, the scale runs,
//! the per-packet part; everything set up and torn down here.
//!
//! Per mode: a fresh topology (so no conntrack entry of another mode is
//! left), a check that the mode can run here at all (`xproxy run` exits 6
//! if not: the mode is skipped with its reason), the no-proxy baseline,
//! then per number of Services N: a fresh API server holding the N
//! Services, a fresh agent (fresh pins: its conntrack is empty), and the
//! measurements while it runs.

use std::{
    net::{SocketAddr, SocketAddrV4},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use testbed::topology::{NODE_IP, NODE_IP6};
use testbed::{
    agent_bed::{NodeApiServer, TempDir},
    fixtures::{node_dual_stack as node, yaml_documents},
    netns::Netns,
};

use crate::{
    agent::{self, BenchAgent, Started},
    latency::{self, Latency, Target},
    memory, packet_cost,
    plan::{Plan, ScalePoint},
    program_time,
    programming::{self, EndpointPod},
    progress::Progress,
    results::{
        Baseline, BaselinePaths, Ipv6Latency, MANIFEST_FILE_SERVICES, ModeResult, ModeStatus, Parameters, Run,
        RunLatency, RunThroughput, ScaleRun, ScaleSource,
    },
    services::{self, CHANGE_CLUSTER_IP, PORT, ServiceSet},
    throughput,
    topology::{self, BenchTopology, CniMasquerade, pod_ip, pod_name},
};

/// What [`run`] produced, besides the parts' timings.
pub struct Outcome {
    pub modes: Vec<ModeResult>,
    pub scale: Vec<ScaleRun>,
    pub per_packet: Option<crate::results::PerPacket>,
}

pub struct Runner<'a> {
    plan: &'a Plan,
    xproxy: PathBuf,
    progress: &'a Progress,
    scratch: TempDir,
    wrk: bool,
}

/// The steps of the progress bar.
pub fn steps(plan: &Plan) -> u64 {
    let mode_steps = if plan.mode_runs {
        plan.modes.len() * (plan.services.len() + 1)
    } else {
        0
    };
    (mode_steps + plan.scale.len() + usize::from(plan.per_packet)) as u64
}

impl<'a> Runner<'a> {
    pub fn new(plan: &'a Plan, xproxy: &Path, progress: &'a Progress) -> Result<Self> {
        let wrk = throughput::wrk_available();
        if !wrk {
            progress.say("wrk is not installed (apt-get install wrk): no throughput is measured");
        }
        Ok(Self {
            plan,
            xproxy: xproxy.to_owned(),
            progress,
            scratch: TempDir::new("bench")?,
            wrk,
        })
    }

    pub fn parameters(&self) -> Parameters {
        let p = self.plan;
        Parameters {
            quick: p.quick,
            modes: p.modes.clone(),
            services: p.services.clone(),
            seed: p.seed,
            endpoints_per_service: (services::MIN_ENDPOINTS, services::MAX_ENDPOINTS),
            backend_pods: services::PODS,
            node_port_every: services::NODE_PORT_EVERY,
            latency_connections: p.connections,
            latency_rounds: p.rounds,
            wrk: self.wrk.then(|| p.wrk.clone()),
            endpoint_changes: p.changes,
            endpoint_change_services: p.change_at,
            probe_timeout_ms: u64::try_from(p.probe_timeout.as_millis()).unwrap_or(u64::MAX),
            server_threads: topology::server_workers(),
            agent_config: agent::CONFIG.to_owned(),
            paths: vec![
                (
                    "ClusterIP path".into(),
                    "the client pod (10.244.0.100) -> ClusterIP:80 of the Service, through the node".into(),
                ),
                (
                    "NodePort path".into(),
                    "the outside client (172.30.0.1) -> 172.30.0.2:NodePort, through the node's uplink".into(),
                ),
                (
                    "IPv6 paths".into(),
                    "the same clients (fd00:244::64, fd00:30::1) -> the last Service's IPv6 ClusterIP:80 and \
                     [fd00:30::2]:NodePort (the last Service is dual-stack; its IPv6 endpoints are the same pods)"
                        .into(),
                ),
                (
                    "baseline, direct".into(),
                    "the same clients -> an endpoint's address of the last Service, no Service involved".into(),
                ),
            ],
        }
    }

    pub fn run(&self) -> Outcome {
        let modes = if self.plan.mode_runs {
            self.plan.modes.iter().map(|mode| self.mode(mode)).collect()
        } else {
            Vec::new()
        };
        let scale = self.scale_runs();
        let per_packet = self.plan.per_packet.then(|| {
            let result = self.progress.part("per-packet (BPF_PROG_TEST_RUN)", || {
                packet_cost::measure(self.plan.quick, &|m| self.progress.message(m))
            });
            self.progress.step();
            result
        });
        Outcome {
            modes,
            scale,
            per_packet,
        }
    }

    fn say(&self, line: &str) {
        self.progress.say(line);
    }

    // -----------------------------------------------------------------------
    // One mode.

    fn mode(&self, mode: &str) -> ModeResult {
        let mut result = ModeResult {
            mode: mode.to_owned(),
            status: ModeStatus::Ran,
            baseline: None,
            runs: Vec::new(),
        };
        match self.available(mode) {
            Ok(None) => {}
            Ok(Some(reason)) => {
                self.say(&format!("{mode}: skipped: {reason}"));
                result.status = ModeStatus::Skipped { reason };
                self.progress.step();
                return result;
            }
            Err(e) => {
                result.status = ModeStatus::Skipped {
                    reason: format!("the agent did not start: {e:#}"),
                };
                return result;
            }
        }
        // A node of its own for every N: nothing of one agent is left for
        // the next (conntrack entries, rules), and no cleanup has to run.
        let mut gave_up: Option<String> = None;
        for (i, &n) in self.plan.services.iter().enumerate() {
            let started = std::time::Instant::now();
            let mut run = empty_run(n, self.plan.seed);
            if let Some(why) = &gave_up {
                run.note = Some(why.clone());
            } else {
                match self
                    .progress
                    .part(&format!("{mode} at {n} Services: topology"), BenchTopology::build)
                {
                    Ok(topo) => {
                        if i == 0 {
                            self.measure_baseline(&topo, mode, &mut result);
                        }
                        if let Err(e) = self.measure(&topo, mode, &mut run) {
                            self.say(&format!("{mode} at {n} Services FAILED: {e:#}"));
                            run.error = Some(format!("{e:#}"));
                        }
                    }
                    Err(e) => run.error = Some(format!("building the topology: {e:#}")),
                }
                if let Some(timeout) = run.programming.as_ref().and_then(|p| p.timed_out_after_s) {
                    gave_up = Some(format!(
                        "not measured: {n} Services were not programmed within {timeout:.0} s"
                    ));
                }
            }
            run.seconds = started.elapsed().as_secs_f64();
            result.runs.push(run);
            self.progress.step();
        }
        result
    }

    /// The no-proxy baseline, in `topo` before any agent ran there.
    fn measure_baseline(&self, topo: &BenchTopology, mode: &str, result: &mut ModeResult) {
        match self
            .progress
            .part(&format!("{mode}: no-proxy baseline"), || self.baseline(topo))
        {
            Ok(b) => result.baseline = Some(b),
            Err(e) => self.say(&format!("{mode}: baseline failed: {e:#}")),
        }
        self.progress.step();
    }

    /// `None` if `mode` runs here; else why not.
    fn available(&self, mode: &str) -> Result<Option<String>> {
        let topo = BenchTopology::build()?;
        let api = NodeApiServer::start(&topo.node)?;
        api.apply(&node())?;
        let kubeconfig = self.scratch.path().join("kubeconfig-empty.yaml");
        api.server().write_kubeconfig(&kubeconfig)?;
        let source = agent::Source::Kubeconfig(&kubeconfig);
        match BenchAgent::start(&self.xproxy, &topo.node, mode, source, self.scratch.path(), true)? {
            Started::Running(mut agent) => {
                agent.stop(libc::SIGTERM);
                Ok(None)
            }
            Started::Unavailable(reason) => Ok(Some(match mode {
                "ipvs" => format!(
                    "this host's kernel has no IPVS (`xproxy run` exited 6: {reason}); `cargo xtask bench \
                     --vm` measures it beside the ebpf and iptables modes in a Debian 6.1 guest"
                ),
                _ => format!("`xproxy run` exited 6 (mode unavailable): {reason}"),
            })),
        }
    }

    /// Straight to pod-1's address from both clients, on the bare node and
    /// with a CNI's masquerade rule, the two alternating round by round.
    fn baseline(&self, topo: &BenchTopology) -> Result<Baseline> {
        let pod = SocketAddr::from((pod_ip(1), services::TARGET_PORT));
        // Own local ports for each of the four: a CNI round's kernel
        // conntrack entries must not meet a later round's connections.
        let mut targets: Vec<Target> = (0..4).map(|slot| Target::new(pod, slot, 4)).collect();
        let needed = self.plan.rounds * self.plan.connections;
        if needed > targets[0].capacity() {
            bail!("{needed} baseline connections per path would reuse local ports: fewer rounds or connections");
        }
        let clients = [&topo.client_pod.ns, &topo.client];
        let mut rounds: [Vec<latency::Round>; 4] = Default::default();
        let mut one_round = |i: usize, r: usize, setting: &str| -> Result<()> {
            let target = &mut targets[i];
            self.progress.message(&format!(
                "baseline round {r}/{}: {}, {setting}",
                self.plan.rounds, target.addr
            ));
            rounds[i].push(latency::round(clients[i % 2], target, self.plan.connections)?);
            Ok(())
        };
        for r in 1..=self.plan.rounds {
            one_round(0, r, "bare node")?;
            one_round(1, r, "bare node")?;
            let cni = CniMasquerade::install(&topo.node)?;
            one_round(2, r, "CNI masquerade")?;
            one_round(3, r, "CNI masquerade")?;
            cni.remove()?;
        }
        let [pod_bare, client_bare, pod_cni, client_cni] = rounds.map(|r| Latency::of(&r));
        Ok(Baseline {
            bare: BaselinePaths {
                clusterip_path: pod_bare?,
                nodeport_path: client_bare?,
            },
            cni_masquerade: Some(BaselinePaths {
                clusterip_path: pod_cni?,
                nodeport_path: client_cni?,
            }),
        })
    }

    // -----------------------------------------------------------------------
    // One mode at one N.

    fn start_api(&self, topo: &BenchTopology, set: &ServiceSet) -> Result<(NodeApiServer, PathBuf)> {
        let api = NodeApiServer::start(&topo.node)?;
        api.apply(&node())?;
        for object in set.objects(pod_ip(0)) {
            api.apply(&object)?;
        }
        let kubeconfig = self.scratch.path().join(format!("kubeconfig-{}.yaml", set.len()));
        api.server()
            .write_kubeconfig(&kubeconfig)
            .context("writing the kubeconfig")?;
        Ok((api, kubeconfig))
    }

    /// The Services of `set` (and the node's Node) as YAML files of
    /// [`MANIFEST_FILE_SERVICES`] Services each, in a fresh directory.
    fn write_manifests(&self, set: &ServiceSet) -> Result<PathBuf> {
        let dir = self.scratch.path().join(format!("manifests-{}", set.len()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let write = |name: String, objects: &[serde_json::Value]| {
            let path = dir.join(name);
            std::fs::write(&path, yaml_documents(objects)).with_context(|| format!("writing {}", path.display()))
        };
        write("node.yaml".into(), &[node()])?;
        // A Service and its EndpointSlice are next to each other.
        for (i, file) in set.objects(pod_ip(0)).chunks(2 * MANIFEST_FILE_SERVICES).enumerate() {
            write(format!("services-{i:03}.yaml"), file)?;
        }
        Ok(dir)
    }

    fn start_agent(&self, topo: &BenchTopology, mode: &str, source: agent::Source<'_>) -> Result<BenchAgent> {
        match BenchAgent::start(&self.xproxy, &topo.node, mode, source, self.scratch.path(), false)? {
            Started::Running(agent) => Ok(*agent),
            Started::Unavailable(reason) => bail!("the mode became unavailable: {reason}"),
        }
    }

    fn measure(&self, topo: &BenchTopology, mode: &str, run: &mut Run) -> Result<()> {
        let n = run.services;
        let label = format!("{mode} at {n} Services");
        let set = ServiceSet::generate(n, self.plan.seed)?;
        let (api, kubeconfig) = self.progress.part(&format!("{label}: loading the API server"), || {
            self.start_api(topo, &set)
        })?;
        let mut agent = self.start_agent(topo, mode, agent::Source::Kubeconfig(&kubeconfig))?;
        let outcome = self.measure_with_agent(topo, &api, &mut agent, &set, &label, run);
        if let Err(e) = outcome {
            let log = agent.log_text();
            let tail: Vec<&str> = log
                .lines()
                .rev()
                .take(20)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            bail!("{e:#}\nthe agent's log (last lines):\n{}", tail.join("\n"));
        }
        // A sync that outlasts the probe logs its time later.
        if let Some(p) = run.programming.as_mut()
            && p.sync_s.is_none()
        {
            p.sync_s = agent::parse_log(&agent.log_text()).first_sync_with(n as u64 + 1);
        }
        // A sync that timed out is still running: stop it at once.
        let timed_out = run.programming.as_ref().is_some_and(|p| p.timed_out_after_s.is_some());
        self.progress.part(&format!("{label}: stopping"), || {
            agent.stop(if timed_out { libc::SIGKILL } else { libc::SIGTERM });
            drop(api);
        });
        Ok(())
    }

    fn measure_with_agent(
        &self,
        topo: &BenchTopology,
        api: &NodeApiServer,
        agent: &mut BenchAgent,
        set: &ServiceSet,
        label: &str,
        run: &mut Run,
    ) -> Result<()> {
        let n = set.len();
        let (first, last) = (set.first(), set.last());
        let cluster = |s: &services::BenchService| SocketAddrV4::new(s.cluster_ip, PORT);
        let node_port = |s: &services::BenchService| -> Result<SocketAddrV4> {
            Ok(SocketAddrV4::new(NODE_IP, s.node_port.context("a NodePort")?))
        };

        let programming = self.progress.part(&format!("{label}: programming"), || {
            programming::wait_programmed(
                agent,
                &topo.client_pod.ns,
                cluster(last),
                n + 1,
                (self.plan.probe_timeout, self.plan.program_timeout),
            )
        })?;
        let timed_out = programming.timed_out_after_s;
        self.say(&format!(
            "{label}: delivered -> answering {}, agent's sync {}{}",
            fmt_s(programming.delivered_to_answer_s),
            fmt_s(programming.sync_s),
            timed_out.map_or(String::new(), |t| format!(": NOT PROGRAMMED within {t:.0} s"))
        ));
        run.programming = Some(programming);
        if timed_out.is_some() {
            run.note = sync_failure(agent);
            return Ok(());
        }

        let direct = SocketAddrV4::new(last.endpoints[0].ip, services::TARGET_PORT);
        let mut addrs: Vec<(&Netns, SocketAddr)> = vec![
            (&topo.client_pod.ns, cluster(first).into()),
            (&topo.client_pod.ns, cluster(last).into()),
            (&topo.client_pod.ns, direct.into()),
            (&topo.client, node_port(first)?.into()),
            (&topo.client, node_port(last)?.into()),
            (&topo.client, direct.into()),
        ];
        // Every address answers before the rounds start (the last Service
        // did, in the bulk measurement; a mode may still be at work on the
        // others).
        for (ns, addr) in &addrs {
            answers(ns, *addr, programming::CHECK_PATIENCE)?;
        }
        // The dual-stack last Service over IPv6: measured where it answers,
        // a note where not (the IPv4 figures stand either way).
        let ipv6 = ipv6_targets(topo, last)?;
        match ipv6.iter().try_for_each(|(ns, addr)| answers(ns, *addr, IPV6_PATIENCE)) {
            Ok(()) => addrs.extend(ipv6),
            Err(e) => {
                self.say(&format!("{label}: IPv6 not measured: {e:#}"));
                run.note = Some(format!("IPv6 not measured: {e:#}"));
            }
        }
        run.latency = Some(self.progress.part(&format!("{label}: latency"), || {
            // IPv6 targets take the port shares of IPv4 ones: flows of two
            // families never meet in any conntrack.
            let mut targets: Vec<Target> = addrs
                .iter()
                .enumerate()
                .map(|(i, (_, addr))| Target::new(*addr, i % IPV4_TARGETS, IPV4_TARGETS))
                .collect();
            let needed = self.plan.rounds * self.plan.connections;
            if needed > targets[0].capacity() {
                bail!(
                    "{needed} connections per target would reuse local ports ({}): fewer rounds or connections",
                    targets[0].capacity()
                );
            }
            let mut pairs: Vec<(&testbed::netns::Netns, &mut Target)> =
                addrs.iter().map(|(ns, _)| *ns).zip(targets.iter_mut()).collect();
            let found = latency::interleaved(&mut pairs, self.plan.rounds, self.plan.connections, &|m| {
                self.progress.message(&format!("{label}: {m}"));
            })?;
            run_latency(found)
        })?);
        agent.alive()?;
        self.measure_program_time(topo, (cluster(last), node_port(last)?, direct), label, run);
        agent.alive()?;

        if self.wrk {
            let wrk = &self.plan.wrk;
            let measured = self
                .progress
                .part(&format!("{label}: throughput (wrk)"), || -> Result<_> {
                    let np = node_port(last)?;
                    let cip = cluster(last);
                    Ok(RunThroughput {
                        nodeport_short: throughput::measure(&topo.client, np, false, wrk)?,
                        nodeport_keepalive: throughput::measure(&topo.client, np, true, wrk)?,
                        clusterip_short: throughput::measure(&topo.client_pod.ns, cip, false, wrk)?,
                        clusterip_keepalive: throughput::measure(&topo.client_pod.ns, cip, true, wrk)?,
                    })
                });
            // A load generator that misbehaves costs the throughput, not
            // the rest of the run; the report says so.
            match measured {
                Ok(t) => run.throughput = Some(t),
                Err(e) => {
                    self.say(&format!("{label}: throughput not measured: {e:#}"));
                    run.note = Some(format!("throughput not measured: {e:#}"));
                }
            }
            agent.alive()?;
        }

        if n == self.plan.change_at {
            let pods = [
                EndpointPod {
                    ip: pod_ip(0),
                    name: pod_name(0),
                },
                EndpointPod {
                    ip: pod_ip(1),
                    name: pod_name(1),
                },
            ];
            let addr = SocketAddrV4::new(CHANGE_CLUSTER_IP, PORT);
            run.endpoint_change = Some(self.progress.part(&format!("{label}: endpoint changes"), || {
                programming::endpoint_changes(api, &topo.client_pod.ns, addr, pods, n, self.plan.changes, &|m| {
                    self.progress.message(&format!("{label}: {m}"));
                })
            })?);
            agent.alive()?;
        }

        let pid = agent.pid().context("the agent's pid")?;
        run.memory = Some(memory::measure(pid, agent.pin_path())?);
        Ok(())
    }

    /// The programs' share of a request to the last Service (ClusterIP from
    /// the client pod, NodePort from the client) and of one straight to a
    /// pod: an extra round with the kernel's BPF statistics on. Like the
    /// throughput, a failure costs this figure and a note, not the run.
    fn measure_program_time(
        &self,
        topo: &BenchTopology,
        (cluster_ip, node_port, direct): (SocketAddrV4, SocketAddrV4, SocketAddrV4),
        label: &str,
        run: &mut Run,
    ) {
        let targets = [
            ("ClusterIP, last", &topo.client_pod.ns, cluster_ip.into()),
            ("NodePort, last", &topo.client, node_port.into()),
            ("direct, from the client pod", &topo.client_pod.ns, direct.into()),
        ];
        let requests = self.plan.connections.min(PROGRAM_TIME_REQUESTS);
        let measured = self.progress.part(&format!("{label}: programs' time per request"), || {
            program_time::measure(&targets, requests)
        });
        match measured {
            Ok(found) => run.program_time = found,
            Err(e) => {
                self.say(&format!("{label}: programs' time not measured: {e:#}"));
                run.note = Some(format!("programs' time not measured: {e:#}"));
            }
        }
    }

    // -----------------------------------------------------------------------
    // Scale runs.

    fn scale_runs(&self) -> Vec<ScaleRun> {
        if self.plan.scale.is_empty() {
            return Vec::new();
        }
        let topo = match self.progress.part("scale: topology", BenchTopology::build) {
            Ok(topo) => topo,
            Err(e) => {
                return self
                    .plan
                    .scale
                    .iter()
                    .map(|p| failed_scale(p, format!("the topology could not be built: {e:#}")))
                    .collect();
            }
        };
        self.plan
            .scale
            .iter()
            .map(|point| {
                let result = self.scale_run(&topo, point).unwrap_or_else(|e| {
                    self.say(&format!("scale run at {} Services FAILED: {e:#}", point.services));
                    failed_scale(point, format!("{e:#}"))
                });
                self.progress.step();
                result
            })
            .collect()
    }

    fn scale_run(&self, topo: &BenchTopology, point: &ScalePoint) -> Result<ScaleRun> {
        let mode = "ebpf";
        let set = ServiceSet::generate_with(point.services, self.plan.seed, point.endpoints)?;
        let label = format!(
            "scale: {mode} at {} Services, {} endpoints, from {}",
            set.len(),
            set.endpoint_count(),
            point.source
        );
        // The API server (and its kubeconfig) or the manifest directory,
        // the agent's source: kept until the agent stopped.
        let mut api = None;
        let path = match point.source {
            ScaleSource::Api => {
                let (server, kubeconfig) = self.progress.part(&format!("{label}: loading the API server"), || {
                    self.start_api(topo, &set)
                })?;
                api = Some(server);
                kubeconfig
            }
            ScaleSource::Manifests => self.progress.part(&format!("{label}: writing the manifests"), || {
                self.write_manifests(&set)
            })?,
        };
        let source = match point.source {
            ScaleSource::Api => agent::Source::Kubeconfig(&path),
            ScaleSource::Manifests => agent::Source::Manifests(&path),
        };
        let last = SocketAddrV4::new(set.last().cluster_ip, PORT);
        let count = self.plan.scale_repeats;
        let mut repeats = Vec::with_capacity(count);
        // Agents one after another, each from nothing (the one before
        // cleaned up: its programs would answer the probes); the last one
        // stays for the memory reading.
        let mut agent = loop {
            let mut agent = self.start_agent(topo, mode, source)?;
            let repeat = repeats.len() + 1;
            let programming = self
                .progress
                .part(&format!("{label}: programming ({repeat} of {count})"), || {
                    programming::wait_programmed(
                        &mut agent,
                        &topo.client_pod.ns,
                        last,
                        set.len() + 1,
                        (self.plan.probe_timeout, self.plan.program_timeout),
                    )
                })?;
            let read = agent::parse_log(&agent.log_text()).manifests_read_s;
            self.say(&format!(
                "{label} ({repeat} of {count}): start -> answering {}, delivered -> answering {}, agent's sync {}{}",
                fmt_s(Some(programming.start_to_answer_s)),
                fmt_s(programming.delivered_to_answer_s),
                fmt_s(programming.sync_s),
                read.map_or(String::new(), |s| format!(", reading the manifests {}", fmt_s(Some(s))))
            ));
            // One not programmed in time is not tried again.
            let timed_out = programming.timed_out_after_s.is_some();
            repeats.push(programming);
            if repeats.len() == count || timed_out {
                break agent;
            }
            self.progress
                .part(&format!("{label}: cleaning up ({repeat} of {count})"), || {
                    agent.stop_and_clean_up();
                });
        };
        let programming = programming::median(&repeats);
        // The resident set once the agent has handed back what the lists
        // freed (a few milliseconds after its first full sync).
        if let Err(e) = agent.wait_memory_settled(MEMORY_SETTLE_PATIENCE) {
            self.say(&format!("{label}: {e:#}; RSS read anyway"));
        }
        let pid = agent.pid().context("the agent's pid")?;
        let memory = memory::measure(pid, agent.pin_path())?;
        let timed_out = repeats.iter().any(|p| p.timed_out_after_s.is_some());
        let note = if timed_out { sync_failure(&agent) } else { None };
        self.progress.part(&format!("{label}: stopping"), || {
            agent.stop(if timed_out { libc::SIGKILL } else { libc::SIGTERM });
            drop(api);
        });
        Ok(ScaleRun {
            mode: mode.to_owned(),
            source: point.source,
            services: set.len(),
            endpoints: set.endpoint_count(),
            programming,
            repeats,
            memory: Some(memory),
            note,
            error: None,
        })
    }
}

/// How long a scale run waits for the agent to return the memory its
/// first full list freed before reading its RSS.
const MEMORY_SETTLE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// The latency targets in IPv4: ClusterIP first, last, direct; NodePort
/// first, last, direct.
const IPV4_TARGETS: usize = 6;
/// Requests per target of the round that reads the programs' statistics:
/// enough that a program's time per request settles.
const PROGRAM_TIME_REQUESTS: usize = 1000;

/// How long the last Service's IPv6 half may take to answer once its IPv4
/// half does (the same sync programs both): a mode that does not serve it
/// costs the run no more.
const IPV6_PATIENCE: std::time::Duration = std::time::Duration::from_secs(3);

/// `addr` answers from `ns` within `patience` (a mode may still be at work
/// on it).
fn answers(ns: &Netns, addr: SocketAddr, patience: std::time::Duration) -> Result<()> {
    ns.run_in(|| programming::probe_patiently(addr, programming::CHECK_CONNECT_TIMEOUT, patience))?
        .map_err(|e| anyhow::anyhow!("{addr} from {}: {e}", ns.name()))?;
    Ok(())
}

/// The dual-stack `last` Service in IPv6: its ClusterIP from the client
/// pod, its NodePort on the node's IPv6 address from outside.
fn ipv6_targets<'a>(topo: &'a BenchTopology, last: &services::BenchService) -> Result<Vec<(&'a Netns, SocketAddr)>> {
    let cluster = last.cluster_ip6.context("the last Service is dual-stack")?;
    let node_port = last.node_port.context("a NodePort")?;
    Ok(vec![
        (&topo.client_pod.ns, SocketAddr::from((cluster, PORT))),
        (&topo.client, SocketAddr::from((NODE_IP6, node_port))),
    ])
}

/// Why the agent did not program the Services, if its log says.
fn sync_failure(agent: &BenchAgent) -> Option<String> {
    let failure = agent::parse_log(&agent.log_text()).last_sync_failure?;
    Some(format!("the agent's syncs failed: {failure}"))
}

/// A run of `n` Services with nothing measured yet.
fn empty_run(n: usize, seed: u64) -> Run {
    let set = ServiceSet::generate(n, seed).ok();
    Run::new(
        n,
        set.as_ref().map_or(0, ServiceSet::endpoint_count),
        set.as_ref().map_or(0, ServiceSet::node_port_count),
    )
}

fn failed_scale(point: &ScalePoint, error: String) -> ScaleRun {
    ScaleRun {
        mode: "ebpf".into(),
        source: point.source,
        services: point.services,
        endpoints: 0,
        programming: None,
        repeats: Vec::new(),
        memory: None,
        note: None,
        error: Some(error),
    }
}

/// The results in the order of the targets: six IPv4 ones, then the two
/// IPv6 ones if they were measured.
fn run_latency(mut found: Vec<Latency>) -> Result<RunLatency> {
    let ipv6 = match found.len() {
        IPV4_TARGETS => None,
        8 => {
            let nodeport = found.pop().context("eight results")?;
            let clusterip = found.pop().context("eight results")?;
            Some(Ipv6Latency { clusterip, nodeport })
        }
        n => bail!("{n} latency results, want {IPV4_TARGETS} or 8"),
    };
    let [
        clusterip_first,
        clusterip_last,
        clusterip_direct,
        nodeport_first,
        nodeport_last,
        nodeport_direct,
    ]: [Latency; IPV4_TARGETS] = found
        .try_into()
        .map_err(|v: Vec<Latency>| anyhow::anyhow!("{} latency results, want 6", v.len()))?;
    Ok(RunLatency {
        ipv6,
        clusterip_first,
        clusterip_last,
        clusterip_direct,
        nodeport_first,
        nodeport_last,
        nodeport_direct,
    })
}

fn fmt_s(v: Option<f64>) -> String {
    v.map_or_else(|| "?".into(), |s| format!("{:.1} ms", s * 1e3))
}
