//! Bulk transfers through a Service: a server in a pod namespace that sends
//! or takes any number of bytes, and a client that checks, by SHA-256 at the
//! receiving end, that every byte arrived intact, in both directions.
//!
//! One request per connection, a line and then the data:
//!
//! ```text
//! download  client: "GET <bytes> <seed>\n"
//!           server: "<pod name>\n", then <bytes> bytes of pattern(seed), then EOF
//! upload    client: "PUT <bytes> <seed>\n", then <bytes> bytes of pattern(seed)
//!           server: "<sha-256 of what it read, hex> <pod name>\n", then EOF
//! ```
//!
//! [`pattern`] is a deterministic pseudo-random stream, so the client
//! knows the SHA-256 a download must have, and what an upload must hash to,
//! without keeping the data. The answer names the pod that served, so a test
//! can tell which path a Service took.
//!
//! Nothing waits forever: a transfer that makes no progress for a while,
//! or is slower on average than a minimum rate ([`Limits`]), fails with
//! how many bytes got through. The servers run in
//! this process, so the client's error also says how far the server got
//! ([`progress`]): for an upload, how many bytes arrived.

use std::{
    collections::BTreeMap,
    fmt,
    io::{self, BufRead, BufReader, Read, Write},
    net::{Shutdown, SocketAddr, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use sha2::{Digest, Sha256};

use crate::netns::{Netns, Server};

/// The bulk server and client as methods of the namespace they run in.
impl Netns {
    /// Starts a bulk server on `port` (both families) inside the namespace that
    /// names itself `name` (see [`server`]); it is stopped when the
    /// namespace is dropped.
    pub fn serve_bulk(&self, port: u16, name: &str) -> Result<()> {
        self.keep(server(self, port, name)?);
        Ok(())
    }

    /// [`transfer`] from inside this namespace.
    pub fn bulk_transfer(&self, addr: impl Into<SocketAddr>, direction: Direction, bytes: u64) -> Result<Report> {
        let addr = addr.into();
        self.run_in(|| transfer(addr, direction, bytes))?
    }
}

/// The port the bulk servers listen on in the pods.
pub const BULK_PORT: u16 = 8080;
/// How much is read or written at a time.
const CHUNK: usize = 256 << 10;
/// How long a server waits on a silent client (longer than the client
/// waits, so the client reports a stall first, with its numbers).
const SERVER_STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest request line a server reads.
const MAX_REQUEST: u64 = 128;

/// When a transfer is given up.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// A transfer that moves no byte for this long has stalled.
    pub stall: Duration,
    /// A transfer slower than this on average (bytes per second) fails at
    /// its deadline: `stall` plus the time the bytes take at this rate.
    pub min_rate: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            stall: Duration::from_secs(5),
            min_rate: 2 << 20,
        }
    }
}

/// Which way the bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the server (the backend) to the client.
    Download,
    /// From the client to the server (the backend).
    Upload,
}

impl Direction {
    pub const BOTH: [Direction; 2] = [Direction::Download, Direction::Upload];

    fn verb(self) -> &'static str {
        match self {
            Direction::Download => "GET",
            Direction::Upload => "PUT",
        }
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::Download => "download",
            Direction::Upload => "upload",
        })
    }
}

/// A transfer that arrived intact.
#[derive(Clone, Debug)]
pub struct Report {
    /// The pod that served it.
    pub pod: String,
    pub bytes: u64,
    pub took: Duration,
}

impl Report {
    /// Bytes per second.
    pub fn rate(&self) -> f64 {
        self.bytes as f64 / self.took.as_secs_f64().max(1e-6)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes by {} in {:.2?} ({:.0} MiB/s), SHA-256 matches",
            self.bytes,
            self.pod,
            self.took,
            self.rate() / f64::from(1 << 20)
        )
    }
}

// ---------------------------------------------------------------------------
// The data.

/// The byte at offset `offset` of pattern `seed` is byte `offset % 8` of
/// `word(seed, offset / 8)` (little endian): SplitMix64 of a counter, so any
/// part of the stream can be made on its own.
fn word(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with pattern `seed` from byte `offset` on.
pub fn pattern(seed: u64, offset: u64, buf: &mut [u8]) {
    let mut at = 0;
    while at < buf.len() {
        let position = offset + at as u64;
        let skip = (position % 8) as usize;
        let bytes = word(seed, position / 8).to_le_bytes();
        let n = (8 - skip).min(buf.len() - at);
        buf[at..at + n].copy_from_slice(&bytes[skip..skip + n]);
        at += n;
    }
}

/// Calls `sink` with pattern `seed`, `bytes` long, a chunk at a time.
fn for_each_chunk(seed: u64, bytes: u64, mut sink: impl FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK];
    let mut offset = 0;
    while offset < bytes {
        let n = (bytes - offset).min(CHUNK as u64) as usize;
        pattern(seed, offset, &mut buf[..n]);
        sink(&buf[..n])?;
        offset += n as u64;
    }
    Ok(())
}

