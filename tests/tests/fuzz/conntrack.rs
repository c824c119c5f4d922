//! The oracle's own model of the programs' connection tracking, written
//! from the specified semantics (not from `proxy_common::conntrack`).
//!
//! One table of entries keyed by the tuple a packet carries: a flow's
//! forward entry (`client -> frontend`, DNAT to its backend) and its reply
//! entry (`backend -> client`, reverse NAT to its frontend), each with the
//! flow's state and its two FIN bits. A packet's own tuple is looked up:
//! - a packet that opens a flow (forward: a TCP SYN without ACK, any UDP
//!   datagram; reply side: a TCP SYN, any UDP datagram) on an entry whose
//!   flow is closed (TIME_WAIT or CLOSE) removes that entry and is
//!   untracked;
//! - any other hit moves the state on (RST: CLOSE, sticky; FIN: its
//!   direction's bit, both: TIME_WAIT, else FIN_WAIT; a reply while
//!   SYN_SENT: ESTABLISHED; UDP: a reply makes it REPLIED) and, if it
//!   changed, writes the same state into the entry at the entry's partner
//!   tuple (its other direction as the entry names it), if that entry
//!   names the first as its partner in turn (else it is another flow's);
//! - an ICMP error only reads the entry of its tuple.
//!
//! A new flow's reply entry replaces another reply entry on its tuple, but
//! not a forward one (then the flow is not tracked); both start in
//! SYN_SENT (TCP) or UNREPLIED (UDP), whatever the first packet's flags.
//! The fuzz loads the programs with timeouts far longer than a run, so a
//! flow is over only when it is closed.

use std::{collections::HashMap, net::SocketAddrV4};

use proxy_common::proto;
use testbed::frame::tcp_flags::{ACK, FIN, RST, SYN};

/// (source, destination, protocol) of a packet.
pub type Tuple = (SocketAddrV4, SocketAddrV4, u8);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    SynSent,
    Established,
    FinWait,
    TimeWait,
    Close,
    Unreplied,
    Replied,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The reply entry (`backend -> client`); else the forward one.
    pub reply: bool,
    /// What the packet is rewritten to: the backend (forward entry,
    /// destination) or the frontend (reply entry, source).
    pub nat: SocketAddrV4,
    pub state: State,
    /// The client's and the backend's FIN were seen.
    pub fin_forward: bool,
    pub fin_reply: bool,
}

impl Entry {
    fn new(reply: bool, nat: SocketAddrV4, proto: u8) -> Self {
        let state = if proto == proto::TCP {
            State::SynSent
        } else {
            State::Unreplied
        };
        Self {
            reply,
            nat,
            state,
            fin_forward: false,
            fin_reply: false,
        }
    }

    pub fn closed(&self) -> bool {
        matches!(self.state, State::TimeWait | State::Close)
    }

    /// The tuple of the flow's other entry, as this entry names it.
    fn partner(&self, key: &Tuple) -> Tuple {
        if self.reply {
            (key.1, self.nat, key.2)
        } else {
            (self.nat, key.0, key.2)
        }
    }

    /// The state, FIN bits included, after a packet with `tcp_flags`.
    fn after(&self, proto: u8, tcp_flags: u8) -> (State, bool, bool) {
        let now = (self.state, self.fin_forward, self.fin_reply);
        if proto != proto::TCP {
            let replied = self.reply && self.state == State::Unreplied;
            return if replied { (State::Replied, now.1, now.2) } else { now };
        }
        if tcp_flags & RST != 0 {
            return (State::Close, now.1, now.2);
        }
        if self.state == State::Close {
            return now;
        }
        if tcp_flags & FIN != 0 {
            let (fin_forward, fin_reply) = (now.1 || !self.reply, now.2 || self.reply);
            let state = if fin_forward && fin_reply {
                State::TimeWait
            } else {
                State::FinWait
            };
            return (state, fin_forward, fin_reply);
        }
        if self.reply && self.state == State::SynSent {
            return (State::Established, now.1, now.2);
        }
        now
    }
}

/// Whether a packet with `tcp_flags` would open a flow from its side.
fn opens(proto: u8, tcp_flags: u8, reply: bool) -> bool {
    if proto != proto::TCP {
        return true;
    }
    if reply {
        tcp_flags & SYN != 0
    } else {
        tcp_flags & (SYN | ACK) == SYN
    }
}

