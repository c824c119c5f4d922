//! The bpf(2) commands the agent calls itself, in one place: those aya 0.14
//! does not offer (opening a pinned object, detaching a link, reading,
//! writing or deleting many map entries in one call: the batch commands of
//! Linux 5.6)
//! and the one-entry map writes they fall back to, which take a bare
//! descriptor (aya's need its map handle borrowed mutably).

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
const BPF_LINK_DETACH: libc::c_long = 34;

/// The kernel's own "operation not supported" (not in libc): what a map
/// type without batch operations answers.
const ENOTSUPP: i32 = 524;

/// `union bpf_attr` for BPF_OBJ_GET (the kernel takes a prefix).
#[repr(C)]
struct ObjGet {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// `union bpf_attr` for BPF_LINK_DETACH.
#[repr(C)]
struct LinkDetach {
    link_fd: u32,
}

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

/// Calls bpf(2) with `attr`; returns its non-negative result.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised prefix of `union bpf_attr` for
    // `cmd` and its size is passed along: the kernel reads only that much
    // (zero-extending the rest) and writes back only inside it. Pointers in
    // it come from the callers' borrowed arguments, live for the call, of
    // the sizes the kernel reads (the map's key and value sizes, `count`).
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn invalid_data(e: impl std::error::Error + Send + Sync + 'static) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Opens the object (map, program, link) pinned at `path` (BPF_OBJ_GET).
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    let fd = i32::try_from(fd).map_err(invalid_data)?;
    // SAFETY: BPF_OBJ_GET returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens the link pinned at `pin` and detaches it (BPF_LINK_DETACH).
pub(super) fn detach_pinned_link(pin: &Path) -> io::Result<()> {
    let fd = obj_get(pin)?;
    let link_fd = u32::try_from(fd.as_raw_fd()).map_err(invalid_data)?;
    bpf(BPF_LINK_DETACH, &mut LinkDetach { link_fd })?;
    Ok(())
}

fn map_fd(map: BorrowedFd<'_>) -> io::Result<u32> {
    u32::try_from(map.as_raw_fd()).map_err(invalid_data)
}

/// Writes `key -> value` into `map` (BPF_MAP_UPDATE_ELEM, BPF_ANY). `K` and
/// `V` must have the map's key and value sizes.
pub(super) fn map_update_elem<K: aya::Pod, V: aya::Pod>(map: BorrowedFd<'_>, key: &K, value: &V) -> io::Result<()> {
    let mut attr = Elem {
        map_fd: map_fd(map)?,
        key: key as *const K as u64,
        value: value as *const V as u64,
        ..Elem::default()
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// Deletes `key` from `map` (BPF_MAP_DELETE_ELEM); ENOENT if it is not there.
pub(super) fn map_delete_elem<K: aya::Pod>(map: BorrowedFd<'_>, key: &K) -> io::Result<()> {
    let mut attr = Elem {
        map_fd: map_fd(map)?,
        key: key as *const K as u64,
        ..Elem::default()
    };
    bpf(BPF_MAP_DELETE_ELEM, &mut attr).map(drop)
}

/// A batch call that stopped early: the first `done` entries were
/// processed, the one after them failed with `error`.
#[derive(Debug, thiserror::Error)]
#[error("stopped after {done} entries")]
pub(super) struct BatchError {
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
/// `K` and `V` must have the map's key and value sizes (aya checked them
/// when it opened the map): the kernel reads the arrays with those strides.
pub(super) fn map_update_batch<K: aya::Pod, V: aya::Pod>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), BatchError> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    batch(BPF_MAP_UPDATE_BATCH, map, keys, Some(values))
}

/// Deletes `keys` from `map` in one call (BPF_MAP_DELETE_BATCH), in order:
/// the kernel stops at the first key it cannot delete (ENOENT if absent).
pub(super) fn map_delete_batch<K: aya::Pod>(map: BorrowedFd<'_>, keys: &[K]) -> Result<(), BatchError> {
    batch::<K, K>(BPF_MAP_DELETE_BATCH, map, keys, None)
}

fn batch<K: aya::Pod, V: aya::Pod>(
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
        map_fd: map_fd(map).map_err(|e| fail(0, e))?,
        ..Batch::default()
    };
    // The arrays outlive the call; the kernel only reads them.
    match bpf(cmd, &mut attr) {
        Ok(_) => Ok(()),
        Err(error) => Err(fail(processed_before_failure(count, attr.count), error)),
    }
}

/// Where a walk with [`map_lookup_batch`] goes on. The kernel's token is
/// opaque: a bucket index for hash maps, a key for others; this buffer is
/// large enough for either with the keys the agent uses.
#[derive(Default)]
pub(super) struct BatchCursor {
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
/// `K` and `V` must have the map's key and value sizes, as for
/// [`map_update_batch`].
pub(super) fn map_lookup_batch<K: aya::Pod, V: aya::Pod>(
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
        map_fd: map_fd(map).map_err(fail)?,
        ..Batch::default()
    };
    // The kernel writes at most `count` keys and values (the room reserved
    // above) and a token into `next`.
    let complete = match bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
        Ok(_) => false,
        // The walk ran off the end; `count` says how many it read before.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
        Err(error) => return Err(fail(error)),
    };
    let read = (attr.count as usize).min(room);
    // SAFETY: the kernel initialised the first `read` keys and values
    // (plain data: any bytes are valid `Pod` values).
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
    fn batch_attr_has_the_kernel_layout() {
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
}
