//! The mode against an in-memory iptables (restore input applied the way
//! iptables applies it) with its listeners on 127.0.0.1, so syncs, the
//! listeners' lifetimes and cleanup are checked without root. The real
//! kernel and the real agent: `tests/tests/modes.rs`.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use super::*;
use crate::{
    model::{Endpoint, Protocol},
    sys::fake_iptables::FakeKernel as FakeIptables,
};

fn mode(iptables: &FakeIptables) -> UserspaceMode {
    let opts = Options {
        listen: ListenOptions {
            ip: Ipv4Addr::LOCALHOST,
            ..ListenOptions::default()
        },
        node_ports: NodePortAddresses::AllLocal { localhost: true },
    };
    UserspaceMode::new(opts, Handle::current(), Box::new(iptables.clone()))
}

fn service(name: &str, protocol: Protocol, endpoints: &[SocketAddrV4]) -> ServicePort {
    ServicePort {
        name: name.into(),
        protocol,
        cluster_ip: Ipv4Addr::new(10, 96, 0, 88).into(),
        port: 88,
        node_port: Some(30791),
        endpoints: endpoints.iter().map(|e| Endpoint::ready(*e.ip(), e.port())).collect(),
        ..ServicePort::default()
    }
}

fn desired(ports: &[ServicePort]) -> BTreeMap<String, ServicePort> {
    ports.iter().map(|p| (p.name.clone(), p.clone())).collect()
}

fn ep(last: u8) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(10, 244, 0, last), 80)
}

/// A TCP server on 127.0.0.1 answering every connection with `name`.
async fn backend(name: &'static str) -> SocketAddrV4 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind backend");
    let addr = match listener.local_addr().expect("address") {
        std::net::SocketAddr::V4(a) => a,
        std::net::SocketAddr::V6(_) => unreachable!("bound to IPv4"),
    };
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let _ = conn.write_all(name.as_bytes()).await;
        }
    });
    addr
}

async fn answer(port: u16) -> std::io::Result<String> {
    let mut conn = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await?;
    Ok(answer)
}

