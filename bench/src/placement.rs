//! Where the latency client and the pods' server run.
//!
//! A connect's time depends on whether the client and the server share a
//! CPU: the SYN's and the SYN-ACK's wakeups stay on one CPU or cross to
//! the other. On this project's 2-CPU VM a connect took 12 µs with the two
//! apart and 17.5 µs with them together (a C client, by hand), and a run
//! that left placement to the scheduler flipped between the two from round
//! to round and from mode to mode (in an unpinned full run on 2026-12-05
//! the nftables mode at 10,000 Services connected faster than no proxy;
//! `bench/notes/perpacket-findings.md`). So
//! every measurement pins them the same way: the client on the first CPU
//! the bench may use, the server on the others, as two pods on different
//! cores of a node. With one CPU nothing is pinned.

use std::io;

/// The CPUs this process may run on.
fn allowed() -> io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the kernel fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    if unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Pins the calling thread to `cpus`.
fn pin(cpus: &[usize]) -> io::Result<()> {
    // SAFETY: as in `allowed`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // SAFETY: `cpu` came from `allowed`, below CPU_SETSIZE.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    if unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The client's CPU and the server's, if there are at least two.
fn split() -> io::Result<Option<(usize, Vec<usize>)>> {
    let cpus = allowed()?;
    Ok(match cpus.split_first() {
        Some((&client, server)) if !server.is_empty() => Some((client, server.to_vec())),
        _ => None,
    })
}

/// Pins the calling thread (a latency client's) to the client's CPU.
pub fn pin_client() -> io::Result<()> {
    match split()? {
        Some((client, _)) => pin(&[client]),
        None => Ok(()),
    }
}

/// Pins the calling thread (a server worker) to the server's CPUs.
pub fn pin_server() -> io::Result<()> {
    match split()? {
        Some((_, server)) => pin(&server),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_and_server_get_disjoint_cpus() {
        let before = allowed().expect("affinity");
        let Some((client, server)) = split().expect("split") else {
            return; // one CPU: nothing to pin
        };
        assert!(!server.contains(&client));
        assert_eq!(server.len() + 1, before.len());
        // In a thread of its own, so the test's thread keeps its CPUs.
        std::thread::spawn(move || {
            pin_client().expect("pin");
            assert_eq!(allowed().expect("affinity"), vec![client]);
        })
        .join()
        .expect("the pinned thread");
    }
}
