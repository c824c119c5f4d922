//! What the XDP program leaves in the metadata in front of a packet it
//! passes, for tc ingress on the same interface to copy into the skb's
//! mark (XDP runs before there is an skb to mark): a magic that tells ours
//! from anything else's, then the mark. Defined once for the programs and
//! for whoever reads a test run's output, which starts with the metadata.

/// The metadata's layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XdpMark {
    pub magic: u32,
    pub mark: u32,
}

pub const MAGIC: u32 = 0x7870_6d6b;
pub const LEN: usize = core::mem::size_of::<XdpMark>();

impl XdpMark {
    pub const fn new(mark: u32) -> Self {
        Self { magic: MAGIC, mark }
    }

    /// The mark an XDP test run's output starts with, if any, and the
    /// frame after it.
    pub fn split(out: &[u8]) -> (Option<u32>, &[u8]) {
        let word = |at: usize| u32::from_ne_bytes([out[at], out[at + 1], out[at + 2], out[at + 3]]);
        if out.len() > LEN && word(0) == MAGIC {
            (Some(word(4)), &out[LEN..])
        } else {
            (None, out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_the_mark_off_a_marked_frame_only() {
        let frame = [0xaau8; 20];
        let mut marked = MAGIC.to_ne_bytes().to_vec();
        marked.extend(0x2000u32.to_ne_bytes());
        marked.extend(frame);
        assert_eq!(XdpMark::split(&marked), (Some(0x2000), &frame[..]));
        assert_eq!(XdpMark::split(&frame), (None, &frame[..]));
    }
}
