//! The Service writer's Maglev tables on maps in memory: which frontends
//! are flagged, what the table holds, and that it follows the backend set
//! (written with a new set, gone with the old, adopted on restart).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proxy_common::{
    MaglevKey, ServiceValue,
    maglev::{CHUNK, chunks, table_size},
    proto,
    service::FLAG_MAGLEV,
};

use super::{LbMaps, MemoryMaps, ServiceMaps, maglev};
use crate::model::{Endpoint, LbAlgorithm, ServicePort, TrafficPolicy};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0, 0, 0, 0, 0, 1);
const THIS_NODE: &str = "node-a";
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);

fn ep(last: u8, node: &str) -> Endpoint {
    Endpoint {
        node_name: Some(node.into()),
        ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 8080)
    }
}

/// A NodePort Service port of `n` endpoints, the first on this node.
fn port(n: u8, algorithm: Option<LbAlgorithm>) -> ServicePort {
    ServicePort {
        name: "default/web:http".into(),
        cluster_ip: CLUSTER_IP.into(),
        port: 80,
        node_port: Some(30080),
        endpoints: (1..=n)
            .map(|i| ep(i, if i == 1 { THIS_NODE } else { "node-b" }))
            .collect(),
        lb_algorithm: algorithm,
        ..ServicePort::default()
    }
}

fn writer(maps: MemoryMaps) -> ServiceMaps<MemoryMaps> {
    let mut writer = ServiceMaps::on(maps, vec![NODE_IP.into()]).expect("the maps read back");
    writer.set_topology(Some(THIS_NODE.into()), false);
    writer
}

fn frontend(w: &ServiceMaps<MemoryMaps>, addr: impl Into<IpAddr>, port: u16) -> ServiceValue {
    let addr = addr.into();
    w.frontend(addr, port, proto::TCP)
        .unwrap_or_else(|| panic!("no frontend {addr}:{port}"))
}

/// The table of `value`'s set read back from the maps, as backend
/// addresses; `None` if a chunk is missing.
fn table_read_back(w: &ServiceMaps<MemoryMaps>, value: &ServiceValue) -> Option<Vec<IpAddr>> {
    let size = table_size(value.backend_count)?;
    let mut out = Vec::new();
    for chunk in 0..chunks(size) {
        let key = MaglevKey {
            backend_set: value.backend_set,
            chunk,
        };
        let ids = w.maps().maglev_chunk(&key).expect("read")?.ids;
        out.extend(ids.iter().take((size - chunk * CHUNK).min(CHUNK) as usize).map(|id| {
            let v4 = w.maps().backend(*id).expect("read").map(|b| IpAddr::from(b.addr()));
            let v6 = || w.maps().backend6(*id).expect("read").map(|b| IpAddr::from(b.addr()));
            v4.or_else(v6).expect("the entry's backend")
        }));
    }
    Some(out)
}

/// The table `maglev::table` builds for these endpoints, as addresses.
fn table_of(endpoints: &[Endpoint]) -> Vec<IpAddr> {
    let members: Vec<maglev::Member> = (1..)
        .zip(endpoints)
        .map(|(id, e)| maglev::Member {
            id,
            addr: e.addr,
            port: e.port,
        })
        .collect();
    let table = maglev::table(&members).expect("a table");
    table.iter().map(|id| endpoints[*id as usize - 1].addr).collect()
}

/// The annotation flags every frontend of the `Cluster` run and writes
/// the table of its endpoints; a backend leaving writes the new set's
/// table and deletes the old; a restarted writer adopts it; back to
/// random, the flag and the table go.
#[test]
fn maglev_table_follows_the_backend_set() {
    let mut w = writer(MemoryMaps::new());
    let mut svc = port(3, Some(LbAlgorithm::Maglev));
    w.sync_service(&svc).expect("sync");
    for (ip, p) in [(CLUSTER_IP, 80), (NODE_IP, 30080)] {
        let value = frontend(&w, ip, p);
        assert_ne!(value.flags & FLAG_MAGLEV, 0, "{ip}:{p}");
        assert_eq!(table_read_back(&w, &value), Some(table_of(&svc.endpoints)), "{ip}:{p}");
    }
    assert_eq!(
        w.maps().maglev_keys().expect("keys").len(),
        4,
        "1,021 entries: 4 chunks, of one set"
    );

    svc.endpoints.pop();
    w.sync_service(&svc).expect("sync");
    let value = frontend(&w, CLUSTER_IP, 80);
    assert_eq!(table_read_back(&w, &value), Some(table_of(&svc.endpoints)));
    let sets: Vec<u32> = (w.maps().maglev_keys().expect("keys").iter())
        .map(|k| k.backend_set)
        .collect();
    assert!(sets.iter().all(|s| *s == value.backend_set), "the old set's table went");

    let mut w = writer(w.maps().clone());
    let before = w.writes();
    w.sync_service(&svc).expect("sync");
    assert_eq!(w.writes(), before, "adopted with its table");

    svc.lb_algorithm = Some(LbAlgorithm::Random);
    w.sync_service(&svc).expect("sync");
    assert_eq!(frontend(&w, CLUSTER_IP, 80).flags & FLAG_MAGLEV, 0);
    assert!(w.maps().maglev_keys().expect("keys").is_empty());
}

