//! `diff(desired, applied) -> Plan`: what a partial sync must change.

use std::collections::{BTreeMap, BTreeSet};

use crate::{mode::Plan, model::ServicePort};

/// The frontend a service port is known by in every mode: a port whose
/// ClusterIP, port or protocol changed is a different port for the kernel.
fn identity(port: &ServicePort) -> (std::net::IpAddr, u16, crate::model::Protocol) {
    (port.cluster_ip, port.port, port.protocol)
}

/// Every change from `applied` to `desired`.
pub fn diff(desired: &BTreeMap<String, ServicePort>, applied: &BTreeMap<String, ServicePort>) -> Plan {
    let names: BTreeSet<&String> = desired.keys().chain(applied.keys()).collect();
    plan_for(names, desired, applied)
}

/// The changes to the ports named in `changed` only: what a partial sync
/// needs when the model tracks which ports it touched.
pub fn diff_of(
    changed: &BTreeSet<String>,
    desired: &BTreeMap<String, ServicePort>,
    applied: &BTreeMap<String, ServicePort>,
) -> Plan {
    plan_for(changed.iter(), desired, applied)
}

fn plan_for<'a>(
    names: impl IntoIterator<Item = &'a String>,
    desired: &BTreeMap<String, ServicePort>,
    applied: &BTreeMap<String, ServicePort>,
) -> Plan {
    let mut plan = Plan::default();
    for name in names {
        let (new, old) = (desired.get(name), applied.get(name));
        if let Some(old) = old
            && new.is_none_or(|new| identity(new) != identity(old))
        {
            plan.remove.push(old.clone());
        }
        if let Some(new) = new
            && old != Some(new)
        {
            plan.upsert.push(new.clone());
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::{Endpoint, Protocol};

    fn port(name: &str, ip: u8, endpoints: &[u8]) -> ServicePort {
        ServicePort {
            name: name.into(),
            protocol: Protocol::Tcp,
            cluster_ip: Ipv4Addr::new(10, 96, 0, ip).into(),
            port: 80,
            node_port: None,
            endpoints: endpoints
                .iter()
                .map(|e| Endpoint::ready(Ipv4Addr::new(10, 244, 0, *e), 8080))
                .collect(),
            ..ServicePort::default()
        }
    }

    fn state(ports: &[ServicePort]) -> BTreeMap<String, ServicePort> {
        ports.iter().map(|p| (p.name.clone(), p.clone())).collect()
    }

    #[test]
    fn nothing_changed_means_an_empty_plan() {
        let s = state(&[port("a", 1, &[1, 2]), port("b", 2, &[3])]);
        assert!(diff(&s, &s).is_empty());
    }

    #[test]
    fn an_endpoint_change_upserts_only_that_port() {
        let applied = state(&[port("a", 1, &[1, 2]), port("b", 2, &[3])]);
        let desired = state(&[port("a", 1, &[1, 2]), port("b", 2, &[3, 4])]);
        let plan = diff(&desired, &applied);
        assert_eq!(plan.upsert, vec![port("b", 2, &[3, 4])]);
        assert!(plan.remove.is_empty());
    }

    #[test]
    fn added_and_deleted_ports() {
        let applied = state(&[port("a", 1, &[1])]);
        let desired = state(&[port("b", 2, &[2])]);
        let plan = diff(&desired, &applied);
        assert_eq!(plan.upsert, vec![port("b", 2, &[2])]);
        assert_eq!(plan.remove, vec![port("a", 1, &[1])]);
    }

    #[test]
    fn a_new_cluster_ip_replaces_the_old_frontend() {
        let applied = state(&[port("a", 1, &[1])]);
        let desired = state(&[port("a", 9, &[1])]);
        let plan = diff(&desired, &applied);
        assert_eq!(plan.remove, vec![port("a", 1, &[1])]);
        assert_eq!(plan.upsert, vec![port("a", 9, &[1])]);
    }
}
