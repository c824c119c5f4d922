//! The verifier is part of the test suite: every program must load on the
//! running kernel, and its maps must be pinned under the names user space
//! opens them by.

use proxy_common::{maps, socket_lb};
use proxy_userspace::mode::ebpf::{Datapath, ServiceMaps};
use testbed::privileged::{PinDir, require_root};

#[test]
fn every_program_loads_and_pins_its_maps() {
    if !require_root("every_program_loads_and_pins_its_maps") {
        return;
    }
    let pins = PinDir::new();
    let _datapath = Datapath::load(pins.path()).expect("programs pass the verifier");
    for name in [
        maps::SERVICES,
        maps::BACKEND_SLOTS,
        maps::BACKENDS,
        maps::REV_NAT,
        maps::CONNTRACK,
        maps::STATS,
        maps::PORTS,
        socket_lb::SOCK_CONFIG,
        socket_lb::NODE_ADDRS,
        socket_lb::SOCK_REV_NAT,
    ] {
        assert!(pins.path().join(name).exists(), "map {name} is not pinned");
    }
    ServiceMaps::open(pins.path(), vec![]).expect("pinned maps open with the expected layouts");
}
