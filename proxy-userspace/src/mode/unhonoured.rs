//! Service fields a mode cannot honour (issue 12 item 7): never silently
//! wrong. A mode says which fields of a port it leaves out, and how;
//! [`Unhonoured`] turns each (port, field) into one [`Problem`], once, which
//! the mode hands to the agent ([`super::Dataplane::take_problems`]) to
//! log and count with the objects it skips (`xproxy_skipped_objects_total`).

use std::collections::HashSet;

use crate::model::{LbAlgorithm, Problem, ServicePort};

/// What one mode has reported, and what the agent has not taken yet.
#[derive(Default)]
pub struct Unhonoured {
    reported: HashSet<(String, &'static str)>,
    pending: Vec<Problem>,
}

impl Unhonoured {
    /// Reports `field` of `port`, which the mode handles as `how` says,
    /// unless it was reported for that port before.
    pub fn report(&mut self, port: &ServicePort, field: &'static str, how: &str) {
        if self.reported.insert((port.name.clone(), field)) {
            self.pending.push(Problem::new(&port.name, format!("{field}: {how}")));
        }
    }

    /// The problems reported since the last call.
    pub fn take(&mut self) -> Vec<Problem> {
        std::mem::take(&mut self.pending)
    }

    /// How many (port, field) pairs were reported.
    pub fn count(&self) -> usize {
        self.reported.len()
    }
}

/// The `xproxy.io/lb-algorithm` annotation asking for Maglev, which only
/// the ebpf mode does: `(field, how)` for the modes that balance as their
/// kernel tables do.
pub fn lb_algorithm(port: &ServicePort) -> Option<(&'static str, &'static str)> {
    (port.lb_algorithm == Some(LbAlgorithm::Maglev)).then_some((
        "metadata.annotations[xproxy.io/lb-algorithm]",
        "maglev is the ebpf mode's: new flows are balanced at random",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reported_once_per_port_and_field() {
        let mut unhonoured = Unhonoured::default();
        let a = ServicePort {
            name: "default/a".into(),
            ..ServicePort::default()
        };
        let b = ServicePort {
            name: "default/b".into(),
            ..ServicePort::default()
        };
        unhonoured.report(&a, "spec.externalIPs", "not served");
        unhonoured.report(&a, "spec.externalIPs", "not served");
        unhonoured.report(&a, "status.loadBalancer.ingress", "not served");
        assert_eq!(
            unhonoured.take(),
            [
                Problem::new("default/a", "spec.externalIPs: not served"),
                Problem::new("default/a", "status.loadBalancer.ingress: not served"),
            ]
        );
        unhonoured.report(&a, "spec.externalIPs", "not served");
        unhonoured.report(&b, "spec.externalIPs", "not served");
        assert_eq!(
            unhonoured.take(),
            [Problem::new("default/b", "spec.externalIPs: not served")]
        );
        assert!(unhonoured.take().is_empty());
        assert_eq!(unhonoured.count(), 3);
    }
}
