//! Fuzzes each program with mutated frames against an independent oracle.
//!
//! For each of xdp_uplink, tc_ingress and tc_egress: one data path with the
//! seed Services, loaded with conntrack timeouts far longer than a run and
//! a table no run fills, then frames until 1,000,000 of them were mutated
//! (about 1,430,000 in all: 820,000 IPv4, 500,000 IPv6, 110,000 of
//! other ether types, the report says). The frames (`generator`): valid frames of every
//! class, datagrams in fragments in any order, later fragments alone, ICMP
//! errors about translated packets and random ones, mutated 4 times in 5.
//! Fixed seeds fix the stream of random choices; reply and ICMP frames are
//! built from the backends the program picked, so their bytes vary.
//!
//! The oracle (`oracle`) parses each input with `frame::parse_strict`
//! (etherparse based, the documented input policy) and keeps its own
//! records of the flows and their states (`conntrack`) and of the first
//! fragments' ports (`fragments`):
//! - not fully parsed, not TCP/UDP, not for a frontend and not a packet of a
//!   tracked flow: the code is "pass" and the output equals the input;
//! - a packet's own tuple is looked up among the tracked flows first: a
//!   forward entry DNATs it to the flow's backend, a reply entry
//!   reverse-NATs it to the flow's frontend, unless the packet opens a new
//!   flow on a closed flow's entry (which it removes);
//! - a new flow to a Service with backends: a backend of the Service, the
//!   same for its later packets; untracked (passed, counted as an error) if
//!   its reply tuple is another flow's forward tuple;
//! - a first fragment is translated as a whole datagram and its ports
//!   remembered; a later fragment is translated as its flow, addresses
//!   only, if its first's ports are remembered and name a tracked flow
//!   (the kernel's LRU may have evicted them: accepted only where the
//!   eviction bound in `fragments` allows), else passed untouched;
//! - an ICMP error quoting a tracked flow's packet: the quote and one
//!   outer address translated as the entry its reversed tuple names says;
//! - a translation changes only the allowed bytes, to the expected values,
//!   and every checksum keeps its ones' complement residual (`check`); UDP
//!   checksum 0 stays 0;
//! - for a frontend without backends: exactly the RST / ICMP answer (a TCP
//!   RST passes untouched).
//!
//! IPv6 (`ipv6`, `generator6`): a third of the seeds are IPv6 frames to
//! IPv6 Services the agent's writer programs beside the IPv4 seed
//! (ClusterIP, NodePort, SCTP, no endpoints, a load balancer IP with
//! source ranges, a `Local` external IP with the pod network), behind
//! extension headers, in fragments, ICMPv6 errors about them, neighbour
//! discovery and echo, mutated at IPv6 offsets too. The strict parser
//! classifies them as the programs' IPv6 policy says, and the same rules
//! hold: the oracle's records key IPv6 addresses by one-to-one fakes, its
//! first fragments' memory is `XP_FRAGS6`'s own; a new flow outside the
//! source ranges, or from outside the pod network to the `Local` frontend
//! with no local backend, is dropped untouched; translations change only
//! addresses, ports and checksums, consistently (no header checksum; SCTP
//! the address alone); a rejected one gets exactly the RST or ICMPv6 port
//! unreachable.
//!
//! Frames the kernel refuses for tc before the program runs (see
//! `testrun::kernel_may_refuse`) are counted and skipped. At the end the
//! verdict counters must add up to the oracle's counts; every deviation kind
//! is reported with its count and first example. State changes not passed
//! on to an entry that is another flow's are counted (see `conntrack`).
//!
//! Environment: `XPROXY_FUZZ_FRAMES` (mutated frames per program, default
//! 1000000), `XPROXY_FUZZ_SEED`. About 75 s for all
//! three in a debug build on 2 cores (as before the IPv6 share: the frame
//! budget is the same), 10 s with `--release`.

// The fuzz's own modules, beside this file (a test target's root looks
// for modules next to itself, not in a directory of its name).
#[path = "fuzz/check.rs"]
mod check;
#[path = "fuzz/conntrack.rs"]
mod conntrack;
#[path = "fuzz/fragments.rs"]
mod fragments;
#[path = "fuzz/generator.rs"]
mod generator;
#[path = "fuzz/generator6.rs"]
mod generator6;
#[path = "fuzz/ipv6.rs"]
mod ipv6;
#[path = "fuzz/oracle.rs"]
mod oracle;