/// Runs a sync on a blocking-capable thread, as the agent does.
fn sync<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_sync_listens_and_writes_the_rules_once() {
    let kernel = FakeIptables::default();
    let mut mode = mode(&kernel);
    let tcp = service("default/web:http", Protocol::Tcp, &[backend("pod-1").await]);
    let udp = service("default/web:dns", Protocol::Udp, &[ep(1)]);
    let want = desired(&[tcp.clone(), udp.clone()]);
    sync(|| mode.apply_full(&want)).expect("full sync");
    let tcp_port = mode.listener_port(&tcp.name).expect("a TCP listener");
    let udp_port = mode.listener_port(&udp.name).expect("a UDP listener");
    assert_eq!(answer(tcp_port).await.expect("through the proxy"), "pod-1");
    let portals = kernel.chain("nat", rules::CONTAINER_PORTALS).expect("the chain");
    assert_eq!(portals.len(), 2, "{portals:?}");
    assert!(portals[1].ends_with(&format!("-j REDIRECT --to-ports {tcp_port}")));
    assert!(portals[0].ends_with(&format!("-j REDIRECT --to-ports {udp_port}")));
    let prerouting = kernel.chain("nat", "PREROUTING").expect("PREROUTING");
    assert!(prerouting[0].ends_with("-j KUBE-PORTALS-CONTAINER"), "{prerouting:?}");
    assert!(prerouting[1].ends_with("-j KUBE-NODEPORT-CONTAINER"), "{prerouting:?}");
    // 7 jumps, 2 ports x (2 portal + 2 NodePort rules).
    assert_eq!(mode.kernel_writes(), 7 + 8);

    let restores = kernel.restores().len();
    sync(|| mode.apply_full(&want)).expect("idle full sync");
    assert_eq!(kernel.restores().len(), restores, "nothing changed: nothing written");
    assert_eq!(mode.kernel_writes(), 15);
    assert_eq!(mode.listener_port(&tcp.name), Some(tcp_port), "listeners stay");
    assert_eq!(mode.listener_port(&udp.name), Some(udp_port));

    kernel.flush("nat", rules::HOST_PORTALS);
    sync(|| mode.apply_full(&want)).expect("repairing full sync");
    assert_eq!(kernel.chain("nat", rules::HOST_PORTALS).map(|r| r.len()), Some(2));
    assert_eq!(mode.listener_port(&tcp.name), Some(tcp_port));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_changes_touch_no_rule_until_the_last_one_goes() {
    let kernel = FakeIptables::default();
    let mut mode = mode(&kernel);
    let three = service("default/web", Protocol::Tcp, &[ep(1), ep(2), ep(3)]);
    sync(|| mode.apply_full(&desired(std::slice::from_ref(&three)))).expect("full sync");
    let port = mode.listener_port(&three.name).expect("listener");
    let writes = mode.kernel_writes();

    let two = service("default/web", Protocol::Tcp, &[ep(1), ep(2)]);
    let plan = Plan {
        upsert: vec![two.clone()],
        remove: vec![],
    };
    sync(|| mode.apply(&plan)).expect("partial sync");
    assert_eq!(mode.kernel_writes(), writes, "only the balancer changed");
    assert_eq!(mode.listener_port(&two.name), Some(port));

    let none = service("default/web", Protocol::Tcp, &[]);
    let plan = Plan {
        upsert: vec![none.clone()],
        remove: vec![],
    };
    sync(|| mode.apply(&plan)).expect("partial sync");
    assert_eq!(kernel.chain("nat", rules::CONTAINER_PORTALS), Some(vec![]));
    let reject = kernel.chain("filter", rules::REJECT).expect("the reject chain");
    assert_eq!(reject.len(), 2, "ClusterIP and NodePort: {reject:?}");
    assert!(reject.iter().all(|r| r.contains("has no endpoints")));
    assert_eq!(mode.kernel_writes(), writes + 2);
    assert_eq!(
        mode.listener_port(&none.name),
        Some(port),
        "the listener waits for endpoints"
    );

    let plan = Plan {
        upsert: vec![two.clone()],
        remove: vec![],
    };
    sync(|| mode.apply(&plan)).expect("partial sync");
    assert_eq!(kernel.chain("filter", rules::REJECT), Some(vec![]));
    let portals = kernel.chain("nat", rules::CONTAINER_PORTALS).expect("chain");
    assert_eq!(portals.len(), 1);
    assert!(
        portals[0].ends_with(&format!("--to-ports {port}")),
        "the same port again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_port_stops_listening_and_loses_its_rules() {
    let kernel = FakeIptables::default();
    let mut mode = mode(&kernel);
    let web = service("default/web", Protocol::Tcp, &[backend("pod-1").await]);
    sync(|| mode.apply_full(&desired(std::slice::from_ref(&web)))).expect("full sync");
    let port = mode.listener_port(&web.name).expect("listener");
    assert_eq!(answer(port).await.expect("answer"), "pod-1");
    let plan = Plan {
        upsert: vec![],
        remove: vec![web.clone()],
    };
    sync(|| mode.apply(&plan)).expect("partial sync");
    assert_eq!(mode.listener_port(&web.name), None);
    for chain in rules::NAT_CHAINS {
        assert_eq!(kernel.chain("nat", chain), Some(vec![]), "{chain}");
    }
    let closed = tokio::time::timeout(Duration::from_secs(2), async {
        while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(closed.is_ok(), "port {port} still accepts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_sync_drops_what_is_no_longer_desired() {
    let kernel = FakeIptables::default();
    let mut mode = mode(&kernel);
    let a = service("default/a", Protocol::Tcp, &[ep(1)]);
    let b = service("default/b", Protocol::Udp, &[ep(2)]);
    sync(|| mode.apply_full(&desired(&[a.clone(), b.clone()]))).expect("full sync");
    let a_port = mode.listener_port(&a.name);
    sync(|| mode.apply_full(&desired(std::slice::from_ref(&a)))).expect("full sync");
    assert_eq!(mode.listener_port(&a.name), a_port);
    assert_eq!(mode.listener_port(&b.name), None);
    let portals = kernel.chain("nat", rules::CONTAINER_PORTALS).expect("chain");
    assert_eq!(portals.len(), 1, "{portals:?}");
    assert!(portals[0].contains("\"default/a\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_mode_removes_its_chains_and_jumps() {
    let kernel = FakeIptables::default();
    // Someone else's rule stays.
    let mut other = kernel.clone();
    other
        .restore("*nat\n:DOCKER - [0:0]\n-A PREROUTING -j DOCKER\nCOMMIT\n")
        .expect("foreign rules");
    let mut mode = mode(&kernel);
    let web = service("default/web", Protocol::Tcp, &[ep(1)]);
    sync(|| mode.apply_full(&desired(&[web]))).expect("full sync");
    assert!(kernel.chain("nat", rules::HOST_NODE_PORTS).is_some());
    sync(|| drop(mode));
    let saved = other.save().expect("save");
    assert!(!saved.contains("KUBE-"), "left behind:\n{saved}");
    assert!(saved.contains("-A PREROUTING -j DOCKER"), "{saved}");
    assert_eq!(cleanup_with(&mut other).expect("cleanup"), 0, "nothing left to clean");
}

/// One connection from `client` (a 127.0.0.0/8 address) through the
/// proxy on `port`: the backend's answer.
async fn answer_from(client: Ipv4Addr, port: u16) -> String {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.bind((client, 0).into()).expect("bind the client address");
    let mut conn = socket
        .connect((Ipv4Addr::LOCALHOST, port).into())
        .await
        .expect("connect to the proxy");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.expect("an answer");
    answer
}

/// The answers of `n` connections from `client`.
async fn answers_from(client: Ipv4Addr, port: u16, n: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(answer_from(client, port).await);
    }
    out
}

/// ClientIP affinity with real sockets: each client address sticks to one
/// backend; the backend leaving releases its client, the other client
/// keeps its own; affinity off spreads a client again, on sticks it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ip_affinity_keeps_a_client_on_one_backend() {
    let kernel = FakeIptables::default();
    let mut mode = mode(&kernel);
    let backends = [backend("pod-1").await, backend("pod-2").await, backend("pod-3").await];
    let mut web = service("default/web", Protocol::Tcp, &backends);
    web.affinity = Some(Duration::from_secs(600));
    sync(|| mode.apply_full(&desired(std::slice::from_ref(&web)))).expect("full sync");
    let port = mode.listener_port(&web.name).expect("listener");
    let (a, b) = (Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3));

    let first_a = answers_from(a, port, 6).await;
    let first_b = answers_from(b, port, 6).await;
    assert!(first_a.iter().all(|x| *x == first_a[0]), "{first_a:?}");
    assert!(first_b.iter().all(|x| *x == first_b[0]), "{first_b:?}");
    assert_ne!(first_a[0], first_b[0], "two new clients are balanced");

    // A's backend leaves: A moves (and sticks), B stays.
    let gone = ["pod-1", "pod-2", "pod-3"]
        .iter()
        .position(|name| *name == first_a[0])
        .expect("a backend answered");
    let rest: Vec<SocketAddrV4> = backends
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != gone)
        .map(|(_, e)| *e)
        .collect();
    web = ServicePort {
        endpoints: service("default/web", Protocol::Tcp, &rest).endpoints,
        ..web
    };
    let plan = Plan {
        upsert: vec![web.clone()],
        remove: vec![],
    };
    sync(|| mode.apply(&plan)).expect("partial sync");
    let second_a = answers_from(a, port, 6).await;
    assert!(
        second_a.iter().all(|x| *x == second_a[0] && *x != first_a[0]),
        "{second_a:?}"
    );
    assert!(answers_from(b, port, 3).await.iter().all(|x| *x == first_b[0]));

    // Off: A is spread over both remaining backends.
    web.affinity = None;
    let plan = Plan {
        upsert: vec![web.clone()],
        remove: vec![],
    };
    sync(|| mode.apply(&plan)).expect("affinity off");
    let spread = answers_from(a, port, 4).await;
    let distinct: std::collections::BTreeSet<&String> = spread.iter().collect();
    assert_eq!(distinct.len(), 2, "{spread:?}");

    // On again: sticks.
    web.affinity = Some(Duration::from_secs(600));
    let plan = Plan {
        upsert: vec![web],
        remove: vec![],
    };
    sync(|| mode.apply(&plan)).expect("affinity on");
    let again = answers_from(a, port, 6).await;
    assert!(again.iter().all(|x| *x == again[0]), "{again:?}");
}

/// What the mode does not serve (external and LB IPs, the Local policies)
/// is reported once per port and field, however often it is synced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_the_mode_cannot_honour_are_reported_once() {
    let kernel = FakeIptables::default();
    let mut mode = mode(&kernel);
    let mut web = service("default/web", Protocol::Tcp, &[ep(1)]);
    web.external_ips = vec![Ipv4Addr::new(198, 51, 100, 7).into()];
    web.load_balancer_ips = vec![Ipv4Addr::new(203, 0, 113, 5).into()];
    web.external_policy = crate::model::TrafficPolicy::Local;
    let plain = service("default/plain", Protocol::Tcp, &[ep(2)]);
    let want = desired(&[web, plain]);
    sync(|| mode.apply_full(&want)).expect("full sync");
    sync(|| mode.apply_full(&want)).expect("full sync again");
    assert_eq!(mode.unhonoured(), 3);
}

/// A TCP server on `[::1]` answering every connection with `name`.
async fn backend6(name: &'static str) -> std::net::SocketAddr {
    let listener = TcpListener::bind((std::net::Ipv6Addr::LOCALHOST, 0))
        .await
        .expect("bind backend");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let _ = conn.write_all(name.as_bytes()).await;
        }
    });
    addr
}

