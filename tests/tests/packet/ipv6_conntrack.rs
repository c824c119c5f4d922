//! IPv6 flows through TCP's states and a reused tuple, as IPv4's
//! (`tcp_flows_move_through_the_kernels_states`,
//! `a_syn_on_a_closed_flows_tuple_picks_a_current_backend`): `XP_CT6`'s
//! entries read back after every step.

use proxy_common::ipv6::addr6_be;

use super::*;

/// The states of `client`'s flow entries in `XP_CT6` (forward and reply),
/// sorted.
fn flow_states6(h: &Harness, client: SocketAddrV6) -> Vec<u8> {
    let (addr, port) = (addr6_be(*client.ip()), client.port().to_be());
    let mut states: Vec<u8> = conntrack6(h)
        .into_iter()
        .filter(|(k, _)| (k.saddr_be, k.sport_be) == (addr, port) || (k.daddr_be, k.dport_be) == (addr, port))
        .map(|(_, v)| v.state)
        .collect();
    states.sort();
    states
}

/// The IPv6 ClusterIP's TCP frontend now with `backends` only (slots
/// rewritten, as the agent rewrites a set when endpoints leave).
fn keep_tcp_backends(h: &Harness, backends: &[SocketAddrV6]) {
    let mut slots: BpfHashMap<MapData, SlotChunkKey, SlotChunk> = pinned(h, map_names::BACKEND_SLOTS);
    let mut services: BpfHashMap<MapData, Service6Key, ServiceValue> = pinned(h, map_names::SERVICES6);
    let mut chunk = SlotChunk { ids: [0; 16] };
    for (slot, backend) in backends.iter().enumerate() {
        let index = BACKEND_IPS6
            .iter()
            .position(|ip| ip == backend.ip())
            .expect("a seeded backend");
        // The TCP set's ids are the first three (see `seeded6_on`).
        chunk.ids[slot] = FIRST_BACKEND_ID + index as u32;
    }
    let key = SlotChunkKey {
        backend_set: SET,
        chunk: 0,
    };
    slots.insert(key, chunk, 0).expect("slots");
    let key = Service6Key::new(CLUSTER_IP6, SERVICE_PORT, proto::TCP);
    let mut value = services.get(&key, 0).expect("the ClusterIP's TCP frontend");
    value.backend_count = backends.len() as u32;
    services.insert(key, value, 0).expect("frontend");
}

/// Opens a TCP flow to the IPv6 ClusterIP through tc ingress: its SYN and
/// backend.
fn open_tcp6(h: &mut Harness) -> (Frame6, SocketAddrV6) {
    let syn = Frame6::tcp(client6(h), v6(CLUSTER_IP6, SERVICE_PORT), SYN);
    let backend = assert_dnat(h, Prog::TcIngress, &syn, "SYN");
    (syn, backend)
}

/// `request`'s next packet with `flags`, from the client: kept on `backend`.
fn client_sends(h: &mut Harness, request: &Frame6, flags: u8, backend: SocketAddrV6, what: &str) {
    let mut next = request.clone();
    next.tcp_mut().flags = flags;
    let out = run6(h, Prog::TcIngress, &next.build(), Verdict::DnatEstablished, what);
    let checked = check6(&out.frame).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(checked.dst, backend, "{what}: its backend");
}

/// The backend's answer to `request` with `flags`, reverse-NATed to the
/// IPv6 ClusterIP.
fn backend_sends(h: &mut Harness, request: &Frame6, flags: u8, backend: SocketAddrV6, what: &str) {
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    assert_rev_nat(h, Prog::TcIngress, &reply_of(request, backend, flags), cluster, what);
}

#[test]
fn ipv6_tcp_flows_move_through_the_kernels_states() {
    if !require_root("ipv6_tcp_flows_move_through_the_kernels_states") {
        return;
    }
    let mut h = seeded6();
    let (syn, backend) = open_tcp6(&mut h);
    let client = syn.src();
    assert_eq!(flow_states6(&h, client), [state::TCP_SYN_SENT; 2]);
    backend_sends(&mut h, &syn, SYN | ACK, backend, "SYN-ACK");
    assert_eq!(flow_states6(&h, client), [state::TCP_ESTABLISHED; 2]);
    client_sends(&mut h, &syn, FIN | ACK, backend, "client FIN");
    assert_eq!(flow_states6(&h, client), [state::TCP_FIN_WAIT; 2]);
    backend_sends(&mut h, &syn, FIN | ACK, backend, "backend FIN");
    assert_eq!(flow_states6(&h, client), [state::TCP_TIME_WAIT; 2]);
}

/// A client port reused after its flow closed (TIME_WAIT, or a RST) gets
/// a fresh backend among the current ones, never the old flow's, which
/// may have left; a retransmitted SYN of a live flow keeps its backend.
#[test]
fn ipv6_a_syn_on_a_closed_flows_tuple_picks_a_current_backend() {
    if !require_root("ipv6_a_syn_on_a_closed_flows_tuple_picks_a_current_backend") {
        return;
    }
    let mut h = seeded6();
    let (syn, backend) = open_tcp6(&mut h);
    client_sends(&mut h, &syn, SYN, backend, "SYN again");
    let (reset_syn, reset_backend) = open_tcp6(&mut h);
    client_sends(&mut h, &reset_syn, RST | ACK, reset_backend, "client RST");
    client_sends(&mut h, &syn, FIN | ACK, backend, "client FIN");
    backend_sends(&mut h, &syn, FIN | ACK, backend, "backend FIN");
    // Both backends leave; the third (or, if both flows had the same, one
    // of the other two) stays.
    let remaining: Vec<SocketAddrV6> = backends6()
        .into_iter()
        .filter(|b| *b != backend && *b != reset_backend)
        .collect();
    keep_tcp_backends(&h, &remaining);
    for (what, frame, old) in [
        ("SYN after TIME_WAIT", syn, state::TCP_TIME_WAIT),
        ("SYN after RST", reset_syn, state::TCP_CLOSE),
    ] {
        let new_backend = assert_dnat(&mut h, Prog::TcIngress, &frame, what);
        assert!(remaining.contains(&new_backend), "{what}: {new_backend} has left");
        // The new flow's two entries, and the old flow's reply entry: late
        // segments of the old connection are still reverse-NATed until it
        // times out.
        let mut want = vec![state::TCP_SYN_SENT, state::TCP_SYN_SENT, old];
        want.sort();
        assert_eq!(flow_states6(&h, frame.src()), want, "{what}");
    }
}
