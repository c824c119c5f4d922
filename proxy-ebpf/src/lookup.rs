//! Is the packet addressed to a Service frontend?

use proxy_common::{ServiceKey, ServiceValue};

use crate::{maps::SERVICES, parse::Flow};

#[inline(always)]
pub fn frontend(flow: &Flow) -> Option<ServiceValue> {
    let key = ServiceKey {
        addr_be: flow.daddr_be,
        port_be: flow.dport_be,
        proto: flow.proto,
        _pad: 0,
    };
    // SAFETY: copied out at once; the program's run keeps the value valid
    // (an update by user space swaps in a new element, freed after RCU).
    unsafe { SERVICES.get(key).copied() }
}
