//! The Service writer on maps in memory, without root: what it writes is
//! read back with the snapshot reader (`xproxy status`'s) and compared,
//! as `dump`'s text, with what the model says each frontend reaches.
//! Covered: adopting the maps of an agent before, backend ids shared by
//! Service ports, the order of a flush (no packet ever finds a frontend
//! torn), full maps and failed writes (an error, nothing half-visible, the
//! next sync recovers). Every scenario holds an IPv6 Service port beside
//! the IPv4 ones (the IPv6 half of a dual-stack Service): its frontends and
//! backends go to the IPv6 maps, sharing slots and ids with the rest.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::Result;
use proxy_common::{Backend, BackendSlotKey, RevNat};

use super::{BackendsArray, FaultyMaps, LbMaps, MemoryMaps, ServiceMaps, Table};
use crate::{
    dump::{BackendRow, FrontendRow, Snapshot, render_services},
    model::{Endpoint, EndpointSets, Protocol, ServicePort, TrafficPolicy},
};

const NODE_IPS: [IpAddr; 3] = [
    IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)),
    IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x192, 0, 0, 0, 0, 0, 1)),
];
const THIS_NODE: &str = "node-a";

fn ep(last: u8, node: &str) -> Endpoint {
    Endpoint {
        node_name: Some(node.into()),
        ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 8080)
    }
}

/// An IPv6 endpoint: fd00:244::`last`.
fn ep6(last: u16, node: &str) -> Endpoint {
    Endpoint {
        node_name: Some(node.into()),
        ..Endpoint::ready(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, last), 8080)
    }
}

/// The IPv6 half of a dual-stack Service, ClusterIP fd00:96::`vip`.
fn port6(name: &str, vip: u16, node_port: Option<u16>, endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: format!("default/{name}:http{}", crate::model::IPV6_SUFFIX),
        cluster_ip: Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, vip).into(),
        ..port(name, 0, node_port, endpoints)
    }
}

fn port(name: &str, vip: u8, node_port: Option<u16>, endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: format!("default/{name}:http"),
        cluster_ip: Ipv4Addr::new(10, 96, 0, vip).into(),
        port: 80,
        node_port,
        endpoints,
        ..ServicePort::default()
    }
}

/// Four Service ports: a NodePort one, a ClusterIP one sharing two of its
/// endpoints, a UDP one with a `Local` external policy, and the IPv6 half
/// of the first.
fn desired_a() -> Vec<ServicePort> {
    let dns = ServicePort {
        protocol: Protocol::Udp,
        port: 53,
        external_policy: TrafficPolicy::Local,
        ..port("dns", 3, Some(30053), vec![ep(20, THIS_NODE), ep(21, "node-b")])
    };
    vec![
        port(
            "web",
            1,
            Some(30080),
            vec![ep(1, THIS_NODE), ep(2, "node-b"), ep(3, "node-b")],
        ),
        port("api", 2, None, vec![ep(2, "node-b"), ep(3, "node-b")]),
        dns,
        port6("web", 1, Some(30080), vec![ep6(1, THIS_NODE), ep6(2, "node-b")]),
    ]
}

/// `desired_a` changed every way at once: one port gone, one new of each
/// family, one of each with other endpoints, one with a new node port.
fn desired_b() -> Vec<ServicePort> {
    let mut ports = desired_a();
    ports.remove(1);
    ports[0].endpoints = vec![ep(3, "node-b"), ep(4, THIS_NODE), ep(5, "node-b"), ep(6, "node-b")];
    ports[1].node_port = Some(30054);
    ports[2].endpoints = vec![ep6(2, "node-b"), ep6(3, "node-b"), ep6(4, THIS_NODE)];
    ports.push(port("new", 4, Some(30081), vec![ep(7, THIS_NODE), ep(8, "node-b")]));
    ports.push(port6("new", 4, None, vec![ep6(7, THIS_NODE)]));
    ports
}

