//! Rewrites conntrack entries an older agent's programs wrote into today's
//! layout, so that flows survive the upgrade.
//!
//! Before flows had states, the byte that is now `state` held TCP flag
//! bits and `last_seen_ns` held jiffies (a different clock): such entries
//! (without `FLAG_STATEFUL`) get the state their protocol's live flows have and today's
//! time, else the sweep would take their far-past timestamps for idle
//! flows and delete live connections.
//!
//! Before one key space held both directions, a key's 13th byte (now
//! padding) was 1 for reply entries, and values held only ids: the backend
//! (`XP_BACKENDS`, today an array) and the frontend's reverse NAT id (which its entry in
//! `XP_SERVICES` carries; older agents also kept it in `XP_REV_NAT`, which
//! today's agent empties when it adopts the maps). Today's programs look
//! up keys with that byte 0 and translate with the address and port in the
//! value. An entry without them (both 0, never a real translation) is an
//! old one: it is filled in from the id maps, and an old reply entry moves
//! to its new key. Runs once at start, right after today's programs
//! replaced the old ones on the interfaces listed then (until it ran, an
//! old flow's packets are mistranslated, as their entries say nothing).

use std::{collections::HashMap as StdHashMap, path::Path};

use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData};
use proxy_common::{
    Backend, CtKey, CtValue, ServiceKey, ServiceValue,
    conntrack::{FLAG_STATEFUL, state},
    maps, proto,
};

use super::{
    conntrack::now_ns,
    pinned_maps::{open, open_backends},
};

/// Migrates the old entries of the maps pinned under `pin_path`; returns
/// how many were rewritten (entries whose ids are gone are deleted).
pub fn migrate(pin_path: &Path) -> Result<u64> {
    let mut conntrack: HashMap<MapData, CtKey, CtValue> = open(pin_path, maps::CONNTRACK)?;
    // Carried over from an older agent's hash map (`old_maps`).
    let backends = open_backends(pin_path)?;
    let services: HashMap<MapData, ServiceKey, ServiceValue> = open(pin_path, maps::SERVICES)?;
    let old: Vec<(CtKey, CtValue)> = conntrack
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, v)| (v.nat_addr_be == 0 && v.nat_port_be == 0) || v.flags & FLAG_STATEFUL == 0)
        .collect();
    if old.is_empty() {
        return Ok(0);
    }
    // Reverse NAT id -> the frontend's address and port, network order.
    let frontends: StdHashMap<u32, (u32, u16)> = (services.iter().filter_map(Result::ok))
        .map(|(key, value)| (value.rev_nat_id, (key.addr_be, key.port_be)))
        .collect();
    let now = now_ns();
    let mut migrated = 0;
    for (key, mut value) in old {
        let nat = if value.nat_addr_be != 0 || value.nat_port_be != 0 {
            Some((value.nat_addr_be, value.nat_port_be))
        } else if value.is_reply() {
            frontends.get(&value.rev_nat_id).copied()
        } else {
            (backends.get(&value.backend_id, 0).ok())
                .filter(Backend::is_present)
                .map(|b| (b.addr_be, b.port_be))
        };
        // Not atomic, but today's programs cannot use the entry as it is.
        let _ = conntrack.remove(&key);
        let Some((addr_be, port_be)) = nat else {
            continue;
        };
        value.nat_addr_be = addr_be;
        value.nat_port_be = port_be;
        if value.flags & FLAG_STATEFUL == 0 {
            value.state = live_state(key.proto);
            value.last_seen_ns = now;
            value.flags |= FLAG_STATEFUL;
        }
        let new_key = CtKey { _pad: [0; 3], ..key };
        conntrack
            .insert(new_key, value, 0)
            .context("rewriting an old conntrack entry")?;
        migrated += 1;
    }
    Ok(migrated)
}

/// The state an older agent's flow is taken to be in: live and answered.
fn live_state(protocol: u8) -> u8 {
    if protocol == proto::TCP {
        state::TCP_ESTABLISHED
    } else {
        state::UDP_REPLIED
    }
}