use std::{collections::BTreeMap, net::SocketAddrV4, time::Instant};

use proxy_common::{CtTimeouts, Verdict, conntrack::state};
use proxy_userspace::mode::ebpf::{LoadOptions, conntrack::CtSettings, pod_cidrs};
use testbed::{
    frame::{Flow, Flow6, IcmpError, diff, hex},
    privileged::require_root,
    testrun::*,
};

use crate::{
    check::{IcmpRewrite, Side},
    fragments::{FragKey, possible_cpus},
    generator::Generator,
    ipv6::{NODE_IP6, POD_CIDR6, THIS_NODE, seed6_services},
    oracle::{Expect, Oracle, Packet, Prediction},
};

/// Mutated frames per program (unmutated ones come on top, some 40% more).
const DEFAULT_MUTATED: u64 = 1_000_000;
const DEFAULT_SEED: u64 = 0x7870_726f_7879; // "xproxy"

/// Conntrack entries the fuzz's data path is loaded with: far more than a
/// run creates (some 31,000 at the default length), so that no flow is
/// ever evicted (the oracle checks as the run goes).
const CT_ENTRIES: u32 = 1 << 18;
/// Conntrack timeouts: ten days, so no flow idles out during a run and
/// only closed flows are over.
const CT_TIMEOUT_S: u32 = 864_000;

/// Problems found, by kind: count and the first example.
#[derive(Default)]
struct Findings {
    kinds: BTreeMap<String, (u64, String)>,
}

impl Findings {
    fn add(&mut self, kind: String, example: impl FnOnce() -> String) {
        let e = self.kinds.entry(kind).or_insert_with(|| (0, String::new()));
        if e.0 == 0 {
            e.1 = example();
        }
        e.0 += 1;
    }
}

struct Counts {
    /// Frames the program ran (not refused by the kernel), and their bytes.
    ran: u64,
    ran_bytes: u64,
    /// RSTs to a Service without backends: counted as pass or reject.
    rst_to_empty: u64,
    /// Packets and bytes by the verdict the oracle expects.
    by_verdict: [(u64, u64); Verdict::COUNT as usize],
}

impl Counts {
    fn new() -> Self {
        Self {
            ran: 0,
            ran_bytes: 0,
            rst_to_empty: 0,
            by_verdict: [(0, 0); Verdict::COUNT as usize],
        }
    }

    /// A frame of `len` bytes ran; the program must have counted `verdict`
    /// (`None`: pass or reject).
    fn add(&mut self, verdict: Option<Verdict>, len: u64) {
        self.ran += 1;
        self.ran_bytes += len;
        match verdict {
            Some(v) => {
                self.by_verdict[v as usize].0 += 1;
                self.by_verdict[v as usize].1 += len;
            }
            None => self.rst_to_empty += 1,
        }
    }
}

/// What a fuzz run found and counted.
struct Tally {
    findings: Findings,
    /// Frames by expected outcome.
    classes: BTreeMap<String, u64>,
    /// Frames by ether type (IPv4, IPv6, other), as they went in.
    families: [u64; 3],
    counts: Counts,
}

/// What the output of a frame told the oracle.
struct Seen {
    /// The verdict the program must have counted (`None`: pass or reject).
    verdict: Option<Verdict>,
    /// The program looked up the frame's tuple (not so when it had lost a
    /// later fragment's ports).
    looked_up: bool,
    /// The backend the program picked for a new flow.
    new_flow: Option<(Flow, SocketAddrV4)>,
    /// A later fragment's key the program no longer had.
    evicted: Option<FragKey>,
}

impl Seen {
    /// Counted as `verdict`, the frame's tuple looked up as expected.
    fn verdict(verdict: Verdict) -> Self {
        Self {
            verdict: Some(verdict),
            looked_up: true,
            new_flow: None,
            evicted: None,
        }
    }
}

/// One frame's input and output, for checks and examples.
struct Run<'a> {
    prog: Prog,
    input: &'a [u8],
    out: &'a Output,
}

