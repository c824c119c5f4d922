//! Datagrams larger than the MTU and ICMP errors through Services, in the
//! ebpf (tc on the uplink, and native XDP), iptables and nftables modes,
//! on the seed test bed (`testbed::topology`).
//!
//! - Fragments: 4,000- and 60,000-byte UDP datagrams (3 and 41 fragments
//!   at MTU 1,500) from the client pod to a ClusterIP and from the outside
//!   client to a NodePort; the backend echoes each, fragmented too, and
//!   the client must get back exactly what it sent.
//! - ICMP errors: a Service whose backends do not listen on the target
//!   port; the backend's kernel answers with port unreachable, which must
//!   reach the client, through the translation, as ECONNREFUSED on its
//!   connected socket (from the client pod via the ClusterIP, from the
//!   outside client via the NodePort).
//!
//! The modes do not differ here: the kernel modes' conntrack reassembles
//! fragments before NAT and translates ICMP errors of NATed flows; the ebpf
//! mode translates each fragment (`fragments`) and the errors (`icmp_error`).

use std::{
    io,
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use xproxy_tests::{
    agent_harness::{AgentBed, READY_WITHIN, yaml_documents},
    netns::{self, Netns},
    privileged::require_root,
    topology::{BACKENDS, NODE_IP},
};

const ECHO_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 70);
const ECHO_PORT: u16 = 7070;
const ECHO_NODE_PORT: u16 = 30770;
const REFUSING_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 71);
const REFUSING_PORT: u16 = 9;
/// Nothing listens there in the pods.
const CLOSED_PORT: u16 = 9999;
const REFUSING_NODE_PORT: u16 = 30771;
const SIZES: [usize; 2] = [4000, 60_000];
const TIMEOUT: Duration = Duration::from_secs(3);

/// A UDP NodePort Service to `target_port` on every backend pod.
fn udp_service(name: &str, cluster_ip: Ipv4Addr, port: u16, target_port: u16, node_port: u16) -> [Value; 2] {
    let endpoints: Vec<Value> = BACKENDS
        .iter()
        .map(|(_, ip)| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": "xproxy-node"}))
        .collect();
    [
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"type": "NodePort", "clusterIP": cluster_ip.to_string(), "selector": {"app": name},
                     "ports": [{"port": port, "targetPort": target_port, "protocol": "UDP", "nodePort": node_port}]},
        }),
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{name}-1"), "namespace": "default",
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"port": target_port, "protocol": "UDP"}],
            "endpoints": endpoints,
        }),
    ]
}

/// A UDP echo server in a pod: every datagram goes back to its sender.
struct Echo {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Echo {
    fn start(ns: &Netns, port: u16) -> Result<Self> {
        let path: PathBuf = ns.path().to_owned();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let bound = netns::enter(&path)
                .map_err(|e| format!("{e:#}"))
                .and_then(|()| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)).map_err(|e| e.to_string()));
            let socket = match bound {
                Ok(socket) => socket,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = socket.set_read_timeout(Some(Duration::from_millis(100)));
            let _ = ready_tx.send(Ok(()));
            let mut buf = vec![0u8; 65_536];
            while !stopped.load(Ordering::Relaxed) {
                if let Ok((n, peer)) = socket.recv_from(&mut buf) {
                    let _ = socket.send_to(&buf[..n], peer);
                }
            }
        });
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => Ok(Self {
                stop,
                thread: Some(thread),
            }),
            Ok(Err(e)) => bail!("UDP echo on {port}: {e}"),
            Err(e) => bail!("UDP echo on {port} did not start: {e}"),
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Sends `len` bytes in one datagram to `to` and waits for the echo.
fn echo_once(to: SocketAddrV4, len: usize) -> io::Result<Vec<u8>> {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    socket.connect(to)?;
    socket.set_read_timeout(Some(TIMEOUT))?;
    let sent: Vec<u8> = (0..len).map(|i| (i * 31 % 253) as u8).collect();
    socket.send(&sent)?;
    let mut buf = vec![0u8; 65_536];
    let n = socket.recv(&mut buf)?;
    buf.truncate(n);
    if buf != sent {
        return Err(io::Error::other(format!("{n} bytes came back, not the {len} sent")));
    }
    Ok(buf)
}

/// What a connected socket's request to `to` ends with.
fn refusal(to: SocketAddrV4) -> io::Result<String> {
    netns::udp_request(to, TIMEOUT)
}

fn traffic(label: &str, mode: &str, extra: &[&str]) {
    if !require_root(label) {
        return;
    }
    let mut bed = AgentBed::new(label).unwrap_or_else(|e| panic!("{label}: test bed: {e:#}"));
    if let Err(e) = run(&mut bed, mode, extra) {
        panic!("{label}: {e:#}\nagent log:\n{}", bed.log());
    }
}

fn run(bed: &mut AgentBed, mode: &str, extra: &[&str]) -> Result<()> {
    let _echoes: Vec<Echo> = bed
        .topo
        .backends
        .iter()
        .map(|pod| Echo::start(&pod.ns, ECHO_PORT))
        .collect::<Result<_>>()?;
    let mut objects = udp_service("dgram", ECHO_IP, ECHO_PORT, ECHO_PORT, ECHO_NODE_PORT).to_vec();
    objects.extend(udp_service(
        "refusing",
        REFUSING_IP,
        REFUSING_PORT,
        CLOSED_PORT,
        REFUSING_NODE_PORT,
    ));
    bed.write_manifest("traffic.yaml", &yaml_documents(&objects))?;
    let mut args = bed.manifest_args();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    bed.start_agent_in(mode, &args)?;
    bed.wait_first_sync(READY_WITHIN)?;

    let paths = [
        (
            "client pod -> ClusterIP",
            &bed.topo.client_pod.ns,
            ECHO_IP,
            ECHO_PORT,
            REFUSING_IP,
            REFUSING_PORT,
        ),
        (
            "client -> NodePort",
            &bed.topo.client,
            NODE_IP,
            ECHO_NODE_PORT,
            NODE_IP,
            REFUSING_NODE_PORT,
        ),
    ];
    for (path, ns, ip, port, refusing_ip, refusing_port) in paths {
        let to = SocketAddrV4::new(ip, port);
        for len in SIZES {
            netns::wait_for(&format!("{path}: a {len}-byte datagram echoed"), READY_WITHIN, || {
                ns.run_in(|| echo_once(to, len))
                    .map_err(|e| format!("{e:#}"))?
                    .map_err(|e| e.to_string())
            })
            .with_context(|| format!("{path}, {len} bytes"))?;
            // Once programmed, every datagram makes it.
            for _ in 0..5 {
                ns.run_in(|| echo_once(to, len))?
                    .with_context(|| format!("{path}: a {len}-byte datagram"))?;
            }
        }
        let refusing = SocketAddrV4::new(refusing_ip, refusing_port);
        for _ in 0..3 {
            match ns.run_in(|| refusal(refusing))? {
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
                other => bail!("{path}: UDP to {refusing}, whose backends do not listen: {other:?}, not ECONNREFUSED"),
            }
        }
    }
    ensure!(bed.agent_alive().is_ok(), "the agent died");
    Ok(())
}

#[test]
fn traffic_ebpf() {
    traffic("traffic_ebpf", "ebpf", &[]);
}

#[test]
fn traffic_ebpf_native_xdp() {
    traffic("traffic_ebpf_native_xdp", "ebpf", &["--xdp", "native"]);
}

#[test]
fn traffic_iptables() {
    traffic("traffic_iptables", "iptables", &[]);
}

#[test]
fn traffic_nftables() {
    traffic("traffic_nftables", "nftables", &[]);
}
