//! The oracle: what a program must do with a frame, from the frame's
//! policy parse (`frame::parse_strict`, etherparse based), the seed
//! Services, and the oracle's own records of the flows (`conntrack`) and
//! of the first fragments' ports (`fragments`) the program must hold.
//!
//! [`Oracle::expect`] only reads; what the frame does to the records is
//! applied after the run ([`Oracle::ran`], [`Oracle::new_flow`]), once the
//! output has told the program's random pick of a backend, or whether the
//! kernel's LRU had evicted a fragment's ports.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddrV4,
};

use proxy_common::Verdict;
use proxy_userspace::model::ipv4;
use testbed::{
    frame::{
        Flow, IcmpError, LaterFragment, Strict, expected_port_unreachable, expected_rst, parse_strict, tcp_flags::RST,
    },
    testrun::{NODE_IP, Prog, kernel_may_refuse, seed_services},
};

use crate::{
    conntrack::{Conntrack, Lookup, Tuple},
    fragments::{FragKey, FragMemory},
};

/// What a frame must do.
#[derive(Clone, Debug)]
pub enum Expect {
    /// The kernel refuses it before the program runs (tc, short IP header).
    Refused,
    /// Passed untouched under this verdict.
    Pass(Verdict, &'static str),
    /// A TCP RST to a Service without backends: passed untouched, counted
    /// as pass or reject.
    PassRstToEmpty,
    /// Answered with this frame (RST or ICMP port unreachable).
    Reject(Vec<u8>),
    /// A packet of a tracked flow: DNATed to `nat` (forward) or
    /// reverse-NATed to it (reply).
    Tracked {
        packet: Packet,
        reply: bool,
        nat: SocketAddrV4,
    },
    /// The first packet of a new flow to a Service with backends: DNATed to
    /// one of `backends`, or (a backend in `colliding`) left untracked.
    New {
        flow: Flow,
        backends: Vec<SocketAddrV4>,
        colliding: Vec<SocketAddrV4>,
        /// It opens a new flow on a closed flow's tuple.
        reopens: bool,
    },
    /// An ICMP error about a tracked flow's packet: translated as the
    /// entry (reply or forward) it names says.
    IcmpError {
        error: IcmpError,
        reply: bool,
        nat: SocketAddrV4,
    },
}

/// The packet a translation rewrites.
#[derive(Clone, Copy, Debug)]
pub enum Packet {
    /// A whole datagram or a first fragment: addresses, ports, checksums.
    Full(Flow),
    /// A later fragment (its ports were its first's): addresses only. Its
    /// datagram's key, which the kernel may have evicted.
    Later(FragKey),
}

/// What the frame does to the oracle's records, whatever the outcome.
#[derive(Clone, Copy, Debug, Default)]
pub struct Effects {
    /// A first fragment's key and ports, remembered.
    pub remember: Option<(FragKey, (u16, u16))>,
    /// The conntrack lookup of this tuple with these TCP flags (moves a
    /// flow's state on, or removes a closed flow's entry).
    pub lookup: Option<(Tuple, u8)>,
    /// A later fragment's key, looked up.
    pub fragment_lookup: Option<FragKey>,
}

/// An expectation and the frame's effects.
#[derive(Clone, Debug)]
pub struct Prediction {
    pub expect: Expect,
    pub effects: Effects,
}

impl Prediction {
    /// A frame that changes nothing in the records.
    fn only(expect: Expect) -> Self {
        Self {
            expect,
            effects: Effects::default(),
        }
    }
}

impl Expect {
    /// The frame's class, for the report.
    pub fn class(&self) -> String {
        match self {
            Expect::Refused => "refused by the kernel".into(),
            Expect::Pass(v, why) => format!("{} ({why})", v.name()),
            Expect::PassRstToEmpty => "pass: RST to a Service without backends".into(),
            Expect::New { flow, .. } if flow.first_fragment => "dnat_new (first fragment)".into(),
            Expect::New { reopens: true, .. } => "dnat_new (on a closed flow's tuple)".into(),
            Expect::New { .. } => "dnat_new".into(),
            Expect::Tracked { packet, reply, .. } => {
                let verdict = if *reply { "rev_nat" } else { "dnat_established" };
                match packet {
                    Packet::Full(f) if f.first_fragment => format!("{verdict} (first fragment)"),
                    Packet::Full(_) => verdict.into(),
                    Packet::Later(..) => format!("{verdict} (later fragment, or its ports evicted)"),
                }
            }
            Expect::IcmpError { reply: true, .. } => "icmp_error (towards the client)".into(),
            Expect::IcmpError { reply: false, .. } => "icmp_error (towards the backend)".into(),
            Expect::Reject(r) if r.len() == 54 => "reject: TCP RST".into(),
            Expect::Reject(_) => "reject: ICMP port unreachable".into(),
        }
    }
}

/// What the oracle knows: the Services and its records.
pub struct Oracle {
    /// Frontend (address, port, protocol) -> backends.
    services: HashMap<(SocketAddrV4, u8), Vec<SocketAddrV4>>,
    /// The port filter: frontends' ports and backends' ports, any protocol.
    frontend_ports: HashSet<u16>,
    backend_ports: HashSet<u16>,
    pub conntrack: Conntrack,
    /// Entries the program's conntrack table holds with room to spare
    /// (the model has no eviction: a run must stay below).
    conntrack_room: usize,
    pub fragments: FragMemory,
    /// (client, frontend, backend, proto) of every new flow translated, oldest first.
    pub flow_list: Vec<(SocketAddrV4, SocketAddrV4, SocketAddrV4, u8)>,
}

impl Oracle {
    /// The seed Services on a data path whose conntrack table has
    /// `conntrack_entries` entries, on a kernel with `possible_cpus`.
    pub fn new(possible_cpus: usize, conntrack_entries: usize) -> Self {
        let mut o = Oracle {
            services: HashMap::new(),
            frontend_ports: HashSet::new(),
            backend_ports: HashSet::new(),
            conntrack: Conntrack::default(),
            // An LRU map evicts only when full; each CPU's local lists may
            // hold up to 128 free nodes (see `fragments`).
            conntrack_room: conntrack_entries.saturating_sub(128 * possible_cpus),
            fragments: FragMemory::new(possible_cpus),
            flow_list: Vec::new(),
        };
        for svc in seed_services() {
            let p = svc.protocol.number();
            let backends: Vec<SocketAddrV4> = svc
                .endpoints
                .iter()
                .filter_map(|e| Some(SocketAddrV4::new(ipv4(e.addr)?, e.port)))
                .collect();
            o.backend_ports
                .extend(backends.iter().map(std::net::SocketAddrV4::port));
            o.frontend_ports.insert(svc.port);
            let Some(cluster_ip) = ipv4(svc.cluster_ip) else {
                continue;
            };
            o.services
                .insert((SocketAddrV4::new(cluster_ip, svc.port), p), backends.clone());
            if let Some(np) = svc.node_port {
                o.frontend_ports.insert(np);
                o.services.insert((SocketAddrV4::new(NODE_IP, np), p), backends);
            }
        }
        o
    }