impl Run<'_> {
    fn example(&self) -> String {
        format!(
            "input {}\noutput {} code {}",
            hex(self.input),
            hex(&self.out.frame),
            self.out.code
        )
    }

    fn with_diff(&self) -> String {
        format!("{}\ndiff {}", self.example(), diff(self.input, &self.out.frame))
    }

    fn untouched(&self) -> bool {
        self.out.code == self.prog.pass() && self.out.frame == self.input
    }

    /// Checks "passed untouched".
    fn pass(&self, findings: &mut Findings, what: &str) {
        if self.out.code != self.prog.pass() {
            findings.add(format!("{what}: code {} instead of pass", self.out.code), || {
                self.example()
            });
        }
        if self.out.frame != self.input {
            findings.add(format!("{what}: frame changed"), || self.with_diff());
        }
    }

    /// Checks "dropped untouched".
    fn dropped(&self, findings: &mut Findings, what: &str) {
        if self.out.code != self.prog.drop() {
            findings.add(format!("{what}: code {} instead of drop", self.out.code), || {
                self.example()
            });
        }
        if self.out.frame != self.input {
            findings.add(format!("{what}: frame changed"), || self.with_diff());
        }
    }

    /// Checks the code of a translated packet: pass, or for tc_egress's
    /// forward translations a redirect to the backend's interface.
    fn translated_code(&self, findings: &mut Findings, what: &str, forward: bool) {
        let ok = if forward {
            self.prog.dnat_code_ok(self.out.code)
        } else {
            self.out.code == self.prog.pass()
        };
        if !ok {
            findings.add(format!("{what}: code {}", self.out.code), || self.example());
        }
    }
}

/// Runs one frame, checks it against the oracle, updates the oracle.
fn run_one(h: &mut Harness, prog: Prog, oracle: &mut Oracle, input: &[u8], tally: &mut Tally) {
    let Prediction { expect, effects } = oracle.expect(prog, input);
    *tally.classes.entry(expect.class()).or_default() += 1;
    tally.families[family(input)] += 1;
    let out = match h.try_run(prog, input) {
        Ok(out) => out,
        Err(e) if matches!(expect, Expect::Refused) && errno(&e) == Some(libc::EINVAL) => return,
        Err(e) => {
            tally.findings.add(format!("test_run failed: {e}"), || hex(input));
            return;
        }
    };
    let run = Run { prog, input, out: &out };
    let seen = judge(&run, &expect, oracle, &mut tally.findings);
    if let Some(key) = seen.evicted {
        oracle.fragments_of_mut(&key).evicted(&key);
    }
    oracle.ran(&effects, seen.looked_up);
    if let Some((flow, backend)) = seen.new_flow {
        oracle.new_flow(&flow, backend);
    }
    tally.counts.add(seen.verdict, input.len() as u64);
}

/// Checks the output against the expectation; says what it told.
fn judge(run: &Run, expect: &Expect, oracle: &Oracle, findings: &mut Findings) -> Seen {
    match expect {
        Expect::Refused => {
            findings.add("kernel took a frame it may refuse".into(), || run.example());
            Seen::verdict(Verdict::PassMalformed)
        }
        Expect::Pass(v, why) => {
            run.pass(findings, &format!("{} ({why})", v.name()));
            Seen::verdict(*v)
        }
        Expect::PassRstToEmpty => {
            run.pass(findings, "RST to a Service without backends");
            Seen {
                verdict: None,
                looked_up: true,
                new_flow: None,
                evicted: None,
            }
        }
        Expect::Reject(want) => {
            judge_reject(run, want, findings);
            Seen::verdict(Verdict::RejectNoBackend)
        }
        Expect::Drop(v, why) => {
            run.dropped(findings, &format!("{} ({why})", v.name()));
            Seen::verdict(*v)
        }
        Expect::New {
            flow,
            backends,
            colliding,
            six,
            ..
        } => judge_new(run, (flow, six.as_ref()), (backends, colliding), oracle, findings),
        Expect::Icmp6Error { error, reply, nat } => {
            run.translated_code(findings, "IPv6 icmp_error", !*reply);
            if let Err(e) = check::icmp6(run.input, &run.out.frame, error, *reply, *nat) {
                findings.add(format!("IPv6 icmp_error: {e}"), || run.with_diff());
            }
            Seen::verdict(Verdict::IcmpError)
        }
        Expect::Tracked { packet, reply, nat } => judge_tracked(run, packet, *reply, *nat, oracle, findings),
        Expect::IcmpError { error, reply, nat } => {
            let rewrite = if *reply {
                // Towards the client, about a packet to the backend.
                IcmpRewrite {
                    quoted: Side::Destination,
                    outer: Side::Source,
                    old: error.quoted_dst,
                    new: *nat,
                }
            } else {
                // Towards the backend, about a reply from the frontend.
                IcmpRewrite {
                    quoted: Side::Source,
                    outer: Side::Destination,
                    old: error.quoted_src,
                    new: *nat,
                }
            };
            run.translated_code(findings, "icmp_error", !*reply);
            judge_icmp_error(run, error, &rewrite, findings);
            Seen::verdict(Verdict::IcmpError)
        }
    }
}

