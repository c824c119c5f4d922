//! Reads the Service maps back as the programs see them (not from the
//! writer's bookkeeping): the [`Snapshot`] `xproxy status` prints and the
//! writer's tests compare with the model, one frontend, or the backends a
//! frontend picks from.

use std::{
    collections::{BTreeMap, HashMap},
    net::Ipv4Addr,
    ops::Range,
};

use anyhow::{Context, Result};
use proxy_common::{
    Backend, BackendSlotKey, ServiceKey, ServiceValue,
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
    for (_, ct) in maps.conntrack_entries()? {
        if ct.flags & FLAG_REPLY != 0 {
            reply += 1;
        } else {
            forward += 1;
            *flows.entry((ct.rev_nat_id, ct.backend_id)).or_default() += 1;
            *states.entry(settled_state(ct.state, ct.flags)).or_default() += 1;
        }
    }
    let mut frontends = Vec::new();
    for (key, value) in maps.services()? {
        let mut backends = Vec::new();
        for slot in slots_of(&value) {
            let row = match slot_backend(maps, value.backend_set, slot)? {
                Some((id, b)) => BackendRow {
                    addr: Some((b.addr(), b.port())),
                    flows: flows.get(&(value.rev_nat_id, id)).copied().unwrap_or(0),
                },
                None => BackendRow { addr: None, flows: 0 },
            };
            backends.push(row);
        }
        frontends.push(FrontendRow {
            proto: key.proto,
            addr: key.addr(),
            port: key.port(),
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

/// One frontend, as the programs see it.
pub fn frontend(maps: &impl LbMaps, addr: Ipv4Addr, port: u16, proto: u8) -> Option<ServiceValue> {
    maps.service(&ServiceKey::new(addr, port, proto)).ok().flatten()
}

/// The backends a frontend picks from, in slot order; an error if one is
/// missing.
pub fn backend_set(maps: &impl LbMaps, value: &ServiceValue) -> Result<Vec<Backend>> {
    slots_of(value)
        .map(|slot| {
            let found = slot_backend(maps, value.backend_set, slot)?;
            found
                .map(|(_, backend)| backend)
                .with_context(|| format!("slot {slot} of backend set {} is missing", value.backend_set))
        })
        .collect()
}
