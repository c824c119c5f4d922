//! Runs frames through the real programs with BPF_PROG_TEST_RUN.
//!
//! A [`Harness`] loads the embedded object into a fresh [`PinDir`], opens the
//! maps through [`ServiceMaps`] (the only way tests fill them) and runs
//! frames through one of the three programs, returning the verdict code and
//! the frame as the program left it.

use std::net::{Ipv4Addr, SocketAddrV4};

use aya::programs::{ProgramError, TestRun, TestRunOptions};
use proxy_common::{CtKey, CtValue, Verdict, VerdictCounter, maps, xdp_mark::XdpMark};
use proxy_userspace::{
    mode::ebpf::{Datapath, LoadOptions, ServiceMaps},
    model::{Protocol, ServicePort},
};

pub use crate::fixtures::ports::service_port as service;
use crate::privileged::PinDir;

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;

/// The seed Service: `default/nginx-service`, ClusterIP 10.96.0.10 port 88
/// (TCP and UDP), nodePort 30791 on node 192.168.50.10, three pods on port 80.
pub const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const SERVICE_PORT: u16 = 88;
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 10);
pub const NODE_PORT: u16 = 30791;
pub const BACKEND_IPS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(10, 244, 0, 11),
    Ipv4Addr::new(10, 244, 0, 12),
    Ipv4Addr::new(10, 244, 0, 13),
];
pub const BACKEND_PORT: u16 = 80;
pub const SEED_TCP: &str = "default/nginx-service:http";
pub const SEED_UDP: &str = "default/nginx-service:dns";

/// A Service without endpoints (TCP and UDP port 80, nodePort 30800).
pub const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
pub const EMPTY_PORT: u16 = 80;
pub const EMPTY_NODE_PORT: u16 = 30800;

/// A TCP-only Service (port 443 -> 10.244.0.21:8443), for "wrong protocol".
pub const TCP_ONLY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
pub const TCP_ONLY_PORT: u16 = 443;
pub const TCP_ONLY_BACKEND: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 0, 21), 8443);

/// A pod that acts as the client.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 5);
/// An external client (NodePort traffic).
pub const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 7);

pub fn cluster_ip() -> SocketAddrV4 {
    SocketAddrV4::new(CLUSTER_IP, SERVICE_PORT)
}

pub fn node_port() -> SocketAddrV4 {
    SocketAddrV4::new(NODE_IP, NODE_PORT)
}

pub fn seed_backends() -> Vec<SocketAddrV4> {
    BACKEND_IPS
        .iter()
        .map(|ip| SocketAddrV4::new(*ip, BACKEND_PORT))
        .collect()
}

/// The seed Service (TCP and UDP), the no-endpoint Service and the TCP-only one.
pub fn seed_services() -> Vec<ServicePort> {
    let backends = seed_backends();
    vec![
        service(
            SEED_TCP,
            Protocol::Tcp,
            CLUSTER_IP,
            SERVICE_PORT,
            Some(NODE_PORT),
            &backends,
        ),
        service(
            SEED_UDP,
            Protocol::Udp,
            CLUSTER_IP,
            SERVICE_PORT,
            Some(NODE_PORT),
            &backends,
        ),
        service(
            "default/empty:http",
            Protocol::Tcp,
            EMPTY_IP,
            EMPTY_PORT,
            Some(EMPTY_NODE_PORT),
            &[],
        ),
        service(
            "default/empty:dns",
            Protocol::Udp,
            EMPTY_IP,
            EMPTY_PORT,
            Some(EMPTY_NODE_PORT),
            &[],
        ),
        service(
            "default/tcp-only:https",
            Protocol::Tcp,
            TCP_ONLY_IP,
            TCP_ONLY_PORT,
            None,
            &[TCP_ONLY_BACKEND],
        ),
    ]
}

/// The three programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prog {
    XdpUplink,
    TcIngress,
    TcEgress,
}

impl Prog {
    pub const ALL: [Prog; 3] = [Prog::XdpUplink, Prog::TcIngress, Prog::TcEgress];

