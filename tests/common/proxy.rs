//! A TCP proxy between the guard and its server that can go silent: bytes stop flowing both ways
//! while every socket stays open, as in a network partition. It can also hold every chunk back for a
//! while, as a slow link does (the nemesis's delay, where the kernel has no `netem`), or deliver one
//! answer as late as a check accepts and then go silent (`late_answer_then_silence`).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::{alive, as_strs, read_pid, recording_app, wait_until, Lab, FAST};

/// What the proxy does to the bytes it carries, shared by the pumps of every connection.
struct Link {
    /// Nothing passes either way.
    silent: AtomicBool,
    /// Nothing passes from the client to the server.
    upstream_silent: AtomicBool,
    /// Milliseconds each chunk waits before it is passed on, and up to how many more at random.
    delay_ms: AtomicU64,
    jitter_ms: AtomicU64,
    /// Armed by `late_answer_then_silence`: how late the server's next chunk is passed on.
    late_answer_ms: AtomicU64,
    /// Set once that late chunk has been passed on.
    answered_late: AtomicBool,
    /// The server port new connections are carried to.
    upstream_port: AtomicU16,
    /// The server's address: loopback, or a relay's from another network namespace.
    upstream_host: IpAddr,
}

pub struct Proxy {
    pub port: u16,
    link: Arc<Link>,
}

impl Proxy {
    pub fn start(upstream_port: u16) -> Proxy {
        Proxy::listening_on("127.0.0.1:0", upstream_port)
    }

    /// A proxy listening on `address` (e.g. `[::1]:0`, to reach an IPv4-only server over IPv6).
    pub fn listening_on(address: &str, upstream_port: u16) -> Proxy {
        Proxy::carrying(address, (Ipv4Addr::LOCALHOST.into(), upstream_port))
    }

    /// A proxy in the network namespace `netns` (a path such as `/run/netns/<name>`), listening on
    /// `address` there and carrying to `upstream` as that namespace reaches it: a guard on a host of
    /// its own then finds a server at the loopback address the rest of the group (Sentinel's
    /// answers) names it by.
    pub fn in_namespace(netns: &str, address: &str, upstream: (IpAddr, u16)) -> Proxy {
        let (netns, address) = (netns.to_owned(), address.to_owned());
        // A thread's network namespace is its own, and the threads it starts inherit it: the
        // listener, its accept loop and every upstream connection live in `netns`.
        thread::spawn(move || {
            let ns = std::fs::File::open(&netns).unwrap();
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .unwrap_or_else(|e| panic!("enter {netns}: {e}"));
            Proxy::carrying(&address, upstream)
        })
        .join()
        .unwrap()
    }

    /// A proxy listening on `address`, carrying to `upstream`.
    pub fn carrying(address: &str, (upstream_host, upstream_port): (IpAddr, u16)) -> Proxy {
        let listener = TcpListener::bind(address)
            .unwrap_or_else(|e| panic!("a proxy listening on {address}: {e}"));
        let port = listener.local_addr().unwrap().port();
        let link = Arc::new(Link {
            upstream_port: AtomicU16::new(upstream_port),
            upstream_host,
            silent: AtomicBool::default(),
            upstream_silent: AtomicBool::default(),
            delay_ms: AtomicU64::default(),
            jitter_ms: AtomicU64::default(),
            late_answer_ms: AtomicU64::default(),
            answered_late: AtomicBool::default(),
        });
        let shared = link.clone();
        thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let upstream = shared.upstream_port.load(Ordering::SeqCst);
                let Ok(server) = TcpStream::connect((shared.upstream_host, upstream)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                pump(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    shared.clone(),
                    false,
                );
                pump(server, client, shared.clone(), true);
            }
        });
        Proxy { port, link }
    }

    /// From now on, every chunk read in either direction is passed on `delay` later, plus up to
    /// `jitter` more at random.
    pub fn set_delay(&self, delay: Duration, jitter: Duration) {
        self.link
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
        self.link
            .jitter_ms
            .store(jitter.as_millis() as u64, Ordering::SeqCst);
    }

    /// New connections go to the server at `port` from now on, as after a moved address; the open
    /// ones stay where they are.
    pub fn reroute(&self, port: u16) {
        self.link.upstream_port.store(port, Ordering::SeqCst);
    }

    /// From now on, every byte in either direction is dropped; no connection is closed.
    pub fn partition(&self) {
        self.link.silent.store(true, Ordering::SeqCst);
    }

    /// The worst a partition can follow: the server's next answer reaches the client `late` after
    /// the server sent it; from the moment it was sent nothing more reaches the server, and once
    /// it has been passed on nothing passes either way. The server counts its idle time from its
    /// answer, the client from its next question, which is lost.
    pub fn late_answer_then_silence(&self, late: Duration) {
        self.link
            .late_answer_ms
            .store(late.as_millis() as u64, Ordering::SeqCst);
    }

    /// Whether the late answer of `late_answer_then_silence` has been passed on.
    pub fn answered_late(&self) -> bool {
        self.link.answered_late.load(Ordering::SeqCst)
    }
}

