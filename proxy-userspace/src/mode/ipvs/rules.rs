//! The constant iptables rules of the IPVS mode, as kube-proxy's IPVS mode
//! lays them out: IPVS does the DNAT, these rules only decide what to
//! masquerade, matching the ipsets of [`super::ipset`]. Their number does
//! not depend on the number of Services.
//!
//! - nat `KUBE-SERVICES` (from PREROUTING and OUTPUT): load balancer IP
//!   traffic goes through `KUBE-LOAD-BALANCER`; ClusterIP traffic not from
//!   a local pod (or all, with `masqueradeAll`) is marked; external IP
//!   traffic is marked unless its port has `externalTrafficPolicy: Local`
//!   (`KUBE-EXTERNAL-IP` / `-LOCAL`) and accepted; traffic to a local
//!   address goes on to `KUBE-NODE-PORT`; ClusterIP and load balancer
//!   traffic is accepted.
//! - nat `KUBE-LOAD-BALANCER`: marks load balancer IP traffic, except to
//!   ports with `externalTrafficPolicy: Local` (`KUBE-LOAD-BALANCER-LOCAL`).
//! - nat `KUBE-NODE-PORT`: NodePort traffic (`KUBE-NODE-PORT-TCP/UDP`) is
//!   marked, except to node ports with `externalTrafficPolicy: Local`
//!   (`KUBE-NODE-PORT-LOCAL-TCP/UDP`), which keep the client's address.
//! - nat `KUBE-POSTROUTING`: hairpin (`KUBE-LOOP-BACK`) and marked traffic
//!   is masqueraded.
//! - nat `KUBE-MARK-MASQ`: sets the mark bit.
//! - filter `KUBE-FORWARD`: accepts marked and established forwarded
//!   traffic despite a DROP policy.
//! - filter `KUBE-PROXY-FIREWALL` (from INPUT and FORWARD): traffic to a load
//!   balancer IP with `loadBalancerSourceRanges` (`KUBE-LOAD-BALANCER-FW`)
//!   goes to `KUBE-SOURCE-RANGES-FIREWALL`, which lets the ranges
//!   (`KUBE-LOAD-BALANCER-SOURCE-CIDR`) and packets whose source is the
//!   load balancer IP itself (`KUBE-LOAD-BALANCER-SOURCE-IP`, kube-proxy's
//!   allowance for the node) through and drops the rest. IPVS takes the
//!   packets at LOCAL_IN after the filter table, so they are dropped before
//!   IPVS sees them. The node's own connections IPVS translates at
//!   LOCAL_OUT: they never pass these hooks with the load balancer IP, so
//!   they are not filtered, as in kube-proxy's IPVS mode. (kube-proxy's
//!   current names; before 1.25 it marked them in a nat `KUBE-FIREWALL`
//!   chain for dropping.)
//!
//! Unlike kube-proxy, which writes a set's rule only while the set has
//! entries, the rules are always all there: a Service never changes them.
//!
//! Written with one `iptables-restore --noflush`, which replaces exactly
//! these chains; the jumps from the built-in chains are inserted when
//! missing.

use anyhow::{Context, Result};

use crate::{
    mode::options::LocalTraffic,
    model::IpFamily,
    sys::iptables::{Iptables, Saved, SystemIptables, remove_chains, rule_chain, rule_target},
};

use super::ipset::{
    self, CLUSTER_IP, EXTERNAL_IP, EXTERNAL_IP_LOCAL, LOAD_BALANCER_FW, LOAD_BALANCER_LOCAL, LOAD_BALANCER_SOURCE_CIDR,
    LOAD_BALANCER_SOURCE_IP, LOOP_BACK, NODE_PORT_LOCAL_TCP, NODE_PORT_LOCAL_UDP, NODE_PORT_TCP, NODE_PORT_UDP,
};

pub const SERVICES: &str = "KUBE-SERVICES";
pub const NODE_PORT: &str = "KUBE-NODE-PORT";
pub const LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
pub const POSTROUTING: &str = "KUBE-POSTROUTING";
pub const MARK_MASQ: &str = "KUBE-MARK-MASQ";
pub const FORWARD: &str = "KUBE-FORWARD";
pub const PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
pub const SOURCE_RANGES_FIREWALL: &str = "KUBE-SOURCE-RANGES-FIREWALL";

