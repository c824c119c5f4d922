//! `xproxy trace`: one synthetic packet through the live programs of a
//! running ebpf agent, to see what they do with it.
//!
//! The frame (Ethernet, IPv4, TCP or UDP: [`frame`]) is run with
//! BPF_PROG_TEST_RUN through the very program a pinned link attaches at
//! the chosen hook ([`program`]), so it meets the pinned maps the agent
//! keeps. The report ([`report`]) names the program's return code and the
//! verdict counter it moved, the backend conntrack holds for the flow, and
//! the addresses and ports before and after.
//!
//! A trace changes no state real traffic could see: right after the run,
//! the entries the one frame can have touched (its conntrack pair, its
//! affinity entry, the counters on the CPU it ran on) are put back as they
//! were ([`guard`], which says why this rather than clones of the maps,
//! and what it cannot undo).

mod frame;
mod guard;
mod program;
mod report;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::AsFd,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use bpf_sys::test_run::{self, skb_ctx};
use proxy_common::{CtKey, ServiceKey, ServiceValue, Verdict, maps, xdp_mark::XdpMark};

pub use self::program::HookArg;
use self::{
    frame::Tuple,
    guard::{Effect, Maps},
    program::LiveProgram,
    report::{Report, Undone},
};
use super::Failure;
use crate::{config::DEFAULT_PIN_PATH, mode::ebpf::open_pinned, model::Protocol};

/// `xproxy trace`'s command line.
#[derive(Clone, Debug, clap::Args)]
pub struct Flags {
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_PATH)]
    pub pin_path: PathBuf,
    /// The packet's source; without a port, one no tracked flow uses.
    #[arg(long, value_name = "ADDR[:PORT]", value_parser = parse_source)]
    pub from: Source,
    /// The packet's destination.
    #[arg(long, value_name = "ADDR:PORT")]
    pub to: SocketAddrV4,
    #[arg(long, value_enum, default_value = "tcp")]
    pub proto: ProtoArg,
    /// The interface whose program runs the packet (its XDP program if it
    /// has one, else tc ingress, unless --hook says).
    #[arg(long, value_name = "NAME")]
    pub iface: Option<String>,
    /// The hook; without --iface, the first interface that has it (`pod`:
    /// one that is not an uplink). Default: tc-ingress.
    #[arg(long, value_enum)]
    pub hook: Option<HookArg>,
    /// Send a TCP SYN (a connection's first packet) instead of an ACK; with
    /// `--proto sctp` an INIT instead of a DATA chunk.
    #[arg(long)]
    pub syn: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `--from`: an address and maybe a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source {
    pub addr: Ipv4Addr,
    pub port: Option<u16>,
}

