//! BPF_PROG_TEST_RUN on any program descriptor, so that the real programs
//! (aya's) and hand-loaded baselines are timed through the very same call;
//! with an skb context for a tc program that should see its device and
//! whose mark is read back (`xproxy trace`).

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
// at most that many), both borrowed for the call; `ctx_in` and `ctx_out`
// likewise for the context (the same buffer: the kernel copies the context
// in before the run and out after it), or zero without one.
unsafe impl Attr for TestRunAttr {}

/// `struct __sk_buff` as a tc program's test run takes it in and gives it
/// back: a context of [`skb_ctx::SIZE`] bytes in which only the fields
/// named here may be non-zero going in (the kernel refuses others).
pub mod skb_ctx {
    /// `sizeof(struct __sk_buff)` (up to `hwtstamp`, Linux 5.16).
    pub const SIZE: usize = 192;
    /// Byte offsets of `u32` fields, in host byte order.
    pub const MARK: usize = 8;
    pub const INGRESS_IFINDEX: usize = 36;
    /// The device the skb is on (it must exist in the caller's network
    /// namespace; 0: the kernel's loopback).
    pub const IFINDEX: usize = 40;

    /// The `u32` at `offset` of `ctx`.
    pub fn get(ctx: &[u8; SIZE], offset: usize) -> u32 {
        let mut field = [0; 4];
        field.copy_from_slice(&ctx[offset..offset + 4]);
        u32::from_ne_bytes(field)
    }

    /// Writes `value` at `offset` of `ctx`.
    pub fn set(ctx: &mut [u8; SIZE], offset: usize, value: u32) {
        ctx[offset..offset + 4].copy_from_slice(&value.to_ne_bytes());
    }
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
pub fn prog_test_run(prog: BorrowedFd<'_>, data_in: &[u8], data_out: &mut [u8]) -> io::Result<Run> {
    run(prog, data_in, data_out, None)
}

/// [`prog_test_run`] of a tc program with the skb's context `ctx` (see
/// [`skb_ctx`]), which holds the context as the program left it afterwards.
pub fn prog_test_run_skb(
    prog: BorrowedFd<'_>,
    data_in: &[u8],
    data_out: &mut [u8],
    ctx: &mut [u8; skb_ctx::SIZE],
) -> io::Result<Run> {
    run(prog, data_in, data_out, Some(ctx))
}

fn run(prog: BorrowedFd<'_>, data_in: &[u8], data_out: &mut [u8], ctx: Option<&mut [u8]>) -> io::Result<Run> {
    let size = |len: usize| u32::try_from(len).map_err(crate::invalid_data);
    let (ctx_size, ctx_ptr) = match ctx {
        Some(ctx) => (size(ctx.len())?, ctx.as_mut_ptr() as u64),
        None => (0, 0),
    };
    let mut attr = TestRunAttr {
        prog_fd: fd_field(prog)?,
        data_size_in: size(data_in.len())?,
        data_size_out: size(data_out.len())?,
        data_in: data_in.as_ptr() as u64,
        data_out: data_out.as_mut_ptr() as u64,
        repeat: 1,
        ctx_size_in: ctx_size,
        ctx_size_out: ctx_size,
        ctx_in: ctx_ptr,
        ctx_out: ctx_ptr,
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

    #[test]
    fn skb_context_fields_are_read_back_as_written() {
        let mut ctx = [0; skb_ctx::SIZE];
        skb_ctx::set(&mut ctx, skb_ctx::MARK, 0x4000);
        skb_ctx::set(&mut ctx, skb_ctx::IFINDEX, 7);
        assert_eq!(skb_ctx::get(&ctx, skb_ctx::MARK), 0x4000);
        assert_eq!(skb_ctx::get(&ctx, skb_ctx::IFINDEX), 7);
        assert_eq!(skb_ctx::get(&ctx, skb_ctx::INGRESS_IFINDEX), 0);
    }
}
