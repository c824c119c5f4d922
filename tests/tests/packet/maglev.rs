//! Maglev in the data path (issue 15 item 2): new flows of a frontend
//! that selects Maglev take their backend from the agent's table, so one
//! of 20 backends leaving moves few flows, and it coming back restores
//! every flow's backend; another node with the same endpoints picks the
//! same backend for the same flow.

use std::collections::BTreeMap;

use proxy_common::service::FLAG_MAGLEV;
use proxy_userspace::model::LbAlgorithm;

use super::*;

const MAGLEV_TCP: &str = "default/maglev:http";
const MAGLEV_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
const MAGLEV_PORT: u16 = 80;
const FLOWS: usize = 10_000;

fn maglev_service(backends: &[SocketAddrV4]) -> ServicePort {
    ServicePort {
        lb_algorithm: Some(LbAlgorithm::Maglev),
        ..service(MAGLEV_TCP, Protocol::Tcp, MAGLEV_IP, MAGLEV_PORT, None, backends)
    }
}

/// 20 endpoints of one Service port.
fn twenty_backends() -> Vec<SocketAddrV4> {
    (0..20).map(|i| addr(Ipv4Addr::new(10, 244, 3, 10 + i), 8080)).collect()
}

/// `FLOWS` SYNs from distinct clients: 40 source addresses x 250 ports.
fn synthetic_flows() -> Vec<Vec<u8>> {
    let frontend = addr(MAGLEV_IP, MAGLEV_PORT);
    (0..FLOWS)
        .map(|i| {
            let client = addr(
                Ipv4Addr::new(10, 244, 100, (i / 250) as u8 + 1),
                30_000 + (i % 250) as u16,
            );
            Frame::tcp(client, frontend, SYN).build()
        })
        .collect()
}

/// Each flow's backend, as a new flow (conntrack is emptied first, so
/// every flow is picked anew); half through XDP, half through tc: both
/// programs pick by the same table.
fn pick_all(h: &mut Harness, flows: &[Vec<u8>]) -> Vec<SocketAddrV4> {
    forget_flows(h);
    (flows.iter().enumerate())
        .map(|(i, frame)| {
            let prog = if i % 2 == 0 { Prog::XdpUplink } else { Prog::TcIngress };
            let out = h.run(prog, frame);
            assert!(
                prog.dnat_code_ok(out.code),
                "flow {i} via {}: code {}",
                prog.name(),
                out.code
            );
            dnat_dst(&out)
        })
        .collect()
}

fn forget_flows(h: &mut Harness) {
    let mut conntrack = pinned_conntrack(h);
    for (key, _) in h.conntrack() {
        conntrack.remove(&key).expect("deleting a conntrack entry");
    }
}

fn flows_per_backend(picks: &[SocketAddrV4]) -> BTreeMap<SocketAddrV4, usize> {
    let mut out = BTreeMap::new();
    for b in picks {
        *out.entry(*b).or_default() += 1;
    }
    out
}

/// The figure: 20 backends, 10,000 flows; one backend leaves:
/// at most 1/20 + 2% of the flows change backend (its own, and at most
/// 2% of the others'); it comes back: every flow has its first backend.
#[test]
fn maglev_moves_few_flows_when_one_of_20_backends_leaves() {
    if !require_root("maglev_moves_few_flows_when_one_of_20_backends_leaves") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    let all = twenty_backends();
    h.sync(&maglev_service(&all));
    let frontend = h.maps.frontend(MAGLEV_IP, MAGLEV_PORT, proxy_common::proto::TCP);
    assert_ne!(
        frontend.map_or(0, |f| f.flags & FLAG_MAGLEV),
        0,
        "the frontend selects Maglev"
    );
    let flows = synthetic_flows();
    let first = pick_all(&mut h, &flows);
    let shares = flows_per_backend(&first);
    assert_eq!(shares.len(), 20, "every backend gets flows: {shares:?}");
    assert!(
        shares.values().all(|n| (350..=650).contains(n)),
        "about 500 flows a backend: {shares:?}"
    );

    let removed = all[7];
    let rest: Vec<SocketAddrV4> = all.iter().copied().filter(|b| *b != removed).collect();
    h.sync(&maglev_service(&rest));
    let second = pick_all(&mut h, &flows);
    assert!(!second.contains(&removed));
    let on_removed = first.iter().filter(|b| **b == removed).count();
    let moved = first.iter().zip(&second).filter(|(a, b)| a != b).count();
    let others_moved = moved - on_removed;
    eprintln!(
        "maglev: {moved} of {FLOWS} flows moved when 1 of 20 backends left \
         ({on_removed} were on it, {others_moved} of the others' moved)"
    );
    assert!(
        moved * 100 <= FLOWS * 7,
        "{moved} flows moved, more than 1/20 + 2% of {FLOWS} ({on_removed} on the removed backend)"
    );

    h.sync(&maglev_service(&all));
    let third = pick_all(&mut h, &flows);
    let differ = first.iter().zip(&third).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "re-adding the backend restores every flow's backend");
}

/// Another node, whose agent learned the endpoints in another order (its
/// backend ids differ), picks the same backend for every flow; a frontend
/// without the annotation picks at random (not by the table).
#[test]
fn maglev_picks_the_same_backend_on_every_node() {
    if !require_root("maglev_picks_the_same_backend_on_every_node") {
        return;
    }
    let all = twenty_backends();
    let mut reversed = all.clone();
    reversed.reverse();
    let mut node_a = Harness::new(vec![NODE_IP]);
    let mut node_b = Harness::new(vec![NODE_IP]);
    node_a.sync(&maglev_service(&all));
    node_b.sync(&maglev_service(&reversed));
    let flows: Vec<Vec<u8>> = synthetic_flows().into_iter().step_by(10).collect();
    let a = pick_all(&mut node_a, &flows);
    assert_eq!(a, pick_all(&mut node_b, &flows), "both nodes pick alike");

    // Random: the same flows picked twice mostly differ.
    node_a.sync(&ServicePort {
        lb_algorithm: Some(LbAlgorithm::Random),
        ..maglev_service(&all)
    });
    let random = pick_all(&mut node_a, &flows);
    let same = a.iter().zip(&random).filter(|(x, y)| x == y).count();
    assert!(
        same < flows.len() / 5,
        "{same} of {} random picks matched Maglev's",
        flows.len()
    );
}