/// The SHA-256 of pattern `seed`, `bytes` long, in lowercase hex.
pub fn pattern_sha256(seed: u64, bytes: u64) -> String {
    let mut hasher = Sha256::new();
    let _ = for_each_chunk(seed, bytes, |chunk| {
        hasher.update(chunk);
        Ok(())
    });
    hex(&hasher.finalize())
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------
// How far the servers got, by seed (each transfer has a seed of its own).

/// A server's count of the bytes it sent or received so far, by seed.
static PROGRESS: Mutex<BTreeMap<u64, Arc<AtomicU64>>> = Mutex::new(BTreeMap::new());

fn progress_counter(seed: u64) -> Arc<AtomicU64> {
    let mut all = PROGRESS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    all.entry(seed).or_default().clone()
}

/// How many bytes the server of transfer `seed` sent (download) or
/// received (upload) so far; `None` if no server of this process saw the
/// request.
pub fn progress(seed: u64) -> Option<u64> {
    let all = PROGRESS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    all.get(&seed).map(|n| n.load(Ordering::Relaxed))
}

fn forget_progress(seed: u64) {
    PROGRESS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .remove(&seed);
}

/// A seed no other transfer of this process has.
fn fresh_seed() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    word(u64::from(std::process::id()), n)
}

// ---------------------------------------------------------------------------
// The server.

/// A bulk server on `port` (IPv4 and IPv6) in `ns` that names itself `name`; every
/// connection is served on a thread of its own. Returns once it listens.
pub fn server(ns: &Netns, port: u16, name: &str) -> Result<Server> {
    let name = name.to_owned();
    let what = format!("bulk server {name}@{}:{port}", ns.name());
    let log_as = what.clone();
    Server::tcp_threaded(ns, port, what, move |stream, stop| {
        if let Err(e) = serve(stream, &name, stop) {
            eprintln!("{log_as}: {e:#}");
        }
    })
}

/// One request: a download or an upload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Request {
    direction: Direction,
    bytes: u64,
    seed: u64,
}

impl Request {
    fn line(&self) -> String {
        format!("{} {} {}\n", self.direction.verb(), self.bytes, self.seed)
    }

    fn parse(line: &str) -> Result<Self> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let [verb, bytes, seed] = words[..] else {
            bail!("request {line:?} is not \"GET|PUT BYTES SEED\"");
        };
        let direction = match verb {
            "GET" => Direction::Download,
            "PUT" => Direction::Upload,
            other => bail!("unknown request {other:?}"),
        };
        Ok(Self {
            direction,
            bytes: bytes.parse().with_context(|| format!("byte count in {line:?}"))?,
            seed: seed.parse().with_context(|| format!("seed in {line:?}"))?,
        })
    }
}

/// Serves one connection: reads the request, sends or takes the data.
fn serve(stream: TcpStream, name: &str, stop: &AtomicBool) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(SERVER_STALL_TIMEOUT))?;
    stream.set_write_timeout(Some(SERVER_STALL_TIMEOUT))?;
    let mut reader = BufReader::with_capacity(CHUNK, stream.try_clone()?);
    let request = Request::parse(&read_line(&mut reader).context("reading the request")?)?;
    let done = progress_counter(request.seed);
    let mut writer = &stream;
    match request.direction {
        Direction::Download => {
            writer.write_all(format!("{name}\n").as_bytes())?;
            send(writer, request, &done, stop).with_context(|| format!("{request:?}"))?;
        }
        Direction::Upload => {
            let digest = receive(&mut reader, request.bytes, &done, stop).with_context(|| format!("{request:?}"))?;
            writer.write_all(format!("{digest} {name}\n").as_bytes())?;
        }
    }
    // Half-close and wait for the client's close: closing at once could
    // reset the connection while the last bytes are still on their way.
    stream.shutdown(Shutdown::Write)?;
    let _ = io::copy(&mut reader.take(MAX_REQUEST), &mut io::sink());
    Ok(())
}