/// Checks an ICMP error's translation.
fn judge_icmp_error(run: &Run, error: &IcmpError, rewrite: &IcmpRewrite, findings: &mut Findings) {
    if let Err(e) = check::icmp(run.input, &run.out.frame, error, rewrite) {
        findings.add(format!("icmp_error: {e}"), || run.with_diff());
    }
}

fn judge_reject(run: &Run, want: &[u8], findings: &mut Findings) {
    let ipv6 = want[12..14] == [0x86, 0xdd];
    let what = match (ipv6, want.len()) {
        (false, 54) => "reject TCP",
        (false, _) => "reject UDP",
        (true, 74) => "reject IPv6 TCP",
        (true, _) => "reject IPv6 UDP",
    };
    if run.out.code != run.prog.reject() {
        findings.add(
            format!("{what}: code {} instead of {}", run.out.code, run.prog.reject()),
            || run.example(),
        );
    }
    if run.out.frame != want {
        findings.add(format!("{what}: wrong answer frame"), || {
            format!(
                "{}\nwant   {}\ndiff {}",
                run.example(),
                hex(want),
                diff(want, &run.out.frame)
            )
        });
    }
}

/// A new flow (`six`: an IPv6 one, `flow` its faked form) must be
/// DNATed to one of `backends`, unless to one of `colliding`.
fn judge_new(
    run: &Run,
    (flow, six): (&Flow, Option<&Flow6>),
    (backends, colliding): (&[SocketAddrV4], &[SocketAddrV4]),
    oracle: &Oracle,
    findings: &mut Findings,
) -> Seen {
    if !colliding.is_empty() && run.untouched() {
        // Its reply tuple is another flow's forward tuple: untracked.
        return Seen::verdict(Verdict::Error);
    }
    run.translated_code(findings, "dnat_new", true);
    let seen = Seen::verdict(Verdict::DnatNew);
    let dst = match six {
        Some(f6) => check::full6(run.input, &run.out.frame, f6, Side::Destination).map(|a| oracle.fake.addr(a)),
        None => check::full(run.input, &run.out.frame, flow, Side::Destination),
    };
    match dst {
        Err(e) => findings.add(format!("dnat_new: {e}"), || run.with_diff()),
        Ok(dst) if !backends.contains(&dst) => findings
            .add("dnat_new: destination is not a backend of the Service".into(), || {
                run.example()
            }),
        Ok(dst) if colliding.contains(&dst) => findings.add(
            "dnat_new: tracked although its reply tuple is another flow's".into(),
            || run.example(),
        ),
        Ok(dst) => {
            return Seen {
                new_flow: Some((*flow, dst)),
                ..seen
            };
        }
    }
    seen
}

fn judge_tracked(
    run: &Run,
    packet: &Packet,
    reply: bool,
    nat: SocketAddrV4,
    oracle: &Oracle,
    findings: &mut Findings,
) -> Seen {
    let (verdict, side) = if reply {
        (Verdict::RevNat, Side::Source)
    } else {
        (Verdict::DnatEstablished, Side::Destination)
    };
    let what = verdict.name();
    if let Packet::Later(key) | Packet::Later6(key) = packet
        && run.untouched()
    {
        return judge_forgotten(run, key, oracle, findings);
    }
    run.translated_code(findings, what, !reply);
    let result = match packet {
        Packet::Full(flow) => check::full(run.input, &run.out.frame, flow, side).map(|a| a == nat),
        Packet::Full6(flow) => check::full6(run.input, &run.out.frame, flow, side).map(|a| oracle.fake.addr(a) == nat),
        Packet::Later(_) => check::later(run.input, &run.out.frame, side).map(|a| a == *nat.ip()),
        Packet::Later6(_) => check::later6(run.input, &run.out.frame, side).map(|a| oracle.fake.ip(a) == *nat.ip()),
    };
    match result {
        Err(e) => findings.add(format!("{what}: {e}"), || run.with_diff()),
        Ok(false) => findings.add(format!("{what}: not translated to the flow's {nat}"), || run.example()),
        Ok(true) => {}
    }
    Seen::verdict(verdict)
}

