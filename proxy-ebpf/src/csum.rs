//! Internet checksum arithmetic (RFC 1071, incremental updates per RFC 1624),
//! for IPv4 fields and IPv6 addresses.
//!
//! The one's complement sum does not care about byte order as long as every
//! word is taken the same way, so these functions work on words exactly as
//! loaded from the packet (network order bytes in a native integer).

/// Folds a 64-bit accumulator into 16 bits with end-around carry.
#[inline(always)]
pub fn fold(mut sum: u64) -> u16 {
    sum = (sum & 0xffff_ffff) + (sum >> 32);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// Adds both 16-bit halves of a 32-bit word.
#[inline(always)]
pub fn add32(sum: u64, word: u32) -> u64 {
    sum + (word & 0xffff) as u64 + (word >> 16) as u64
}

/// RFC 1624 eqn. 3, HC' = ~(~HC + ~m + m'), for a changed 32-bit field.
#[inline(always)]
pub fn replace32(check: u16, old: u32, new: u32) -> u16 {
    !fold(add32(add32((!check) as u64, !old), new))
}

/// The same for a changed 16-bit field.
#[inline(always)]
pub fn replace16(check: u16, old: u16, new: u16) -> u16 {
    !fold((!check) as u64 + (!old) as u64 + new as u64)
}

/// A UDP checksum of 0 means "none" and must stay 0; a computed 0 is sent
/// as 0xffff (RFC 768).
#[inline(always)]
pub fn udp_replace32(check: u16, old: u32, new: u32) -> u16 {
    if check == 0 {
        0
    } else {
        nonzero(replace32(check, old, new))
    }
}

#[inline(always)]
pub fn udp_replace16(check: u16, old: u16, new: u16) -> u16 {
    if check == 0 {
        0
    } else {
        nonzero(replace16(check, old, new))
    }
}

#[inline(always)]
fn nonzero(check: u16) -> u16 {
    if check == 0 { 0xffff } else { check }
}

/// The one's complement difference of an IPv6 address changing from `old`
/// to `new` (~old + new over the four words), folded: added to a checksum
/// it makes the checksum cover `new` instead of `old` (for
/// `bpf_l4_csum_replace`'s diff form, and [`replace_diff`]).
#[inline(always)]
pub fn diff128(old: &[u32; 4], new: &[u32; 4]) -> u16 {
    let mut sum = 0u64;
    for i in 0..4 {
        sum = add32(add32(sum, !old[i]), new[i]);
    }
    fold(sum)
}

/// A checksum updated by a difference from [`diff128`] (RFC 1624 eqn. 3).
#[inline(always)]
pub fn replace_diff(check: u16, diff: u16) -> u16 {
    !fold((!check) as u64 + diff as u64)
}

/// [`replace_diff`] for UDP: 0 ("none") stays 0, a computed 0 is 0xffff.
#[inline(always)]
pub fn udp_replace_diff(check: u16, diff: u16) -> u16 {
    if check == 0 {
        0
    } else {
        nonzero(replace_diff(check, diff))
    }
}