fn writer<M: LbMaps>(maps: M) -> ServiceMaps<M> {
    let mut writer = ServiceMaps::on(maps, NODE_IPS.to_vec()).expect("the maps read back");
    writer.set_topology(Some(THIS_NODE.into()), false);
    writer
}

/// What the ebpf mode's full sync does (`apply_full`).
fn full_sync<M: LbMaps>(writer: &mut ServiceMaps<M>, desired: &[ServicePort]) -> Result<()> {
    let keep: Vec<&ServicePort> = desired.iter().collect();
    writer.batch(|w| {
        w.retain(&keep)?;
        desired.iter().try_for_each(|p| w.sync_service(p))
    })
}

fn rows(endpoints: &[&Endpoint]) -> Vec<BackendRow> {
    endpoints
        .iter()
        .map(|e| BackendRow {
            addr: Some((e.addr, e.port)),
            flows: 0,
        })
        .collect()
}

/// The frontends `desired` calls for, each with the endpoints the model
/// says its traffic reaches ([`EndpointSets`]).
fn frontends_of(desired: &[ServicePort]) -> Vec<FrontendRow> {
    let mut out = Vec::new();
    for p in desired {
        let sets = EndpointSets::of(p, Some(THIS_NODE));
        let row = |addr, port, node_port, local: bool, backends: &[&Endpoint]| FrontendRow {
            proto: p.protocol.number(),
            addr,
            port,
            node_port,
            local_only: local && sets.has_any(),
            backends: rows(backends),
        };
        out.push(row(p.cluster_ip, p.port, false, p.internal_local(), sets.internal()));
        let node_ips = p.node_port.map(|_| NODE_IPS).into_iter().flatten();
        for ip in node_ips.filter(|ip| ip.is_ipv4() == p.cluster_ip.is_ipv4()) {
            let node_port = p.node_port.unwrap_or_default();
            out.push(row(ip, node_port, true, p.external_local(), sets.external()));
        }
    }
    out
}

/// `frontends` as `dump` renders them, backends sorted: slot order is the
/// writer's business, which backends a frontend reaches is the model's.
fn render(mut frontends: Vec<FrontendRow>) -> String {
    frontends.sort_by_key(|f| (f.proto, f.addr, f.port));
    for f in &mut frontends {
        f.backends.sort_by_key(|b| b.addr);
    }
    render_services(&Snapshot {
        frontends,
        forward_flows: 0,
        reply_flows: 0,
        flow_states: Vec::new(),
        table: None,
        verdicts: Vec::new(),
    })
}

/// Asserts that the maps, read back, hold exactly what `desired` says.
fn assert_maps_hold<M: LbMaps>(writer: &ServiceMaps<M>, desired: &[ServicePort]) {
    let seen = writer.snapshot().expect("snapshot").frontends;
    assert_eq!(render(seen), render(frontends_of(desired)));
}

/// Entries `desired` needs in each map (services, slot chunks, backends,
/// reverse NAT: none, nothing reads them): no more, so nothing was left
/// behind.
fn entries_for(desired: &[ServicePort]) -> [usize; 4] {
    let frontends = frontends_of(desired).len();
    let slots = desired
        .iter()
        .map(|p| super::slot_layout::SlotLayout::of(&EndpointSets::of(p, Some(THIS_NODE))).map_or(0, |l| l.slots.len()))
        .map(|slots| proxy_common::SlotChunk::count(slots) as usize)
        .sum();
    let mut backends: Vec<_> = (desired.iter())
        .flat_map(|p| p.endpoints.iter().map(|e| (e.addr, e.port, p.protocol)))
        .collect();
    backends.sort_by_key(|(a, p, proto)| (*a, *p, proto.number()));
    backends.dedup();
    [frontends, slots, backends.len(), 0]
}

fn assert_no_torn_views(maps: &MemoryMaps) {
    assert_eq!(
        maps.torn_views(),
        Vec::<String>::new(),
        "a packet found a frontend torn"
    );
}

