//! Pinned objects, maps, links and programs: BPF_OBJ_GET, BPF_OBJ_PIN,
//! BPF_MAP_CREATE, BPF_LINK_DETACH, BPF_LINK_CREATE (XDP) and
//! BPF_PROG_LOAD of raw instructions.

use std::{
    ffi::{CStr, CString},
    io,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::Path,
};

use crate::{Attr, call, cmd, fd_field, owned_fd};

/// `BPF_PROG_TYPE_SCHED_CLS`: a tc classifier.
pub const PROG_TYPE_SCHED_CLS: u32 = 3;
/// `BPF_PROG_TYPE_XDP`.
pub const PROG_TYPE_XDP: u32 = 6;
/// `BPF_XDP`, the attach type of an XDP link.
pub const ATTACH_XDP: u32 = 37;
/// `XDP_FLAGS_DRV_MODE`: native XDP, in the driver.
pub const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// `union bpf_attr` for BPF_OBJ_GET and BPF_OBJ_PIN (the kernel takes a
/// prefix).
#[repr(C)]
struct ObjGet {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

// SAFETY: the kernel's layout; `pathname` points at a NUL-terminated string
// the caller keeps alive for the call.
unsafe impl Attr for ObjGet {}

/// `union bpf_attr` for BPF_MAP_CREATE, up to `map_name`.
#[repr(C)]
#[derive(Default)]
struct MapCreate {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

// SAFETY: the kernel's layout; no addresses.
unsafe impl Attr for MapCreate {}

/// `BPF_MAP_TYPE_HASH`.
pub const MAP_TYPE_HASH: u32 = 1;
/// `BPF_F_NO_PREALLOC`.
pub const MAP_F_NO_PREALLOC: u32 = 1;

/// What [`map_create`] creates.
#[derive(Clone, Copy, Debug)]
pub struct MapSpec<'a> {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
    /// At most 15 bytes (longer names are cut).
    pub name: &'a str,
}

/// Creates a map (BPF_MAP_CREATE) without BTF, as a program object's maps
/// are not: for tests standing in for maps another program version made.
pub fn map_create(spec: &MapSpec<'_>) -> io::Result<OwnedFd> {
    let mut attr = MapCreate {
        map_type: spec.map_type,
        key_size: spec.key_size,
        value_size: spec.value_size,
        max_entries: spec.max_entries,
        map_flags: spec.flags,
        ..MapCreate::default()
    };
    let name = spec.name.as_bytes();
    let len = name.len().min(attr.map_name.len() - 1);
    attr.map_name[..len].copy_from_slice(&name[..len]);
    owned_fd(call(cmd::MAP_CREATE, &mut attr)?)
}

/// Pins the object `fd` at `path` in bpffs (BPF_OBJ_PIN).
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: fd_field(fd)?,
        file_flags: 0,
    };
    call(cmd::OBJ_PIN, &mut attr).map(drop)
}

/// `union bpf_attr` for BPF_LINK_DETACH.
#[repr(C)]
struct LinkDetach {
    link_fd: u32,
}

// SAFETY: the kernel's layout; no addresses.
unsafe impl Attr for LinkDetach {}

/// `union bpf_attr` for BPF_LINK_CREATE, up to `flags`.
#[repr(C)]
struct LinkCreate {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

// SAFETY: the kernel's layout; no addresses.
unsafe impl Attr for LinkCreate {}

/// `union bpf_attr` for BPF_PROG_LOAD, up to `expected_attach_type`.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

// SAFETY: the kernel's layout; `insns` points at `insn_cnt` instructions
// and `license` at a NUL-terminated string, both kept alive by the caller
// for the call; no log buffer.
unsafe impl Attr for ProgLoadAttr {}

/// Opens the object (map, program, link) pinned at `path` (BPF_OBJ_GET).
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    owned_fd(call(cmd::OBJ_GET, &mut attr)?)
}

/// Detaches `link` from its hook (BPF_LINK_DETACH): the program stops
/// running at once, whoever else holds the link.
pub fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkDetach {
        link_fd: fd_field(link)?,
    };
    call(cmd::LINK_DETACH, &mut attr).map(drop)
}

/// Opens the link pinned at `pin` and detaches it.
pub fn detach_pinned_link(pin: &Path) -> io::Result<()> {
    link_detach(obj_get(pin)?.as_fd())
}

/// Attaches XDP program `prog` to interface `ifindex` of the calling
/// thread's network namespace in native mode, as a link (BPF_LINK_CREATE):
/// detached when the returned descriptor is closed.
pub fn link_xdp_native(prog: BorrowedFd<'_>, ifindex: u32) -> io::Result<OwnedFd> {
    let mut attr = LinkCreate {
        prog_fd: fd_field(prog)?,
        target_ifindex: ifindex,
        attach_type: ATTACH_XDP,
        flags: XDP_FLAGS_DRV_MODE,
    };
    owned_fd(call(cmd::LINK_CREATE, &mut attr)?)
}

/// A program given as raw instructions (8 bytes each, little-endian).
#[derive(Clone, Copy, Debug)]
pub struct RawProgram<'a> {
    /// `BPF_PROG_TYPE_*` ([`PROG_TYPE_XDP`], [`PROG_TYPE_SCHED_CLS`]).
    pub prog_type: u32,
    /// The attach type the verifier checks against (0 where none).
    pub expected_attach_type: u32,
    pub insns: &'a [[u8; 8]],
    pub license: &'a CStr,
    /// Up to 15 bytes are kept.
    pub name: &'a str,
}

/// Loads `prog` (BPF_PROG_LOAD), without a verifier log.
pub fn prog_load(prog: &RawProgram<'_>) -> io::Result<OwnedFd> {
    let mut name = [0u8; 16];
    let len = prog.name.len().min(15);
    name[..len].copy_from_slice(&prog.name.as_bytes()[..len]);
    let mut attr = ProgLoadAttr {
        prog_type: prog.prog_type,
        insn_cnt: u32::try_from(prog.insns.len()).map_err(crate::invalid_data)?,
        insns: prog.insns.as_ptr() as u64,
        license: prog.license.as_ptr() as u64,
        prog_name: name,
        expected_attach_type: prog.expected_attach_type,
        ..ProgLoadAttr::default()
    };
    owned_fd(call(cmd::PROG_LOAD, &mut attr)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attrs_have_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<ObjGet>(), 16);
        assert_eq!(std::mem::size_of::<LinkCreate>(), 16);
        // prog_type .. prog_ifindex, expected_attach_type.
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, prog_name), 48);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, expected_attach_type), 68);
    }

    #[test]
    fn a_path_with_a_nul_is_refused_before_the_kernel() {
        let error = obj_get(Path::new("a\0b")).expect_err("NUL in the path");
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
    }
}