/// Our chains by table.
pub const CHAINS: [(&str, &[&str]); 2] = [
    ("nat", &[SERVICES, NODE_PORT, LOAD_BALANCER, POSTROUTING, MARK_MASQ]),
    ("filter", &[FORWARD, PROXY_FIREWALL, SOURCE_RANGES_FIREWALL]),
];

/// `(table, built-in chain, our chain, comment)`: the jumps into our chains.
pub const JUMPS: [(&str, &str, &str, &str); 6] = [
    ("nat", "PREROUTING", SERVICES, "kubernetes service portals"),
    ("nat", "OUTPUT", SERVICES, "kubernetes service portals"),
    ("nat", "POSTROUTING", POSTROUTING, "kubernetes postrouting rules"),
    ("filter", "FORWARD", FORWARD, "kubernetes forwarding rules"),
    ("filter", "INPUT", PROXY_FIREWALL, "kube-proxy firewall rules"),
    ("filter", "FORWARD", PROXY_FIREWALL, "kube-proxy firewall rules"),
];

/// What the rules depend on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleOptions {
    pub masquerade_bit: u8,
    pub masquerade_all: bool,
    /// IPv4 traffic from this node's pods.
    pub local_traffic: Option<LocalTraffic>,
    /// IPv6 traffic from this node's pods (the IPv6 cluster CIDR, or the
    /// same interfaces as for IPv4).
    pub local_traffic_v6: Option<LocalTraffic>,
}

impl RuleOptions {
    /// How the rules of `family` tell this node's pods' traffic.
    fn local_traffic(&self, family: IpFamily) -> Option<&LocalTraffic> {
        match family {
            IpFamily::V4 => self.local_traffic.as_ref(),
            IpFamily::V6 => self.local_traffic_v6.as_ref(),
        }
    }
}

fn if_not_local(local: &LocalTraffic) -> String {
    match local {
        LocalTraffic::Cidr(cidr) => format!("! -s {}/{}", cidr.addr(), cidr.prefix_len()),
        LocalTraffic::Bridge(name) => format!("! -i {name}"),
        LocalTraffic::InterfacePrefix(prefix) => format!("! -i {prefix}+"),
    }
}