#[test]
fn the_maps_read_back_as_the_model_says() {
    let memory = MemoryMaps::new();
    let mut w = writer(memory.clone());
    for desired in [desired_a(), desired_b(), desired_a(), Vec::new()] {
        full_sync(&mut w, &desired).expect("sync");
        assert_maps_hold(&w, &desired);
        assert_eq!(memory.entries(), entries_for(&desired));
    }
    assert_no_torn_views(&memory);
}

/// Every step of every flush leaves each frontend whole for a packet:
/// slots and backends are in place before a frontend points at them and
/// stay until no frontend does (`write_batch::FLUSH_STAGES`), also when a
/// set grows, shrinks, is replaced or its port removed.
#[test]
fn no_step_of_a_flush_shows_a_packet_a_torn_frontend() {
    let memory = MemoryMaps::new();
    let mut w = writer(memory.clone());
    let base = port("web", 1, Some(30080), (1..=4).map(|i| ep(i, "node-b")).collect());
    let grown = ServicePort {
        endpoints: (1..=8).map(|i| ep(i, "node-b")).collect(),
        ..base.clone()
    };
    let shrunk = ServicePort {
        endpoints: vec![ep(8, "node-b")],
        ..base.clone()
    };
    let replaced = ServicePort {
        endpoints: vec![ep(30, THIS_NODE), ep(31, "node-b")],
        external_policy: TrafficPolicy::Local,
        ..base.clone()
    };
    let empty = ServicePort {
        endpoints: Vec::new(),
        ..base.clone()
    };
    for step in [base, grown, shrunk, replaced, empty.clone(), empty] {
        w.sync_service(&step).expect("sync");
        assert_maps_hold(&w, std::slice::from_ref(&step));
    }
    w.remove_service("default/web:http").expect("remove");
    assert_eq!(memory.entries(), [0; 4]);
    assert_no_torn_views(&memory);
}

/// A new agent finds the maps the last one left, adopts them, and syncing
/// the same Services writes nothing; what it no longer wants goes.
#[test]
fn a_restarted_writer_adopts_the_maps_and_writes_nothing() {
    let memory = MemoryMaps::new();
    full_sync(&mut writer(memory.clone()), &desired_a()).expect("first agent");

    let mut restarted = writer(memory.clone());
    assert_eq!(restarted.service_port_count(), desired_a().len());
    assert_maps_hold(&restarted, &desired_a());
    full_sync(&mut restarted, &desired_a()).expect("same Services");
    assert_eq!(restarted.writes(), 0, "everything was in place");

    let fewer = &desired_a()[..1];
    full_sync(&mut restarted, fewer).expect("fewer Services");
    assert_maps_hold(&restarted, fewer);
    assert_eq!(memory.entries(), entries_for(fewer));
    assert_no_torn_views(&memory);
}

/// Opening maps reads the backends array (1M entries in the kernel) once,
/// for the port filter and the ids alike, and not at all when the start
/// created it: the writer then programs the same as on any empty maps.
#[test]
fn the_backends_array_is_read_once_and_not_when_this_start_created_it() {
    let memory = MemoryMaps::new();
    full_sync(&mut writer(memory.clone()), &desired_a()).expect("first agent");
    let restarted = writer(memory.clone());
    assert_eq!(restarted.maps().backend_scans(), 1);
    assert_eq!(restarted.service_port_count(), desired_a().len());

    let created = MemoryMaps::new();
    let mut fresh = ServiceMaps::on_with(created.clone(), NODE_IPS.to_vec(), BackendsArray::Created).expect("open");
    fresh.set_topology(Some(THIS_NODE.into()), false);
    assert_eq!(fresh.maps().backend_scans(), 0);
    full_sync(&mut fresh, &desired_a()).expect("sync");
    assert_maps_hold(&fresh, &desired_a());
    assert_eq!(created.entries(), entries_for(&desired_a()));
    assert_eq!(fresh.maps().backend_scans(), 0, "a sync reads no backends back either");
}