    /// Frontends, sorted (for the frame generator).
    pub fn frontends(&self) -> Vec<(SocketAddrV4, u8)> {
        let mut f: Vec<_> = self.services.keys().copied().collect();
        f.sort();
        f
    }

    /// The port filter: could a packet with these ports be Service traffic?
    fn may_be_service(&self, src: SocketAddrV4, dst: SocketAddrV4) -> bool {
        self.frontend_ports.contains(&dst.port()) || self.backend_ports.contains(&src.port())
    }

    pub fn expect(&self, prog: Prog, input: &[u8]) -> Prediction {
        if kernel_may_refuse(prog, input) {
            return Prediction::only(Expect::Refused);
        }
        match parse_strict(input) {
            Strict::Malformed(why) => Prediction::only(Expect::Pass(Verdict::PassMalformed, why)),
            Strict::NotIpv4OrL4(why) => Prediction::only(Expect::Pass(Verdict::PassNotIpv4OrL4, why)),
            // No IPv6 Service is programmed here, and no IPv6 flow tracked.
            Strict::Ipv6Flow(_) => Prediction::only(Expect::Pass(Verdict::PassNotService, "no IPv6 Service")),
            Strict::Ipv6Fragment => Prediction::only(Expect::Pass(Verdict::PassFragmentUntracked, "IPv6 fragment")),
            Strict::Flow(flow) => self.expect_flow(input, flow),
            Strict::LaterFragment(f) => self.expect_later(f),
            Strict::IcmpError(e) => Prediction::only(self.expect_icmp_error(e)),
        }
    }

    /// A whole datagram or first fragment.
    fn expect_flow(&self, input: &[u8], flow: Flow) -> Prediction {
        if !self.may_be_service(flow.src, flow.dst) {
            return Prediction::only(Expect::Pass(Verdict::PassNotService, "port filter"));
        }
        let tuple = (flow.src, flow.dst, flow.proto);
        let remember = flow.first_fragment.then(|| {
            let key = (*flow.src.ip(), *flow.dst.ip(), flow.ip_id, flow.proto);
            (key, (flow.src.port(), flow.dst.port()))
        });
        let lookup = self.conntrack.find(&tuple, flow.tcp_flags);
        let expect = match lookup {
            Lookup::Hit { reply, nat } => Expect::Tracked {
                packet: Packet::Full(flow),
                reply,
                nat,
            },
            Lookup::Miss | Lookup::Reopens => {
                let removed = (lookup == Lookup::Reopens).then_some(tuple);
                self.untracked(input, flow, removed)
            }
        };
        Prediction {
            expect,
            effects: Effects {
                remember,
                lookup: Some((tuple, flow.tcp_flags)),
                fragment_lookup: None,
            },
        }
    }