/// A dual-stack Service: the IPv6 port gets its own IPv6 listener that
/// relays to the IPv6 endpoint, and its rules go to ip6tables only (the
/// node's own traffic DNATed to `[::1]`), the IPv4 port's to iptables only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_service_gets_a_listener_and_rules_per_family() {
    let (kernel, kernel6) = (FakeIptables::default(), FakeIptables::default());
    let mut opts = mode(&kernel).opts.clone();
    opts.listen.ip6 = std::net::Ipv6Addr::LOCALHOST;
    let mut mode = UserspaceMode::new(opts, Handle::current(), Box::new(kernel.clone())).with_ipv6(
        Box::new(kernel6.clone()),
        NodePortAddresses::AllLocal { localhost: false },
    );
    assert_eq!(mode.families(), [IpFamily::V4, IpFamily::V6]);
    let v4 = service("default/web", Protocol::Tcp, &[backend("pod-1").await]);
    let pod6 = backend6("pod-1 over IPv6").await;
    let v6 = ServicePort {
        name: format!("default/web{}", crate::model::IPV6_SUFFIX),
        cluster_ip: "fd00:96::88".parse().expect("an address"),
        endpoints: vec![Endpoint::ready(pod6.ip(), pod6.port())],
        ..v4.clone()
    };
    sync(|| mode.apply_full(&desired(&[v4.clone(), v6.clone()]))).expect("full sync");
    let port6 = mode.listener_port(&v6.name).expect("an IPv6 listener");
    let mut conn = TcpStream::connect((std::net::Ipv6Addr::LOCALHOST, port6))
        .await
        .expect("the IPv6 listener");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.expect("an answer");
    assert_eq!(answer, "pod-1 over IPv6");
    let port4 = mode.listener_port(&v4.name).expect("an IPv4 listener");

    let host6 = kernel6.chain("nat", rules::HOST_PORTALS).expect("the IPv6 chain");
    assert_eq!(
        host6,
        [format!(
            "-d fd00:96::88/128 -p tcp -m comment --comment \"default/web (IPv6)\" -m tcp --dport 88 -j DNAT --to-destination [::1]:{port6}"
        )]
    );
    let node_ports6 = kernel6.chain("nat", rules::HOST_NODE_PORTS).expect("the IPv6 chain");
    assert!(node_ports6[0].starts_with("! -d ::1/128 -p tcp"), "{node_ports6:?}");
    let host4 = kernel.chain("nat", rules::HOST_PORTALS).expect("the IPv4 chain");
    assert_eq!(host4.len(), 1, "{host4:?}");
    assert!(
        host4[0].ends_with(&format!("--to-destination 127.0.0.1:{port4}")),
        "{host4:?}"
    );

    // The IPv6 port loses its endpoints: rejected with ICMPv6, in ip6tables.
    let empty = ServicePort {
        endpoints: Vec::new(),
        ..v6.clone()
    };
    sync(|| {
        mode.apply(&Plan {
            upsert: vec![empty],
            remove: vec![],
        })
    })
    .expect("partial sync");
    let reject6 = kernel6.chain("filter", rules::REJECT).expect("the IPv6 reject chain");
    assert!(
        reject6
            .iter()
            .all(|r| r.ends_with("-j REJECT --reject-with icmp6-port-unreachable")),
        "{reject6:?}"
    );
    assert_eq!(reject6.len(), 2, "{reject6:?}");
    assert_eq!(kernel.chain("filter", rules::REJECT).map(|r| r.len()), Some(0));

    drop(mode);
    for k in [&kernel, &kernel6] {
        assert_eq!(k.chain("nat", rules::HOST_PORTALS), None, "rules left after the mode");
    }
}