/// A later fragment of a tracked flow passed untouched: the program had
/// lost its first's ports, which the kernel's LRU may have evicted.
fn judge_forgotten(run: &Run, key: &FragKey, oracle: &Oracle, findings: &mut Findings) -> Seen {
    let fragments = oracle.fragments_of(key);
    if !fragments.may_be_evicted(key) {
        let younger = fragments.younger(key);
        findings.add(
            "later fragment untranslated though its first's ports cannot have been evicted".into(),
            || format!("{}\n{younger} keys remembered after its own", run.example()),
        );
    }
    Seen {
        looked_up: false,
        evicted: Some(*key),
        ..Seen::verdict(Verdict::PassFragmentUntracked)
    }
}

/// 0 for an IPv4 frame, 1 for IPv6, 2 for anything else (VLAN tags,
/// ARP, truncated Ethernet), by its ether type.
fn family(frame: &[u8]) -> usize {
    match frame.get(12..14) {
        Some([0x08, 0x00]) => 0,
        Some([0x86, 0xdd]) => 1,
        _ => 2,
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The seeded data path with long timeouts and a big conntrack table.
fn harness() -> Harness {
    let options = LoadOptions {
        conntrack: CtSettings {
            timeouts: CtTimeouts {
                seconds: [CT_TIMEOUT_S; state::COUNT],
            },
            entries: CT_ENTRIES,
            entries6: CT_ENTRIES,
        },
        ..LoadOptions::default()
    };
    let mut h = Harness::with_options(vec![NODE_IP], options);
    h.maps.set_node_ips(vec![NODE_IP.into(), NODE_IP6.into()]);
    h.maps.set_topology(Some(THIS_NODE.into()), false);
    for svc in seed_services().into_iter().chain(seed6_services()) {
        h.sync(&svc);
    }
    let pods = format!("{}/{}", POD_CIDR6.0, POD_CIDR6.1).parse().expect("a CIDR");
    pod_cidrs::write(h.pin_dir(), &pod_cidrs::trie_entries(&[pods])).expect("the pod networks written");
    h
}

fn fuzz(prog: Prog) {
    let target: u64 = env_or("XPROXY_FUZZ_FRAMES", DEFAULT_MUTATED);
    let seed: u64 = env_or("XPROXY_FUZZ_SEED", DEFAULT_SEED);
    let mut h = harness();
    let mut oracle = Oracle::new(possible_cpus(), CT_ENTRIES as usize);
    let mut generator = Generator::new(seed, &oracle);
    let mut tally = Tally {
        findings: Findings::default(),
        classes: BTreeMap::new(),
        families: [0; 3],
        counts: Counts::new(),
    };
    let (mut frames, mut mutated) = (0u64, 0u64);
    let start = Instant::now();
    while mutated < target {
        let (input, was_mutated) = generator.next(&oracle);
        frames += 1;
        mutated += u64::from(was_mutated);
        run_one(&mut h, prog, &mut oracle, &input, &mut tally);
    }
    let elapsed = start.elapsed();
    println!(
        "fuzz {}: {frames} frames ({mutated} mutated), seed {seed:#x}, {:.1} s ({:.2} µs/frame)",
        prog.name(),
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e6 / frames as f64,
    );
    report(&h, &oracle, tally, prog);
}

/// Prints what ran and panics with every deviation, counters included.
fn report(h: &Harness, oracle: &Oracle, tally: Tally, prog: Prog) {
    let [v4, v6, other] = tally.families;
    println!("  frames by ether type: IPv4 {v4}, IPv6 {v6}, other {other}");
    println!("  frames by expected outcome:");
    for (class, n) in &tally.classes {
        println!("    {n:>9}  {class}");
    }
    println!(
        "  conntrack entries: {} ({} state changes kept from an entry of another flow, {} IPv6 flows)",
        oracle.conntrack.len(),
        oracle.conntrack.one_way_partners,
        oracle.flow_list6.len(),
    );
    for (family, f) in [("IPv4", &oracle.fragments), ("IPv6", &oracle.fragments6)] {
        println!(
            "  {family} first fragments' keys remembered: {}, seen evicted: {} (the youngest with {} keys after it)",
            f.len(),
            f.evictions,
            f.youngest_evicted.map_or("no".into(), |y| y.to_string()),
        );
    }
    let Tally {
        mut findings, counts, ..
    } = tally;
    check_counters(h, &counts, &mut findings);
    if !findings.kinds.is_empty() {
        let mut report = format!("fuzz {}: {} kinds of deviation\n", prog.name(), findings.kinds.len());
        for (kind, (n, example)) in &findings.kinds {
            report += &format!("- {kind}: {n} frames\n  {}\n", example.replace('\n', "\n  "));
        }
        panic!("{report}");
    }
}

/// The counters must add up to the oracle's counts: exactly for every
/// verdict but the three pass verdicts, compared as one sum (the policy's
/// check order decides which pass verdict a frame with several flaws
/// gets); RSTs to empty Services may count as pass or reject. Every frame
/// the program ran is counted once, with its length.
fn check_counters(h: &Harness, counts: &Counts, findings: &mut Findings) {
    let got = h.counts();
    let got_of = |v: Verdict| got[v as usize].packets;
    let want_of = |v: Verdict| counts.by_verdict[v as usize].0;
    println!("  counters (got / oracle):");
    for v in Verdict::ALL {
        println!("    {:<24} {:>9} / {:>9}", v.name(), got_of(v), want_of(v));
    }
    println!("    either pass or reject: {}", counts.rst_to_empty);
    const PASS: [Verdict; 3] = [
        Verdict::PassNotService,
        Verdict::PassNotIpv4OrL4,
        Verdict::PassMalformed,
    ];
    for v in Verdict::ALL {
        let (p, b) = counts.by_verdict[v as usize];
        let exact = !PASS.contains(&v) && v != Verdict::RejectNoBackend;
        if exact && (got[v as usize].packets, got[v as usize].bytes) != (p, b) {
            findings.add(
                format!(
                    "counter {}: {} packets {} bytes, oracle {p} packets {b} bytes",
                    v.name(),
                    got_of(v),
                    got[v as usize].bytes
                ),
                String::new,
            );
        }
    }
    let got_pass: u64 = PASS.iter().map(|&v| got_of(v)).sum();
    let want_pass: u64 = PASS.iter().map(|&v| want_of(v)).sum();
    let consistent = got_of(Verdict::RejectNoBackend)
        .checked_sub(want_of(Verdict::RejectNoBackend))
        .is_some_and(|r| r <= counts.rst_to_empty && got_pass + r == want_pass + counts.rst_to_empty);
    if !consistent {
        findings.add(
            format!(
                "counters: pass {got_pass} reject {}; oracle pass {want_pass} reject {} (+{} pass-or-reject)",
                got_of(Verdict::RejectNoBackend),
                want_of(Verdict::RejectNoBackend),
                counts.rst_to_empty,
            ),
            String::new,
        );
    }
    let (got_packets, got_bytes) = got.iter().fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes));
    if (got_packets, got_bytes) != (counts.ran, counts.ran_bytes) {
        findings.add(
            format!(
                "counters: {got_packets} packets {got_bytes} bytes in all, but {} frames of {} bytes ran",
                counts.ran, counts.ran_bytes
            ),
            String::new,
        );
    }
}

