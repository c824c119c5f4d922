//! SCTP (RFC 9260) as the data path and the tools that build SCTP frames
//! see it: the common header's layout, the chunk types that open and close
//! an association, and the CRC32c that covers the SCTP packet.
//!
//! The CRC covers the SCTP packet only, no IP pseudo-header: a DNAT that
//! changes addresses leaves it valid, one that changes a port breaks it.
//! The programs never compute it (a loop over the whole packet); the agent's
//! trace and the tests do, to build valid frames.

/// Length of the common header: source port, destination port,
/// verification tag, checksum.
pub const COMMON_HEADER_LEN: usize = 12;
/// Offset of the checksum in the common header (stored little-endian).
pub const CHECKSUM_OFFSET: usize = 8;
/// Offset of the first chunk's type byte.
pub const FIRST_CHUNK_TYPE_OFFSET: usize = COMMON_HEADER_LEN;

/// Chunk types (RFC 9260 section 3.2) the data path and the tests use.
pub mod chunk {
    pub const DATA: u8 = 0;
    pub const INIT: u8 = 1;
    pub const INIT_ACK: u8 = 2;
    pub const ABORT: u8 = 6;
    pub const SHUTDOWN: u8 = 7;
    pub const SHUTDOWN_ACK: u8 = 8;
    pub const COOKIE_ECHO: u8 = 10;
    pub const COOKIE_ACK: u8 = 11;
    pub const SHUTDOWN_COMPLETE: u8 = 14;
}

/// CRC32c (Castagnoli, reflected polynomial 0x82F63B78) of `bytes`, as
/// SCTP computes it over its packet with the checksum field zeroed. Bitwise:
/// it builds test frames, it is not on a hot path.
pub fn crc32c(bytes: impl IntoIterator<Item = u8>) -> u32 {
    const POLY: u32 = 0x82F6_3B78;
    let mut crc = u32::MAX;
    for byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ POLY } else { crc >> 1 };
        }
    }
    !crc
}

/// The CRC32c of `packet` (an SCTP packet: common header and chunks) as
/// if its checksum field were zero.
fn packet_crc(packet: &[u8]) -> u32 {
    let field = CHECKSUM_OFFSET..COMMON_HEADER_LEN;
    crc32c(
        packet
            .iter()
            .enumerate()
            .map(|(i, b)| if field.contains(&i) { 0 } else { *b }),
    )
}

/// Writes the CRC32c of `packet` into its checksum field, which SCTP
/// stores little-endian. A packet shorter than the common header is left
/// as it is.
pub fn set_checksum(packet: &mut [u8]) {
    let crc = packet_crc(packet);
    if let Some(field) = packet.get_mut(CHECKSUM_OFFSET..COMMON_HEADER_LEN) {
        field.copy_from_slice(&crc.to_le_bytes());
    }
}

/// Whether `packet`'s checksum field holds its CRC32c.
pub fn checksum_ok(packet: &[u8]) -> bool {
    packet
        .get(CHECKSUM_OFFSET..COMMON_HEADER_LEN)
        .is_some_and(|field| field == packet_crc(packet).to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 3720 appendix B.4's test vectors for CRC32c.
    #[test]
    fn crc32c_matches_the_published_vectors() {
        assert_eq!(crc32c([0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c([0xFFu8; 32]), 0x62A8_AB43);
        let ascending: [u8; 32] = core::array::from_fn(|i| u8::try_from(i).unwrap_or(0));
        assert_eq!(crc32c(ascending), 0x46DD_794E);
        assert_eq!(crc32c(*b"123456789"), 0xE306_9283);
    }

    #[test]
    fn a_set_checksum_checks_and_a_changed_port_breaks_it() {
        let mut packet = [0u8; 32];
        packet[..4].copy_from_slice(&[0x9c, 0x40, 0x1b, 0x58]);
        packet[FIRST_CHUNK_TYPE_OFFSET] = chunk::INIT;
        set_checksum(&mut packet);
        assert!(checksum_ok(&packet));
        packet[3] = 0x59;
        assert!(!checksum_ok(&packet));
    }
}
