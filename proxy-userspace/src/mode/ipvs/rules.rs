//! The constant iptables rules of the IPVS mode, as kube-proxy's IPVS mode
//! lays them out: IPVS does the DNAT, these rules only decide what to
//! masquerade, matching the ipsets of [`super::ipset`]. Their number does
//! not depend on the number of Services.
//!
//! - nat `KUBE-SERVICES` (from PREROUTING and OUTPUT): ClusterIP traffic not
//!   from a local pod (or all, with `masqueradeAll`) is marked; traffic to
//!   a local address goes on to `KUBE-NODE-PORT`; ClusterIP traffic is
//!   accepted.
//! - nat `KUBE-NODE-PORT`: NodePort traffic (`KUBE-NODE-PORT-TCP/UDP`) is
//!   marked, except to node ports with `externalTrafficPolicy: Local`
//!   (`KUBE-NODE-PORT-LOCAL-TCP/UDP`), which keep the client's address.
//! - nat `KUBE-POSTROUTING`: hairpin (`KUBE-LOOP-BACK`) and marked traffic
//!   is masqueraded.
//! - nat `KUBE-MARK-MASQ`: sets the mark bit.
//! - filter `KUBE-FORWARD`: accepts marked and established forwarded
//!   traffic despite a DROP policy.
//!
//! Written with one `iptables-restore --noflush`, which replaces exactly
//! these chains; the jumps from the built-in chains are inserted when
//! missing.

use anyhow::{Context, Result};

use crate::{
    mode::options::LocalTraffic,
    sys::iptables::{Iptables, Saved, SystemIptables, remove_chains, rule_chain, rule_target},
};

use super::ipset::{CLUSTER_IP, LOOP_BACK, NODE_PORT_LOCAL_TCP, NODE_PORT_LOCAL_UDP, NODE_PORT_TCP, NODE_PORT_UDP};

pub const SERVICES: &str = "KUBE-SERVICES";
pub const NODE_PORT: &str = "KUBE-NODE-PORT";
pub const POSTROUTING: &str = "KUBE-POSTROUTING";
pub const MARK_MASQ: &str = "KUBE-MARK-MASQ";
pub const FORWARD: &str = "KUBE-FORWARD";

/// Our chains by table.
pub const CHAINS: [(&str, &[&str]); 2] = [
    ("nat", &[SERVICES, NODE_PORT, POSTROUTING, MARK_MASQ]),
    ("filter", &[FORWARD]),
];

/// `(table, built-in chain, our chain, comment)`: the jumps into our chains.
pub const JUMPS: [(&str, &str, &str, &str); 4] = [
    ("nat", "PREROUTING", SERVICES, "kubernetes service portals"),
    ("nat", "OUTPUT", SERVICES, "kubernetes service portals"),
    ("nat", "POSTROUTING", POSTROUTING, "kubernetes postrouting rules"),
    ("filter", "FORWARD", FORWARD, "kubernetes forwarding rules"),
];

/// What the rules depend on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleOptions {
    pub masquerade_bit: u8,
    pub masquerade_all: bool,
    pub local_traffic: Option<LocalTraffic>,
}

fn if_not_local(local: &LocalTraffic) -> String {
    match local {
        LocalTraffic::Cidr(cidr) => format!("! -s {}/{}", cidr.addr(), cidr.prefix_len()),
        LocalTraffic::Bridge(name) => format!("! -i {name}"),
        LocalTraffic::InterfacePrefix(prefix) => format!("! -i {prefix}+"),
    }
}

