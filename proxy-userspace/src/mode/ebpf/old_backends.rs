//! Carries the backends an older agent kept in a hash map (`XP_BACKENDS`,
//! ids that only grew) over into today's array (`XP_BACKENDS_ARR`, see
//! `proxy_common::maps::BACKENDS`), then unpins the old map.
//!
//! The backend sets the older agent wrote name backends by id; with their
//! backends in the array under the same ids, today's programs serve new
//! flows from the moment they are attached, before the first sync (which
//! may wait for an API server that is down). An id the array cannot hold
//! (at or past `BACKENDS_MAX`) is left out: the sets naming it read back
//! as incomplete, and the first sync writes them afresh.

use std::{fs, path::Path};

use anyhow::{Context, Result};
use aya::maps::{Array, HashMap, MapData};
use proxy_common::{Backend, maps};

use super::pinned_maps::{open, pinned};

/// What [`carry_over`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CarriedOver {
    pub copied: u64,
    /// Entries whose ids the array cannot hold.
    pub left_out: u64,
}

/// Copies the old map's backends pinned under `pin_path` into the array
/// pinned there and unpins the old map; `None` if there is none.
pub fn carry_over(pin_path: &Path) -> Result<Option<CarriedOver>> {
    let old_pin = pin_path.join(maps::OLD_BACKENDS);
    if !old_pin.exists() {
        return Ok(None);
    }
    let old: HashMap<MapData, u32, Backend> = open(pin_path, maps::OLD_BACKENDS)?;
    let mut array: Array<MapData, Backend> = Array::try_from(pinned(pin_path, maps::BACKENDS)?)
        .with_context(|| format!("map {} has an unexpected layout", maps::BACKENDS))?;
    let mut done = CarriedOver::default();
    for entry in &old {
        let (id, backend) = entry.context("reading the old backends")?;
        if id >= array.len() || !backend.is_present() {
            done.left_out += 1;
            continue;
        }
        array.set(id, backend, 0).context("copying a backend")?;
        done.copied += 1;
    }
    fs::remove_file(&old_pin).with_context(|| format!("unpinning {}", old_pin.display()))?;
    Ok(Some(done))
}