/// The default applies to ports without the annotation; the annotation
/// wins over it. A `Local` frontend whose run differs from the
/// `Cluster` one balances at random.
#[test]
fn the_default_and_the_annotation_and_local_runs() {
    let mut w = writer(MemoryMaps::new());
    w.set_lb_default(LbAlgorithm::Maglev);
    let mut svc = ServicePort {
        external_policy: TrafficPolicy::Local,
        ..port(3, None)
    };
    w.sync_service(&svc).expect("sync");
    assert_ne!(frontend(&w, CLUSTER_IP, 80).flags & FLAG_MAGLEV, 0, "the default");
    let node_port = frontend(&w, NODE_IP, 30080);
    assert_eq!(
        (node_port.backend_count, node_port.flags & FLAG_MAGLEV),
        (1, 0),
        "Local run"
    );
    svc.lb_algorithm = Some(LbAlgorithm::Random);
    w.sync_service(&svc).expect("sync");
    assert_eq!(frontend(&w, CLUSTER_IP, 80).flags & FLAG_MAGLEV, 0, "the annotation");
    assert!(w.maps().maglev_keys().expect("keys").is_empty());
    w.retain(&[]).expect("retain nothing");
}

/// A table found halfway written (an agent died mid-sync) is not adopted:
/// the next sync writes the set afresh, and the stray chunks go.
#[test]
fn a_half_written_table_is_rewritten() {
    let maps = MemoryMaps::new();
    let mut w = writer(maps.clone());
    let svc = port(3, Some(LbAlgorithm::Maglev));
    w.sync_service(&svc).expect("sync");
    let first = frontend(&w, CLUSTER_IP, 80);
    let stray = MaglevKey {
        backend_set: first.backend_set,
        chunk: 1,
    };
    maps.drop_maglev_chunk(&stray);
    let mut w = writer(maps);
    w.sync_service(&svc).expect("sync");
    w.retain(&[&svc]).expect("retain");
    let value = frontend(&w, CLUSTER_IP, 80);
    assert_ne!(value.backend_set, first.backend_set, "written afresh");
    assert_eq!(table_read_back(&w, &value), Some(table_of(&svc.endpoints)));
    let keys = w.maps().maglev_keys().expect("keys");
    assert!(keys.iter().all(|k| k.backend_set == value.backend_set), "{keys:?}");
}

/// The IPv6 half of a dual-stack Service gets a table of its own IPv6
/// endpoints, placed by their IPv6 identities, on its IPv6 frontends.
#[test]
fn an_ipv6_port_has_a_table_of_its_endpoints() {
    let ip6 = |last: u16| Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, last);
    let mut w = ServiceMaps::on(MemoryMaps::new(), vec![NODE_IP.into(), NODE_IP6.into()]).expect("the maps read back");
    let svc = ServicePort {
        name: "default/web:http (IPv6)".into(),
        cluster_ip: Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 1).into(),
        endpoints: (1..=5).map(|i| Endpoint::ready(ip6(i), 8080)).collect(),
        ..port(0, Some(LbAlgorithm::Maglev))
    };
    w.sync_service(&svc).expect("sync");
    for (ip, p) in [(svc.cluster_ip, 80), (NODE_IP6.into(), 30080)] {
        let value = frontend(&w, ip, p);
        assert_ne!(value.flags & FLAG_MAGLEV, 0, "{ip}:{p}");
        assert_eq!(table_read_back(&w, &value), Some(table_of(&svc.endpoints)), "{ip}:{p}");
    }
    assert!(
        w.frontend(NODE_IP, 30080, proto::TCP).is_none(),
        "no IPv4 node port for an IPv6 port"
    );
}
