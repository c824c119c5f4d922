//! BPF_PROG_TEST_RUN on any program descriptor, so that the real programs
//! (aya's) and hand-loaded baselines are timed through the very same call.

use std::{io, os::fd::BorrowedFd};

use crate::{Attr, call, cmd, fd_field};

/// `union bpf_attr` for BPF_PROG_TEST_RUN.
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

// SAFETY: the kernel's layout; `data_in` points at `data_size_in` readable
// bytes and `data_out` at `data_size_out` writable ones (the kernel writes
// at most that many), both borrowed for the call; no context.
unsafe impl Attr for TestRunAttr {}

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
pub fn prog_test_run(prog: BorrowedFd<'_>, data_in: &[u8], data_out: &mut [u8]) -> io::Result<Run> {
    let size = |len: usize| u32::try_from(len).map_err(crate::invalid_data);
    let mut attr = TestRunAttr {
        prog_fd: fd_field(prog)?,
        data_size_in: size(data_in.len())?,
        data_size_out: size(data_out.len())?,
        data_in: data_in.as_ptr() as u64,
        data_out: data_out.as_mut_ptr() as u64,
        repeat: 1,
        ..TestRunAttr::default()
    };
    call(cmd::PROG_TEST_RUN, &mut attr)?;
    Ok(Run {
        code: attr.retval,
        duration_ns: attr.duration,
        out_len: attr.data_size_out as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attr_has_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<TestRunAttr>(), 80);
        assert_eq!(std::mem::offset_of!(TestRunAttr, repeat), 32);
        assert_eq!(std::mem::offset_of!(TestRunAttr, ctx_in), 48);
        assert_eq!(std::mem::offset_of!(TestRunAttr, flags), 64);
    }
}