    pub fn name(self) -> &'static str {
        match self {
            Prog::XdpUplink => maps::PROG_XDP_UPLINK,
            Prog::TcIngress => maps::PROG_TC_INGRESS,
            Prog::TcEgress => maps::PROG_TC_EGRESS,
        }
    }

    /// The code for "pass it on untouched".
    pub fn pass(self) -> u32 {
        match self {
            Prog::XdpUplink => XDP_PASS,
            Prog::TcIngress | Prog::TcEgress => TC_ACT_OK,
        }
    }

    /// The code for "drop it".
    pub fn drop(self) -> u32 {
        match self {
            Prog::XdpUplink => XDP_DROP,
            Prog::TcIngress | Prog::TcEgress => TC_ACT_SHOT,
        }
    }

    /// The code for "send the answer back" (RST / ICMP).
    pub fn reject(self) -> u32 {
        match self {
            Prog::XdpUplink => XDP_TX,
            Prog::TcIngress | Prog::TcEgress => TC_ACT_REDIRECT,
        }
    }

    /// Whether `code` is allowed after a forward DNAT: pass, or for tc_egress
    /// also a redirect to the backend's interface.
    pub fn dnat_code_ok(self, code: u32) -> bool {
        code == self.pass() || (self == Prog::TcEgress && code == TC_ACT_REDIRECT)
    }
}

/// The size of the uapi `struct __sk_buff` (192 bytes since Linux 5.16).
const SK_BUFF_LEN: usize = 192;

/// What a program returned and the frame it left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    pub code: u32,
    pub frame: Vec<u8>,
}

impl Output {
    /// The mark an XDP run left in the metadata in front of the frame, for
    /// tc ingress to copy into the skb; `None` if it left none.
    pub fn xdp_mark(&self) -> Option<u32> {
        XdpMark::split(&self.frame).0
    }

    /// The output without the metadata XDP left in front of its frame.
    pub fn without_meta(&self) -> Output {
        Output {
            code: self.code,
            frame: XdpMark::split(&self.frame).1.to_vec(),
        }
    }
}

/// A loaded data path in its own pin directory, with its maps opened.
/// Fields drop in order: maps and programs before the pin directory.
pub struct Harness {
    pub maps: ServiceMaps,
    datapath: Datapath,
    next_port: u16,
    out_buf: Vec<u8>,
    pin: PinDir,
}

/// Large enough for any output: test frames are far below a page.
const OUT_BUF_LEN: usize = 8192;

impl Harness {
    /// Loads the programs into a fresh pin directory; NodePorts are
    /// programmed on `node_ips`. Panics with context on failure.
    pub fn new(node_ips: Vec<Ipv4Addr>) -> Self {
        Self::with_snat_mark(node_ips, 0)
    }

    /// [`Self::new`] with the SNAT fallback on: flows that need it are
    /// marked with `snat_mark` (on the skb; XDP leaves it in the metadata).
    pub fn with_snat_mark(node_ips: Vec<Ipv4Addr>, snat_mark: u32) -> Self {
        Self::with_options(
            node_ips,
            LoadOptions {
                snat_mark,
                ..LoadOptions::default()
            },
        )
    }

    /// [`Self::new`] with the programs loaded with `options`.
    pub fn with_options(node_ips: Vec<Ipv4Addr>, options: LoadOptions) -> Self {
        let pin = PinDir::new();
        let datapath = Datapath::load_with(pin.path(), &options)
            .unwrap_or_else(|e| panic!("loading the data path into {}: {e:#}", pin.path().display()));
        let maps = ServiceMaps::open(pin.path(), node_ips.into_iter().map(Into::into).collect())
            .unwrap_or_else(|e| panic!("opening the maps in {}: {e:#}", pin.path().display()));
        Self {
            maps,
            datapath,
            next_port: 20000,
            out_buf: vec![0; OUT_BUF_LEN],
            pin,
        }
    }

    /// A harness with [`seed_services`] programmed on node [`NODE_IP`].
    pub fn seeded() -> Self {
        Self::seeded_on(Self::new(vec![NODE_IP]))
    }

    /// [`Self::seeded`] with the data path loaded with `options`.
    pub fn seeded_with(options: LoadOptions) -> Self {
        Self::seeded_on(Self::with_options(vec![NODE_IP], options))
    }

    fn seeded_on(mut h: Self) -> Self {
        for svc in seed_services() {
            h.sync(&svc);
        }
        h
    }

    pub fn pin_dir(&self) -> &std::path::Path {
        self.pin.path()
    }

    pub fn sync(&mut self, svc: &ServicePort) {
        self.maps
            .sync_service(svc)
            .unwrap_or_else(|e| panic!("sync_service {}: {e:#}", svc.name));
    }

    /// A client port no earlier call returned, so cases do not share flows.
    pub fn next_port(&mut self) -> u16 {
        let port = self.next_port;
        self.next_port = self.next_port.checked_add(1).expect("out of client ports");
        port
    }

    /// Runs `frame` through `prog` once.
    pub fn try_run(&mut self, prog: Prog, frame: &[u8]) -> Result<Output, ProgramError> {
        self.test_run(prog, frame, None)
    }