/// Entries an agent left behind when it died halfway through a sync (no
/// frontend names them) and the reverse NAT entries older agents wrote
/// go with the next full sync, and their ids are not handed out in it.
#[test]
fn leftovers_of_an_agent_that_died_go_with_the_next_full_sync() {
    let memory = MemoryMaps::new();
    full_sync(&mut writer(memory.clone()), &desired_a()).expect("first agent");
    let stray = Backend::new(Ipv4Addr::new(10, 244, 9, 9), 80, 6);
    let older_agents: Vec<(u32, RevNat)> = (memory.services().unwrap().iter())
        .map(|(key, value)| (value.rev_nat_id, RevNat::new(key.addr(), key.port())))
        .chain([(900, RevNat::new(Ipv4Addr::new(10, 96, 9, 9), 80))])
        .collect();
    memory.leave(
        &[(
            BackendSlotKey {
                backend_set: 900,
                slot: 0,
            },
            900,
        )],
        &[(900, stray)],
        &older_agents,
    );

    let mut restarted = writer(memory.clone());
    let mut more = desired_a();
    more.push(port("late", 9, None, vec![ep(40, "node-b")]));
    full_sync(&mut restarted, &more).expect("sync");
    assert_maps_hold(&restarted, &more);
    assert_eq!(memory.entries(), entries_for(&more), "the leftovers are gone");
    let backends = memory.backends().unwrap();
    let late = backends.iter().find(|(_, b)| b.addr() == Ipv4Addr::new(10, 244, 0, 40));
    let (id, _) = late.expect("the late port's backend");
    assert_ne!(
        *id, 900,
        "an id found in the maps is not handed out while its entry is there"
    );
    let v6 = memory.services6().unwrap().into_iter().map(|(_, v)| v);
    let all = memory.services().unwrap().into_iter().map(|(_, v)| v).chain(v6);
    let mut rev_nat_ids: Vec<u32> = all.map(|v| v.rev_nat_id).collect();
    rev_nat_ids.sort_unstable();
    rev_nat_ids.dedup();
    assert_eq!(
        rev_nat_ids.len(),
        frontends_of(&more).len(),
        "each frontend its own reverse NAT id"
    );
}

/// An endpoint in two Service ports is one backend entry under one id; it
/// stays while either uses it and goes with the last, its id not reused.
#[test]
fn a_shared_backend_goes_with_the_last_port_using_it() {
    let memory = MemoryMaps::new();
    let mut w = writer(memory.clone());
    let web = port("web", 1, None, vec![ep(1, "node-b"), ep(2, "node-b")]);
    let api = port("api", 2, None, vec![ep(2, "node-b")]);
    full_sync(&mut w, &[web.clone(), api.clone()]).expect("sync");
    assert_eq!(memory.entries()[2], 2, "10.244.0.2 once for both ports");
    let backend_of = |w: &ServiceMaps<MemoryMaps>, p: &ServicePort| {
        let value = w.frontend(p.cluster_ip, p.port, 6).expect("frontend");
        let slot = BackendSlotKey {
            backend_set: value.backend_set,
            slot: value.backend_count - 1,
        };
        memory.slot(&slot).unwrap().expect("slot")
    };
    let shared = backend_of(&w, &api);
    assert_eq!(backend_of(&w, &web), shared);

    w.remove_service(&web.name).expect("remove web");
    assert!(memory.backend(shared).unwrap().is_some(), "api still uses it");
    w.remove_service(&api.name).expect("remove api");
    assert_eq!(memory.entries(), [0; 4]);

    w.sync_service(&api).expect("api again");
    assert_ne!(backend_of(&w, &api), shared, "a freed id is not handed out again soon");
    assert_no_torn_views(&memory);
}

