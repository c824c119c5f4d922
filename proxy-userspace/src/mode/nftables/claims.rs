//! Frontends claimed by more than one service port: the same
//! `IP . proto . port` (an external IP or LB IP of one Service that is
//! another's external IP, LB IP or ClusterIP) or `proto . nodePort`.
//! Nothing in the API stops two Services from listing the same external
//! IP, but a verdict map has one element per key: one port can have it.
//! The port with the lowest name keeps the frontend (the same in full and
//! partial syncs); the others lose their elements for it, which is
//! reported once per port and frontend as a [`Problem`] (the agent logs and
//! counts it: [`Claims::take_problems`]).

use std::collections::{BTreeMap, BTreeSet};

use super::ruleset::PortRules;
use crate::model::Problem;

/// Who claims which frontend (a map element key).
#[derive(Clone, Debug, Default)]
pub struct Claims {
    by_key: BTreeMap<String, BTreeSet<String>>,
    by_port: BTreeMap<String, BTreeSet<String>>,
    /// (port, frontend) pairs already reported as lost.
    reported: BTreeSet<(String, String)>,
    /// Reported, not yet taken.
    problems: Vec<Problem>,
}

/// The frontends `rules` program: the keys of their map elements.
pub fn frontends(rules: &PortRules) -> BTreeSet<String> {
    rules.elements.iter().map(|e| e.key.clone()).collect()
}

impl Claims {
    /// Forgets every claim (before a full sync); what was reported stays.
    pub fn clear(&mut self) {
        self.by_key.clear();
        self.by_port.clear();
    }

    /// Makes `keys` the claims of `port` (empty: the port is gone). Returns
    /// the other ports sharing a frontend with its old or new claims: who
    /// keeps what may have changed for them.
    pub fn set(&mut self, port: &str, keys: BTreeSet<String>) -> BTreeSet<String> {
        let old = self.by_port.remove(port).unwrap_or_default();
        for key in &old {
            if let Some(claimants) = self.by_key.get_mut(key) {
                claimants.remove(port);
                if claimants.is_empty() {
                    self.by_key.remove(key);
                }
            }
        }
        for key in &keys {
            self.by_key.entry(key.clone()).or_default().insert(port.to_owned());
        }
        let neighbours = old
            .iter()
            .chain(&keys)
            .filter_map(|key| self.by_key.get(key))
            .flatten()
            .filter(|other| other.as_str() != port)
            .cloned()
            .collect();
        if !keys.is_empty() {
            self.by_port.insert(port.to_owned(), keys);
        }
        neighbours
    }

    /// The frontends `port` claims that a port with a lower name has.
    pub fn lost(&self, port: &str) -> BTreeSet<String> {
        let Some(keys) = self.by_port.get(port) else {
            return BTreeSet::new();
        };
        keys.iter()
            .filter(|key| {
                self.by_key
                    .get(*key)
                    .and_then(|claimants| claimants.first())
                    .is_some_and(|owner| owner.as_str() != port)
            })
            .cloned()
            .collect()
    }

    /// `rules` without the elements of frontends `port` lost; reports each
    /// newly lost one.
    pub fn honoured(&mut self, port: &str, mut rules: PortRules) -> PortRules {
        let lost = self.lost(port);
        self.reported.retain(|(p, key)| p != port || lost.contains(key));
        for key in &lost {
            if self.reported.insert((port.to_owned(), key.clone())) {
                let owner = self
                    .by_key
                    .get(key)
                    .and_then(|c| c.first())
                    .cloned()
                    .unwrap_or_default();
                self.problems.push(Problem::new(port, lost_reason(key, &owner)));
            }
        }
        rules.elements.retain(|e| !lost.contains(&e.key));
        rules
    }

    /// The problems reported since the last call.
    pub fn take_problems(&mut self) -> Vec<Problem> {
        std::mem::take(&mut self.problems)
    }
}

/// Why `key` is not programmed for a port: `owner` has it.
fn lost_reason(key: &str, owner: &str) -> String {
    // `IP . proto . port` has three parts, `proto . nodePort` two.
    let what = if key.split(" . ").count() == 3 {
        "external IP / load balancer IP"
    } else {
        "node port"
    };
    format!("{what} {key} is also {owner}'s, which keeps it (the lower name): not programmed for this Service port")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|k| (*k).to_owned()).collect()
    }

    #[test]
    fn the_lowest_name_keeps_a_shared_frontend() {
        let mut claims = Claims::default();
        assert!(
            claims
                .set("default/b", keys(&["192.0.2.10 . tcp . 80", "10.96.0.2 . tcp . 80"]))
                .is_empty()
        );
        let neighbours = claims.set("default/a", keys(&["192.0.2.10 . tcp . 80", "10.96.0.1 . tcp . 80"]));
        assert_eq!(neighbours, keys(&["default/b"]));
        assert_eq!(claims.lost("default/b"), keys(&["192.0.2.10 . tcp . 80"]));
        assert!(claims.lost("default/a").is_empty());

        // a goes: b has it again.
        assert_eq!(claims.set("default/a", BTreeSet::new()), keys(&["default/b"]));
        assert!(claims.lost("default/b").is_empty());
    }

    #[test]
    fn a_lost_frontend_is_counted_once() {
        use crate::mode::nftables::ruleset::Element;
        let element = |key: &str| Element {
            map: "service-ips",
            key: key.into(),
            comment: None,
            verdict: "goto x".into(),
        };
        let rules = PortRules {
            elements: vec![element("192.0.2.10 . tcp . 80"), element("10.96.0.2 . tcp . 80")],
            ..PortRules::default()
        };
        let mut claims = Claims::default();
        claims.set("default/a", keys(&["192.0.2.10 . tcp . 80"]));
        claims.set("default/b", frontends(&rules));
        for _ in 0..3 {
            let kept = claims.honoured("default/b", rules.clone());
            assert_eq!(frontends(&kept), keys(&["10.96.0.2 . tcp . 80"]));
        }
        let problems = claims.take_problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].object, "default/b");
        assert!(
            problems[0]
                .reason
                .starts_with("external IP / load balancer IP 192.0.2.10 . tcp . 80 is also default/a's"),
            "{}",
            problems[0].reason
        );
        assert!(claims.take_problems().is_empty());
        // Resolved, then lost again: reported again.
        claims.set("default/a", BTreeSet::new());
        assert_eq!(claims.honoured("default/b", rules.clone()), rules);
        claims.set("default/a", keys(&["192.0.2.10 . tcp . 80"]));
        claims.honoured("default/b", rules);
        assert_eq!(claims.take_problems().len(), 1);
    }
}