    /// Runs `frame` through a tc program once and returns, beside its
    /// output, the mark it left on the skb (the kernel writes the skb's
    /// fields back into `struct __sk_buff`, whose `mark` is at byte 8).
    pub fn run_tc_marked(&mut self, prog: Prog, frame: &[u8]) -> (Output, u32) {
        assert!(prog != Prog::XdpUplink, "XDP has no skb to mark");
        let mut skb = [0u8; SK_BUFF_LEN];
        let out = self
            .test_run(prog, frame, Some(&mut skb))
            .unwrap_or_else(|e| panic!("test_run of {}: {e:#?}", prog.name()));
        (out, u32::from_ne_bytes([skb[8], skb[9], skb[10], skb[11]]))
    }

    /// One test run of `frame` through `prog`; the program's context is
    /// written back into `ctx_out` if given.
    fn test_run(&mut self, prog: Prog, frame: &[u8], ctx_out: Option<&mut [u8]>) -> Result<Output, ProgramError> {
        let opts = TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut self.out_buf),
            ctx_out,
            ..TestRunOptions::default()
        };
        let result = match prog {
            Prog::XdpUplink => self.datapath.xdp().expect("xdp_uplink is loaded").test_run(opts)?,
            Prog::TcIngress | Prog::TcEgress => self
                .datapath
                .tc(prog.name())
                .expect("tc program is loaded")
                .test_run(opts)?,
        };
        let len = result.data_size_out as usize;
        assert!(
            len <= OUT_BUF_LEN,
            "{}: output of {len} bytes overflowed the buffer",
            prog.name()
        );
        Ok(Output {
            code: result.return_value,
            frame: self.out_buf[..len].to_vec(),
        })
    }

    /// Runs `frame` through `prog` once; panics if the kernel refuses it.
    pub fn run(&mut self, prog: Prog, frame: &[u8]) -> Output {
        self.try_run(prog, frame).unwrap_or_else(|e| {
            panic!(
                "test_run of {} on {} failed: {e:#?}",
                prog.name(),
                crate::frame::hex(frame)
            )
        })
    }

    /// The summed per-CPU counters, indexed by `Verdict as usize`.
    pub fn counts(&self) -> [VerdictCounter; Verdict::COUNT as usize] {
        let mut out = [VerdictCounter::default(); Verdict::COUNT as usize];
        for (verdict, counter) in self.maps.verdict_counts().expect("reading the stats map") {
            out[verdict as usize] = counter;
        }
        out
    }

    pub fn conntrack(&self) -> Vec<(CtKey, CtValue)> {
        self.maps.conntrack_entries().expect("dumping conntrack")
    }

    /// Takes a Service port out of the maps.
    pub fn remove(&mut self, svc: &ServicePort) {
        self.maps
            .remove_port(svc)
            .unwrap_or_else(|e| panic!("removing {}: {e:#}", svc.name));
    }

    /// What the ebpf mode does after each sync: deletes the conntrack
    /// entries of UDP flows whose backend left; returns how many.
    pub fn delete_stale_udp_flows(&self) -> u64 {
        proxy_userspace::mode::ebpf::stale_flows::delete_stale_udp_flows(self.pin.path(), &self.maps)
            .expect("deleting stale UDP flows")
    }
}

/// Whether the kernel's BPF_PROG_TEST_RUN may refuse `frame` for `prog`
/// with EINVAL before the program runs. Every program type refuses frames
/// under 14 bytes. For skb programs (tc) recent kernels also refuse an IPv4
/// ether type with fewer than 20 bytes after the Ethernet header, and an
/// IPv6 one with fewer than 40 (`bpf_prog_test_run_skb`; seen on 6.18 and on
/// Debian's 6.1.192, so probably a stable backport).
/// Real tc hooks do see such frames; only XDP can test them here.
pub fn kernel_may_refuse(prog: Prog, frame: &[u8]) -> bool {
    if frame.len() < 14 {
        return true;
    }
    if prog == Prog::XdpUplink {
        return false;
    }
    let ether_type = u16::from_be_bytes([frame[12], frame[13]]);
    match ether_type {
        0x0800 => frame.len() < 14 + 20,
        0x86dd => frame.len() < 14 + 40,
        _ => false,
    }
}

/// The errno of a failed test run, if it was a syscall error.
pub fn errno(e: &ProgramError) -> Option<i32> {
    match e {
        ProgramError::SyscallError(s) => s.io_error.raw_os_error(),
        _ => None,
    }
}
