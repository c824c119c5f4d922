//! Maglev live (issue 15 item 2): the real agent in the ebpf mode on the
//! test bed, a Service annotated `xproxy.io/lb-algorithm: maglev`, UDP
//! requests from fixed source ports. Each new flow must reach the backend
//! the Maglev table predicts for its 5-tuple (computed here with the
//! agent's table builder and the programs' flow hash), from a pod to the
//! ClusterIP (tc) and from outside to the NodePort (the uplink), over IPv4
//! and over IPv6 (the Service is dual-stack: each half has a table of its
//! family's endpoints); with the annotation switched to `random` the picks
//! no longer follow the table.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use proxy_common::{
    ipv6::addr6_be,
    maglev::{flow_hash, flow_hash6},
    proto,
};
use proxy_userspace::mode::ebpf::maglev;
use serde_json::{Value, json};
use testbed::{
    agent_bed::{AgentBed, READY_WITHIN, on_own_bed},
    fixtures::{
        NODE_NAME, PortDef, backend_ips, backend_ips6, dual_stack, on_node, service_with, slice_with, slice6_with,
        yaml_documents,
    },
    netns::{self, Netns},
    probe::{Protocol, REQUEST_TIMEOUT},
    topology::{BACKENDS, CLIENT_IP, CLIENT_IP6, CLIENT_POD, NODE_IP, NODE_IP6, TARGET_PORT, pod_ipv6},
};

const MANIFEST: &str = "maglev.yaml";
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 40);
const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 1, 0x40);
const PORT: u16 = 88;
const NODE_PORT: u16 = 30840;
/// Flows per place and phase: were the picks random among 3, all of them
/// matching the table would have a chance of (1/3)^30.
const FLOWS: u16 = 30;

fn objects(algorithm: &str) -> Vec<Value> {
    let ports = [PortDef {
        name: None,
        protocol: Protocol::Udp,
        port: PORT,
        target_port: TARGET_PORT,
        node_port: Some(NODE_PORT),
    }];
    let mut svc = service_with("maglev", CLUSTER_IP, &ports, None);
    svc["metadata"]["annotations"] = json!({"xproxy.io/lb-algorithm": algorithm});
    let endpoints6: Vec<(Ipv6Addr, &str)> = backend_ips6().into_iter().map(|ip| (ip, NODE_NAME)).collect();
    vec![
        dual_stack(svc, CLUSTER_IP6),
        slice_with("maglev-1", "maglev", &ports, &on_node(&backend_ips())),
        slice6_with("maglev-6", "maglev", &ports, &endpoints6),
    ]
}

/// The backend (pod name) the table of the bed's three endpoints of the
/// flow's family gives a UDP flow from `client` to `frontend`.
fn predicted(client: SocketAddr, frontend: SocketAddr) -> Result<&'static str> {
    let members: Vec<maglev::Member> = (0..)
        .zip(BACKENDS)
        .map(|(id, (_, addr))| maglev::Member {
            id,
            addr: if client.is_ipv4() {
                addr.into()
            } else {
                pod_ipv6(addr).into()
            },
            port: TARGET_PORT,
        })
        .collect();
    let table = maglev::table(&members).context("a table for 3 endpoints")?;
    let (sport, dport) = (client.port().to_be(), frontend.port().to_be());
    let hash = match (client.ip(), frontend.ip()) {
        (IpAddr::V4(c), IpAddr::V4(f)) => {
            let be = |ip: Ipv4Addr| u32::from_ne_bytes(ip.octets());
            flow_hash(be(c), be(f), sport, dport, proto::UDP)
        }
        (IpAddr::V6(c), IpAddr::V6(f)) => flow_hash6(&addr6_be(c), &addr6_be(f), sport, dport, proto::UDP),
        _ => anyhow::bail!("{client} and {frontend} are of two families"),
    };
    let id = table[(hash % table.len() as u32) as usize];
    Ok(BACKENDS[id as usize].0)
}

