//! Programs the port filter (`XP_PORTS`, see `proxy_common::ports`): the
//! programs let a packet pass without any hash lookup unless its
//! destination port is a frontend's or its source port a backend's.
//!
//! Bits are set before the frontends that need them are written and never
//! cleared: a TCP flow outlives its Service and its backend (see
//! `stale_flows`), and its packets must still reach the conntrack lookup.
//! A stale bit only costs that port's other packets a lookup.

use std::collections::BTreeMap;

use anyhow::Result;
use proxy_common::{Backend, PortBits, ports};

use super::lb_maps::LbMaps;

/// What the filter holds, element by element: the map's words, kept in
/// step write by write so that only words that gain a bit are written.
pub(super) struct PortFilter {
    bits: Vec<PortBits>,
}

impl PortFilter {
    /// Reads the filter of `maps` and sets the bits of every frontend and
    /// backend already in them (left by an earlier agent, maybe one from
    /// before the filter existed); `backends` are the backends array's
    /// entries, read by the caller.
    pub fn load(maps: &impl LbMaps, backends: &[(u32, Backend)]) -> Result<Self> {
        let mut this = Self {
            bits: maps.port_words()?,
        };
        let frontend_ports: Vec<u16> = maps.services()?.iter().map(|(k, _)| k.port()).collect();
        let backend_ports: Vec<u16> = backends.iter().map(|(_, b)| b.port()).collect();
        this.allow(maps, frontend_ports, backend_ports)?;
        Ok(this)
    }

    /// Sets the bits of `frontends` (frontend ports) and `backends`
    /// (backend ports), writing only elements that change.
    pub fn allow(
        &mut self,
        maps: &impl LbMaps,
        frontends: impl IntoIterator<Item = u16>,
        backends: impl IntoIterator<Item = u16>,
    ) -> Result<()> {
        let mut wanted: BTreeMap<u32, PortBits> = BTreeMap::new();
        let frontends = frontends.into_iter().map(|port| (port, true));
        for (port, is_frontend) in frontends.chain(backends.into_iter().map(|port| (port, false))) {
            let (i, bit) = ports::slot(port);
            let current = self.bits.get(i as usize).copied().unwrap_or_default();
            let word = wanted.entry(i).or_insert(current);
            if is_frontend {
                word.frontend |= bit;
            } else {
                word.backend |= bit;
            }
        }
        for (i, word) in wanted {
            if self.bits.get(i as usize) != Some(&word) {
                maps.set_port_word(i, word)?;
                if let Some(cached) = self.bits.get_mut(i as usize) {
                    *cached = word;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::ports::slot;

    use super::*;
    use crate::mode::ebpf::MemoryMaps;

    #[test]
    fn ports_map_to_one_bit_of_one_element() {
        assert_eq!(slot(0), (0, 1));
        assert_eq!(slot(80), (1, 1 << 16));
        assert_eq!(slot(30791), (481, 1 << 7));
        assert_eq!(slot(65535), (1023, 1 << 63));
    }

    #[test]
    fn only_words_that_gain_a_bit_are_written() {
        let maps = MemoryMaps::new();
        let mut filter = PortFilter::load(&maps, &[]).unwrap();
        filter.allow(&maps, [80], [8080]).unwrap();
        let words = maps.port_words().unwrap();
        let (i, bit) = slot(80);
        assert_eq!(words[i as usize].frontend, bit);
        let (j, bit) = slot(8080);
        assert_eq!(words[j as usize].backend, bit);
        let faulty = crate::mode::ebpf::FaultyMaps::new(maps.clone());
        faulty.fail_nth_write(1);
        filter
            .allow(&faulty, [80], [8080])
            .expect("nothing new: nothing written");
        assert!(faulty.armed());
    }
}