#[test]
fn fuzz_xdp_uplink() {
    if !require_root("fuzz_xdp_uplink") {
        return;
    }
    fuzz(Prog::XdpUplink);
}

#[test]
fn fuzz_tc_ingress() {
    if !require_root("fuzz_tc_ingress") {
        return;
    }
    fuzz(Prog::TcIngress);
}

#[test]
fn fuzz_tc_egress() {
    if !require_root("fuzz_tc_egress") {
        return;
    }
    fuzz(Prog::TcEgress);
}

/// The oracle classifies hand-made cases as the policy says (no kernel needed).
#[cfg(test)]
mod tests {
    use etherparse::{Icmpv4Type, icmpv4::DestUnreachableHeader};
    use testbed::frame::{Frame, fragments, tcp_flags::*};

    use super::*;

    fn expect(oracle: &Oracle, prog: Prog, frame: &[u8]) -> Expect {
        oracle.expect(prog, frame).expect
    }

    /// Runs `frame` through the oracle as if the program did what it said,
    /// picking `backend` for a new flow.
    fn as_expected(oracle: &mut Oracle, frame: &[u8], backend: SocketAddrV4) -> Expect {
        let Prediction { expect, effects } = oracle.expect(Prog::TcIngress, frame);
        oracle.ran(&effects, true);
        if let Expect::New { flow, .. } = &expect {
            oracle.new_flow(flow, backend);
        }
        expect
    }

