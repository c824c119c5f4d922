//! The verifier is part of the test suite: every program must load on the
//! running kernel, and its maps must be pinned under the names user space
//! opens them by. It prints how many instructions the verifier processed
//! per program (`--nocapture`), to keep the programs' growth in view.

use proxy_common::{maps, socket_lb};
use proxy_userspace::mode::ebpf::{Datapath, ServiceMaps};
use testbed::privileged::{PinDir, require_root};

#[test]
fn every_program_loads_and_pins_its_maps() {
    if !require_root("every_program_loads_and_pins_its_maps") {
        return;
    }
    let pins = PinDir::new();
    let mut datapath = Datapath::load(pins.path()).expect("programs pass the verifier");
    print_verified_instructions(&mut datapath);
    for name in [
        maps::SERVICES,
        maps::BACKEND_SLOTS,
        maps::BACKENDS,
        maps::REV_NAT,
        maps::CONNTRACK,
        maps::STATS,
        maps::PORTS,
        maps::AFFINITY,
        maps::MEMBERS,
        maps::SOURCE_RANGES,
        maps::SERVICE_PORTS,
        maps::POD_CIDRS,
        maps::MAGLEV,
        maps::SERVICES6,
        maps::BACKENDS6,
        maps::CONNTRACK6,
        socket_lb::SOCK_CONFIG,
        socket_lb::NODE_ADDRS,
        socket_lb::SOCK_REV_NAT,
        socket_lb::SOCK_CONFIG6,
        socket_lb::NODE_ADDRS6,
        socket_lb::SOCK_REV_NAT6,
    ] {
        assert!(pins.path().join(name).exists(), "map {name} is not pinned");
    }
    ServiceMaps::open(pins.path(), vec![]).expect("pinned maps open with the expected layouts");
    // What lets a first start skip reading the (empty) backends array back.
    assert!(datapath.created_backends_array(), "the first load creates the array");
    let again = Datapath::load(pins.path()).expect("a second load reuses the pinned maps");
    assert!(!again.created_backends_array(), "a second load adopts the pinned array");
}

/// The verifier's processed-instruction count of each program (the kernel
/// reports it from 5.16 on).
fn print_verified_instructions(datapath: &mut Datapath) {
    let xdp = datapath.xdp().expect("xdp_uplink").info().expect("xdp_uplink's info");
    eprintln!(
        "verified instructions: {} {:?}",
        maps::PROG_XDP_UPLINK,
        xdp.verified_instruction_count()
    );
    for name in [maps::PROG_TC_INGRESS, maps::PROG_TC_EGRESS] {
        let info = datapath.tc(name).expect(name).info().expect("tc program's info");
        eprintln!("verified instructions: {name} {:?}", info.verified_instruction_count());
    }
    for name in socket_lb::PROGRAMS {
        let info = datapath
            .socket_program(name)
            .expect(name)
            .info()
            .expect("socket program's info");
        eprintln!("verified instructions: {name} {:?}", info.verified_instruction_count());
    }
}