/// The `iptables-restore --noflush` (`ip6tables-restore` for
/// [`IpFamily::V6`]) input writing our chains, matching the sets of
/// `family`, plus the jumps `missing` (from [`missing_jumps`]).
pub fn render(opts: &RuleOptions, family: IpFamily, missing: &[(&str, &str, &str, &str)]) -> String {
    let set = |name| ipset::name(name, family);
    let (cluster_ip, loop_back) = (set(CLUSTER_IP), set(LOOP_BACK));
    let mark = format!("{:#x}", 1u32 << opts.masquerade_bit);
    let mut nat = vec![format!(
        "-A {SERVICES} -m comment --comment \"Kubernetes service lb portal\" \
         -m set --match-set {} dst,dst -j {LOAD_BALANCER}",
        set(ipset::LOAD_BALANCER)
    )];
    // Which ClusterIP traffic to masquerade: all of it; else what does not
    // come from a local pod; else (nothing tells pods apart) what comes
    // *from* a ClusterIP: the node's own connections to a Service, whose
    // source is the VIP itself because kube-ipvs0 holds every VIP, so the
    // backend would answer the VIP. kube-proxy's IPVS mode does the same.
    let (source, sets) = if opts.masquerade_all {
        (String::new(), "dst,dst")
    } else if let Some(local) = opts.local_traffic(family) {
        (format!("{} ", if_not_local(local)), "dst,dst")
    } else {
        (String::new(), "src,dst")
    };
    nat.push(format!(
        "-A {SERVICES} {source}-m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" \
         -m set --match-set {cluster_ip} {sets} -j {MARK_MASQ}"
    ));
    nat.extend(external_ip_rules(family));
    nat.push(format!("-A {SERVICES} -m addrtype --dst-type LOCAL -j {NODE_PORT}"));
    for accepted in [cluster_ip, set(ipset::LOAD_BALANCER)] {
        nat.push(format!("-A {SERVICES} -m set --match-set {accepted} dst,dst -j ACCEPT"));
    }
    nat.push(format!(
        "-A {LOAD_BALANCER} -m comment --comment \"Kubernetes service load balancer ip + port with externalTrafficPolicy=local\" \
         -m set --match-set {} dst,dst -j RETURN",
        set(LOAD_BALANCER_LOCAL)
    ));
    nat.push(format!("-A {LOAD_BALANCER} -j {MARK_MASQ}"));
    for (proto, masq_set, local_set) in [
        ("tcp", set(NODE_PORT_TCP), set(NODE_PORT_LOCAL_TCP)),
        ("udp", set(NODE_PORT_UDP), set(NODE_PORT_LOCAL_UDP)),
    ] {
        nat.push(format!(
            "-A {NODE_PORT} -p {proto} -m comment --comment \"Kubernetes nodeport {} port with externalTrafficPolicy=local\" \
             -m set --match-set {local_set} dst -j RETURN",
            proto.to_uppercase()
        ));
        nat.push(format!(
            "-A {NODE_PORT} -p {proto} -m comment --comment \"Kubernetes nodeport {} port for masquerade purpose\" \
             -m set --match-set {masq_set} dst -j {MARK_MASQ}",
            proto.to_uppercase()
        ));
    }
    nat.push(format!(
        "-A {POSTROUTING} -m comment --comment \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" \
         -m set --match-set {loop_back} dst,dst,src -j MASQUERADE"
    ));
    nat.push(format!("-A {POSTROUTING} -m mark ! --mark {mark}/{mark} -j RETURN"));
    nat.push(format!("-A {POSTROUTING} -j MARK --xor-mark {mark}"));
    nat.push(format!(
        "-A {POSTROUTING} -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
    ));
    nat.push(format!("-A {MARK_MASQ} -j MARK --or-mark {mark}"));
    let mut filter = vec![
        format!(
            "-A {FORWARD} -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"
        ),
        format!(
            "-A {FORWARD} -m comment --comment \"kubernetes forwarding conntrack rule\" \
             -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
        ),
    ];
    filter.extend(firewall_rules(family));
    let mut out = String::new();
    for ((table, chains), rules) in CHAINS.iter().zip([nat, filter]) {
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

/// nat `KUBE-SERVICES` rules for external IPs: those of `Cluster` ports
/// are marked for masquerade; both kinds are accepted (to IPVS, past the
/// NodePort rules). kube-proxy accepts them in two rules, from outside the
/// node (`physdev` and `addrtype` source matches) and to a local address;
/// here every external IP is bound to `kube-ipvs0` and so local, and the
/// second rule alone accepts the same packets.
fn external_ip_rules(family: IpFamily) -> Vec<String> {
    let (external_ip, external_ip_local) = (ipset::name(EXTERNAL_IP, family), ipset::name(EXTERNAL_IP_LOCAL, family));
    let accept = |set: &str, comment: &str| {
        format!(
            "-A {SERVICES} -m comment --comment \"{comment}\" -m set --match-set {set} dst,dst \
             -m addrtype --dst-type LOCAL -j ACCEPT"
        )
    };
    let cluster = "Kubernetes service external ip + port for masquerade and filter purpose";
    let local = "Kubernetes service external ip + port with externalTrafficPolicy=local";
    vec![
        format!(
            "-A {SERVICES} -m comment --comment \"{cluster}\" -m set --match-set {external_ip} dst,dst -j {MARK_MASQ}"
        ),
        accept(external_ip, cluster),
        accept(external_ip_local, local),
    ]
}

/// filter `KUBE-PROXY-FIREWALL` and `KUBE-SOURCE-RANGES-FIREWALL`:
/// `loadBalancerSourceRanges`.
fn firewall_rules(family: IpFamily) -> Vec<String> {
    let set = |name| ipset::name(name, family);
    let (load_balancer_fw, load_balancer_source_cidr, load_balancer_source_ip) = (
        set(LOAD_BALANCER_FW),
        set(LOAD_BALANCER_SOURCE_CIDR),
        set(LOAD_BALANCER_SOURCE_IP),
    );
    vec![
        format!(
            "-A {PROXY_FIREWALL} -m comment --comment \"Kubernetes service load balancer ip + port for load balancer with sourceRange\" \
             -m set --match-set {load_balancer_fw} dst,dst -j {SOURCE_RANGES_FIREWALL}"
        ),
        format!(
            "-A {SOURCE_RANGES_FIREWALL} -m comment --comment \"Kubernetes service load balancer ip + port + source cidr for packet filter purpose\" \
             -m set --match-set {load_balancer_source_cidr} dst,dst,src -j RETURN"
        ),
        format!(
            "-A {SOURCE_RANGES_FIREWALL} -m comment --comment \"Kubernetes service load balancer ip + port + source IP for packet filter purpose\" \
             -m set --match-set {load_balancer_source_ip} dst,dst,src -j RETURN"
        ),
        format!("-A {SOURCE_RANGES_FIREWALL} -j DROP"),
    ]
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

/// Writes the rules of `family` (and missing jumps) through `iptables`
/// (the tools of that family).
pub fn write(iptables: &mut dyn Iptables, opts: &RuleOptions, family: IpFamily) -> Result<()> {
    let saved = Saved::parse(&iptables.save().context("reading the current rules")?);
    iptables
        .restore(&render(opts, family, &missing_jumps(&saved)))
        .with_context(|| format!("writing the IPVS mode's {} rules", family.name()))
}

/// Removes our chains and the jumps into them, IPv4 and IPv6; idempotent,
/// and nothing happens without iptables installed. Returns how many chains it removed.
pub fn cleanup() -> Result<usize> {
    let mut removed = 0;
    for mut system in [SystemIptables::default(), SystemIptables::ipv6()] {
        if system.check().is_err() {
            continue;
        }
        let is_ours =
            |table: &str, chain: &str| CHAINS.iter().any(|(t, chains)| *t == table && chains.contains(&chain));
        removed += remove_chains(&mut system, is_ours).context("removing the IPVS mode's chains")?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> RuleOptions {
        RuleOptions {
            masquerade_bit: 14,
            masquerade_all: false,
            local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
            local_traffic_v6: Some(LocalTraffic::Cidr("fd00:10:244::/56".parse().expect("cidr"))),
        }
    }

    #[test]
    fn renders_kube_proxys_constant_rules() {
        let text = render(&opts(), IpFamily::V4, &JUMPS);
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
        assert!(
            text.lines()
                .any(|l| l == "-I INPUT -m comment --comment \"kube-proxy firewall rules\" -j KUBE-PROXY-FIREWALL"),
            "{text}"
        );
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
        assert_eq!(missing.len(), 5);
        assert!(!missing.iter().any(|(_, from, _, _)| *from == "PREROUTING"));
        assert!(!chains_present(&saved));
    }

    #[test]
    fn without_local_detection_the_nodes_own_vip_sourced_traffic_is_marked() {
        let mut o = opts();
        o.local_traffic = None;
        let rules = render(&o, IpFamily::V4, &[]);
        assert!(
            rules.contains("-m set --match-set KUBE-CLUSTER-IP src,dst -j KUBE-MARK-MASQ"),
            "{rules}"
        );
        assert!(!rules.contains("KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"), "{rules}");
        o.masquerade_all = true;
        let all = render(&o, IpFamily::V4, &[]);
        assert!(
            all.contains("-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"),
            "{all}"
        );
    }

    /// The lines of `text` in `chain`, in order.
    fn chain<'a>(text: &'a str, chain: &str) -> Vec<&'a str> {
        let prefix = format!("-A {chain} ");
        text.lines().filter(|l| l.starts_with(&prefix)).collect()
    }

    /// kube-proxy's order: load balancer IPs through KUBE-LOAD-BALANCER
    /// first, external IPs marked (Cluster) and accepted before the
    /// NodePort jump, ClusterIPs and load balancer IPs accepted last.
    #[test]
    fn load_balancer_and_external_ip_rules_come_in_kube_proxys_order() {
        let text = render(&opts(), IpFamily::V4, &[]);
        let services = chain(&text, SERVICES);
        let position = |needle: &str| {
            services
                .iter()
                .position(|l| l.contains(needle))
                .unwrap_or_else(|| panic!("no {needle} in {services:#?}"))
        };
        assert_eq!(
            position("--match-set KUBE-LOAD-BALANCER dst,dst -j KUBE-LOAD-BALANCER"),
            0
        );
        let masq = position("--match-set KUBE-EXTERNAL-IP dst,dst -j KUBE-MARK-MASQ");
        let accept = position("--match-set KUBE-EXTERNAL-IP dst,dst -m addrtype --dst-type LOCAL -j ACCEPT");
        let local = position("--match-set KUBE-EXTERNAL-IP-LOCAL dst,dst -m addrtype --dst-type LOCAL -j ACCEPT");
        let node_port = position("-j KUBE-NODE-PORT");
        assert!(
            masq < accept && accept < node_port && local < node_port,
            "{services:#?}"
        );
        assert!(position("KUBE-LOAD-BALANCER dst,dst -j ACCEPT") > node_port);
        assert!(
            !services
                .iter()
                .any(|l| l.contains("KUBE-EXTERNAL-IP-LOCAL") && l.contains("MARK-MASQ"))
        );
        assert_eq!(
            chain(&text, LOAD_BALANCER),
            [
                "-A KUBE-LOAD-BALANCER -m comment --comment \"Kubernetes service load balancer ip + port with externalTrafficPolicy=local\" -m set --match-set KUBE-LOAD-BALANCER-LOCAL dst,dst -j RETURN",
                "-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ",
            ]
        );
    }

    /// loadBalancerSourceRanges: filtered load balancer IPs go to
    /// KUBE-SOURCE-RANGES-FIREWALL, which returns the allowed sources and
    /// drops the rest.
    #[test]
    fn the_firewall_drops_what_no_source_range_allows() {
        let text = render(&opts(), IpFamily::V4, &[]);
        assert_eq!(
            chain(&text, PROXY_FIREWALL),
            [
                "-A KUBE-PROXY-FIREWALL -m comment --comment \"Kubernetes service load balancer ip + port for load balancer with sourceRange\" -m set --match-set KUBE-LOAD-BALANCER-FW dst,dst -j KUBE-SOURCE-RANGES-FIREWALL"
            ]
        );
        let ranges = chain(&text, SOURCE_RANGES_FIREWALL);
        assert_eq!(ranges.len(), 3, "{ranges:#?}");
        assert!(ranges[0].ends_with("--match-set KUBE-LOAD-BALANCER-SOURCE-CIDR dst,dst,src -j RETURN"));
        assert!(ranges[1].ends_with("--match-set KUBE-LOAD-BALANCER-SOURCE-IP dst,dst,src -j RETURN"));
        assert_eq!(ranges[2], "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP");
        // The filter table holds the firewall chains (not nat).
        let filter = &text[text.find("*filter").expect("a filter table")..];
        assert!(filter.contains(":KUBE-PROXY-FIREWALL - [0:0]\n:KUBE-SOURCE-RANGES-FIREWALL - [0:0]\n"));
    }

    /// The ip6tables twin: the same chains, matching kube-proxy's IPv6
    /// sets (`KUBE-6-*`) and telling pods by the IPv6 cluster CIDR.
    #[test]
    fn ipv6_rules_match_the_ipv6_sets() {
        let text = render(&opts(), IpFamily::V6, &[]);
        let v4 = render(&opts(), IpFamily::V4, &[]);
        assert_eq!(text.lines().count(), v4.lines().count());
        for line in [
            "-A KUBE-SERVICES ! -s fd00:10:244::/56 -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-6-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ",
            "-A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port for masquerade purpose\" -m set --match-set KUBE-6-NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
            "-A KUBE-POSTROUTING -m comment --comment \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" -m set --match-set KUBE-6-LOOP-BACK dst,dst,src -j MASQUERADE",
            "-A KUBE-SOURCE-RANGES-FIREWALL -m comment --comment \"Kubernetes service load balancer ip + port + source cidr for packet filter purpose\" -m set --match-set KUBE-6-LOAD-BALANCER-SOURCE-CID dst,dst,src -j RETURN",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
        }
        let sets: Vec<&str> = text
            .split_whitespace()
            .skip_while(|w| *w != "--match-set")
            .collect::<Vec<_>>()
            .windows(2)
            .filter(|w| w[0] == "--match-set")
            .map(|w| w[1])
            .collect();
        assert!(sets.iter().all(|s| s.starts_with("KUBE-6-")), "{sets:?}");
    }
}
