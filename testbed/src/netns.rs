//! Network namespaces for end-to-end tests: a namespace per simulated host
//! (client, node, pods), veths between them, servers that answer with a
//! name (the bulk servers of [`crate::bulk`] are kept here too), and clients that run
//! inside a namespace.
//!
//! Everything a test creates lives in namespaces it created itself (named
//! with [`unique_name`]), so tests can run in parallel and never send a
//! packet on the machine's own interfaces. A [`Netns`] is deleted when it
//! is dropped, also when the test panics: its servers are stopped and
//! joined first, then `ip netns del` removes it, and with it every veth
//! that has an end inside it.

use std::{
    ffi::CString,
    fs::File,
    io::{self, Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU16, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::privileged::unique_name;

/// Where `ip netns add` mounts the namespaces it creates.
const NETNS_RUN_DIR: &str = "/var/run/netns";

/// `ip netns add` mounts /var/run/netns the first time it runs; two first
/// runs at once can race, so this process creates and deletes namespaces
/// one at a time.
static IP_NETNS_LOCK: Mutex<()> = Mutex::new(());

/// How long a server waits for a client's request before giving up on it.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a server's loop looks at its stop flag.
const SERVER_POLL_MS: i32 = 20;

/// A network namespace created with `ip netns add`, deleted on drop.
pub struct Netns {
    name: String,
    path: PathBuf,
    servers: Mutex<Vec<Server>>,
    /// bpf links of programs the harness attached (see [`Netns::attach_xdp_pass`]).
    links: Mutex<Vec<OwnedFd>>,
}

impl Netns {
    /// Creates a namespace named `prefix` + a unique suffix, with `lo` up.
    pub fn new(prefix: &str) -> Result<Self> {
        let name = unique_name(prefix);
        {
            let _guard = IP_NETNS_LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            run(Command::new("ip").args(["netns", "add", &name]))?;
        }
        let ns = Self {
            path: Path::new(NETNS_RUN_DIR).join(&name),
            name,
            servers: Mutex::new(Vec::new()),
            links: Mutex::new(Vec::new()),
        };
        // From here on, Drop deletes the namespace if anything below fails.
        ns.ip(&["link", "set", "lo", "up"])?;
        // Links made from now on skip IPv6 duplicate address detection:
        // until it ends, a new veth's link-local address is tentative and
        // the first IPv6 packets over it wait a second or more. Nothing to
        // do on a kernel without IPv6 (no such entry).
        if Path::new("/proc/sys/net/ipv6").exists() {
            ns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
        }
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's file, e.g. for `setns`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in a fresh thread that has entered this namespace and
    /// returns its result. Sockets `f` creates belong to this namespace
    /// (also after the thread ended); netlink and interface names resolve
    /// in it. A panic in `f` is propagated to the caller.
    pub fn run_in<R: Send, F: FnOnce() -> R + Send>(&self, f: F) -> Result<R> {
        std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name(format!("in-{}", self.name))
                .spawn_scoped(scope, || -> Result<R> {
                    enter(&self.path)?;
                    Ok(f())
                })
                .context("spawning a thread")?;
            match thread.join() {
                Ok(result) => result,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// A command that will start inside this namespace. Unlike `ip netns
    /// exec`, only the network namespace changes: the mount namespace, and
    /// with it /sys/fs/bpf and its pins, stays the caller's.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
        command_in(&self.path, program)
    }

    /// Runs `ip -n NAME args...` and returns its stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Runs a command inside the namespace (`ip netns exec NAME args...`)
    /// and returns its stdout; a non-zero exit is an error carrying stderr.
    ///
    /// `ip netns exec` also gives the command its own mount namespace with a
    /// fresh /sys, in which /sys/fs/bpf is empty: for anything that needs
    /// pinned objects, use [`Netns::run_in`] (which changes only the network
    /// namespace) instead.
    pub fn exec(&self, args: &[&str]) -> Result<String> {
        run(Command::new("ip").args(["netns", "exec", &self.name]).args(args))
    }

    /// Sets a sysctl of this namespace, e.g. `("net.ipv4.ip_forward", "1")`.
    /// Written through /proc/sys from a thread inside the namespace (the
    /// net.* entries there belong to the reader's namespace), so no
    /// `sysctl` binary is needed.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let file = Path::new("/proc/sys").join(key.replace('.', "/"));
        self.run_in(|| std::fs::write(&file, value))?
            .with_context(|| format!("sysctl {key}={value} in netns {}", self.name))
    }

    /// Reads a sysctl of this namespace.
    pub fn sysctl_get(&self, key: &str) -> Result<String> {
        let file = Path::new("/proc/sys").join(key.replace('.', "/"));
        Ok(self
            .run_in(|| std::fs::read_to_string(&file))?
            .with_context(|| format!("reading sysctl {key} in netns {}", self.name))?
            .trim()
            .to_owned())
    }

    /// `ethtool -K dev feature on|off` inside the namespace, e.g.
    /// `("tx", false)` to turn checksum offload off, `("gro", true)`.
    pub fn ethtool_k(&self, dev: &str, feature: &str, on: bool) -> Result<()> {
        self.exec(&["ethtool", "-K", dev, feature, if on { "on" } else { "off" }])?;
        Ok(())
    }

    /// `ethtool -k dev` (the offload features) as printed.
    pub fn ethtool_features(&self, dev: &str) -> Result<String> {
        self.exec(&["ethtool", "-k", dev])
    }

    /// Adds an address (CIDR notation) to `dev`. An IPv6 address skips
    /// duplicate address detection: usable at once, not after a second of
    /// "tentative" (the bed's links hold no duplicates).
    pub fn add_addr(&self, dev: &str, cidr: &str) -> Result<()> {
        if cidr.contains(':') {
            self.ip(&["addr", "add", cidr, "dev", dev, "nodad"])?;
        } else {
            self.ip(&["addr", "add", cidr, "dev", dev])?;
        }
        Ok(())
    }

    /// `ip route add args...`, e.g. `&["default", "via", "10.0.0.1"]`.
    pub fn add_route(&self, args: &[&str]) -> Result<()> {
        let mut all = vec!["route", "add"];
        all.extend_from_slice(args);
        self.ip(&all)?;
        Ok(())
    }

    /// The interface index of `dev` in this namespace.
    pub fn ifindex(&self, dev: &str) -> Result<u32> {
        let c_dev = CString::new(dev).context("interface name contains NUL")?;
        let index = self.run_in(|| {
            // SAFETY: c_dev is a valid NUL-terminated string.
            unsafe { libc::if_nametoindex(c_dev.as_ptr()) }
        })?;
        if index == 0 {
            bail!("no interface {dev} in netns {}", self.name);
        }
        Ok(index)
    }

    /// Starts a TCP server on `0.0.0.0:port` inside the namespace that
    /// answers every connection with `reply` (see [`Server::tcp`]); it is
    /// stopped when the namespace is dropped.
    pub fn serve_tcp(&self, port: u16, reply: &str) -> Result<()> {
        self.keep(Server::tcp(self, port, reply)?);
        Ok(())
    }

    /// Starts a TCP server on `0.0.0.0:port` inside the namespace that
    /// answers every connection with `name`, a space and the client's
    /// address as it arrived here (see [`Server::tcp_peer`]): what a
    /// backend sees of source NAT. Stopped when the namespace is dropped.
    pub fn serve_tcp_peer(&self, port: u16, name: &str) -> Result<()> {
        self.keep(Server::tcp_peer(self, port, name)?);
        Ok(())
    }

    /// Starts a TCP echo server on `0.0.0.0:port` inside the namespace for
    /// long-lived connections (see [`Server::tcp_echo`]); it is stopped
    /// when the namespace is dropped.
    pub fn serve_tcp_echo(&self, port: u16) -> Result<()> {
        self.keep(Server::tcp_echo(self, port)?);
        Ok(())
    }

    /// Starts a UDP server on `0.0.0.0:port` inside the namespace that
    /// answers every datagram with `reply` (see [`Server::udp`]); it is
    /// stopped when the namespace is dropped.
    pub fn serve_udp(&self, port: u16, reply: &str) -> Result<()> {
        self.keep(Server::udp(self, port, reply)?);
        Ok(())
    }

    /// Starts SCTP servers on `0.0.0.0:port` and `[::]:port` inside the
    /// namespace that answer every association with `reply` (see
    /// [`Server::sctp`]); they are stopped when the namespace is dropped.
    pub fn serve_sctp(&self, port: u16, reply: &str) -> Result<()> {
        for any in [IpAddr::V4(Ipv4Addr::UNSPECIFIED), IpAddr::V6(Ipv6Addr::UNSPECIFIED)] {
            self.keep(Server::sctp(self, SocketAddr::new(any, port), reply)?);
        }
        Ok(())
    }

    /// [`sctp_request`] from inside this namespace.
    pub fn sctp_request(&self, addr: impl Into<SocketAddr>, timeout: Duration) -> Result<io::Result<String>> {
        let addr = addr.into();
        self.run_in(|| sctp_request(addr, timeout))
    }

    /// Keeps `server` running until the namespace is dropped.
    pub(crate) fn keep(&self, server: Server) {
        self.servers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(server);
    }

    /// [`tcp_request`] from inside this namespace.
    pub fn tcp_request(&self, addr: impl Into<SocketAddr>, timeout: Duration) -> Result<io::Result<String>> {
        let addr = addr.into();
        self.run_in(|| tcp_request(addr, timeout))
    }

    /// [`udp_request`] from inside this namespace.
    pub fn udp_request(&self, addr: impl Into<SocketAddr>, timeout: Duration) -> Result<io::Result<String>> {
        let addr = addr.into();
        self.run_in(|| udp_request(addr, timeout))
    }

    /// [`ping`] from inside this namespace.
    pub fn ping(&self, addr: Ipv4Addr, timeout: Duration) -> Result<io::Result<Duration>> {
        self.run_in(|| ping(addr, timeout))
    }

    /// Attaches a program that returns XDP_PASS to `dev`, in native mode,
    /// for as long as this namespace lives.
    ///
    /// Frames another program sends with XDP_TX or XDP_REDIRECT into a veth
    /// are queued on the peer's ring, but the kernel only schedules the
    /// peer's NAPI poll when the peer has an XDP program: with GRO alone they
    /// wait for unrelated traffic to flush them (veth.c, `veth_xdp_flush`).
    /// The harness loads the two instructions itself, so it needs no object.
    pub fn attach_xdp_pass(&self, dev: &str) -> Result<()> {
        let c_dev = CString::new(dev).context("interface name contains NUL")?;
        let link = self
            .run_in(|| -> Result<OwnedFd> {
                // SAFETY: c_dev is a valid NUL-terminated string.
                let ifindex = unsafe { libc::if_nametoindex(c_dev.as_ptr()) };
                if ifindex == 0 {
                    bail!("no interface {dev}: {}", io::Error::last_os_error());
                }
                let prog = bpf::load_pass(bpf::Pass::Xdp).context("loading an XDP_PASS program")?;
                bpf::link_xdp(&prog, ifindex).with_context(|| format!("attaching XDP_PASS to {dev} in native mode"))
            })?
            .with_context(|| format!("netns {}", self.name))?;
        self.links
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(link);
        Ok(())
    }

    /// Stops and joins this namespace's servers (also done on drop).
    pub fn stop_servers(&self) {
        let servers = std::mem::take(&mut *self.servers.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        drop(servers);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Servers hold sockets (and so references) in the namespace: stop
        // them first so the namespace really goes away.
        self.stop_servers();
        self.links
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
        let _guard = IP_NETNS_LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(e) = run(Command::new("ip").args(["netns", "del", &self.name]))
            && self.path.exists()
        {
            eprintln!("warning: could not delete netns {}: {e:#}", self.name);
        }
    }
}

/// [`Netns::command`] for a namespace known by its path.
pub fn command_in(ns_path: &Path, program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
    use std::os::unix::process::CommandExt;
    let ns = File::open(ns_path).with_context(|| format!("opening {}", ns_path.display()))?;
    let mut cmd = Command::new(program);
    // SAFETY: between fork and exec the closure only calls setns(2) on an
    // fd opened beforehand: no allocation, no locks.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}

/// Moves the calling thread into the network namespace at `path`.
pub fn enter(path: &Path) -> Result<()> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: setns only reads the fd, which `file` keeps open.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("setns into {}", path.display()));
    }
    Ok(())
}

/// Creates a veth pair with one end (`a_if`) in `a` and the other (`b_if`)
/// in `b`, both up. Neither end ever exists in the caller's namespace.
/// Names must be at most 15 bytes and free in their namespace.
pub fn veth(a: &Netns, a_if: &str, b: &Netns, b_if: &str) -> Result<()> {
    for name in [a_if, b_if] {
        if name.len() > 15 {
            bail!("interface name {name} is longer than 15 bytes");
        }
    }
    a.ip(&[
        "link",
        "add",
        a_if,
        "type",
        "veth",
        "peer",
        "name",
        b_if,
        "netns",
        b.name(),
    ])?;
    a.ip(&["link", "set", a_if, "up"])?;
    b.ip(&["link", "set", b_if, "up"])?;
    Ok(())
}

/// Runs a command; its stdout on success, else an error with its stderr.
pub fn run(cmd: &mut Command) -> Result<String> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().with_context(|| format!("running {shown}"))?;
    if !out.status.success() {
        bail!(
            "{shown} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Polls `check` until it returns `Some`, at most `timeout`; the error
/// names `what` and the last state `check` reported through `Err`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Result<T, String>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut delay = Duration::from_millis(5);
    loop {
        match check() {
            Ok(v) => return Ok(v),
            Err(last) if Instant::now() >= deadline => {
                bail!("timed out after {timeout:?} waiting for {what}: {last}")
            }
            Err(_) => {
                std::thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_millis(100));
            }
        }
    }
}

/// A server thread inside a namespace, stopped and joined on drop.
pub struct Server {
    what: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// A TCP server on `0.0.0.0:port` in `ns`. For every connection it reads
    /// a line (or until the client half-closes), writes `reply` and a
    /// newline, and closes. Returns once the socket is listening.
    pub fn tcp(ns: &Netns, port: u16, reply: &str) -> Result<Self> {
        let line = format!("{reply}\n");
        Self::tcp_answering(ns, port, reply, move |_| line.clone())
    }

    /// Like [`Server::tcp`], but the answer is `name`, a space and the
    /// client's address (`pod-1 172.30.0.1`).
    pub fn tcp_peer(ns: &Netns, port: u16, name: &str) -> Result<Self> {
        let name = name.to_owned();
        // The servers take both families on one socket: an IPv4 client
        // arrives as `::ffff:a.b.c.d`, shown as the IPv4 address it is.
        Self::tcp_answering(ns, port, &name.clone(), move |peer| {
            format!("{name} {}\n", peer.ip().to_canonical())
        })
    }

    fn tcp_answering(
        ns: &Netns,
        port: u16,
        what: &str,
        reply: impl Fn(SocketAddr) -> String + Send + 'static,
    ) -> Result<Self> {
        let what = format!("tcp server {what}@{}:{port}", ns.name());
        Self::spawn(
            ns,
            what.clone(),
            move || listen_tcp(port),
            move |listener: &TcpListener| match listener.accept() {
                Ok((stream, peer)) => {
                    // A client that misbehaves costs at most the timeouts.
                    let _ = answer_tcp(stream, reply(peer).as_bytes());
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => eprintln!("{what}: accept: {e}"),
            },
        )
    }

    /// An SCTP server on `local` in `ns` (a one-to-one style
    /// socket, which accepts and writes as a TCP one does). The server
    /// speaks first: for every association it writes `reply` and a newline
    /// and shuts down, without waiting for a request. Why: Linux 6.1 now
    /// and then loses a DATA chunk that arrives while accept(2) moves its
    /// association to the new socket (seen in the guest: the pod's
    /// `SctpInOrderChunks` counted the client's chunk, no SACK went out and
    /// the server's read never returned it), so a client that sends first
    /// may wait for nothing through no fault of the proxy. Returns once the
    /// socket is listening.
    pub fn sctp(ns: &Netns, local: SocketAddr, reply: &str) -> Result<Self> {
        let line = format!("{reply}\n");
        let what = format!("sctp server {reply}@{}:{local}", ns.name());
        Self::spawn(
            ns,
            what.clone(),
            move || listen_sctp(local),
            move |listener: &TcpListener| match listener.accept() {
                Ok((stream, _)) => {
                    let _ = speak_first(stream, line.as_bytes());
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => eprintln!("{what}: accept: {e}"),
            },
        )
    }

    /// A TCP echo server on `0.0.0.0:port` in `ns`: every connection gets a
    /// thread of its own that sends back whatever it receives until the
    /// client closes, so many long-lived connections are served at once.
    /// Stopping the server closes them all. Returns once the socket is
    /// listening.
    pub fn tcp_echo(ns: &Netns, port: u16) -> Result<Self> {
        Self::tcp_threaded(ns, port, format!("tcp echo@{}:{port}", ns.name()), echo_tcp)
    }

    /// A TCP server on `0.0.0.0:port` in `ns` that runs `handle` on a
    /// thread of its own for every connection, with a flag that is set when
    /// the server stops (`handle` must return soon after). Stopping the
    /// server joins them all. Returns once the socket is listening.
    pub(crate) fn tcp_threaded(
        ns: &Netns,
        port: u16,
        what: String,
        handle: impl Fn(TcpStream, &AtomicBool) + Clone + Send + 'static,
    ) -> Result<Self> {
        let mut connections = Connections::default();
        Self::spawn(
            ns,
            what.clone(),
            move || listen_tcp(port),
            // The closure owns the connection threads: when the server's
            // thread ends, dropping it stops and joins them.
            move |listener: &TcpListener| match listener.accept() {
                Ok((stream, _)) => connections.add(stream, &what, handle.clone()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => eprintln!("{what}: accept: {e}"),
            },
        )
    }

    /// A UDP server on `0.0.0.0:port` in `ns` that answers every datagram
    /// with `reply` and a newline. Returns once the socket is bound.
    pub fn udp(ns: &Netns, port: u16, reply: &str) -> Result<Self> {
        let line = format!("{reply}\n").into_bytes();
        Self::udp_answering(ns, port, reply, move |_| line.clone())
    }

    /// A UDP server on `0.0.0.0:port` in `ns` that sends every datagram,
    /// up to the largest IPv4 allows, back to its sender.
    pub fn udp_echo(ns: &Netns, port: u16) -> Result<Self> {
        Self::udp_answering(ns, port, "echo", <[u8]>::to_vec)
    }

    fn udp_answering(
        ns: &Netns,
        port: u16,
        what: &str,
        answer: impl Fn(&[u8]) -> Vec<u8> + Send + 'static,
    ) -> Result<Self> {
        let what = format!("udp server {what}@{}:{port}", ns.name());
        Self::spawn(
            ns,
            what.clone(),
            move || {
                let socket = bind_both_families(port, UdpSocket::bind)?;
                socket.set_nonblocking(true)?;
                Ok(socket)
            },
            move |socket: &UdpSocket| {
                let mut buf = vec![0u8; 65_536];
                match socket.recv_from(&mut buf) {
                    Ok((n, peer)) => {
                        if let Err(e) = socket.send_to(&answer(&buf[..n]), peer) {
                            eprintln!("{what}: send to {peer}: {e}");
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => eprintln!("{what}: recv: {e}"),
                }
            },
        )
    }

    /// Binds with `bind` in a thread inside `ns`, reports the result back,
    /// then calls `serve` whenever the socket is readable until stopped.
    fn spawn<S: AsRawFd + 'static>(
        ns: &Netns,
        what: String,
        bind: impl FnOnce() -> io::Result<S> + Send + 'static,
        mut serve: impl FnMut(&S) + Send + 'static,
    ) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let path = ns.path().to_owned();
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new()
            .name(what.chars().take(15).collect())
            .spawn(move || {
                let socket = match enter(&path)
                    .map_err(|e| format!("{e:#}"))
                    .and_then(|()| bind().map_err(|e| format!("bind: {e}")))
                {
                    Ok(socket) => {
                        let _ = ready_tx.send(Ok(()));
                        socket
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while !thread_stop.load(Ordering::Relaxed) {
                    let mut pfd = libc::pollfd {
                        fd: socket.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd, for a socket this thread owns.
                    let n = unsafe { libc::poll(&mut pfd, 1, SERVER_POLL_MS) };
                    if n > 0 {
                        serve(&socket);
                    }
                }
            })
            .with_context(|| format!("spawning {what}"))?;
        let server = Self {
            what,
            stop,
            thread: Some(thread),
        };
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => Ok(server),
            Ok(Err(e)) => bail!("{} did not start: {e}", server.what),
            Err(e) => bail!("{} did not report whether it started: {e}", server.what),
        }
    }

    /// Stops the server and joins its thread.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            eprintln!("warning: {} panicked", self.what);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The connection threads of a [`Server::tcp_threaded`]; dropping it stops
/// and joins them.
#[derive(Default)]
struct Connections {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Connections {
    fn add(&mut self, stream: TcpStream, what: &str, handle: impl FnOnce(TcpStream, &AtomicBool) + Send + 'static) {
        self.threads.retain(|t| !t.is_finished());
        let stop = self.stop.clone();
        let spawned = std::thread::Builder::new()
            .name("tcp conn".into())
            .spawn(move || handle(stream, &stop));
        match spawned {
            Ok(thread) => self.threads.push(thread),
            Err(e) => eprintln!("{what}: spawning a connection thread: {e}"),
        }
    }
}

impl Drop for Connections {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Echoes until the peer closes, an error, or `stop`.
fn echo_tcp(mut stream: TcpStream, stop: &AtomicBool) {
    let setup = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(Duration::from_millis(SERVER_POLL_MS as u64 * 5))))
        .and_then(|()| stream.set_write_timeout(Some(SERVER_IO_TIMEOUT)));
    if setup.is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if stream.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}

/// A non-blocking listener on `port` of both families, for a server's thread.
fn listen_tcp(port: u16) -> io::Result<TcpListener> {
    let listener = bind_both_families(port, TcpListener::bind)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// `bind` on `[::]:port`, which Linux makes a socket of both families
/// (`IPV6_V6ONLY` is off by default): the bed's servers answer on IPv4 and
/// IPv6 alike. A kernel without IPv6 gets `0.0.0.0:port`.
fn bind_both_families<S>(port: u16, bind: impl Fn(SocketAddr) -> io::Result<S>) -> io::Result<S> {
    match bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))) {
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))),
        bound => bound,
    }
}

/// The unspecified address of `addr`'s family, port 0: where a client
/// socket to `addr` binds.
fn any_local(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
    }
}

/// An SCTP one-to-one listener on `local`, held as a `TcpListener`:
/// accept(2), read(2) and write(2) work on it as on TCP. An IPv6 one takes
/// IPv6 only (its IPv4 twin has the same port).
fn listen_sctp(local: SocketAddr) -> io::Result<TcpListener> {
    let fd = stream_socket(local, libc::IPPROTO_SCTP)?;
    if local.is_ipv6() {
        let one: libc::c_int = 1;
        set_option_at(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &one)?;
    }
    quick_sctp_retransmits(&fd)?;
    // SO_REUSEADDR as std sets it for TCP listeners.
    let one: libc::c_int = 1;
    set_socket_option(&fd, libc::SO_REUSEADDR, &one)?;
    bind_to(&fd, local)?;
    // SAFETY: listen(2) on a bound socket we own.
    check_ret(unsafe { libc::listen(fd.as_raw_fd(), 128) })?;
    let listener = TcpListener::from(fd);
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// The local port of the next SCTP association, in turn from a range
/// below the node ports. Linux picks SCTP's ephemeral ports at random, so
/// a client soon reuses one while IPVS still holds the closed association
/// (10 s); with conntrack on (as the IPVS mode has it) IPVS drops the
/// first packet of a reused connection, as it does a TCP SYN, and SCTP
/// sends the INIT again only after its 3 s initial RTO: longer than a
/// probe waits. TCP's ports go in turn: so do these.
fn next_sctp_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    const FIRST: u16 = 20_000;
    const COUNT: u16 = 10_000;
    FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % COUNT
}

/// `struct sctp_rtoinfo` of `<linux/sctp.h>` (milliseconds; association 0:
/// the socket's default for its associations).
#[repr(C)]
struct SctpRtoInfo {
    assoc_id: i32,
    initial_ms: u32,
    max_ms: u32,
    min_ms: u32,
}

/// `SOL_SCTP` and `SCTP_RTOINFO` of `<linux/sctp.h>` (not in libc).
const SOL_SCTP: libc::c_int = 132;
const SCTP_RTOINFO: libc::c_int = 0;

/// Gives the socket's associations TCP-like retransmission timers. SCTP's
/// defaults (RTO.Initial 3 s, RTO.Min 1 s) resend a lost INIT or DATA
/// chunk only after the probes' 2 s: one packet lost on a loaded guest
/// would fail a request that TCP (200 ms minimum) recovers. The
/// retransmission still goes through the proxy's path, so a path that
/// keeps losing still fails.
fn quick_sctp_retransmits(fd: &OwnedFd) -> io::Result<()> {
    let rto = SctpRtoInfo {
        assoc_id: 0,
        initial_ms: 200,
        max_ms: 400,
        min_ms: 100,
    };
    set_option_at(fd, SOL_SCTP, SCTP_RTOINFO, &rto)
}

/// Whether the calling thread's namespace can open SCTP sockets.
pub fn sctp_available() -> bool {
    stream_socket(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)), libc::IPPROTO_SCTP).is_ok()
}