    /// A packet no flow tracks (any more): a new flow, an answer, or not ours.
    fn untracked(&self, input: &[u8], flow: Flow, removed: Option<Tuple>) -> Expect {
        match self.services.get(&(flow.dst, flow.proto)) {
            Some(backends) if !backends.is_empty() => Expect::New {
                flow,
                backends: backends.clone(),
                colliding: backends
                    .iter()
                    .copied()
                    .filter(|b| self.conntrack.collides(flow.src, *b, flow.proto, removed))
                    .collect(),
                reopens: removed.is_some(),
            },
            Some(_) if flow.is_tcp() && flow.tcp_flags & RST != 0 => Expect::PassRstToEmpty,
            Some(_) if flow.is_tcp() => Expect::Reject(expected_rst(input, &flow)),
            Some(_) => Expect::Reject(expected_port_unreachable(input, &flow)),
            None if removed.is_some() => Expect::Pass(Verdict::PassNotService, "opens a closed flow's reply tuple"),
            None => Expect::Pass(Verdict::PassNotService, "no frontend, no flow"),
        }
    }

    /// A later fragment: its first's ports, if remembered, and the flow
    /// they name, if tracked.
    fn expect_later(&self, f: LaterFragment) -> Prediction {
        let key = (f.src, f.dst, f.ip_id, f.proto);
        let untracked = |why| Expect::Pass(Verdict::PassFragmentUntracked, why);
        let mut effects = Effects {
            fragment_lookup: Some(key),
            ..Effects::default()
        };
        let Some(ports) = self.fragments.ports(&key) else {
            let expect = untracked("no first fragment seen");
            return Prediction { expect, effects };
        };
        let tuple = later_tuple(&f, ports);
        if !self.may_be_service(tuple.0, tuple.1) {
            let expect = Expect::Pass(Verdict::PassNotService, "port filter");
            return Prediction { expect, effects };
        }
        effects.lookup = Some((tuple, 0));
        let expect = match self.conntrack.find(&tuple, 0) {
            Lookup::Hit { reply, nat } => Expect::Tracked {
                packet: Packet::Later(key),
                reply,
                nat,
            },
            Lookup::Miss | Lookup::Reopens => untracked("its flow is not tracked"),
        };
        Prediction { expect, effects }
    }

    /// An ICMP error: its tuple is the quoted one reversed (the direction
    /// it travels); the entry there, if any, decides, unchanged.
    fn expect_icmp_error(&self, e: IcmpError) -> Expect {
        let tuple = (e.quoted_dst, e.quoted_src, e.quoted_proto);
        if !self.may_be_service(tuple.0, tuple.1) {
            return Expect::Pass(Verdict::PassNotService, "ICMP error: port filter");
        }
        match self.conntrack.related(&tuple) {
            Some(entry) => Expect::IcmpError {
                error: e,
                reply: entry.reply,
                nat: entry.nat,
            },
            None => Expect::Pass(Verdict::PassNotService, "ICMP error about no tracked flow"),
        }
    }

    /// The frame ran: applies its effects. `lookup` is false when the
    /// program showed it had lost a later fragment's ports (no lookup then).
    pub fn ran(&mut self, effects: &Effects, lookup: bool) {
        if let Some((key, ports)) = effects.remember {
            self.fragments.remember(key, ports);
        }
        if let Some(key) = effects.fragment_lookup {
            self.fragments.looked_up(&key);
        }
        if let (Some((tuple, flags)), true) = (effects.lookup, lookup) {
            self.conntrack.look_up(&tuple, flags);
        }
    }

    /// The program translated a new flow to `backend`.
    pub fn new_flow(&mut self, flow: &Flow, backend: SocketAddrV4) {
        let tuple = (flow.src, flow.dst, flow.proto);
        assert!(
            self.conntrack.create(&tuple, backend),
            "the oracle cannot track a flow it expected the program to track"
        );
        self.flow_list.push((flow.src, flow.dst, backend, flow.proto));
        assert!(
            self.conntrack.len() < self.conntrack_room,
            "the fuzz outgrew its conntrack table ({} entries): load the data path with more",
            self.conntrack.len()
        );
    }
}

/// A later fragment's tuple, with the ports its first fragment gave it.
pub fn later_tuple(f: &LaterFragment, ports: (u16, u16)) -> Tuple {
    (
        SocketAddrV4::new(f.src, ports.0),
        SocketAddrV4::new(f.dst, ports.1),
        f.proto,
    )
}
