//! The bpf(2) commands xproxy calls itself, in one place, for the agent,
//! the bench and the test bed: those aya 0.14 does not offer on a bare
//! descriptor.
//!
//! - [`obj`]: opening a pinned object, detaching a link, creating an XDP
//!   link, loading a program from raw instructions;
//! - [`map`]: writing, deleting and reading map entries one at a time or
//!   many in one call (the batch commands of Linux 5.6), on a borrowed
//!   descriptor (aya's need its map handle borrowed mutably, one thread);
//! - [`test_run`]: BPF_PROG_TEST_RUN on any program descriptor.
//!
//! Each command fills a prefix of `union bpf_attr` (a `#[repr(C)]` struct
//! per command, its layout checked in tests) and goes through [`call`],
//! the only place that enters the kernel. Depends on libc, thiserror and
//! bytemuck only, so the test bed can use it without the agent.

use std::io;

pub mod map;
pub mod obj;
pub mod test_run;

/// bpf(2) command numbers (`enum bpf_cmd`).
mod cmd {
    pub const MAP_CREATE: libc::c_long = 0;
    pub const MAP_UPDATE_ELEM: libc::c_long = 2;
    pub const MAP_DELETE_ELEM: libc::c_long = 3;
    pub const PROG_LOAD: libc::c_long = 5;
    pub const OBJ_PIN: libc::c_long = 6;
    pub const OBJ_GET: libc::c_long = 7;
    pub const PROG_TEST_RUN: libc::c_long = 10;
    pub const MAP_LOOKUP_BATCH: libc::c_long = 24;
    pub const MAP_UPDATE_BATCH: libc::c_long = 26;
    pub const MAP_DELETE_BATCH: libc::c_long = 27;
    pub const LINK_CREATE: libc::c_long = 28;
    pub const LINK_DETACH: libc::c_long = 34;
}

/// A `#[repr(C)]` prefix of `union bpf_attr` for one command, with every
/// pointer in it valid for the call.
///
/// # Safety
///
/// Implementors must be `#[repr(C)]` with the kernel's layout for the
/// commands they are passed with, and every address in them must point at
/// memory that is live for the call and as large as the kernel reads or
/// writes there for that command.
unsafe trait Attr {}

/// Calls bpf(2) with `attr`; returns its non-negative result.
fn call<T: Attr>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised prefix of `union bpf_attr` for
    // `cmd` (the `Attr` contract) and its size is passed along: the kernel
    // reads only that much (zero-extending the rest) and writes back only
    // inside it. The addresses in it are valid for the call (`Attr`).
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

/// A descriptor as the `u32` field `union bpf_attr` holds.
fn fd_field(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<u32> {
    use std::os::fd::AsRawFd;
    u32::try_from(fd.as_raw_fd()).map_err(invalid_data)
}

/// Takes ownership of the descriptor a command returned.
fn owned_fd(ret: libc::c_long) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let fd = i32::try_from(ret).map_err(invalid_data)?;
    // SAFETY: the command returned a new descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}