/// Connects to `addr` over SCTP (one-to-one style, at most `timeout`) and
/// reads the answer until the server shuts the association down (the
/// server speaks first: see [`Server::sctp`]); returns it without
/// surrounding whitespace. Runs in the calling thread's namespace.
///
/// Each association gets a local port of its own (see [`next_sctp_port`]).
pub fn sctp_request(addr: impl Into<SocketAddr>, timeout: Duration) -> io::Result<String> {
    let addr = addr.into();
    sctp_request_bound(any_local(addr).ip(), addr, timeout)
}

/// [`sctp_request`] from the local address `source`.
pub fn sctp_request_from_addr(source: Ipv4Addr, addr: SocketAddrV4, timeout: Duration) -> io::Result<String> {
    sctp_request_bound(source.into(), addr.into(), timeout)
}

fn sctp_request_bound(source: IpAddr, addr: SocketAddr, timeout: Duration) -> io::Result<String> {
    let deadline = Instant::now() + timeout;
    let local = SocketAddr::new(source, next_sctp_port());
    let mut stream = stream_connect(libc::IPPROTO_SCTP, local, addr, timeout)?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer.trim().to_owned())
}

/// Writes `reply` on a new SCTP association and shuts it down (see
/// [`Server::sctp`]).
fn speak_first(mut stream: TcpStream, reply: &[u8]) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(SERVER_IO_TIMEOUT))?;
    stream.write_all(reply)?;
    stream.shutdown(Shutdown::Write)
}