/// A map too full for a sync: the sync fails, packets still see the last
/// complete state (nothing of the new one is reachable), and the next sync
/// with room recovers, leaving nothing of the failed one behind.
#[test]
fn a_full_map_fails_the_sync_and_the_next_one_recovers() {
    let faulty = FaultyMaps::new(MemoryMaps::new());
    let mut w = writer(faulty);
    let small = desired_a();
    full_sync(&mut w, &small).expect("fits");
    let room = w.maps().memory().entries()[2] + 2;
    w.maps().full_at(Table::Backends, room);

    let error = full_sync(&mut w, &desired_b()).expect_err("five new backends, room for two");
    assert!(format!("{error:#}").contains("map full"), "{error:#}");
    assert_maps_hold(&w, &small);

    w.maps().full_at(Table::Backends, usize::MAX);
    full_sync(&mut w, &desired_b()).expect("room again");
    assert_maps_hold(&w, &desired_b());
    assert_eq!(w.maps().memory().entries(), entries_for(&desired_b()));
    assert_no_torn_views(w.maps().memory());
}

/// Whichever write of a sync fails (every flush step and port filter word
/// in turn), no packet finds a frontend torn, and the next sync brings the
/// maps to the model with nothing left behind.
#[test]
fn whichever_write_fails_the_next_sync_recovers() {
    for n in 1.. {
        let faulty = FaultyMaps::new(MemoryMaps::new());
        let mut w = writer(faulty);
        full_sync(&mut w, &desired_a()).expect("before the failure");
        w.maps().fail_nth_write(n);
        let failed = full_sync(&mut w, &desired_b()).is_err();
        if w.maps().armed() {
            assert!(!failed, "a sync of fewer than {n} writes went through");
            assert!(n > 3, "the sync made {} writes at least", n - 1);
            break;
        }
        assert!(failed, "write {n} failed, the sync must say so");
        full_sync(&mut w, &desired_b()).unwrap_or_else(|e| panic!("after write {n} failed: {e:#}"));
        assert_maps_hold(&w, &desired_b());
        assert_eq!(w.maps().memory().entries(), entries_for(&desired_b()), "write {n}");
        assert_no_torn_views(w.maps().memory());
    }
}

/// The snapshot (`xproxy status`) counts `XP_CT6`'s flows with `XP_CT`'s:
/// in the totals, and per backend of the IPv6 frontend they went through.
#[test]
fn the_snapshot_counts_ipv6_flows_too() {
    use proxy_common::{CtKey6, CtValue6, conntrack::FLAG_REPLY, proto};
    let maps = MemoryMaps::new();
    let mut w = writer(maps.clone());
    let svc = port6("web", 1, None, vec![ep6(1, THIS_NODE)]);
    w.sync_service(&svc).expect("sync");
    let frontend = w.frontend(svc.cluster_ip, 80, proto::TCP).expect("the IPv6 frontend");
    let slot = BackendSlotKey {
        backend_set: frontend.backend_set,
        slot: frontend.backend_offset,
    };
    let backend = maps.slot(&slot).expect("read").expect("the frontend's slot");
    let client: Ipv6Addr = "fd00:30::1".parse().expect("address");
    let value = |flags| CtValue6 {
        backend_id: backend,
        rev_nat_id: frontend.rev_nat_id,
        flags,
        ..bytemuck::Zeroable::zeroed()
    };
    let backend_ip = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 1);
    maps.track6(&[
        (
            CtKey6::new(
                client,
                40000,
                Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 1),
                80,
                proto::TCP,
            ),
            value(0),
        ),
        (
            CtKey6::new(backend_ip, 8080, client, 40000, proto::TCP),
            value(FLAG_REPLY),
        ),
    ]);
    let snapshot = w.snapshot().expect("snapshot");
    assert_eq!((snapshot.forward_flows, snapshot.reply_flows), (1, 1));
    let row = (snapshot.frontends.iter())
        .find(|f| f.addr == svc.cluster_ip)
        .expect("the IPv6 frontend's row");
    assert_eq!(row.backends[0].flows, 1);
}
