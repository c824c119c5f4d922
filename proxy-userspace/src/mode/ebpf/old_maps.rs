//! Carries what an older agent kept in maps of an older layout over into
//! today's, then unpins the old maps:
//! - backends, in a hash map (`XP_BACKENDS`, ids that only grew), into
//!   the backends array (`XP_BACKENDS_ARR`, see `proxy_common::maps::BACKENDS`);
//! - slots, one id per entry (`XP_SLOTS`), into chunks of 16
//!   (`XP_SLOT_CHUNKS`, see `proxy_common::SlotChunk`).
//!
//! The frontends the older agent wrote name backend sets by id, and the
//! sets name backends by id; with both carried over under the same ids,
//! today's programs serve new flows from the moment they are attached,
//! before the first sync (which may wait for an API server that is down).
//! A backend id the array cannot hold (at or past `BACKENDS_MAX`) is left
//! out: the sets naming it read back as incomplete, and the first sync
//! writes them afresh.

use std::{collections::BTreeMap, fs, path::Path};

use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData};
use bytemuck::Zeroable;
use proxy_common::{Backend, BackendSlotKey, SlotChunk, SlotChunkKey, maps};

use super::pinned_maps::{open, open_backends};

/// What [`carry_over`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CarriedOver {
    pub backends: u64,
    /// Backends whose ids the array cannot hold.
    pub left_out: u64,
    /// Slots, now in chunks.
    pub slots: u64,
}

/// Carries the old maps pinned under `pin_path` over into today's maps
/// pinned there and unpins them; `None` if there is none.
pub fn carry_over(pin_path: &Path) -> Result<Option<CarriedOver>> {
    let mut done = CarriedOver::default();
    let backends = carry_over_backends(pin_path, &mut done)?;
    let slots = carry_over_slots(pin_path, &mut done)?;
    Ok((backends || slots).then_some(done))
}

/// The backends; whether there was an old map.
fn carry_over_backends(pin_path: &Path, done: &mut CarriedOver) -> Result<bool> {
    let old_pin = pin_path.join(maps::OLD_BACKENDS);
    if !old_pin.exists() {
        return Ok(false);
    }
    let old: HashMap<MapData, u32, Backend> = open(pin_path, maps::OLD_BACKENDS)?;
    let mut array = open_backends(pin_path)?;
    for entry in &old {
        let (id, backend) = entry.context("reading the old backends")?;
        if id >= array.len() || !backend.is_present() {
            done.left_out += 1;
            continue;
        }
        array.set(id, backend, 0).context("copying a backend")?;
        done.backends += 1;
    }
    fs::remove_file(&old_pin).with_context(|| format!("unpinning {}", old_pin.display()))?;
    Ok(true)
}

/// The slots, gathered into chunks; whether there was an old map.
fn carry_over_slots(pin_path: &Path, done: &mut CarriedOver) -> Result<bool> {
    let old_pin = pin_path.join(maps::OLD_BACKEND_SLOTS);
    if !old_pin.exists() {
        return Ok(false);
    }
    let old: HashMap<MapData, BackendSlotKey, u32> = open(pin_path, maps::OLD_BACKEND_SLOTS)?;
    let mut chunks: BTreeMap<SlotChunkKey, SlotChunk> = BTreeMap::new();
    for entry in &old {
        let (slot, id) = entry.context("reading the old slots")?;
        let chunk = chunks.entry(slot.chunk_key()).or_insert_with(SlotChunk::zeroed);
        chunk.ids[slot.index_in_chunk()] = id;
        done.slots += 1;
    }
    let mut new: HashMap<MapData, SlotChunkKey, SlotChunk> = open(pin_path, maps::BACKEND_SLOTS)?;
    for (key, chunk) in chunks {
        new.insert(key, chunk, 0).context("copying slots")?;
    }
    fs::remove_file(&old_pin).with_context(|| format!("unpinning {}", old_pin.display()))?;
    Ok(true)
}