/// How many of [`FLOWS`] new flows from `from` (address `source`, ports
/// from `first_port` on) to `to` reached the predicted backend.
fn matching_flows(from: &Netns, source: IpAddr, first_port: u16, to: SocketAddr) -> Result<u16> {
    let mut matching = 0;
    for port in first_port..first_port + FLOWS {
        let answer = from
            .run_in(|| netns::udp_request_from(port, to, REQUEST_TIMEOUT))?
            .with_context(|| format!("a request from {source}:{port} to {to}"))?;
        if answer == predicted(SocketAddr::new(source, port), to)? {
            matching += 1;
        }
    }
    Ok(matching)
}

#[test]
fn maglev_picks_the_tables_backend_for_every_new_flow() {
    if !testbed::privileged::require_root("maglev_picks_the_tables_backend_for_every_new_flow") {
        return;
    }
    on_own_bed("maglev_live", |bed, checks| {
        start(bed, &objects("maglev"))?;
        let pod = &bed.topo.client_pod.ns;
        let client = &bed.topo.client;
        let pod_ip = CLIENT_POD.1;
        let families: [(IpAddr, IpAddr, IpAddr, IpAddr); 2] = [
            (pod_ip.into(), CLUSTER_IP.into(), CLIENT_IP.into(), NODE_IP.into()),
            (
                pod_ipv6(pod_ip).into(),
                CLUSTER_IP6.into(),
                CLIENT_IP6.into(),
                NODE_IP6.into(),
            ),
        ];
        for (pod_source, cluster_ip, client_source, node_ip) in families {
            let cluster = SocketAddr::new(cluster_ip, PORT);
            let node_port = SocketAddr::new(node_ip, NODE_PORT);
            checks.check(
                &format!("client pod -> ClusterIP {cluster}: {FLOWS} UDP flows, each on the table's backend"),
                all_match(matching_flows(pod, pod_source, 40_000, cluster)),
            );
            checks.check(
                &format!("client -> NodePort {node_port}: {FLOWS} UDP flows, each on the table's backend"),
                all_match(matching_flows(client, client_source, 40_000, node_port)),
            );
        }
        let cluster = SocketAddr::new(CLUSTER_IP.into(), PORT);
        let pod_ip = IpAddr::from(pod_ip);
        bed.write_manifest(MANIFEST, &yaml_documents(&objects("random")))?;
        // Until the agent has synced the change, new flows still follow
        // the table: wait for one that does not, within a few tries.
        checks.check(
            "annotation random: new flows no longer follow the table",
            netns::wait_for("a pick off the table", READY_WITHIN, || {
                match matching_flows(pod, pod_ip, fresh_ports(), cluster) {
                    Ok(n) if n < FLOWS - 5 => Ok(format!("{n} of {FLOWS} on the table's backend")),
                    Ok(n) => Err(format!("{n} of {FLOWS} still on the table's backend")),
                    Err(e) => Err(format!("{e:#}")),
                }
            }),
        );
        Ok(())
    });
}

/// A block of source ports no earlier flow of the test used (UDP flows
/// stay tracked, and a tracked flow keeps its backend).
fn fresh_ports() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(41_000);
    NEXT.fetch_add(FLOWS, Ordering::Relaxed)
}

fn all_match(matching: Result<u16>) -> Result<String> {
    let matching = matching?;
    ensure!(matching == FLOWS, "{matching} of {FLOWS} flows on the table's backend");
    Ok(format!("{FLOWS} of {FLOWS}"))
}

/// Starts the agent on `objects` and waits until the NodePort answers
/// over UDP (from a source port the measured flows do not use).
fn start(bed: &mut AgentBed, objects: &[Value]) -> Result<()> {
    bed.write_manifest(MANIFEST, &yaml_documents(objects))?;
    bed.start_agent_in("ebpf", &bed.manifest_args())?;
    bed.wait_first_sync(READY_WITHIN)?;
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let client = &bed.topo.client;
    netns::wait_for(&format!("{node_port} to answer over UDP"), READY_WITHIN, || {
        let answer = client
            .run_in(|| netns::udp_request_from(39_999, node_port, Duration::from_millis(500)))
            .map_err(|e| format!("{e:#}"))?
            .map_err(|e| e.to_string())?;
        if BACKENDS.iter().any(|(name, _)| *name == answer) {
            Ok(())
        } else {
            Err(format!("answered {answer:?}"))
        }
    })
}
