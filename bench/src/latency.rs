//! First-packet cost: sequential new TCP connections from inside a
//! namespace, each timed twice: socket + bind + connect (the SYN's way
//! through the node and the SYN-ACK's way back), and the whole request
//! (connect, a line out, the pod's name back to the server's close).
//!
//! Every connection of a target comes from a local port of its own, so
//! each is a new flow to every conntrack (the kernel's and the programs'):
//! no connection is steered by an entry an earlier one left.

use std::{
    io::{Read, Write},
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use testbed::netns::Netns;

use crate::{
    placement, sock,
    stats::{Summary, percentile},
};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Local ports a latency client picks from; each target gets a slice.
const PORTS: std::ops::Range<u32> = 2_000..65_000;

/// Where connections go, and from which local ports.
#[derive(Clone, Debug)]
pub struct Target {
    pub addr: SocketAddr,
    ports: std::ops::Range<u16>,
    next: u16,
}

impl Target {
    /// Target `slot` of `slots` to `addr`: its local ports are the slot-th
    /// share of [`PORTS`].
    pub fn new(addr: SocketAddr, slot: usize, slots: usize) -> Self {
        let share = (PORTS.end - PORTS.start) / slots.max(1) as u32;
        let start = PORTS.start + share * slot as u32;
        let ports = start as u16..(start + share) as u16;
        Self {
            addr,
            next: ports.start,
            ports,
        }
    }

    /// The next local port, cycling through the target's share.
    fn next_port(&mut self) -> u16 {
        let port = self.next;
        self.next = if self.next + 1 >= self.ports.end {
            self.ports.start
        } else {
            self.next + 1
        };
        port
    }

    /// How many connections fit before a local port comes round again.
    pub fn capacity(&self) -> usize {
        self.ports.len()
    }
}

/// The samples of one round, in microseconds.
#[derive(Clone, Debug, Default)]
pub struct Round {
    pub connect_us: Vec<f64>,
    pub request_us: Vec<f64>,
    pub failures: usize,
    pub first_failure: Option<String>,
}

/// `count` sequential connections from `ns` to `target`, from the
/// client's CPU (see `placement`).
pub fn round(ns: &Netns, target: &mut Target, count: usize) -> Result<Round> {
    ns.run_in(|| -> Result<Round> {
        placement::pin_client().context("pinning the latency client to its CPU")?;
        let mut round = Round {
            connect_us: Vec::with_capacity(count),
            request_us: Vec::with_capacity(count),
            ..Round::default()
        };
        for _ in 0..count {
            let port = target.next_port();
            match one_connection(port, target.addr) {
                Ok((connect, request)) => {
                    round.connect_us.push(micros(connect));
                    round.request_us.push(micros(request));
                }
                Err(e) => {
                    round.failures += 1;
                    round
                        .first_failure
                        .get_or_insert_with(|| format!("from port {port}: {e}"));
                }
            }
        }
        Ok(round)
    })?
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// One connection: (socket + connect, the whole request).
fn one_connection(port: u16, addr: SocketAddr) -> std::io::Result<(Duration, Duration)> {
    let start = Instant::now();
    let mut stream = sock::connect_from(port, addr, CONNECT_TIMEOUT)?;
    let connected = start.elapsed();
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.write_all(b"hello\n")?;
    let mut answer = [0u8; 64];
    let mut len = 0;
    loop {
        let n = stream.read(&mut answer[len..])?;
        if n == 0 || len + n == answer.len() {
            len += n;
            break;
        }
        len += n;
    }
    let total = start.elapsed();
    if len == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "closed without an answer",
        ));
    }
    Ok((connected, total))
}

/// p50 and p99 of connect and request latency, each as a median with
/// min-max over the rounds; in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub connect_p50_us: Summary,
    pub connect_p99_us: Summary,
    pub request_p50_us: Summary,
    pub request_p99_us: Summary,
    pub connections_per_round: usize,
    pub failures: usize,
}

impl Latency {
    /// Summarises rounds; fails if any round had no successful connection.
    pub fn of(rounds: &[Round]) -> Result<Self> {
        let mut per_round = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for round in rounds {
            let stats = [
                percentile(&round.connect_us, 50.0),
                percentile(&round.connect_us, 99.0),
                percentile(&round.request_us, 50.0),
                percentile(&round.request_us, 99.0),
            ];
            for (list, stat) in per_round.iter_mut().zip(stats) {
                match stat {
                    Some(value) => list.push(value),
                    None => bail!(
                        "a round had no successful connection ({} failed; first: {})",
                        round.failures,
                        round.first_failure.as_deref().unwrap_or("?")
                    ),
                }
            }
        }
        let summary = |values: &[f64]| Summary::of(values).unwrap_or(Summary::one(f64::NAN));
        Ok(Self {
            connect_p50_us: summary(&per_round[0]),
            connect_p99_us: summary(&per_round[1]),
            request_p50_us: summary(&per_round[2]),
            request_p99_us: summary(&per_round[3]),
            connections_per_round: rounds
                .iter()
                .map(|r| r.connect_us.len() + r.failures)
                .max()
                .unwrap_or(0),
            failures: rounds.iter().map(|r| r.failures).sum(),
        })
    }
}

/// Several targets measured in interleaved rounds (round 1 of each, then
/// round 2 of each, ...), so a slow moment of the machine hits all of them
/// alike instead of one.
pub fn interleaved(
    targets: &mut [(&Netns, &mut Target)],
    rounds: usize,
    count: usize,
    progress: &dyn Fn(&str),
) -> Result<Vec<Latency>> {
    let mut all: Vec<Vec<Round>> = vec![Vec::new(); targets.len()];
    for r in 0..rounds {
        for (i, (ns, target)) in targets.iter_mut().enumerate() {
            progress(&format!("latency round {}/{rounds}: {}", r + 1, target.addr));
            all[i].push(round(ns, target, count)?);
        }
    }
    all.iter().map(|rounds| Latency::of(rounds)).collect()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn targets_get_disjoint_port_shares_and_cycle() {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 80));
        let a = Target::new(addr, 0, 6);
        let b = Target::new(addr, 1, 6);
        let last = Target::new(addr, 5, 6);
        assert!(a.ports.end <= b.ports.start);
        assert!(u32::from(last.ports.end) <= PORTS.end);
        assert_eq!(a.capacity(), 10_500);
        let mut small = Target {
            addr,
            ports: 10..13,
            next: 10,
        };
        let ports: Vec<u16> = (0..5).map(|_| small.next_port()).collect();
        assert_eq!(ports, vec![10, 11, 12, 10, 11]);
    }

    #[test]
    fn summarises_rounds_by_their_percentiles() {
        let round = |base: f64| Round {
            connect_us: (1..=100).map(|i| base + f64::from(i)).collect(),
            request_us: (1..=100).map(|i| 2.0 * (base + f64::from(i))).collect(),
            failures: 1,
            first_failure: None,
        };
        let latency = Latency::of(&[round(0.0), round(10.0), round(5.0)]).expect("rounds");
        assert_eq!(latency.connect_p50_us.median, 55.0);
        assert_eq!(latency.connect_p50_us.min, 50.0);
        assert_eq!(latency.connect_p50_us.max, 60.0);
        assert_eq!(latency.connect_p99_us.median, 104.0);
        assert_eq!(latency.request_p50_us.median, 110.0);
        assert_eq!(latency.connections_per_round, 101);
        assert_eq!(latency.failures, 3);
        let empty = Round {
            failures: 3,
            first_failure: Some("refused".into()),
            ..Round::default()
        };
        assert!(Latency::of(&[empty]).is_err());
    }
}
