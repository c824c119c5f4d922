//! The bpf(2) commands this module needs beyond what aya offers:
//! BPF_PROG_TEST_RUN on any
//! program descriptor (so baselines and the real programs are timed through
//! the very same call), and opening a pinned object (the agent's).

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
};

pub use proxy_userspace::mode::ebpf::sys::obj_get;

const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// The pass-only baselines are the test bed's.
pub use testbed::netns::bpf::{Pass as PassProgram, load_pass};

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