/// The `iptables-restore --noflush` input writing our chains, plus the
/// jumps `missing` (from [`missing_jumps`]).
pub fn render(opts: &RuleOptions, missing: &[(&str, &str, &str, &str)]) -> String {
    let mark = format!("{:#x}", 1u32 << opts.masquerade_bit);
    let mut nat = vec![];
    // Which ClusterIP traffic to masquerade: all of it; else what does not
    // come from a local pod; else (nothing tells pods apart) what comes
    // *from* a ClusterIP: the node's own connections to a Service, whose
    // source is the VIP itself because kube-ipvs0 holds every VIP, so the
    // backend would answer the VIP. kube-proxy's IPVS mode does the same.
    let (source, sets) = if opts.masquerade_all {
        (String::new(), "dst,dst")
    } else if let Some(local) = &opts.local_traffic {
        (format!("{} ", if_not_local(local)), "dst,dst")
    } else {
        (String::new(), "src,dst")
    };
    nat.push(format!(
        "-A {SERVICES} {source}-m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" \
         -m set --match-set {CLUSTER_IP} {sets} -j {MARK_MASQ}"
    ));
    nat.push(format!("-A {SERVICES} -m addrtype --dst-type LOCAL -j {NODE_PORT}"));
    nat.push(format!(
        "-A {SERVICES} -m set --match-set {CLUSTER_IP} dst,dst -j ACCEPT"
    ));
    for (proto, set, local_set) in [
        ("tcp", NODE_PORT_TCP, NODE_PORT_LOCAL_TCP),
        ("udp", NODE_PORT_UDP, NODE_PORT_LOCAL_UDP),
    ] {
        nat.push(format!(
            "-A {NODE_PORT} -p {proto} -m comment --comment \"Kubernetes nodeport {} port with externalTrafficPolicy=local\" \
             -m set --match-set {local_set} dst -j RETURN",
            proto.to_uppercase()
        ));
        nat.push(format!(
            "-A {NODE_PORT} -p {proto} -m comment --comment \"Kubernetes nodeport {} port for masquerade purpose\" \
             -m set --match-set {set} dst -j {MARK_MASQ}",
            proto.to_uppercase()
        ));
    }
    nat.push(format!(
        "-A {POSTROUTING} -m comment --comment \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" \
         -m set --match-set {LOOP_BACK} dst,dst,src -j MASQUERADE"
    ));
    nat.push(format!("-A {POSTROUTING} -m mark ! --mark {mark}/{mark} -j RETURN"));
    nat.push(format!("-A {POSTROUTING} -j MARK --xor-mark {mark}"));
    nat.push(format!(
        "-A {POSTROUTING} -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
    ));
    nat.push(format!("-A {MARK_MASQ} -j MARK --or-mark {mark}"));
    let filter = [
        format!(
            "-A {FORWARD} -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"
        ),
        format!(
            "-A {FORWARD} -m comment --comment \"kubernetes forwarding conntrack rule\" \
             -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
        ),
    ];
    let mut out = String::new();
    for ((table, chains), rules) in CHAINS.iter().zip([nat, filter.to_vec()]) {
        out.push_str(&format!("*{table}\n"));
        for chain in *chains {
            out.push_str(&format!(":{chain} - [0:0]\n"));
        }
        out.extend(rules.iter().map(|r| format!("{r}\n")));
        for (jump_table, from, to, comment) in missing {
            if jump_table == table {
                out.push_str(&format!("-I {from} -m comment --comment \"{comment}\" -j {to}\n"));
            }
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// The jumps of [`JUMPS`] not in `saved`.
pub fn missing_jumps(saved: &Saved) -> Vec<(&'static str, &'static str, &'static str, &'static str)> {
    JUMPS
        .iter()
        .filter(|(table, from, to, _)| {
            !saved.tables.get(*table).is_some_and(|t| {
                t.rules
                    .iter()
                    .any(|r| rule_chain(r) == Some(*from) && rule_target(r) == Some(*to))
            })
        })
        .copied()
        .collect()
}

/// Whether all our chains are in `saved`.
pub fn chains_present(saved: &Saved) -> bool {
    CHAINS.iter().all(|(table, chains)| {
        saved
            .tables
            .get(*table)
            .is_some_and(|t| chains.iter().all(|c| t.chains.iter().any(|have| have == c)))
    })
}

/// Writes the rules (and missing jumps) through `iptables`.
pub fn write(iptables: &mut dyn Iptables, opts: &RuleOptions) -> Result<()> {
    let saved = Saved::parse(&iptables.save().context("reading the current rules")?);
    iptables
        .restore(&render(opts, &missing_jumps(&saved)))
        .context("writing the IPVS mode's iptables rules")
}

/// Removes our chains and the jumps into them; idempotent, and nothing
/// happens without iptables installed. Returns how many chains it removed.
pub fn cleanup() -> Result<usize> {
    let mut system = SystemIptables::default();
    if system.check().is_err() {
        return Ok(0);
    }
    let is_ours = |table: &str, chain: &str| CHAINS.iter().any(|(t, chains)| *t == table && chains.contains(&chain));
    remove_chains(&mut system, is_ours).context("removing the IPVS mode's chains")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> RuleOptions {
        RuleOptions {
            masquerade_bit: 14,
            masquerade_all: false,
            local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
        }
    }

    #[test]
    fn renders_kube_proxys_constant_rules() {
        let text = render(&opts(), &JUMPS);
        for line in [
            "-A KUBE-SERVICES ! -s 10.244.0.0/16 -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ",
            "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT",
            "-A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port with externalTrafficPolicy=local\" -m set --match-set KUBE-NODE-PORT-LOCAL-TCP dst -j RETURN",
            "-A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port for masquerade purpose\" -m set --match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
            "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
            "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
            "-I PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            "-I FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
        }
        assert_eq!(text.matches("COMMIT").count(), 2);
        // Local node ports return before the masquerade rule marks them.
        let node_port: Vec<&str> = text.lines().filter(|l| l.starts_with("-A KUBE-NODE-PORT ")).collect();
        assert_eq!(node_port.len(), 4, "{node_port:#?}");
        for (i, set) in [
            "KUBE-NODE-PORT-LOCAL-TCP",
            "KUBE-NODE-PORT-TCP",
            "KUBE-NODE-PORT-LOCAL-UDP",
            "KUBE-NODE-PORT-UDP",
        ]
        .iter()
        .enumerate()
        {
            let target = if i % 2 == 0 { "RETURN" } else { "KUBE-MARK-MASQ" };
            assert!(
                node_port[i].contains(&format!("--match-set {set} dst -j {target}")),
                "{node_port:#?}"
            );
        }
    }

    #[test]
    fn present_jumps_are_not_inserted_again() {
        let saved = Saved::parse(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n\
             -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\nCOMMIT\n",
        );
        let missing = missing_jumps(&saved);
        assert_eq!(missing.len(), 3);
        assert!(!missing.iter().any(|(_, from, _, _)| *from == "PREROUTING"));
        assert!(!chains_present(&saved));
    }

    #[test]
    fn without_local_detection_the_nodes_own_vip_sourced_traffic_is_marked() {
        let mut o = opts();
        o.local_traffic = None;
        let rules = render(&o, &[]);
        assert!(
            rules.contains("-m set --match-set KUBE-CLUSTER-IP src,dst -j KUBE-MARK-MASQ"),
            "{rules}"
        );
        assert!(!rules.contains("KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"), "{rules}");
        o.masquerade_all = true;
        let all = render(&o, &[]);
        assert!(
            all.contains("-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"),
            "{all}"
        );
    }
}
