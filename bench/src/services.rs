//! The Services the agent is given: N of them, each with 1..=10 endpoints
//! drawn from a fixed seed, so every mode and every run sees the same set.
//!
//! Address plan (see `topology`): Service `i` is `svc-NNNNNN` at ClusterIP
//! `10.96.0.10 + i`, port 80 -> 80. Every [`NODE_PORT_EVERY`]th Service
//! (and always the last one) is also a NodePort. Endpoints are real: backend
//! pod `k` answers on every address of `10.(160+k).0.0/16` (a local route
//! in its namespace), and a Service's endpoints sit on distinct pods, each
//! with an address of its own, as pods of different Services would.
//!
//! The last Service is dual-stack: its IPv6 ClusterIP is
//! [`FIRST_CLUSTER_IP6`] + `i`, and a second EndpointSlice holds its
//! endpoints' pods' IPv6 addresses (a pod answers on one, [`pod_ipv6`] of
//! its primary IPv4 address).
//!
//! Besides the N Services there is one more, `svc-change`, whose single
//! endpoint the endpoint-change measurement moves between two pods.

use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Result, ensure};
use serde_json::Value;
use testbed::{
    fixtures::{NODE_NAME, PortDef, dual_stack, service, slice, slice6_with},
    topology::pod_ipv6,
};

use crate::topology::pod_ip;

/// Backend pods; a Service has at most this many endpoints.
pub const PODS: usize = 10;
pub const MIN_ENDPOINTS: usize = 1;
pub const MAX_ENDPOINTS: usize = PODS;
/// The Service port and the port the pods serve.
pub const PORT: u16 = 80;
pub const TARGET_PORT: u16 = testbed::topology::TARGET_PORT;
/// Every this-many-th Service is a NodePort too (kube-proxy's range holds
/// only 2,768 of them).
pub const NODE_PORT_EVERY: usize = 10;
const NODE_PORT_MIN: u16 = 30000;
const NODE_PORT_MAX: u16 = 32767;
/// The ClusterIP of Service 0; Service `i` has this + `i`.
const FIRST_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The last usable address of 10.96.0.0/12.
const LAST_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 111, 255, 254);
/// The IPv6 ClusterIP Service `i` would have; only the last one has it.
const FIRST_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0xa);
/// The ClusterIP of the endpoint-change Service (below the others).
pub const CHANGE_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 9);
pub const CHANGE_SERVICE: &str = "svc-change";
/// Addresses one pod can take in its /16 (.0.0 and .255.255 skipped).
const ADDRESSES_PER_POD: usize = 65_534;

/// The seed the reference runs use.
pub const DEFAULT_SEED: u64 = 0x5eed_0001;

/// The /16 of endpoint addresses pod `k` answers on.
pub fn endpoint_block(pod: usize) -> (Ipv4Addr, u8) {
    (Ipv4Addr::new(10, 160 + pod as u8, 0, 0), 16)
}

/// The `n`th address (1-based) of pod `k`'s block.
fn endpoint_ip(pod: usize, n: usize) -> Ipv4Addr {
    let (block, _) = endpoint_block(pod);
    let [a, b, _, _] = block.octets();
    Ipv4Addr::new(a, b, (n >> 8) as u8, (n & 0xff) as u8)
}

/// One endpoint: the pod behind it and the address it answers on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchEndpoint {
    pub pod: usize,
    pub ip: Ipv4Addr,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchService {
    pub index: usize,
    pub name: String,
    pub cluster_ip: Ipv4Addr,
    /// Set for the last Service: it is dual-stack.
    pub cluster_ip6: Option<Ipv6Addr>,
    pub node_port: Option<u16>,
    pub endpoints: Vec<BenchEndpoint>,
}