fn parse_source(text: &str) -> Result<Source, String> {
    if let Ok(addr) = text.parse::<SocketAddrV4>() {
        return Ok(Source {
            addr: *addr.ip(),
            port: Some(addr.port()),
        });
    }
    text.parse::<Ipv4Addr>()
        .map(|addr| Source { addr, port: None })
        .map_err(|_| format!("{text:?} is not an IPv4 address with an optional :PORT"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProtoArg {
    Tcp,
    Udp,
    Sctp,
}

impl From<ProtoArg> for Protocol {
    fn from(proto: ProtoArg) -> Self {
        match proto {
            ProtoArg::Tcp => Protocol::Tcp,
            ProtoArg::Udp => Protocol::Udp,
            ProtoArg::Sctp => Protocol::Sctp,
        }
    }
}

/// Source ports a trace picks from when `--from` has none (IANA's dynamic
/// range, above any node port).
const FREE_PORTS: std::ops::RangeInclusive<u16> = 49152..=65535;
/// Large enough for any frame a program leaves (an ICMP answer quotes ours).
const OUT_LEN: usize = 4096;

/// Runs the trace and prints its report.
pub fn trace(flags: &Flags) -> Result<(), Failure> {
    let report = run(flags)?;
    if flags.json {
        let json = serde_json::to_string_pretty(&report).context("rendering the report")?;
        println!("{json}");
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

fn run(flags: &Flags) -> Result<Report> {
    let pin_path = &flags.pin_path;
    program::ensure_pinned(pin_path)?;
    let uplinks = if flags.iface.is_none() {
        uplinks(pin_path)?
    } else {
        Vec::new()
    };
    let live = program::find(pin_path, flags.iface.as_deref(), flags.hook, &uplinks)?;
    let mut maps = Maps::open(pin_path)?;
    let proto = Protocol::from(flags.proto);
    let src_port = match flags.from.port {
        Some(port) => port,
        None => free_port(&maps, flags.from.addr, flags.to, proto)?,
    };
    let tuple = Tuple {
        src: SocketAddrV4::new(flags.from.addr, src_port),
        dst: flags.to,
        proto,
    };
    let frame = frame::build(&tuple, flags.syn);
    let ran = run_undone(&live, &mut maps, &tuple, &frame)?;
    let before = frame::headers(&frame).context("the frame just built is IPv4")?;
    Ok(report_of(live, before, flags.syn && proto != Protocol::Udp, ran))
}

/// The report of a run of the frame with headers `before` through `live`.
fn report_of(live: LiveProgram, before: frame::Headers, syn: bool, ran: Ran) -> Report {
    let Ran {
        code,
        frame: out,
        mark,
        effect,
    } = ran;
    // The forward entry of the frame's flow holds its backend; a reply
    // entry (the frame was a backend's answer) holds the frontend.
    let nat = |reply: bool| {
        let entry = effect.entry.filter(|e| e.is_reply() == reply)?;
        let (addr, port) = entry.nat();
        Some(SocketAddrV4::new(addr, port))
    };
    let (backend, frontend) = (nat(false), nat(true));
    let verdict = effect.verdict;
    Report {
        program: live.hook.program(),
        hook: live.hook,
        iface: live.iface,
        program_id: live.id,
        syn,
        code,
        action: report::action_name(live.hook.is_xdp(), code),
        verdict: verdict.map(Verdict::name),
        meaning: report::meaning(verdict),
        backend,
        frontend,
        before,
        after: frame::headers(&out),
        mark,
        mark_for: report::mark_purpose(mark, effect.entry.as_ref()),
        undone: Undone {
            conntrack_entries: effect.conntrack_undone,
            affinity_entry: effect.affinity_undone,
            counters: verdict.is_some(),
        },
    }
}

/// What one run gave back.
struct Ran {
    code: u32,
    /// The frame as the program left it.
    frame: Vec<u8>,
    /// The skb's mark after a tc program's run; the one XDP left in the
    /// metadata for tc ingress to copy into the skb.
    mark: u32,
    effect: Effect,
}

/// Runs `frame` through the live program and puts back what it changed,
/// also when the run failed.
fn run_undone(live: &LiveProgram, maps: &mut Maps, tuple: &Tuple, frame: &[u8]) -> Result<Ran> {
    let key = ct_key(tuple);
    let mut ctx = (!live.hook.is_xdp()).then(|| skb_context(live));
    let cpu = guard::pin_to_current_cpu()?;
    let before = maps.before(&key, cpu)?;
    let mut out = vec![0; OUT_LEN];
    let run = match ctx.as_mut() {
        Some(ctx) => test_run::prog_test_run_skb(live.fd.as_fd(), frame, &mut out, ctx),
        None => test_run::prog_test_run(live.fd.as_fd(), frame, &mut out),
    };
    let effect = maps
        .undo(before, &key, frame.len())
        .context("undoing the trace's changes")?;
    let run = run.with_context(|| format!("BPF_PROG_TEST_RUN of program {} ({})", live.id, live.hook.program()))?;
    out.truncate(run.out_len.min(OUT_LEN));
    let (mark, frame) = match ctx {
        Some(ctx) => (skb_ctx::get(&ctx, skb_ctx::MARK), out),
        // XDP's output starts with the metadata, if it left a mark there.
        None => {
            let (mark, frame) = XdpMark::split(&out);
            (mark.unwrap_or(0), frame.to_vec())
        }
    };
    Ok(Ran {
        code: run.code,
        frame,
        mark,
        effect,
    })
}

/// The skb a tc program sees: on the interface traced (so that its route
/// lookups start there), arrived on it for an ingress hook. An interface
/// of another network namespace (the pins are global) leaves the skb on
/// the kernel's loopback device, which changes no verdict.
fn skb_context(live: &LiveProgram) -> [u8; skb_ctx::SIZE] {
    let mut ctx = [0; skb_ctx::SIZE];
    let Ok(ifindex) = nix::net::if_::if_nametoindex(live.iface.as_str()) else {
        tracing::warn!(
            iface = live.iface,
            "not in this network namespace: the skb is on loopback"
        );
        return ctx;
    };
    skb_ctx::set(&mut ctx, skb_ctx::IFINDEX, ifindex);
    if live.hook != HookArg::TcEgress {
        skb_ctx::set(&mut ctx, skb_ctx::INGRESS_IFINDEX, ifindex);
    }
    ctx
}

fn ct_key(tuple: &Tuple) -> CtKey {
    CtKey::new(
        *tuple.src.ip(),
        tuple.src.port(),
        *tuple.dst.ip(),
        tuple.dst.port(),
        tuple.proto.number(),
    )
}

/// A source port of `src` whose flow to `dst` conntrack does not track.
fn free_port(maps: &Maps, src: Ipv4Addr, dst: SocketAddrV4, proto: Protocol) -> Result<u16> {
    for port in FREE_PORTS {
        let key = ct_key(&Tuple {
            src: SocketAddrV4::new(src, port),
            dst,
            proto,
        });
        if maps.conntrack_entry(&key)?.is_none() {
            return Ok(port);
        }
    }
    bail!("every source port of {src} to {dst} is tracked: pass --from {src}:PORT")
}

/// The interfaces of this network namespace the agent took for uplinks:
/// those with an XDP link, and those carrying an address that is a Service
/// frontend (a node IP with its node ports).
fn uplinks(pin_path: &Path) -> Result<Vec<String>> {
    let mut names: BTreeSet<String> = program::linked_interfaces(pin_path, maps::PROG_XDP_UPLINK)?
        .into_iter()
        .collect();
    let services: aya::maps::HashMap<_, ServiceKey, ServiceValue> = open_pinned(pin_path, maps::SERVICES)?;
    let frontends: BTreeSet<u32> = services.keys().filter_map(Result::ok).map(|k| k.addr_be).collect();
    // Node ports answer on every local address, the pods' gateway too,
    // which every pod veth carries: only an address one interface alone
    // carries marks an uplink.
    let mut carriers: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for ifaddr in nix::ifaddrs::getifaddrs().context("listing this namespace's addresses")? {
        let Some(addr) = ifaddr.address.as_ref().and_then(|a| a.as_sockaddr_in()) else {
            continue;
        };
        let addr = u32::from_ne_bytes(addr.ip().octets());
        if frontends.contains(&addr) {
            carriers.entry(addr).or_default().push(ifaddr.interface_name);
        }
    }
    names.extend(carriers.into_values().filter(|c| c.len() == 1).flatten());
    Ok(names.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_may_have_a_port() {
        assert_eq!(
            parse_source("10.0.0.1:4000"),
            Ok(Source {
                addr: Ipv4Addr::new(10, 0, 0, 1),
                port: Some(4000)
            })
        );
        assert_eq!(
            parse_source("10.0.0.1"),
            Ok(Source {
                addr: Ipv4Addr::new(10, 0, 0, 1),
                port: None
            })
        );
        assert!(parse_source("10.0.0.1:x").is_err());
        assert!(parse_source("node-1").is_err());
    }

    #[test]
    fn without_pins_the_error_names_the_pin_path() {
        let missing = std::env::temp_dir().join(format!("xproxy-trace-no-pins-{}", std::process::id()));
        let flags = Flags {
            pin_path: missing.clone(),
            from: Source {
                addr: Ipv4Addr::new(10, 244, 0, 14),
                port: None,
            },
            to: "10.96.0.88:88".parse().expect("literal"),
            proto: ProtoArg::Tcp,
            iface: None,
            hook: None,
            syn: true,
            json: false,
        };
        let error = format!("{:#}", run(&flags).expect_err("no agent"));
        assert!(error.contains(&missing.display().to_string()), "{error}");
        assert!(error.contains("xproxy run --mode ebpf"), "{error}");
    }
}