/// kube-proxy's userspace mode never relayed SCTP: an SCTP port gets no
/// listener and no rule, and is reported; a TCP port of the same name
/// that turns into SCTP loses its listener and its rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sctp_ports_are_reported_and_not_served() {
    let kernel = FakeIptables::default();
    let mut mode = mode(&kernel);
    let tcp = service("default/sig", Protocol::Tcp, &[ep(1)]);
    sync(|| mode.apply_full(&desired(std::slice::from_ref(&tcp)))).expect("full sync");
    assert!(mode.listener_port(&tcp.name).is_some());
    let sctp = service("default/sig", Protocol::Sctp, &[ep(1)]);
    let plan = Plan {
        upsert: vec![sctp.clone()],
        ..Plan::default()
    };
    sync(|| mode.apply(&plan)).expect("partial sync");
    assert_eq!(mode.listener_port(&sctp.name), None);
    let portals = kernel.chain("nat", rules::CONTAINER_PORTALS).expect("the chain");
    assert!(portals.is_empty(), "{portals:?}");
    let problems = mode.take_problems();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].reason.contains("SCTP is not supported"), "{problems:?}");
    sync(|| mode.apply_full(&desired(std::slice::from_ref(&sctp)))).expect("full sync");
    assert_eq!(mode.listener_port(&sctp.name), None);
    assert!(mode.take_problems().is_empty(), "reported once");
}