impl BenchService {
    /// The Service and its EndpointSlice (and a dual-stack one's IPv6
    /// slice), as the API server stores them.
    pub fn objects(&self) -> Vec<Value> {
        let ips: Vec<Ipv4Addr> = self.endpoints.iter().map(|e| e.ip).collect();
        let service = service(&self.name, self.cluster_ip, PORT, TARGET_PORT, self.node_port);
        let slice = slice(&format!("{}-1", self.name), &self.name, TARGET_PORT, &ips);
        let Some(ip6) = self.cluster_ip6 else {
            return vec![service, slice];
        };
        let ips6: Vec<(Ipv6Addr, &str)> = (self.endpoints.iter())
            .map(|e| (pod_ipv6(pod_ip(e.pod)), NODE_NAME))
            .collect();
        let port = PortDef::tcp(0, TARGET_PORT, None);
        let slice6 = slice6_with(&format!("{}-ipv6", self.name), &self.name, &[port], &ips6);
        vec![dual_stack(service, ip6), slice, slice6]
    }
}

/// N Services with their endpoints, generated from a seed.
#[derive(Clone, Debug)]
pub struct ServiceSet {
    pub services: Vec<BenchService>,
}

/// How many endpoints each Service gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointCount {
    /// Uniform in [`MIN_ENDPOINTS`]..=[`MAX_ENDPOINTS`], from the seed.
    Random,
    /// The same number for every Service.
    Fixed(usize),
}

impl ServiceSet {
    /// `count` Services with 1..=10 endpoints each.
    pub fn generate(count: usize, seed: u64) -> Result<Self> {
        Self::generate_with(count, seed, EndpointCount::Random)
    }

    pub fn generate_with(count: usize, seed: u64, endpoints: EndpointCount) -> Result<Self> {
        if let EndpointCount::Fixed(n) = endpoints {
            ensure!(
                (MIN_ENDPOINTS..=MAX_ENDPOINTS).contains(&n),
                "{n} endpoints per Service: {MIN_ENDPOINTS}..={MAX_ENDPOINTS}"
            );
        }
        ensure!(count > 0, "at least one Service");
        let capacity = u32::from(LAST_CLUSTER_IP) - u32::from(FIRST_CLUSTER_IP) + 1;
        ensure!(
            count <= capacity as usize,
            "{count} Services do not fit in 10.96.0.0/12 (at most {capacity})"
        );
        let mut rng = SplitMix64(seed);
        let mut used = [0usize; PODS];
        let mut services = Vec::with_capacity(count);
        for index in 0..count {
            let random_count = MIN_ENDPOINTS + rng.below(MAX_ENDPOINTS - MIN_ENDPOINTS + 1);
            let endpoint_count = match endpoints {
                EndpointCount::Random => random_count,
                EndpointCount::Fixed(n) => n,
            };
            let first_pod = rng.below(PODS);
            let mut endpoints = Vec::with_capacity(endpoint_count);
            for j in 0..endpoint_count {
                let pod = (first_pod + j) % PODS;
                used[pod] += 1;
                ensure!(
                    used[pod] <= ADDRESSES_PER_POD,
                    "{count} Services need more than {ADDRESSES_PER_POD} endpoint addresses on one pod"
                );
                endpoints.push(BenchEndpoint {
                    pod,
                    ip: endpoint_ip(pod, used[pod]),
                });
            }
            services.push(BenchService {
                index,
                name: service_name(index),
                cluster_ip: Ipv4Addr::from(u32::from(FIRST_CLUSTER_IP) + index as u32),
                cluster_ip6: (index + 1 == count)
                    .then(|| Ipv6Addr::from(u128::from(FIRST_CLUSTER_IP6) + index as u128)),
                node_port: node_port(index, count),
                endpoints,
            });
        }
        Ok(Self { services })
    }

    pub fn first(&self) -> &BenchService {
        &self.services[0]
    }

    pub fn last(&self) -> &BenchService {
        &self.services[self.services.len() - 1]
    }

    pub fn len(&self) -> usize {
        self.services.len()
    }

    /// Endpoints of all Services together.
    pub fn endpoint_count(&self) -> usize {
        self.services.iter().map(|s| s.endpoints.len()).sum()
    }