/// Carries bytes from `from` to `to` as `link` says; `to_client` is the server's direction.
fn pump(mut from: TcpStream, mut to: TcpStream, link: Arc<Link>, to_client: bool) {
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if link.silent.load(Ordering::SeqCst)
                || (!to_client && link.upstream_silent.load(Ordering::SeqCst))
            {
                continue;
            }
            let late = if to_client {
                link.late_answer_ms.swap(0, Ordering::SeqCst)
            } else {
                0
            };
            if late > 0 {
                link.upstream_silent.store(true, Ordering::SeqCst);
                thread::sleep(Duration::from_millis(late));
                let _ = to.write_all(&buf[..n]);
                link.silent.store(true, Ordering::SeqCst);
                link.answered_late.store(true, Ordering::SeqCst);
                continue;
            }
            let jitter = link.jitter_ms.load(Ordering::SeqCst);
            let delay = link.delay_ms.load(Ordering::SeqCst) + rand::random_range(0..=jitter);
            if delay > 0 {
                thread::sleep(Duration::from_millis(delay));
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        if !link.silent.load(Ordering::SeqCst) {
            let _ = to.shutdown(Shutdown::Write);
        }
    });
}

/// The silent partition of a session backend (MySQL, PostgreSQL) with the `FAST` timings: a guard
/// reaching the server at `server_port` through a proxy holds `name`; the proxy goes silent. While
/// its app lives, a guard reaching the server directly (`direct`) is refused; the app is stopped
/// within detection + grace; and the server frees the silent session's lock only after the session
/// timeout `W = ceil(0.2 + 0.8 + 2 + 5) = 8s`, which `url_via(port)` and `held()` observe.
pub fn assert_partition_stops_the_app_before_the_server_frees_the_lock(
    server_port: u16,
    url_via: impl Fn(u16) -> String,
    name: &str,
    held: impl Fn() -> bool,
) {
    let proxy = Proxy::start(server_port);
    let mut lab = Lab::new();
    let (proxied, direct) = (url_via(proxy.port), url_via(server_port));
    let args = |url: &'_ str| -> Vec<String> {
        let mut v = vec![
            "--url".to_owned(),
            url.to_owned(),
            "--name".to_owned(),
            name.to_owned(),
        ];
        v.extend(FAST.iter().map(|s| s.to_string()));
        v
    };
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(
        &as_strs(&args(&proxied)),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    let app = read_pid(&pidfile, Duration::from_secs(10));

    let partitioned = Instant::now();
    proxy.partition();
    while alive(app) {
        let (code, log) = lab.run(&as_strs(&args(&direct)), &["true"], Duration::from_secs(10));
        if alive(app) {
            assert_eq!(
                code, 1,
                "a second guard acquired while the first app was alive: {log}"
            );
        }
        assert!(
            partitioned.elapsed() < Duration::from_secs(5),
            "app not stopped within detection + grace"
        );
    }
    // Detection bound is check-interval 200ms + check-timeout 800ms; the app traps TERM at once.
    let stopped = partitioned.elapsed();
    assert!(
        stopped < Duration::from_millis(2500),
        "app stopped only after {stopped:?}"
    );
    assert_eq!(guard.code(Duration::from_secs(10)), 75);
    assert!(
        guard.log_text().contains("reason=check_timeout"),
        "{}",
        guard.log_text()
    );

    let freed = wait_until(Duration::from_secs(20), || !held());
    assert!(freed, "the server kept the lock of a partitioned guard");
    let freed_after = partitioned.elapsed();
    assert!(
        freed_after >= Duration::from_secs(7),
        "server freed the lock after only {freed_after:?}"
    );
}
