//! Service fields a mode cannot honour (issue 12 item 7): never silently
//! wrong. Each mode says which fields of a port it leaves out, and how;
//! [`Unhonoured`] logs that once per port and field and counts it in
//! [`UNHONOURED_FIELDS`] (`xproxy_unhonoured_service_fields_total`).

use std::{collections::HashSet, sync::LazyLock};

use prometheus_client::metrics::counter::Counter;
use tracing::warn;

use crate::model::ServicePort;

/// Every (service port, field) some mode of this process found it cannot
/// honour, counted once each; the metrics server exports it.
pub static UNHONOURED_FIELDS: LazyLock<Counter> = LazyLock::new(Counter::default);

/// What one mode has reported so far.
pub struct Unhonoured {
    mode: &'static str,
    reported: HashSet<(String, &'static str)>,
}

impl Unhonoured {
    pub fn new(mode: &'static str) -> Self {
        Self {
            mode,
            reported: HashSet::new(),
        }
    }

    /// Logs and counts `field` of `port`, which the mode handles as `how`
    /// says, unless it was reported for that port before.
    pub fn report(&mut self, port: &ServicePort, field: &'static str, how: &str) {
        if self.reported.insert((port.name.clone(), field)) {
            warn!(mode = self.mode, port = port.name, field, "{how}");
            UNHONOURED_FIELDS.inc();
        }
    }

    /// How many (port, field) pairs this mode reported.
    pub fn count(&self) -> usize {
        self.reported.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reported_once_per_port_and_field() {
        let mut unhonoured = Unhonoured::new("test");
        let a = ServicePort {
            name: "default/a".into(),
            ..ServicePort::default()
        };
        let b = ServicePort {
            name: "default/b".into(),
            ..ServicePort::default()
        };
        let before = UNHONOURED_FIELDS.get();
        unhonoured.report(&a, "spec.externalIPs", "not served");
        unhonoured.report(&a, "spec.externalIPs", "not served");
        unhonoured.report(&a, "status.loadBalancer.ingress", "not served");
        unhonoured.report(&b, "spec.externalIPs", "not served");
        assert_eq!(unhonoured.count(), 3);
        // Other tests may count at the same time: at least ours.
        assert!(UNHONOURED_FIELDS.get() >= before + 3);
    }
}