    #[test]
    fn oracle_classifies_the_seed_frames() {
        let oracle = Oracle::new(2, 1 << 18);
        let c = SocketAddrV4::new(CLIENT_IP, 40000);
        let syn = Frame::tcp(c, cluster_ip(), SYN).build();
        assert!(matches!(expect(&oracle, Prog::XdpUplink, &syn), Expect::New { .. }));
        let empty = Frame::udp(c, SocketAddrV4::new(EMPTY_IP, EMPTY_PORT), b"x").build();
        assert!(matches!(expect(&oracle, Prog::TcIngress, &empty), Expect::Reject(r) if r.len() == 70));
        let rst = Frame::tcp(c, SocketAddrV4::new(NODE_IP, EMPTY_NODE_PORT), RST).build();
        assert!(matches!(expect(&oracle, Prog::TcIngress, &rst), Expect::PassRstToEmpty));
        let other = Frame::tcp(c, SocketAddrV4::new(CLUSTER_IP, 89), SYN).build();
        assert!(matches!(
            expect(&oracle, Prog::TcIngress, &other),
            Expect::Pass(Verdict::PassNotService, _)
        ));
        assert!(matches!(expect(&oracle, Prog::TcIngress, &syn[..20]), Expect::Refused));
        assert!(matches!(
            expect(&oracle, Prog::XdpUplink, &syn[..20]),
            Expect::Pass(Verdict::PassMalformed, _)
        ));
    }

    #[test]
    fn a_closed_flow_gives_way_to_a_syn_only() {
        let mut oracle = Oracle::new(2, 1 << 18);
        let c = SocketAddrV4::new(CLIENT_IP, 40000);
        let b = seed_backends()[0];
        let syn = Frame::tcp(c, cluster_ip(), SYN).build();
        assert!(matches!(as_expected(&mut oracle, &syn, b), Expect::New { .. }));
        let rst = Frame::tcp(b, c, RST | ACK).build();
        assert!(matches!(
            as_expected(&mut oracle, &rst, b),
            Expect::Tracked { reply: true, .. }
        ));
        let ack = Frame::tcp(c, cluster_ip(), ACK).build();
        assert!(matches!(expect(&oracle, Prog::TcIngress, &ack), Expect::Tracked { nat, .. } if nat == b));
        assert!(matches!(expect(&oracle, Prog::TcIngress, &syn), Expect::New { .. }));
        // The backend's SYN-ACK on the closed tuple is no Service's reply.
        let syn_ack = Frame::tcp(b, c, SYN | ACK).build();
        assert!(matches!(
            expect(&oracle, Prog::TcIngress, &syn_ack),
            Expect::Pass(Verdict::PassNotService, _)
        ));
    }

    #[test]
    fn fragments_follow_their_first_and_errors_their_flow() {
        let mut oracle = Oracle::new(2, 1 << 18);
        let c = SocketAddrV4::new(CLIENT_IP, 40001);
        let b = seed_backends()[1];
        let datagram = Frame::udp(c, cluster_ip(), &[1; 40]);
        let pieces: Vec<Vec<u8>> = fragments(&datagram, 16).iter().map(Frame::build).collect();
        assert!(matches!(
            expect(&oracle, Prog::TcIngress, &pieces[1]),
            Expect::Pass(Verdict::PassFragmentUntracked, _)
        ));
        assert!(matches!(as_expected(&mut oracle, &pieces[0], b), Expect::New { .. }));
        assert!(matches!(
            expect(&oracle, Prog::TcIngress, &pieces[2]),
            Expect::Tracked {
                packet: Packet::Later(..),
                reply: false,
                ..
            }
        ));
        let dnat = Frame::udp(c, b, &[1; 40]).build();
        let port_unreachable = Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port);
        let error = Frame::icmp_error(*b.ip(), CLIENT_IP, port_unreachable, &dnat[14..14 + 28]).build();
        assert!(matches!(
            expect(&oracle, Prog::TcIngress, &error),
            Expect::IcmpError { reply: true, nat, .. } if nat == cluster_ip()
        ));
    }
}