    pub fn node_port_count(&self) -> usize {
        self.services.iter().filter(|s| s.node_port.is_some()).count()
    }

    /// Every Service and EndpointSlice, in order, then the endpoint-change
    /// Service with its endpoint on `change_ip`.
    pub fn objects(&self, change_ip: Ipv4Addr) -> Vec<Value> {
        let mut objects: Vec<Value> = self.services.iter().flat_map(BenchService::objects).collect();
        objects.push(service(CHANGE_SERVICE, CHANGE_CLUSTER_IP, PORT, TARGET_PORT, None));
        objects.push(change_slice(change_ip));
        objects
    }
}

/// The EndpointSlice of the endpoint-change Service with its one endpoint.
pub fn change_slice(ip: Ipv4Addr) -> Value {
    slice(&format!("{CHANGE_SERVICE}-1"), CHANGE_SERVICE, TARGET_PORT, &[ip])
}

/// Names sort in index order, as the agent's model orders them.
pub fn service_name(index: usize) -> String {
    format!("svc-{index:06}")
}

/// Every [`NODE_PORT_EVERY`]th Service gets the next port from 30000 up
/// while the range lasts; the last Service always gets 32767.
fn node_port(index: usize, count: usize) -> Option<u16> {
    if index + 1 == count {
        return Some(NODE_PORT_MAX);
    }
    if !index.is_multiple_of(NODE_PORT_EVERY) {
        return None;
    }
    let port = usize::from(NODE_PORT_MIN) + index / NODE_PORT_EVERY;
    (port < usize::from(NODE_PORT_MAX)).then_some(port as u16)
}