/// What a packet's own tuple finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// No entry.
    Miss,
    /// A closed flow's entry the packet opens anew: removed, the packet untracked.
    Reopens,
    /// A tracked flow's entry: the packet is translated with it.
    Hit { reply: bool, nat: SocketAddrV4 },
}

#[derive(Default)]
pub struct Conntrack {
    entries: HashMap<Tuple, Entry>,
    /// State changes not passed on: the entry at the partner tuple names
    /// another entry as its partner (a closed flow's reply entry left
    /// behind by a new flow to another backend, or a reply entry a second
    /// flow took over). Reported, see `advance`.
    pub one_way_partners: u64,
}

impl Conntrack {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// What the lookup of a packet's tuple finds (without changing anything).
    pub fn find(&self, tuple: &Tuple, tcp_flags: u8) -> Lookup {
        match self.entries.get(tuple) {
            None => Lookup::Miss,
            Some(e) if e.closed() && opens(tuple.2, tcp_flags, e.reply) => Lookup::Reopens,
            Some(e) => Lookup::Hit {
                reply: e.reply,
                nat: e.nat,
            },
        }
    }

    /// Does what the lookup of [`Self::find`] does to the table.
    pub fn look_up(&mut self, tuple: &Tuple, tcp_flags: u8) {
        match self.find(tuple, tcp_flags) {
            Lookup::Miss => {}
            Lookup::Reopens => {
                self.entries.remove(tuple);
            }
            Lookup::Hit { .. } => self.advance(tuple, tcp_flags),
        }
    }

    /// Moves the state of the entry at `tuple` on, and writes it into the
    /// entry at its partner tuple if that one is the same flow's (it names
    /// `tuple` as its partner): a late RST of a closed flow must not close
    /// the new flow its client opened on the same tuple to another backend.
    fn advance(&mut self, tuple: &Tuple, tcp_flags: u8) {
        let entry = self.entries[tuple];
        let (state, fin_forward, fin_reply) = entry.after(tuple.2, tcp_flags);
        if (state, fin_forward, fin_reply) == (entry.state, entry.fin_forward, entry.fin_reply) {
            return;
        }
        let partner = entry.partner(tuple);
        let mut keys = vec![*tuple];
        match self.entries.get(&partner) {
            Some(p) if p.partner(&partner) == *tuple => keys.push(partner),
            Some(_) => self.one_way_partners += 1,
            None => {}
        }
        for key in keys {
            if let Some(e) = self.entries.get_mut(&key) {
                (e.state, e.fin_forward, e.fin_reply) = (state, fin_forward, fin_reply);
            }
        }
    }

    /// The entry an ICMP error travelling as `tuple` is about.
    pub fn related(&self, tuple: &Tuple) -> Option<Entry> {
        self.entries.get(tuple).copied()
    }

    /// Whether a new flow `client -> frontend` to `backend` cannot be
    /// tracked: its reply tuple is a forward entry (`removed` is an entry
    /// the packet's lookup removes first).
    pub fn collides(&self, client: SocketAddrV4, backend: SocketAddrV4, proto: u8, removed: Option<Tuple>) -> bool {
        let key = (backend, client, proto);
        Some(key) != removed && self.entries.get(&key).is_some_and(|e| !e.reply)
    }

    /// Records the new flow `tuple` (client -> frontend) to `backend`, as
    /// the program does; `false` if it is not tracked.
    pub fn create(&mut self, tuple: &Tuple, backend: SocketAddrV4) -> bool {
        let (client, frontend, proto) = *tuple;
        let reply_key = (backend, client, proto);
        if self.entries.get(&reply_key).is_some_and(|e| !e.reply) {
            return false;
        }
        self.entries.insert(reply_key, Entry::new(true, frontend, proto));
        if self.entries.contains_key(tuple) {
            self.entries.remove(&reply_key);
            return false;
        }
        self.entries.insert(*tuple, Entry::new(false, backend, proto));
        true
    }