fn answer_tcp(mut stream: TcpStream, reply: &[u8]) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(SERVER_IO_TIMEOUT))?;
    stream.set_write_timeout(Some(SERVER_IO_TIMEOUT))?;
    let mut request = Vec::new();
    let mut buf = [0u8; 512];
    while !request.contains(&b'\n') && request.len() < 4096 {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break; // the client half-closed
        }
        request.extend_from_slice(&buf[..n]);
    }
    stream.write_all(reply)?;
    stream.shutdown(Shutdown::Write)
}

/// Connects to `addr` (at most `timeout`), sends a line, half-closes and
/// reads the answer to its end; returns it without surrounding whitespace.
/// Runs in the calling thread's namespace: see [`Netns::run_in`].
pub fn tcp_request(addr: impl Into<SocketAddr>, timeout: Duration) -> io::Result<String> {
    let deadline = Instant::now() + timeout;
    let stream = TcpStream::connect_timeout(&addr.into(), timeout)?;
    exchange_line(stream, deadline)
}

/// [`tcp_request`] from the local address `source` (one of the calling
/// thread's namespace): a second client on the same host.
pub fn tcp_request_from_addr(source: Ipv4Addr, addr: SocketAddrV4, timeout: Duration) -> io::Result<String> {
    let deadline = Instant::now() + timeout;
    let stream = tcp_connect_from(source, addr, timeout)?;
    exchange_line(stream, deadline)
}

