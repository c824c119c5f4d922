//! Programs the port filter (`XP_PORTS`, see `proxy_common::ports`): the
//! programs let a packet pass without any hash lookup unless its
//! destination port is a frontend's or its source port a backend's.
//!
//! Bits are set before the frontends that need them are written and never
//! cleared: a TCP flow outlives its Service and its backend (see
//! `stale_flows`), and its packets must still reach the conntrack lookup.
//! A stale bit only costs that port's other packets a lookup.

use std::{collections::BTreeMap, path::Path};

use anyhow::{Context, Result};
use aya::maps::{Array, HashMap, MapData};

use super::maps::{open, pinned};
use proxy_common::{Backend, PortBits, ServiceKey, ServiceValue, maps, ports};

pub struct PortFilter {
    map: Array<MapData, PortBits>,
    /// What the map holds, element by element.
    bits: Vec<PortBits>,
}

impl PortFilter {
    /// Opens the filter pinned under `pin_path` and sets the bits of every
    /// frontend and backend already in the maps (left by an earlier agent,
    /// maybe one from before the filter existed).
    pub fn open(pin_path: &Path) -> Result<Self> {
        let map: Array<MapData, PortBits> = Array::try_from(pinned(pin_path, maps::PORTS)?)
            .with_context(|| format!("map {} has an unexpected layout", maps::PORTS))?;
        let bits = (0..ports::PORT_WORDS)
            .map(|i| map.get(&i, 0))
            .collect::<Result<Vec<_>, _>>()
            .context("reading the port filter")?;
        let mut this = Self { map, bits };
        let services: HashMap<MapData, ServiceKey, ServiceValue> = open(pin_path, maps::SERVICES)?;
        let backends: HashMap<MapData, u32, Backend> = open(pin_path, maps::BACKENDS)?;
        let frontend_ports = services
            .keys()
            .map(|k| k.map(|k| k.port()))
            .collect::<Result<Vec<_>, _>>()?;
        let backend_ports = backends
            .iter()
            .map(|e| e.map(|(_, b)| b.port()))
            .collect::<Result<Vec<_>, _>>()?;
        this.allow(frontend_ports, backend_ports)?;
        Ok(this)
    }

    /// Sets the bits of `frontends` (frontend ports) and `backends`
    /// (backend ports), writing only elements that change.
    pub fn allow(
        &mut self,
        frontends: impl IntoIterator<Item = u16>,
        backends: impl IntoIterator<Item = u16>,
    ) -> Result<()> {
        // Only the words that gain a bit are written (most calls add none);
        // the cache follows the map, write by write.
        let mut wanted: BTreeMap<u32, PortBits> = BTreeMap::new();
        for port in frontends {
            let (i, bit) = ports::slot(port);
            wanted.entry(i).or_insert(self.bits[i as usize]).frontend |= bit;
        }
        for port in backends {
            let (i, bit) = ports::slot(port);
            wanted.entry(i).or_insert(self.bits[i as usize]).backend |= bit;
        }
        for (i, word) in wanted {
            if word != self.bits[i as usize] {
                self.map.set(i, word, 0).context("writing the port filter")?;
                self.bits[i as usize] = word;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::ports::slot;

    #[test]
    fn ports_map_to_one_bit_of_one_element() {
        assert_eq!(slot(0), (0, 1));
        assert_eq!(slot(80), (1, 1 << 16));
        assert_eq!(slot(30791), (481, 1 << 7));
        assert_eq!(slot(65535), (1023, 1 << 63));
    }
}
