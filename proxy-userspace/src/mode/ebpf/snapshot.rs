//! Reads the Service maps back as the programs see them (not from the
//! writer's bookkeeping): the [`Snapshot`] `xproxy status` prints and the
//! writer's tests compare with the model, one frontend, or the backends a
//! frontend picks from.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    ops::Range,
};

use anyhow::{Context, Result};
use proxy_common::{
    Backend, BackendSlotKey, Service6Key, ServiceKey, ServiceValue,
    conntrack::{FLAG_REPLY, settled_state},
    service::{FLAG_NODE_PORT, FLAGS_LOCAL},
};

use super::lb_maps::LbMaps;
use crate::dump::{BackendRow, FrontendRow, Snapshot};

/// The slots a frontend picks from.
pub(super) fn slots_of(value: &ServiceValue) -> Range<u32> {
    value.backend_offset..value.backend_offset.saturating_add(value.backend_count)
}

/// Everything the programs would use now, with tracked flows counted per
/// backend; a slot or backend that is missing shows as such.
pub fn snapshot(maps: &impl LbMaps) -> Result<Snapshot> {
    let mut flows: HashMap<(u32, u32), u64> = HashMap::new();
    let mut states: BTreeMap<u8, u64> = BTreeMap::new();
    let (mut forward, mut reply) = (0, 0);
    // Both tables' flows: an IPv6 entry's fields are an IPv4 one's.
    let v4 = (maps.conntrack_entries()?.into_iter()).map(|(_, ct)| (ct.flags, ct.state, ct.rev_nat_id, ct.backend_id));
    let v6 = (maps.conntrack6_entries()?.into_iter()).map(|(_, ct)| (ct.flags, ct.state, ct.rev_nat_id, ct.backend_id));
    for (flags, state, rev_nat_id, backend_id) in v4.chain(v6) {
        if flags & FLAG_REPLY != 0 {
            reply += 1;
        } else {
            forward += 1;
            *flows.entry((rev_nat_id, backend_id)).or_default() += 1;
            *states.entry(settled_state(state, flags)).or_default() += 1;
        }
    }
    let mut frontends = Vec::new();
    let v4 = maps
        .services()?
        .into_iter()
        .map(|(k, v)| ((k.addr().into(), k.port(), k.proto), v));
    let v6 = maps
        .services6()?
        .into_iter()
        .map(|(k, v)| ((k.addr().into(), k.port(), k.proto), v));
    for ((addr, port, proto), value) in v4.chain(v6) {
        let mut backends = Vec::new();
        for slot in slots_of(&value) {
            let row = match slot_endpoint(maps, value.backend_set, slot)? {
                Some((id, endpoint)) => BackendRow {
                    addr: Some(endpoint),
                    flows: flows.get(&(value.rev_nat_id, id)).copied().unwrap_or(0),
                },
                None => BackendRow { addr: None, flows: 0 },
            };
            backends.push(row);
        }
        frontends.push(FrontendRow {
            proto,
            addr,
            port,
            node_port: value.flags & FLAG_NODE_PORT != 0,
            local_only: value.flags & FLAGS_LOCAL != 0,
            backends,
        });
    }
    frontends.sort_by_key(|f| (f.proto, f.addr, f.port));
    Ok(Snapshot {
        frontends,
        forward_flows: forward,
        reply_flows: reply,
        flow_states: states.into_iter().collect(),
        table: None,
        verdicts: maps.verdicts()?,
    })
}

/// The backend id in a slot and its backend; `None` if either is missing.
fn slot_backend(maps: &impl LbMaps, backend_set: u32, slot: u32) -> Result<Option<(u32, Backend)>> {
    let Some(id) = maps.slot(&BackendSlotKey { backend_set, slot })? else {
        return Ok(None);
    };
    Ok(maps.backend(id)?.map(|b| (id, b)))
}

/// The backend id in a slot and its endpoint, of either family; `None` if
/// the slot or the backend is missing.
fn slot_endpoint(maps: &impl LbMaps, backend_set: u32, slot: u32) -> Result<Option<(u32, (IpAddr, u16))>> {
    let Some(id) = maps.slot(&BackendSlotKey { backend_set, slot })? else {
        return Ok(None);
    };
    if let Some(b) = maps.backend(id)? {
        return Ok(Some((id, (b.addr().into(), b.port()))));
    }
    Ok(maps.backend6(id)?.map(|b| (id, (b.addr().into(), b.port()))))
}

/// One frontend, as the programs see it.
pub fn frontend(maps: &impl LbMaps, addr: IpAddr, port: u16, proto: u8) -> Option<ServiceValue> {
    let found = match addr {
        IpAddr::V4(addr) => maps.service(&ServiceKey::new(addr, port, proto)),
        IpAddr::V6(addr) => maps.service6(&Service6Key::new(addr, port, proto)),
    };
    found.ok().flatten()
}

/// The endpoints a frontend of either family picks from, in slot order;
/// an error if one is missing.
pub fn backend_endpoints(maps: &impl LbMaps, value: &ServiceValue) -> Result<Vec<(IpAddr, u16)>> {
    every_slot(value, |slot| slot_endpoint(maps, value.backend_set, slot))
}

/// The backends an IPv4 frontend picks from, in slot order; an error if
/// one is missing.
pub fn backend_set(maps: &impl LbMaps, value: &ServiceValue) -> Result<Vec<Backend>> {
    every_slot(value, |slot| slot_backend(maps, value.backend_set, slot))
}

/// What `read` finds in each slot of `value`'s run, in order; an error
/// naming the first slot it finds nothing in.
fn every_slot<T>(value: &ServiceValue, read: impl Fn(u32) -> Result<Option<(u32, T)>>) -> Result<Vec<T>> {
    slots_of(value)
        .map(|slot| {
            let found = read(slot)?;
            found
                .map(|(_, item)| item)
                .with_context(|| format!("slot {slot} of backend set {} is missing", value.backend_set))
        })
        .collect()
}
