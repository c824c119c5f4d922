//! Map entries on a borrowed descriptor: one at a time
//! (BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM) or many in one call
//! (BPF_MAP_UPDATE_BATCH, BPF_MAP_DELETE_BATCH, BPF_MAP_LOOKUP_BATCH,
//! Linux 5.6). Several threads may write several maps at once.
//!
//! Every function takes the key and value types as `bytemuck::Pod`, and
//! they must have the map's key and value sizes: the kernel reads (and for
//! lookups writes) the arrays with those strides, whatever the types say.
//! That is why they are `unsafe`: callers that opened the map with aya as
//! a map of these types have had the sizes checked then.

use std::{io, os::fd::BorrowedFd};

use bytemuck::Pod;

use crate::{Attr, call, cmd, fd_field, invalid_data};

/// The kernel's own "operation not supported" (not in libc): what a map
/// type without batch operations answers.
const ENOTSUPP: i32 = 524;

/// `union bpf_attr` for BPF_MAP_UPDATE_ELEM and BPF_MAP_DELETE_ELEM.
#[repr(C)]
#[derive(Default)]
struct Elem {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

// SAFETY: the kernel's layout; `key` and `value` point at borrowed `Pod`
// values of the map's key and value sizes (the callers' `# Safety`).
unsafe impl Attr for Elem {}

/// `union bpf_attr` for the BPF_MAP_*_BATCH commands. `count` goes in as
/// the number of entries and comes back as the number processed.
#[repr(C)]
#[derive(Default)]
struct Batch {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

// SAFETY: the kernel's layout; `keys` and `values` point at `count`
// entries of the map's sizes (the callers' `# Safety`), `in_batch` and
// `out_batch` at a token buffer as large as the map's key (checked), all
// borrowed for the call.
unsafe impl Attr for Batch {}

/// Writes `key -> value` into `map` (BPF_MAP_UPDATE_ELEM, BPF_ANY).
///
/// # Safety
///
/// `K` and `V` must have `map`'s key and value sizes.
pub unsafe fn update_elem<K: Pod, V: Pod>(map: BorrowedFd<'_>, key: &K, value: &V) -> io::Result<()> {
    let mut attr = Elem {
        map_fd: fd_field(map)?,
        key: key as *const K as u64,
        value: value as *const V as u64,
        ..Elem::default()
    };
    call(cmd::MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// Deletes `key` from `map` (BPF_MAP_DELETE_ELEM); ENOENT if it is not there.
///
/// # Safety
///
/// `K` must have `map`'s key size.
pub unsafe fn delete_elem<K: Pod>(map: BorrowedFd<'_>, key: &K) -> io::Result<()> {
    let mut attr = Elem {
        map_fd: fd_field(map)?,
        key: key as *const K as u64,
        ..Elem::default()
    };
    call(cmd::MAP_DELETE_ELEM, &mut attr).map(drop)
}

/// A batch call that stopped early: the first `done` entries were
/// processed, the one after them failed with `error`.
#[derive(Debug, thiserror::Error)]
#[error("stopped after {done} entries")]
pub struct BatchError {
    pub done: usize,
    #[source]
    pub error: io::Error,
}

impl BatchError {
    /// The kernel has no batch operations for this map (older than 5.6:
    /// unknown command; or a map type without them). Only meaningful when
    /// nothing was processed.
    pub fn unsupported(&self) -> bool {
        self.done == 0
            && matches!(
                self.error.raw_os_error(),
                Some(libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS | ENOTSUPP)
            )
    }

    /// The entry after the processed ones was not in the map (a delete).
    pub fn not_found(&self) -> bool {
        self.error.raw_os_error() == Some(libc::ENOENT)
    }
}

/// Writes `keys[i] -> values[i]` into `map` in one call
/// (BPF_MAP_UPDATE_BATCH, flags BPF_ANY), in order: the kernel stops at the
/// first entry it cannot write.
///
/// # Safety
///
/// `K` and `V` must have `map`'s key and value sizes.
pub unsafe fn update_batch<K: Pod, V: Pod>(map: BorrowedFd<'_>, keys: &[K], values: &[V]) -> Result<(), BatchError> {
    if keys.len() != values.len() {
        let error = io::Error::new(io::ErrorKind::InvalidInput, "one value per key");
        return Err(BatchError { done: 0, error });
    }
    batch(cmd::MAP_UPDATE_BATCH, map, keys, Some(values))
}

/// Deletes `keys` from `map` in one call (BPF_MAP_DELETE_BATCH), in order:
/// the kernel stops at the first key it cannot delete (ENOENT if absent).
///
/// # Safety
///
/// `K` must have `map`'s key size.
pub unsafe fn delete_batch<K: Pod>(map: BorrowedFd<'_>, keys: &[K]) -> Result<(), BatchError> {
    batch::<K, K>(cmd::MAP_DELETE_BATCH, map, keys, None)
}

fn batch<K: Pod, V: Pod>(
    cmd: libc::c_long,
    map: BorrowedFd<'_>,
    keys: &[K],
    values: Option<&[V]>,
) -> Result<(), BatchError> {
    let fail = |done: usize, error: io::Error| BatchError { done, error };
    let count = u32::try_from(keys.len()).map_err(|e| fail(0, invalid_data(e)))?;
    if count == 0 {
        return Ok(());
    }
    let mut attr = Batch {
        keys: keys.as_ptr() as u64,
        values: values.map_or(0, |v| v.as_ptr() as u64),
        count,
        map_fd: fd_field(map).map_err(|e| fail(0, e))?,
        ..Batch::default()
    };
    // The arrays outlive the call; the kernel only reads them.
    match call(cmd, &mut attr) {
        Ok(_) => Ok(()),
        Err(error) => Err(fail(processed_before_failure(count, attr.count), error)),
    }
}

/// Where a walk with [`lookup_batch`] goes on. The kernel's token is
/// opaque: a bucket index for hash maps, a key for others; this buffer is
/// large enough for either with keys of up to 64 bytes.
#[derive(Default)]
pub struct BatchCursor {
    token: [u64; 8],
    started: bool,
}

impl BatchCursor {
    /// Whether a call went through (a walk the kernel turned down at once
    /// may fall back to another way).
    pub fn started(&self) -> bool {
        self.started
    }
}

/// Reads the next entries of `map` (BPF_MAP_LOOKUP_BATCH) into `keys` and
/// `values` (cleared first; their capacity is how many are asked for, at
/// least one). Returns whether the walk is complete: then the entries read
/// are the last ones. A hash bucket holds more entries than asked for:
/// ENOSPC, ask again with more room.
///
/// # Safety
///
/// `K` and `V` must have `map`'s key and value sizes: the kernel writes
/// that many bytes per entry into the room reserved for `K`s and `V`s.
pub unsafe fn lookup_batch<K: Pod, V: Pod>(
    map: BorrowedFd<'_>,
    cursor: &mut BatchCursor,
    keys: &mut Vec<K>,
    values: &mut Vec<V>,
) -> Result<bool, BatchError> {
    let fail = |error: io::Error| BatchError { done: 0, error };
    if std::mem::size_of::<K>() > std::mem::size_of_val(&cursor.token) {
        return Err(fail(io::Error::from(io::ErrorKind::InvalidInput)));
    }
    keys.clear();
    values.clear();
    let room = keys.capacity().min(values.capacity()).max(1);
    keys.reserve(room);
    values.reserve(room);
    let mut next = [0u64; 8];
    let mut attr = Batch {
        in_batch: if cursor.started {
            cursor.token.as_ptr() as u64
        } else {
            0
        },
        out_batch: next.as_mut_ptr() as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: u32::try_from(room).unwrap_or(u32::MAX),
        map_fd: fd_field(map).map_err(fail)?,
        ..Batch::default()
    };
    // The kernel writes at most `count` keys and values (the room reserved
    // above) and a token into `next`.
    let complete = match call(cmd::MAP_LOOKUP_BATCH, &mut attr) {
        Ok(_) => false,
        // The walk ran off the end; `count` says how many it read before.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
        Err(error) => return Err(fail(error)),
    };
    let read = (attr.count as usize).min(room);
    // SAFETY: the kernel initialised the first `read` keys and values, all
    // inside the reserved room (plain data: any bytes are valid `Pod`s).
    unsafe {
        keys.set_len(read);
        values.set_len(read);
    }
    cursor.token = next;
    cursor.started = true;
    Ok(complete)
}

/// How many entries a failed batch call processed. The kernel writes back
/// the index of the entry that failed (always below `asked`); a call it
/// rejected before looking at any entry (unknown command, no batch support,
/// bad flags) leaves `count` as it was.
fn processed_before_failure(asked: u32, written_back: u32) -> usize {
    if written_back < asked { written_back as usize } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_rejected_up_front_processed_nothing() {
        assert_eq!(processed_before_failure(10, 10), 0);
        assert_eq!(processed_before_failure(10, 3), 3);
        assert_eq!(processed_before_failure(10, 0), 0);
    }

    #[test]
    fn attrs_have_the_kernel_layout() {
        // in_batch, out_batch, keys, values, count + map_fd, elem_flags, flags.
        assert_eq!(std::mem::size_of::<Batch>(), 56);
        assert_eq!(std::mem::offset_of!(Batch, count), 32);
        assert_eq!(std::mem::offset_of!(Batch, map_fd), 36);
        assert_eq!(std::mem::offset_of!(Batch, elem_flags), 40);
        assert_eq!(std::mem::offset_of!(Batch, flags), 48);
        // map_fd, (padding), key, value, flags.
        assert_eq!(std::mem::size_of::<Elem>(), 32);
        assert_eq!(std::mem::offset_of!(Elem, key), 8);
    }

    #[test]
    fn unsupported_only_when_nothing_was_processed() {
        let error = |done, errno| BatchError {
            done,
            error: io::Error::from_raw_os_error(errno),
        };
        assert!(error(0, ENOTSUPP).unsupported());
        assert!(
            !error(3, libc::EINVAL).unsupported(),
            "a failure after some entries is real"
        );
        assert!(error(2, libc::ENOENT).not_found());
    }
}