/// SplitMix64: a tiny, fixed generator, so a seed means the same Services
/// whatever version of a random-number crate is in the lockfile.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (the modulo bias is below 1e-17 for these n).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_services() {
        let a = ServiceSet::generate(1000, DEFAULT_SEED).expect("set");
        let b = ServiceSet::generate(1000, DEFAULT_SEED).expect("set");
        assert_eq!(a.services, b.services);
        let other = ServiceSet::generate(1000, DEFAULT_SEED + 1).expect("set");
        assert_ne!(a.services, other.services);
        // A smaller set is a prefix of a larger one: N grows, nothing moves.
        let small = ServiceSet::generate(100, DEFAULT_SEED).expect("set");
        assert_eq!(small.services[..99], a.services[..99]);
    }

    #[test]
    fn the_seed_is_pinned() {
        // Changing the generator changes every published number: this test
        // makes that a conscious decision.
        let set = ServiceSet::generate(5, DEFAULT_SEED).expect("set");
        let counts: Vec<usize> = set.services.iter().map(|s| s.endpoints.len()).collect();
        let first_pods: Vec<usize> = set.services.iter().map(|s| s.endpoints[0].pod).collect();
        assert_eq!((counts, first_pods), (vec![3, 6, 8, 6, 1], vec![6, 7, 4, 1, 7]));
    }

    #[test]
    fn endpoints_are_distinct_real_pod_addresses() {
        let set = ServiceSet::generate(20_000, DEFAULT_SEED).expect("set");
        let mut seen = HashSet::new();
        let mut per_count = [0usize; MAX_ENDPOINTS + 1];
        for svc in &set.services {
            per_count[svc.endpoints.len()] += 1;
            let pods: HashSet<usize> = svc.endpoints.iter().map(|e| e.pod).collect();
            assert_eq!(pods.len(), svc.endpoints.len(), "{} repeats a pod", svc.name);
            for e in &svc.endpoints {
                let (block, _) = endpoint_block(e.pod);
                assert_eq!(e.ip.octets()[..2], block.octets()[..2]);
                assert!(seen.insert(e.ip), "{} used twice", e.ip);
            }
        }
        assert_eq!(seen.len(), set.endpoint_count());
        assert_eq!(per_count[0], 0);
        // Every count 1..=10 occurs about 2,000 times.
        assert!(per_count[1..].iter().all(|n| (1700..2300).contains(n)), "{per_count:?}");
    }

    #[test]
    fn cluster_ips_names_and_node_ports() {
        let set = ServiceSet::generate(20_000, DEFAULT_SEED).expect("set");
        assert_eq!(set.first().cluster_ip, Ipv4Addr::new(10, 96, 0, 10));
        assert_eq!(set.last().cluster_ip, Ipv4Addr::new(10, 96, 78, 41));
        assert_eq!(set.first().name, "svc-000000");
        assert_eq!(set.last().name, "svc-019999");
        assert_eq!(set.first().node_port, Some(30000));
        assert_eq!(set.last().node_port, Some(32767));
        let ports: HashSet<u16> = set.services.iter().filter_map(|s| s.node_port).collect();
        assert_eq!(ports.len(), set.node_port_count(), "node ports are unique");
        assert_eq!(set.node_port_count(), 2001);
        let names: Vec<&str> = set.services.iter().map(|s| s.name.as_str()).collect();
        assert!(names.windows(2).all(|w| w[0] < w[1]), "names sort in index order");
        // The node port range runs out before 100,000 Services.
        let big = ServiceSet::generate(100_000, DEFAULT_SEED).expect("set");
        assert_eq!(big.node_port_count(), 2767 + 1);
        assert!(big.services.iter().all(|s| s.node_port.is_none_or(|p| p >= 30000)));
    }

    #[test]
    fn objects_pair_services_with_slices() {
        let set = ServiceSet::generate(3, DEFAULT_SEED).expect("set");
        let objects = set.objects(Ipv4Addr::new(10, 244, 0, 11));
        assert_eq!(objects.len(), 2 * 3 + 1 + 2);
        assert_eq!(objects[0]["kind"], "Service");
        assert_eq!(objects[0]["spec"]["clusterIP"], "10.96.0.10");
        assert_eq!(objects[1]["kind"], "EndpointSlice");
        assert_eq!(
            objects[1]["metadata"]["labels"]["kubernetes.io/service-name"],
            "svc-000000"
        );
        assert_eq!(
            objects[1]["endpoints"].as_array().map(Vec::len),
            Some(set.first().endpoints.len())
        );
        // The last Service is dual-stack, with an IPv6 slice of its pods.
        assert_eq!(objects[4]["spec"]["clusterIPs"][1], "fd00:96::c");
        assert_eq!(objects[6]["addressType"], "IPv6");
        let pod = set.last().endpoints[0].pod;
        assert_eq!(
            objects[6]["endpoints"][0]["addresses"][0],
            pod_ipv6(pod_ip(pod)).to_string()
        );
        assert!(set.services[..2].iter().all(|s| s.cluster_ip6.is_none()));
        assert_eq!(objects[7]["metadata"]["name"], CHANGE_SERVICE);
        assert_eq!(objects[8]["endpoints"][0]["addresses"][0], "10.244.0.11");
    }

    #[test]
    fn a_fixed_endpoint_count() {
        let set = ServiceSet::generate_with(10_000, DEFAULT_SEED, EndpointCount::Fixed(10)).expect("set");
        assert!(set.services.iter().all(|s| s.endpoints.len() == 10));
        assert_eq!(set.endpoint_count(), 100_000);
        assert!(ServiceSet::generate_with(1, DEFAULT_SEED, EndpointCount::Fixed(11)).is_err());
    }

    #[test]
    fn too_many_services_are_refused() {
        assert!(ServiceSet::generate(0, DEFAULT_SEED).is_err());
        assert!(ServiceSet::generate(2_000_000, DEFAULT_SEED).is_err());
        // 1,000,000 Services of 10 endpoints need 1,000,000 addresses per pod.
        assert!(ServiceSet::generate_with(1_000_000, DEFAULT_SEED, EndpointCount::Fixed(10)).is_err());
    }
}