    #[cfg(test)]
    pub fn entry(&self, tuple: &Tuple) -> Option<Entry> {
        self.entries.get(tuple).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddrV4 {
        s.parse().expect("socket address")
    }

    const TCP: u8 = proto::TCP;

    #[test]
    fn a_rst_closes_and_only_a_bare_syn_opens_anew() {
        let mut ct = Conntrack::default();
        let (c, fe, b) = (addr("10.244.1.5:40000"), addr("10.96.0.10:88"), addr("10.244.0.11:80"));
        let fwd = (c, fe, TCP);
        let rep = (b, c, TCP);
        assert!(ct.create(&fwd, b));
        ct.look_up(&rep, SYN | ACK);
        assert_eq!(ct.entry(&fwd).map(|e| e.state), Some(State::Established));
        ct.look_up(&rep, RST);
        assert_eq!(ct.entry(&fwd).map(|e| e.state), Some(State::Close));
        assert_eq!(ct.find(&fwd, ACK), Lookup::Hit { reply: false, nat: b });
        assert_eq!(ct.find(&fwd, SYN | ACK), Lookup::Hit { reply: false, nat: b });
        assert_eq!(ct.find(&fwd, SYN), Lookup::Reopens);
        assert_eq!(ct.find(&rep, SYN | ACK), Lookup::Reopens);
        ct.look_up(&fwd, SYN);
        assert_eq!(ct.find(&fwd, SYN), Lookup::Miss);
        // The old reply entry stays until the new flow's replaces it.
        assert!(ct.create(&fwd, b));
        assert_eq!(ct.entry(&rep).map(|e| e.state), Some(State::SynSent));
    }

    #[test]
    fn a_fin_each_way_closes_and_a_state_change_reaches_the_partner() {
        let mut ct = Conntrack::default();
        let (c, fe, b) = (addr("10.244.1.5:40000"), addr("10.96.0.10:88"), addr("10.244.0.11:80"));
        let (fwd, rep) = ((c, fe, TCP), (b, c, TCP));
        assert!(ct.create(&fwd, b));
        ct.look_up(&fwd, FIN | ACK);
        ct.look_up(&fwd, FIN | ACK);
        assert_eq!(ct.entry(&rep).map(|e| e.state), Some(State::FinWait));
        ct.look_up(&rep, FIN);
        assert!(
            ct.entry(&fwd)
                .is_some_and(|e| e.closed() && e.fin_forward && e.fin_reply)
        );
        // A second frontend of the Service: the same reply tuple, replaced.
        let np = (c, addr("192.168.50.10:30791"), TCP);
        assert!(ct.create(&np, b));
        assert_eq!(ct.find(&rep, ACK), Lookup::Hit { reply: true, nat: np.1 });
        // The first flow's packets no longer move the second's reply entry.
        ct.look_up(&fwd, RST);
        assert_eq!(ct.entry(&fwd).map(|e| e.state), Some(State::Close));
        assert_eq!(ct.entry(&rep).map(|e| e.state), Some(State::SynSent));
        assert_eq!(ct.entry(&np).map(|e| e.state), Some(State::SynSent));
        assert_eq!(ct.one_way_partners, 1);
    }

    #[test]
    fn a_late_rst_of_a_closed_flow_leaves_the_new_flow_on_its_tuple_alone() {
        let mut ct = Conntrack::default();
        let (c, fe) = (addr("10.244.1.5:42000"), addr("10.96.0.10:88"));
        let (old, new) = (addr("10.244.0.11:80"), addr("10.244.0.13:80"));
        let fwd = (c, fe, TCP);
        assert!(ct.create(&fwd, old));
        ct.look_up(&fwd, FIN | ACK);
        ct.look_up(&(old, c, TCP), FIN | ACK);
        ct.look_up(&fwd, SYN);
        assert!(ct.create(&fwd, new));
        ct.look_up(&(old, c, TCP), RST);
        assert_eq!(ct.entry(&(old, c, TCP)).map(|e| e.state), Some(State::Close));
        assert_eq!(ct.entry(&fwd).map(|e| e.state), Some(State::SynSent));
        assert_eq!(ct.entry(&(new, c, TCP)).map(|e| e.state), Some(State::SynSent));
        assert_eq!(ct.find(&fwd, SYN), Lookup::Hit { reply: false, nat: new });
    }

    #[test]
    fn a_forward_entry_on_the_reply_tuple_leaves_the_flow_untracked() {
        let mut ct = Conntrack::default();
        let (c, fe, b) = (addr("10.244.1.5:40000"), addr("10.96.0.10:88"), addr("10.244.0.11:80"));
        // A flow whose client is the backend's address and port, to c's.
        assert!(ct.create(&(b, c, TCP), addr("10.244.0.12:80")));
        assert!(ct.collides(c, b, TCP, None));
        assert!(!ct.collides(c, b, TCP, Some((b, c, TCP))));
        assert!(!ct.create(&(c, fe, TCP), b));
        assert_eq!(ct.find(&(c, fe, TCP), SYN), Lookup::Miss);
    }
}