/// [`udp_request`] from the local address `source`.
pub fn udp_request_from_addr(source: Ipv4Addr, addr: SocketAddrV4, timeout: Duration) -> io::Result<String> {
    udp_request_bound(SocketAddrV4::new(source, 0).into(), addr.into(), timeout)
}

/// A TCP connection from `source` (any port) to `addr`, given up after
/// `timeout` (`TimedOut`). std cannot bind before connecting, so this is
/// socket(2), bind(2) and a blocking connect(2), which Linux gives up after
/// `SO_SNDTIMEO` (with EINPROGRESS).
fn tcp_connect_from(source: Ipv4Addr, addr: SocketAddrV4, timeout: Duration) -> io::Result<TcpStream> {
    stream_connect(libc::IPPROTO_TCP, SocketAddr::from((source, 0)), addr.into(), timeout)
}

/// `ret` of a libc call as a `Result` (`errno` on a negative one).
fn check_ret(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn socklen(size: usize) -> libc::socklen_t {
    libc::socklen_t::try_from(size).unwrap_or(libc::socklen_t::MAX)
}

/// setsockopt(2) of `SOL_SOCKET` option `name` to `value`.
fn set_socket_option<T>(fd: &OwnedFd, name: libc::c_int, value: &T) -> io::Result<()> {
    set_option_at(fd, libc::SOL_SOCKET, name, value)
}

/// setsockopt(2) of option `name` at `level`.
fn set_option_at<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` is a valid `T` of the length given, and the caller
    // names the option that takes a `T`.
    check_ret(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            std::ptr::from_ref(value).cast(),
            socklen(std::mem::size_of::<T>()),
        )
    })
    .map(drop)
}

/// bind(2) to `local`.
fn bind_to(fd: &OwnedFd, local: SocketAddr) -> io::Result<()> {
    let (local, len) = raw_sockaddr(local);
    // SAFETY: a valid socket address of the length given.
    check_ret(unsafe { libc::bind(fd.as_raw_fd(), (&raw const local).cast(), len) }).map(drop)
}

/// A fresh `SOCK_STREAM` socket of `protocol` (TCP, or SCTP one-to-one)
/// of `addr`'s family.
fn stream_socket(addr: SocketAddr, protocol: libc::c_int) -> io::Result<OwnedFd> {
    let family = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = check_ret(unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, protocol) })?;
    // SAFETY: fd is a fresh, valid descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A `SOCK_STREAM` connection of `protocol` from `local` (port 0: any) to
/// `addr`, given up after `timeout`: see [`tcp_connect_from`]. An SCTP
/// one is held as a `TcpStream`, which reads and writes it as TCP.
fn stream_connect(
    protocol: libc::c_int,
    local: SocketAddr,
    addr: SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let fd = stream_socket(addr, protocol)?;
    if protocol == libc::IPPROTO_SCTP {
        quick_sctp_retransmits(&fd)?;
    }
    let limit = libc::timeval {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(timeout.subsec_micros()),
    };
    set_socket_option(&fd, libc::SO_SNDTIMEO, &limit)?;
    bind_to(&fd, local)?;
    let (remote, len) = raw_sockaddr(addr);
    // SAFETY: a valid socket address of the length given.
    let connected = check_ret(unsafe { libc::connect(fd.as_raw_fd(), (&raw const remote).cast(), len) });
    match connected {
        Ok(_) => Ok(TcpStream::from(fd)),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no connection from {local} to {addr} in {timeout:?}"),
        )),
        Err(e) => Err(e),
    }
}

/// `addr` as the C socket address of its family, with its length.
fn raw_sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero bytes are a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&raw mut storage).cast(), sockaddr_in(v4)) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let raw = libc::sockaddr_in6 {
                sin6_family: libc::sa_family_t::try_from(libc::AF_INET6).unwrap_or_default(),
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&raw mut storage).cast(), raw) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, socklen(len))
}

fn sockaddr_in(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::sa_family_t::try_from(libc::AF_INET).unwrap_or_default(),
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

/// Sends a line on `stream`, half-closes and reads the answer to its end,
/// all before `deadline`; the answer without surrounding whitespace.
fn exchange_line(mut stream: TcpStream, deadline: Instant) -> io::Result<String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))?;
    stream.write_all(b"hello\n")?;
    stream.shutdown(Shutdown::Write)?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer.trim().to_owned())
}

/// Only connects (at most `timeout`): for checking that a connection is
/// refused. Runs in the calling thread's namespace.
pub fn tcp_connect(addr: impl Into<SocketAddr>, timeout: Duration) -> io::Result<TcpStream> {
    TcpStream::connect_timeout(&addr.into(), timeout)
}

/// Sends one datagram from a fresh socket connected to `addr` and waits at
/// most `timeout` for the answer, which must come from `addr` (the socket is
/// connected). An ICMP port unreachable makes this fail at once with
/// `ConnectionRefused`. Runs in the calling thread's namespace.
pub fn udp_request(addr: impl Into<SocketAddr>, timeout: Duration) -> io::Result<String> {
    let addr = addr.into();
    udp_request_bound(any_local(addr), addr, timeout)
}

/// [`udp_request`] from local port `source_port` (0: any): the same port
/// again is the same flow to conntrack.
pub fn udp_request_from(source_port: u16, addr: impl Into<SocketAddr>, timeout: Duration) -> io::Result<String> {
    let addr = addr.into();
    let mut local = any_local(addr);
    local.set_port(source_port);
    udp_request_bound(local, addr, timeout)
}

/// Sends `len` bytes (a fixed pattern) in one datagram to `to`, an echo
/// server, and waits at most `timeout` for them to come back; anything
/// but the same bytes is an error. Above the MTU the datagram leaves in
/// fragments, and the echo comes back in fragments too.
pub fn udp_echo_roundtrip(to: impl Into<SocketAddr>, len: usize, timeout: Duration) -> io::Result<()> {
    let to = to.into();
    let socket = UdpSocket::bind(any_local(to))?;
    socket.connect(to)?;
    socket.set_read_timeout(Some(timeout))?;
    let sent: Vec<u8> = (0..len).map(|i| (i * 31 % 253) as u8).collect();
    socket.send(&sent)?;
    let mut buf = vec![0u8; 65_536];
    let n = socket.recv(&mut buf)?;
    if buf[..n] != sent[..] {
        return Err(io::Error::other(format!("{n} bytes came back, not the {len} sent")));
    }
    Ok(())
}

fn udp_request_bound(local: SocketAddr, addr: SocketAddr, timeout: Duration) -> io::Result<String> {
    let socket = UdpSocket::bind(local)?;
    socket.connect(addr)?;
    socket.set_read_timeout(Some(timeout))?;
    socket.send(b"hello\n")?;
    let mut buf = [0u8; 2048];
    let n = socket.recv(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).trim().to_owned())
}

/// Sends one ICMP echo request to `addr` and waits at most `timeout` for
/// the matching reply; returns the round-trip time. Uses a raw socket (no
/// `ping` binary needed). Runs in the calling thread's namespace.
pub fn ping(addr: Ipv4Addr, timeout: Duration) -> io::Result<Duration> {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::IPPROTO_ICMP) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let ident = (std::process::id() as u16) ^ 0x5870;
    let seq: u16 = 1;
    let mut request = [0u8; 16];
    request[0] = 8; // echo request
    request[4..6].copy_from_slice(&ident.to_be_bytes());
    request[6..8].copy_from_slice(&seq.to_be_bytes());
    request[8..16].copy_from_slice(b"xproxy!!");
    let sum = internet_checksum(&request);
    request[2..4].copy_from_slice(&sum.to_be_bytes());

    let dest = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr.octets()),
        },
        sin_zero: [0; 8],
    };
    let start = Instant::now();
    // SAFETY: buffer and address are valid for the lengths given.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            (&dest as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let deadline = start + timeout;
    let mut buf = [0u8; 1500];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no echo reply from {addr} in {timeout:?}"),
            ));
        }
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, ms) } <= 0 {
            continue;
        }
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let packet = &buf[..n as usize];
        // Raw IPv4 sockets deliver the IP header too.
        if packet.len() < 20 {
            continue;
        }
        let ihl = usize::from(packet[0] & 0x0f) * 4;
        let src = Ipv4Addr::new(packet[12], packet[13], packet[14], packet[15]);
        let Some(icmp) = packet.get(ihl..) else {
            continue;
        };
        if src == addr
            && icmp.len() >= 8
            && icmp[0] == 0
            && icmp[4..6] == ident.to_be_bytes()
            && icmp[6..8] == seq.to_be_bytes()
        {
            return Ok(start.elapsed());
        }
    }
}

/// RFC 1071 checksum.
fn internet_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for chunk in data.chunks(2) {
        let word = u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The pass-only programs the test bed loads itself (through the shared
/// `bpf-sys` layer, no object file needed): the XDP peer of a veth and the
/// benchmarks' baselines.
pub mod bpf {
    use std::{
        io,
        os::fd::{AsFd, OwnedFd},
    };

    use bpf_sys::obj::{self, RawProgram};

    /// A program that only returns its hook's "pass" code.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Pass {
        /// `return XDP_PASS` (2).
        Xdp,
        /// `return TC_ACT_OK` (0), a tc classifier.
        Tc,
    }

    impl Pass {
        /// The code the program returns.
        pub fn code(self) -> u32 {
            match self {
                Pass::Xdp => 2,
                Pass::Tc => 0,
            }
        }

        /// The code's name, for reports.
        pub fn name(self) -> &'static str {
            match self {
                Pass::Xdp => "XDP_PASS",
                Pass::Tc => "TC_ACT_OK",
            }
        }
    }

    /// Loads `r0 = <pass code>; exit` as the program type of `pass`.
    pub fn load_pass(pass: Pass) -> io::Result<OwnedFd> {
        let mut mov = [0u8; 8];
        mov[0] = 0xb7; // mov64 r0, imm
        mov[4..8].copy_from_slice(&pass.code().to_le_bytes());
        let exit = [0x95, 0, 0, 0, 0, 0, 0, 0];
        let (prog_type, expected_attach_type) = match pass {
            Pass::Xdp => (obj::PROG_TYPE_XDP, obj::ATTACH_XDP),
            Pass::Tc => (obj::PROG_TYPE_SCHED_CLS, 0),
        };
        obj::prog_load(&RawProgram {
            prog_type,
            expected_attach_type,
            insns: &[mov, exit],
            license: c"GPL",
            name: "test_pass",
        })
    }

    /// Attaches `prog` in native mode to `ifindex` in the calling thread's
    /// namespace; detached when the returned link is closed.
    pub(super) fn link_xdp(prog: &OwnedFd, ifindex: u32) -> io::Result<OwnedFd> {
        obj::link_xdp_native(prog.as_fd(), ifindex)
    }
}