/// Sends the pattern `request` asks for, counting the bytes in `done`.
fn send(mut writer: &TcpStream, request: Request, done: &AtomicU64, stop: &AtomicBool) -> io::Result<()> {
    for_each_chunk(request.seed, request.bytes, |chunk| {
        if stop.load(Ordering::Relaxed) {
            return Err(io::Error::other("the server stopped"));
        }
        write_counted(&mut writer, chunk, |n| {
            done.fetch_add(n as u64, Ordering::Relaxed);
        })
    })
}

/// `write_all` that tells `count` every part the socket took, so a stall
/// is reported to the byte.
fn write_counted(writer: &mut impl Write, mut buf: &[u8], mut count: impl FnMut(usize)) -> io::Result<()> {
    while !buf.is_empty() {
        match writer.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                count(n);
                buf = &buf[n..];
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads `bytes` bytes, counting them in `done`; returns their SHA-256.
fn receive(reader: &mut impl Read, bytes: u64, done: &AtomicU64, stop: &AtomicBool) -> Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0;
    while got < bytes {
        ensure!(!stop.load(Ordering::Relaxed), "the server stopped");
        let want = (bytes - got).min(CHUNK as u64) as usize;
        let n = match reader.read(&mut buf[..want]) {
            Ok(0) => bail!("the client closed after {got} of {bytes} bytes"),
            Ok(n) => n,
            Err(e) => return Err(e).with_context(|| format!("after {got} of {bytes} bytes")),
        };
        hasher.update(&buf[..n]);
        got += n as u64;
        done.store(got, Ordering::Relaxed);
    }
    Ok(hex(&hasher.finalize()))
}

/// One line (without its newline), at most [`MAX_REQUEST`] bytes.
fn read_line(reader: &mut impl BufRead) -> Result<String> {
    let mut line = String::new();
    reader.take(MAX_REQUEST).read_line(&mut line)?;
    ensure!(line.ends_with('\n'), "no complete line, got {line:?}");
    Ok(line.trim_end().to_owned())
}

// ---------------------------------------------------------------------------
// The client.

/// Moves `bytes` bytes to or from the bulk server at `addr` and checks
/// their SHA-256 at the receiver, within the default [`Limits`]. Runs in
/// the calling thread's namespace: see [`Netns::run_in`].
pub fn transfer(addr: impl Into<SocketAddr>, direction: Direction, bytes: u64) -> Result<Report> {
    transfer_within(addr, direction, bytes, Limits::default())
}

/// [`transfer`] within `limits`.
pub fn transfer_within(
    addr: impl Into<SocketAddr>,
    direction: Direction,
    bytes: u64,
    limits: Limits,
) -> Result<Report> {
    let addr = addr.into();
    let request = Request {
        direction,
        bytes,
        seed: fresh_seed(),
    };
    let result = Client::connect(addr, request, limits).and_then(Client::run);
    let server = progress(request.seed);
    forget_progress(request.seed);
    result.with_context(|| {
        let server = match (server, direction) {
            (None, _) => "the request never reached a bulk server of this process".to_owned(),
            (Some(n), Direction::Download) => format!("the server had sent {n} bytes"),
            (Some(n), Direction::Upload) => format!("the server had received {n} bytes"),
        };
        format!("{direction} of {bytes} bytes through {addr} ({server})")
    })
}

/// One transfer's connection, timing and deadline.
struct Client {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
    request: Request,
    stall: Duration,
    started: Instant,
    deadline: Instant,
}

impl Client {
    fn connect(addr: SocketAddr, request: Request, limits: Limits) -> Result<Self> {
        let started = Instant::now();
        let stream = TcpStream::connect_timeout(&addr, limits.stall).context("connecting")?;
        stream.set_read_timeout(Some(limits.stall))?;
        stream.set_write_timeout(Some(limits.stall))?;
        let reader = BufReader::with_capacity(CHUNK, stream.try_clone()?);
        let at_min_rate = Duration::from_secs_f64(request.bytes as f64 / limits.min_rate.max(1) as f64);
        Ok(Self {
            stream,
            reader,
            request,
            stall: limits.stall,
            started,
            deadline: started + limits.stall + at_min_rate,
        })
    }

    fn run(mut self) -> Result<Report> {
        (&self.stream)
            .write_all(self.request.line().as_bytes())
            .context("sending the request")?;
        let pod = match self.request.direction {
            Direction::Download => self.download()?,
            Direction::Upload => self.upload()?,
        };
        let took = self.started.elapsed();
        self.expect_end()?;
        Ok(Report {
            pod,
            bytes: self.request.bytes,
            took,
        })
    }

    /// Reads the server's name and the data; checks the data's SHA-256.
    fn download(&mut self) -> Result<String> {
        let pod = read_line(&mut self.reader).context("reading the server's name")?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; CHUNK];
        let mut got = 0;
        let bytes = self.request.bytes;
        while got < bytes {
            self.check_deadline(got)?;
            let want = (bytes - got).min(CHUNK as u64) as usize;
            let n = self
                .reader
                .read(&mut buf[..want])
                .map_err(|e| self.failed(&e, got, "received"))?;
            ensure!(n > 0, "the connection ended after {got} of {bytes} bytes arrived");
            hasher.update(&buf[..n]);
            got += n as u64;
        }
        let digest = hex(&hasher.finalize());
        let expected = pattern_sha256(self.request.seed, bytes);
        ensure!(
            digest == expected,
            "{pod} sent {bytes} bytes whose SHA-256 is {digest}, expected {expected}: corrupted on the way"
        );
        Ok(pod)
    }

    /// Sends the data; reads the SHA-256 the server computed and its name.
    fn upload(&mut self) -> Result<String> {
        let bytes = self.request.bytes;
        let mut sent = 0;
        let mut writer = &self.stream;
        let deadline = self.deadline;
        let written = for_each_chunk(self.request.seed, bytes, |chunk| {
            if Instant::now() > deadline {
                return Err(io::Error::other("too slow: past the deadline"));
            }
            write_counted(&mut writer, chunk, |n| sent += n as u64)
        });
        written.map_err(|e| self.failed(&e, sent, "handed to the socket"))?;
        let answer = read_line(&mut self.reader).context("reading the server's SHA-256 and name")?;
        let (digest, pod) = answer
            .split_once(' ')
            .with_context(|| format!("answer {answer:?} is not \"SHA256 NAME\""))?;
        let expected = pattern_sha256(self.request.seed, bytes);
        ensure!(
            digest == expected,
            "{pod} received {bytes} bytes whose SHA-256 is {digest}, expected {expected}: corrupted on the way"
        );
        Ok(pod.to_owned())
    }

    fn check_deadline(&self, got: u64) -> Result<()> {
        ensure!(
            Instant::now() <= self.deadline,
            "too slow: only {got} of {} bytes arrived in {:.1?}",
            self.request.bytes,
            self.started.elapsed()
        );
        Ok(())
    }

    /// The error of a read or write that failed after `done` bytes were
    /// received or sent (`what`).
    fn failed(&self, e: &io::Error, done: u64, what: &str) -> anyhow::Error {
        let bytes = self.request.bytes;
        let took = self.started.elapsed();
        if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            anyhow::anyhow!(
                "stalled: {done} of {bytes} bytes {what}, then nothing for {:?} ({took:.1?} in all)",
                self.stall
            )
        } else {
            anyhow::anyhow!("{e} after {done} of {bytes} bytes {what} ({took:.1?} in all)")
        }
    }

    /// Half-closes and expects the server's end of data (no byte more).
    fn expect_end(&mut self) -> Result<()> {
        self.stream.shutdown(Shutdown::Write)?;
        let mut extra = [0u8; 64];
        match self.reader.read(&mut extra) {
            Ok(0) => Ok(()),
            Ok(n) => bail!(
                "{n} bytes more than asked for: {:?}",
                String::from_utf8_lossy(&extra[..n])
            ),
            Err(e) => Err(e).context("waiting for the server's end of data"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4};

    use super::*;
    use crate::privileged::require_root;

    fn loopback() -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, BULK_PORT)
    }

    /// A namespace whose [`BULK_PORT`] runs `handle` for every connection:
    /// a server that misbehaves.
    fn misbehaving(handle: fn(TcpStream, &AtomicBool)) -> (Netns, Server) {
        let ns = Netns::new("xb").expect("a namespace");
        let server = Server::tcp_threaded(&ns, BULK_PORT, "misbehaving".into(), handle).expect("a server");
        (ns, server)
    }

    /// Reads the request line, then runs `then`.
    fn after_request(stream: &TcpStream, then: impl FnOnce(&mut &TcpStream) -> io::Result<()>) {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        let mut writer = stream;
        let _ = reader.read_line(&mut line).and_then(|_| then(&mut writer));
    }

    /// The error of a transfer from `ns` that must fail (a stall after 300 ms).
    fn failure(ns: &Netns, direction: Direction, bytes: u64) -> String {
        let limits = Limits {
            stall: Duration::from_millis(300),
            ..Limits::default()
        };
        let e = ns
            .run_in(|| transfer_within(loopback(), direction, bytes, limits))
            .expect("ran in the namespace")
            .expect_err("the transfer fails");
        format!("{e:#}")
    }

    #[test]
    fn moves_64_mib_each_way_and_names_the_server() {
        if !require_root("moves_64_mib_each_way_and_names_the_server") {
            return;
        }
        let ns = Netns::new("xb").expect("a namespace");
        ns.serve_bulk(BULK_PORT, "pod-x").expect("a bulk server");
        // One server for both families: over IPv4, then IPv6.
        let loopback6 = SocketAddr::from((Ipv6Addr::LOCALHOST, BULK_PORT));
        for (addr, direction) in [SocketAddr::from(loopback()), loopback6]
            .into_iter()
            .flat_map(|a| Direction::BOTH.map(|d| (a, d)))
        {
            let report = ns
                .bulk_transfer(addr, direction, 64 << 20)
                .unwrap_or_else(|e| panic!("{e:#}"));
            eprintln!("{addr} {direction}: {report}");
            assert_eq!(report.pod, "pod-x");
            assert_eq!(report.bytes, 64 << 20);
        }
    }

    #[test]
    fn a_stalled_download_says_how_many_bytes_arrived() {
        if !require_root("a_stalled_download_says_how_many_bytes_arrived") {
            return;
        }
        let (ns, _server) = misbehaving(|stream, stop| {
            after_request(&stream, |w| {
                w.write_all(b"pod-x\n").and_then(|()| w.write_all(&[0u8; 1000]))
            });
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let message = failure(&ns, Direction::Download, 1 << 20);
        assert!(message.contains("stalled: 1000 of 1048576 bytes received"), "{message}");
        assert!(message.contains("never reached a bulk server"), "{message}");
    }

    #[test]
    fn a_corrupted_download_fails() {
        if !require_root("a_corrupted_download_fails") {
            return;
        }
        let (ns, _server) = misbehaving(|stream, _| {
            after_request(&stream, |w| {
                w.write_all(b"pod-x\n").and_then(|()| w.write_all(&[7u8; 1000]))
            });
        });
        let message = failure(&ns, Direction::Download, 1000);
        assert!(message.contains("pod-x sent 1000 bytes whose SHA-256 is"), "{message}");
    }

    #[test]
    fn an_upload_the_server_hashes_otherwise_fails() {
        if !require_root("an_upload_the_server_hashes_otherwise_fails") {
            return;
        }
        let (ns, _server) = misbehaving(|stream, _| {
            after_request(&stream, |w| w.write_all(b"0000 pod-x\n"));
        });
        let message = failure(&ns, Direction::Upload, 1000);
        assert!(
            message.contains("pod-x received 1000 bytes whose SHA-256 is 0000"),
            "{message}"
        );
    }

    #[test]
    fn the_pattern_is_the_same_in_any_chunking() {
        let mut whole = vec![0u8; 1000];
        pattern(7, 0, &mut whole);
        let mut pieces = vec![0u8; 1000];
        let mut at = 0;
        for n in [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 392] {
            pattern(7, at as u64, &mut pieces[at..at + n]);
            at += n;
        }
        assert_eq!(at, 1000);
        assert_eq!(whole, pieces);
    }

    #[test]
    fn the_pattern_depends_on_the_seed() {
        let (mut a, mut b) = ([0u8; 64], [0u8; 64]);
        pattern(1, 0, &mut a);
        pattern(2, 0, &mut b);
        assert_ne!(a, b);
        assert_ne!(pattern_sha256(1, 1 << 20), pattern_sha256(2, 1 << 20));
    }

    #[test]
    fn the_pattern_hash_is_the_hash_of_the_pattern() {
        let mut data = vec![0u8; CHUNK * 2 + 77];
        pattern(42, 0, &mut data);
        assert_eq!(pattern_sha256(42, data.len() as u64), hex(&Sha256::digest(&data)));
    }

    #[test]
    fn requests_parse_back() {
        let request = Request {
            direction: Direction::Upload,
            bytes: 64 << 20,
            seed: u64::MAX,
        };
        assert_eq!(Request::parse(request.line().trim_end()).expect("parses"), request);
        assert!(Request::parse("GET 12").is_err());
        assert!(Request::parse("POST 1 2").is_err());
        assert!(Request::parse("GET x 2").is_err());
    }
}
