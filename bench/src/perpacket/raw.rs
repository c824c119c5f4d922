//! The bpf(2) commands this module needs beyond what aya offers: loading a
//! program from raw instructions (the baselines), BPF_PROG_TEST_RUN on any
//! program descriptor (so baselines and the real programs are timed through
//! the very same call), and opening a pinned object.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_TEST_RUN: libc::c_long = 10;

const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;

/// A program that only returns its hook's "pass" code: what is left of a
/// test run when the program itself costs (next to) nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassProgram {
    /// `return XDP_PASS` (2).
    Xdp,
    /// `return TC_ACT_OK` (0), a tc classifier.
    Tc,
}

impl PassProgram {
    /// The code the program returns.
    pub fn code(self) -> u32 {
        match self {
            PassProgram::Xdp => 2,
            PassProgram::Tc => 0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PassProgram::Xdp => "XDP_PASS",
            PassProgram::Tc => "TC_ACT_OK",
        }
    }
}

/// The `BPF_PROG_LOAD` part of `union bpf_attr`, up to `expected_attach_type`.
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

/// The `BPF_PROG_TEST_RUN` part of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

/// The `BPF_OBJ_GET` part of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// Calls bpf(2) with `attr`; returns its non-negative result.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: attr is a fully initialised bpf_attr prefix of the size
    // passed; the kernel zero-extends the rest and writes only inside it.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ret)
}

/// Takes ownership of the descriptor a successful bpf(2) call returned.
fn owned_fd(ret: libc::c_long) -> OwnedFd {
    // SAFETY: the call succeeded and returned a new descriptor nobody else owns.
    unsafe { OwnedFd::from_raw_fd(ret as i32) }
}

/// Loads `mov64 r0, <code>; exit` as the given program type.
pub fn load_pass(kind: PassProgram) -> io::Result<OwnedFd> {
    let mut insns = [0u8; 16];
    insns[0] = 0xb7; // mov64 r0, imm
    insns[4..8].copy_from_slice(&kind.code().to_le_bytes());
    insns[8] = 0x95; // exit
    static LICENSE: &[u8] = b"GPL\0";
    let mut name = [0u8; 16];
    name[..10].copy_from_slice(b"bench_pass");
    let (prog_type, expected_attach_type) = match kind {
        PassProgram::Xdp => (BPF_PROG_TYPE_XDP, BPF_XDP),
        PassProgram::Tc => (BPF_PROG_TYPE_SCHED_CLS, 0),
    };
    let mut attr = ProgLoadAttr {
        prog_type,
        insn_cnt: 2,
        insns: insns.as_ptr() as u64,
        license: LICENSE.as_ptr() as u64,
        prog_name: name,
        expected_attach_type,
        ..Default::default()
    };
    bpf(BPF_PROG_LOAD, &mut attr).map(owned_fd)
}

/// What one BPF_PROG_TEST_RUN reported.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    /// The program's return code.
    pub code: u32,
    /// The kernel's measured time for the run, in ns.
    pub duration_ns: u32,
    /// Bytes of the frame as the program left it, written to `data_out`.
    pub out_len: usize,
}

/// Runs `prog` once (repeat = 1) on `data_in`; the frame it leaves is
/// written to `data_out`.
pub fn test_run(prog: BorrowedFd<'_>, data_in: &[u8], data_out: &mut [u8]) -> io::Result<Run> {
    let mut attr = TestRunAttr {
        prog_fd: prog.as_raw_fd() as u32,
        data_size_in: data_in.len() as u32,
        data_size_out: data_out.len() as u32,
        data_in: data_in.as_ptr() as u64,
        data_out: data_out.as_mut_ptr() as u64,
        repeat: 1,
        ..Default::default()
    };
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    Ok(Run {
        code: attr.retval,
        duration_ns: attr.duration,
        out_len: attr.data_size_out as usize,
    })
}

/// Opens the object (map, program, link) pinned at `path`.
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        ..Default::default()
    };
    bpf(BPF_OBJ_GET, &mut attr).map(owned_fd)
}
