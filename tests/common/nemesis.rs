//! The nemesis: random schedules of faults against three guards on hosts of their own, checked from
//! a recorded history alone.
//!
//! Each test runs one backend: its server (a three-member etcd cluster; a Redis primary with two
//! replicas and three sentinels) in this test's network namespace, and three guards, each on a host of its own (a network namespace joined by a veth pair,
//! `common::netns`) and in a freezer cgroup of its own. Every guard runs with `--wait`, the backend's
//! short timings and the default takeover setting (`auto`), as `docker compose up --scale app=3`
//! with a restart policy would run them: a guard that exits is started again. A guard reaches the
//! servers through a relay at its link's far end; the relay can slow the link (the kernel here has
//! no `netem`). A Sentinel guard is told the primary's loopback address, so its host also has a
//! forwarder on each of the group's loopback ports to that server's relay.
//!
//! Every app appends its start, its beats (every 50ms) and its stop, stamped with `CLOCK_MONOTONIC`
//! (one clock for every namespace of the host), to one history file; the nemesis appends each
//! fault's begin and end, and which guards it started with a wrong wall clock. The checker (module
//! `checker`) reads only that history. Faults, one or two
//! at once, are drawn from a seed printed first: `SENTINEL_NEMESIS_SEED` replays it.
//! `SENTINEL_NEMESIS_SECONDS` sets how long faults are drawn per backend (default 40).

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::time::{clock_gettime, ClockId};
use nix::unistd::Pid;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::freeze::Freezer;
use super::netns::{Direction, Host, LoopbackCut};
use super::proxy::Proxy;
use super::sentinel::SECOND_ADDRESS;
use super::*;

const GUARDS: usize = 3;
const LOCK: &str = "nemesis";
/// How long after the faults heal some app must run again. The slowest recovery the fault matrix
/// measures with these timings is 14.2s (a partition on MySQL: the session timeout, then the old
/// holder's bound); a server restarted meanwhile and a guard started again add seconds.
const LIVENESS: Duration = Duration::from_secs(45);
/// A fault lasts at most this long.
const LONGEST_FAULT: Duration = Duration::from_secs(3);
/// A whole tree is frozen at most this long. A standby may take a lock the backend took away at
/// once and wait only the old holder's bound (3s with the shortest timings here, a lock file's:
/// check interval 200ms + check timeout 800ms + grace period 2s; a session lock's adds another
/// check timeout); a tree thawed after that wait ended is the
/// documented limit of docs/guarantees.md ("Frozen or suspended past the deadline"), not a fault
/// the guard claims to survive. Thawing comes first at every heal, so nothing lengthens a freeze.
const LONGEST_FREEZE: Duration = Duration::from_secs(2);
/// Liveness: once the faults heal, one app must still beat this long after the heal (longer than
/// any detection plus grace period here), so an app that is about to be stopped does not count.
const SETTLED: Duration = Duration::from_secs(5);

/// The recording app's first instructions, in the shell the guard starts: take the witness lock on
/// descriptor 9, which every process of the app inherits, then become the Python app. Every earlier
/// app held the witness for as long as any process of its tree lived, so a start that finds it
/// taken is an overlap whatever the stamps say: the exact check for an app that was SIGKILLed and
/// wrote no stop, taken within a millisecond of the exec.
const WITNESS: &str =
    "exec 9>>\"$1\"; shift; flock -n -x 9 || export NEMESIS_OVERLAP=1; exec python3 \"$@\"";

/// The recording app: a start (and `overlap` if the witness was taken), a beat every 50ms, a stop
/// 300ms after SIGTERM, as an app finishing its work does. It also leaves a helper that escapes its
/// process group (`setsid`), holds the witness and beats under the app's name: the guard must stop
/// it with the app, and a helper that outlives its app extends that app's life in the history.
const APP: &str = r#"
import os, signal, subprocess, sys, time
history, name = sys.argv[1], sys.argv[2]
token = os.environ.get("SENTINEL_GUARD_FENCING_TOKEN", "none")
out = os.open(history, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
def record(what):
    os.write(out, f"{time.monotonic_ns()} app {name} {token} {what}\n".encode())
record("start")
if os.environ.get("NEMESIS_OVERLAP"):
    record("overlap")
HELPER = """
import os, sys, time
out = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
while True:
    os.write(out, f"{time.monotonic_ns()} app {sys.argv[2]} {sys.argv[3]} beat\\n".encode())
    time.sleep(0.2)
"""
subprocess.Popen([sys.executable, "-c", HELPER, history, name, token], start_new_session=True, pass_fds=(9,))
def stop(signum, frame):
    time.sleep(0.3)
    record("stop")
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    record("beat")
    time.sleep(0.05)
"#;

fn now_ns() -> u64 {
    let t = clock_gettime(ClockId::CLOCK_MONOTONIC).unwrap();
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// Sends `signal`, ignoring a process already gone: faults may overlap with a guard's own exit.
fn signal(pid: i32, signal: Signal) {
    let _ = kill(Pid::from_raw(pid), signal);
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Partition(usize, Direction),
    Loss(usize),
    Delay(usize, u64),
    GuardStop(usize),
    TreeFreeze(usize),
    GuardKill(usize),
    GuardTerm(usize),
    ServerKill(usize),
    ServerStop,
    TakeAway,
    /// `SENTINEL FAILOVER`: a replica promoted while the lock is held on the primary.
    Failover,
    /// The primary cut off from the sentinels and the replicas, while the guards still reach it:
    /// the sentinels promote a replica, and the old primary serves whoever still talks to it.
    PrimaryCut,
    /// Every guard's host partitioned from the servers at once, both ways: the server's host cut
    /// off from the guards'.
    ServerCut,
}

impl Fault {
    fn kind(self) -> String {
        match self {
            Fault::Partition(_, direction) => format!("partition_{}", direction.name()),
            Fault::Loss(_) => "packet_loss".into(),
            Fault::Delay(..) => "link_delay".into(),
            Fault::GuardStop(_) => "guard_sigstop".into(),
            Fault::TreeFreeze(_) => "tree_frozen".into(),
            Fault::GuardKill(_) => "guard_sigkill".into(),
            Fault::GuardTerm(_) => "guard_sigterm".into(),
            Fault::ServerKill(_) => "server_sigkill".into(),
            Fault::ServerStop => "server_sigstop".into(),
            Fault::TakeAway => "lock_taken_away".into(),
            Fault::Failover => "sentinel_failover".into(),
            Fault::PrimaryCut => "primary_cut_from_group".into(),
            Fault::ServerCut => "server_cut_from_guards".into(),
        }
    }

    /// What the fault acts on: two faults at once never act on the same thing.
    fn target(self) -> Option<usize> {
        match self {
            Fault::Partition(slot, _)
            | Fault::Loss(slot)
            | Fault::Delay(slot, _)
            | Fault::GuardStop(slot)
            | Fault::TreeFreeze(slot)
            | Fault::GuardKill(slot)
            | Fault::GuardTerm(slot) => Some(slot),
            Fault::ServerKill(_)
            | Fault::ServerStop
            | Fault::TakeAway
            | Fault::Failover
            | Fault::PrimaryCut
            | Fault::ServerCut => None,
        }
    }

    fn describe(self) -> String {
        match self {
            Fault::Delay(slot, ms) => format!("{} guard={slot} delay={ms}ms", self.kind()),
            Fault::ServerKill(member) => format!("{} member={member}", self.kind()),
            _ => match self.target() {
                Some(slot) => format!("{} guard={slot}", self.kind()),
                None => self.kind(),
            },
        }
    }
}

/// One of the three guards' places: its host, its relays, its freezer cgroup, and the guard now
/// running there, if any.
struct Slot {
    host: Host,
    relays: Vec<Proxy>,
    /// On the host, at each server's own loopback address, to that server's relay: where the
    /// guards are told a server's address (Sentinel names the primary) rather than given it.
    /// Their listeners live as long as this process, and keep the namespace (not its name) alive.
    forwarders: Vec<Proxy>,
    url: String,
    freezer: Freezer,
    guard: Option<GuardProcess>,
    exited: Option<Instant>,
    started: usize,
}

pub struct Nemesis {
    /// The loopback rules of a `PrimaryCut` in force.
    cut: Option<LoopbackCut>,
    /// The Sentinel group's node a `ServerStop` stopped, to resume that one.
    stopped_node: Option<usize>,
    // Field order is drop order: the slots (after `Drop` has killed their guards) go before the
    // servers and the directory the apps write to.
    slots: Vec<Slot>,
    backend: Backend,
    lab: Lab,
    history: PathBuf,
    rng: StdRng,
    seed: u64,
    faults: BTreeMap<String, usize>,
    exits: BTreeMap<String, usize>,
    rounds: usize,
}

fn server_ports(backend: &Backend) -> Vec<u16> {
    match backend {
        Backend::Mysql(db) => vec![db.port],
        Backend::Postgres(db) => vec![db.port],
        Backend::Redis(redis) => vec![redis.port],
        Backend::Etcd(etcd) => (0..etcd.size()).map(|i| etcd.client_port(i)).collect(),
        Backend::Sentinel(group) => group.ports(),
        Backend::File(_) => Vec::new(),
    }
}

/// The servers a `ServerKill` picks from: each etcd member, each Redis node of a Sentinel group.
fn members(backend: &Backend) -> usize {
    match backend {
        Backend::Etcd(etcd) => etcd.size(),
        Backend::Sentinel(group) => group.nodes.len(),
        _ => 1,
    }
}

fn seed() -> u64 {
    std::env::var("SENTINEL_NEMESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random())
}

fn seconds() -> u64 {
    std::env::var("SENTINEL_NEMESIS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40)
}

fn describe_exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit_{code}"),
        (None, Some(signal)) => format!("signal_{signal}"),
        _ => "unknown".into(),
    }
}

impl Nemesis {
    /// Guards with every default, the takeover setting included.
    pub fn new(backend: Backend) -> Nemesis {
        Nemesis::in_lab(backend, Lab::with_default_takeover())
    }

    /// Guards started as `lab` starts them (`Lab::new`: with the takeover delay off).
    pub fn in_lab(backend: Backend, lab: Lab) -> Nemesis {
        let seed = seed();
        eprintln!(
            "nemesis backend={} seed={seed} (SENTINEL_NEMESIS_SEED={seed} replays it)",
            backend.name()
        );
        let history = lab.path("history");
        fs::write(lab.path("app.py"), APP).unwrap();
        let slots = (0..GUARDS)
            .map(|_| {
                let host = Host::create();
                let mut url = backend.url();
                let (mut relays, mut forwarders) = (Vec::new(), Vec::new());
                for port in server_ports(&backend) {
                    let upstream = match &backend {
                        Backend::Sentinel(group) if group.nodes.iter().any(|n| n.port == port) => {
                            SECOND_ADDRESS.into()
                        }
                        _ => Ipv4Addr::LOCALHOST.into(),
                    };
                    let relay = Proxy::carrying(&format!("{}:0", host.gateway), (upstream, port));
                    if matches!(backend, Backend::Sentinel(_)) {
                        let gateway = host.gateway.parse().unwrap();
                        forwarders.push(Proxy::in_namespace(
                            &format!("/run/netns/{}", host.name),
                            &format!("127.0.0.1:{port}"),
                            (gateway, relay.port),
                        ));
                    } else {
                        url = url.replace(
                            &format!("127.0.0.1:{port}"),
                            &format!("{}:{}", host.gateway, relay.port),
                        );
                    }
                    relays.push(relay);
                }
                Slot {
                    host,
                    relays,
                    forwarders,
                    url,
                    freezer: Freezer::create(),
                    guard: None,
                    exited: None,
                    started: 0,
                }
            })
            .collect();
        Nemesis {
            cut: None,
            stopped_node: None,
            backend,
            lab,
            history,
            slots,
            rng: StdRng::seed_from_u64(seed),
            seed,
            faults: BTreeMap::new(),
            exits: BTreeMap::new(),
            rounds: 0,
        }
    }

    fn note(&self, what: &str) {
        let mut file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.history)
            .unwrap();
        file.write_all(format!("{} nemesis {what}\n", now_ns()).as_bytes())
            .unwrap();
    }

    /// Starts a guard in slot `i`.
    fn spawn(&mut self, i: usize) {
        self.slots[i].started += 1;
        let name = format!("g{i}.{}", self.slots[i].started);
        let mut args: Vec<String> = vec![
            "--url".into(),
            self.slots[i].url.clone(),
            "--name".into(),
            LOCK.into(),
        ];
        args.extend(self.backend.fast_args().iter().map(|s| s.to_string()));
        args.push("--wait".into());
        let history = self.history.display().to_string();
        let witness = self.lab.path("witness").display().to_string();
        let script = self.lab.path("app.py").display().to_string();
        let app = [
            "sh", "-c", WITNESS, "sh", &witness, &script, &history, &name,
        ];
        let mut cmd = self.lab.command(&as_strs(&args), &app);
        // One guard start in four has a wall clock that is minutes off, ahead or behind: a host's
        // clock can be wrong, and the backend's must be the one that counts. Not for a lock file:
        // its guards share one host, whose clock is the backend's, and a step back of it between
        // two acquisitions is the documented limit of the fencing token (README, "Fencing"). The
        // nemesis found just that when each guard had a clock of its own.
        if self.networked() && self.rng.random_ratio(1, 4) {
            let seconds = self.rng.random_range(30..=600);
            let skew = if self.rng.random_bool(0.5) {
                format!("+{seconds}s")
            } else {
                format!("-{seconds}s")
            };
            skew_wall_clock(&mut cmd, &skew);
            *self.faults.entry("guard_clock_skewed".into()).or_default() += 1;
            let note = format!("guard_clock_skewed guard={name} skew={skew}");
            self.note(&note);
        }
        let slot = &mut self.slots[i];
        let cmd = launched_by(&cmd, "nsenter", &[&slot.host.nsenter_arg()]);
        // A guard whose test died (SIGINT, a timeout) dies with it, and its watchdog takes its tree.
        let cmd = launched_by(&cmd, "setpriv", &["--pdeathsig", "KILL", "--"]);
        let cmd = slot.freezer.command(&cmd);
        slot.guard = Some(self.lab.start(cmd));
        slot.exited = None;
    }

    /// Reaps guards that exited and starts them again 300ms later, as a restart policy would. An
    /// exit that means a bug (bad input, an internal error, a panic) ends the test.
    fn keep_guards_running(&mut self) {
        for i in 0..GUARDS {
            let slot = &mut self.slots[i];
            if let Some(guard) = &mut slot.guard {
                if let Some(status) = guard.child.try_wait().unwrap() {
                    let exit = describe_exit(status);
                    // A panic is exit 101 in a debug build and SIGABRT in a release build
                    // (`panic = "abort"`).
                    assert!(
                        !matches!(status.code(), Some(2 | 70 | 101)) && status.signal() != Some(6),
                        "seed {}: guard {i} exited {exit}: {}",
                        self.seed,
                        guard.log_text()
                    );
                    *self.exits.entry(exit).or_default() += 1;
                    slot.guard = None;
                    slot.exited = Some(Instant::now());
                }
            }
            let due = slot
                .exited
                .is_none_or(|at| at.elapsed() >= Duration::from_millis(300));
            if slot.guard.is_none() && due {
                self.spawn(i);
            }
        }
    }

    /// The slot whose app started last: the leader, as far as the history tells.
    fn leader(&self) -> Option<usize> {
        let history = fs::read_to_string(&self.history).unwrap_or_default();
        history
            .lines()
            .rev()
            .find(|l| l.ends_with(" start"))
            .and_then(|l| l.split_whitespace().nth(2))
            .and_then(|name| name.strip_prefix('g'))
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse().ok())
    }

    fn draw(&mut self) -> Fault {
        let slot = match self.leader() {
            Some(leader) if self.rng.random_ratio(3, 5) => leader,
            _ => self.rng.random_range(0..GUARDS),
        };
        let networked = self.networked();
        let members = members(&self.backend);
        let sentinel = matches!(self.backend, Backend::Sentinel(_));
        loop {
            let fault = match self.rng.random_range(0..13) {
                0 if networked => {
                    let direction = [Direction::Both, Direction::ToServer, Direction::FromServer]
                        [self.rng.random_range(0..3)];
                    Fault::Partition(slot, direction)
                }
                1 if networked => Fault::Loss(slot),
                2 if networked => Fault::Delay(slot, self.rng.random_range(20..400)),
                3 => Fault::GuardStop(slot),
                4 => Fault::TreeFreeze(slot),
                5 => Fault::GuardKill(slot),
                6 => Fault::GuardTerm(slot),
                7 if networked => Fault::ServerKill(self.rng.random_range(0..members)),
                8 if networked => Fault::ServerStop,
                9 => Fault::TakeAway,
                10 if sentinel => Fault::Failover,
                11 if sentinel => Fault::PrimaryCut,
                12 if networked => Fault::ServerCut,
                _ => continue,
            };
            return fault;
        }
    }

    /// Whether the guards reach a server over the network (every backend but a lock file).
    fn networked(&self) -> bool {
        !matches!(self.backend, Backend::File(_))
    }

    fn guard_pid(&self, slot: usize) -> Option<i32> {
        self.slots[slot].guard.as_ref().map(GuardProcess::pid)
    }

    fn signal_server(&self, signal: Signal) {
        match &self.backend {
            Backend::Mysql(db) => self::signal(db.pid(), signal),
            Backend::Postgres(db) => db.signal_all(signal as i32),
            Backend::Redis(redis) => self::signal(redis.pid(), signal),
            Backend::Etcd(etcd) => etcd.signal_all(signal as i32),
            // The node stopped: the sentinels may have named another primary since.
            Backend::Sentinel(group) => {
                let node = self.stopped_node.map(|i| &group.nodes[i]);
                if let Some(node) = node.filter(|n| n.is_running()) {
                    self::signal(node.pid(), signal);
                }
            }
            Backend::File(_) => unreachable!("no server"),
        }
    }

    /// Injects `fault`; false if there was nothing for it to act on (no guard in the slot, no
    /// holder to take the lock from), so it is not counted.
    fn apply(&mut self, fault: Fault) -> bool {
        match fault {
            Fault::Partition(slot, direction) => self.slots[slot].host.partition(direction),
            Fault::ServerCut => {
                for slot in &self.slots {
                    slot.host.partition(Direction::Both);
                }
            }
            Fault::Loss(slot) => self.slots[slot].host.lose(0.3),
            Fault::Delay(slot, ms) => {
                for relay in &self.slots[slot].relays {
                    relay.set_delay(Duration::from_millis(ms), Duration::from_millis(ms / 2));
                }
            }
            Fault::GuardStop(slot) | Fault::GuardKill(slot) | Fault::GuardTerm(slot) => {
                let sig = match fault {
                    Fault::GuardStop(_) => Signal::SIGSTOP,
                    Fault::GuardKill(_) => Signal::SIGKILL,
                    _ => Signal::SIGTERM,
                };
                let Some(pid) = self.guard_pid(slot) else {
                    return false;
                };
                signal(pid, sig);
            }
            Fault::TreeFreeze(slot) => self.slots[slot].freezer.freeze(),
            Fault::ServerKill(member) => match &mut self.backend {
                Backend::Mysql(db) => db.kill9(),
                Backend::Postgres(db) => db.kill9(),
                Backend::Redis(redis) => redis.kill9(),
                Backend::Etcd(etcd) => etcd.kill(member),
                Backend::Sentinel(group) => group.nodes[member].kill9(),
                Backend::File(_) => unreachable!("no server"),
            },
            Fault::ServerStop => {
                // Sentinel: the primary, whose replicas and sentinels go on and may replace it.
                if let Backend::Sentinel(group) = &self.backend {
                    self.stopped_node = group.primary_node();
                    if self.stopped_node.is_none() {
                        return false;
                    }
                }
                self.signal_server(Signal::SIGSTOP)
            }
            Fault::Failover => {
                let Backend::Sentinel(group) = &self.backend else {
                    unreachable!("drawn for Sentinel only")
                };
                return group.request_failover();
            }
            Fault::PrimaryCut => {
                let Backend::Sentinel(group) = &self.backend else {
                    unreachable!("drawn for Sentinel only")
                };
                let Some(port) = group.primary_port() else {
                    return false;
                };
                self.cut = Some(LoopbackCut::new(port));
            }
            Fault::TakeAway => {
                return match &self.backend {
                    Backend::Mysql(db) => db
                        .holder_of(LOCK)
                        .map(|conn| db.sql(&format!("KILL {conn}")))
                        .is_some(),
                    Backend::Postgres(db) => db
                        .holder_of(LOCK)
                        .map(|pid| db.sql(&format!("SELECT pg_terminate_backend({pid})")))
                        .is_some(),
                    Backend::Redis(redis) => {
                        redis
                            .cli(&["DEL", &format!("sentinel-guard:{{{LOCK}}}")])
                            .trim()
                            == "1"
                    }
                    Backend::Sentinel(group) => {
                        group.delete_on_primary(&format!("sentinel-guard:{{{LOCK}}}"))
                    }
                    Backend::Etcd(etcd) => {
                        let mut del = etcd.ctl();
                        del.args(["del", &format!("sentinel-guard/lock/{LOCK}")]);
                        stdout_of(del).is_some_and(|out| out.trim() == "1")
                    }
                    Backend::File(files) => fs::remove_file(files.path("backend.lock")).is_ok(),
                };
            }
        }
        true
    }

    fn heal(&mut self, fault: Fault) {
        match fault {
            Fault::Partition(slot, _) | Fault::Loss(slot) => self.slots[slot].host.heal(),
            // A fault of one guard's link healed meanwhile ended this one early on that link.
            Fault::ServerCut => {
                for slot in &self.slots {
                    slot.host.heal();
                }
            }
            Fault::Delay(slot, _) => {
                for relay in &self.slots[slot].relays {
                    relay.set_delay(Duration::ZERO, Duration::ZERO);
                }
            }
            Fault::GuardStop(slot) => {
                if let Some(pid) = self.guard_pid(slot) {
                    signal(pid, Signal::SIGCONT);
                }
            }
            Fault::TreeFreeze(slot) => {
                self.slots[slot].freezer.thaw();
            }
            Fault::ServerKill(member) => match &mut self.backend {
                Backend::Mysql(db) => db.restart(),
                Backend::Postgres(db) => db.restart(),
                Backend::Redis(redis) => redis.restart(),
                Backend::Etcd(etcd) => etcd.restart(member),
                Backend::Sentinel(group) => group.restart_node(member),
                Backend::File(_) => unreachable!("no server"),
            },
            Fault::ServerStop => {
                self.signal_server(Signal::SIGCONT);
                self.stopped_node = None;
            }
            Fault::PrimaryCut => self.cut = None,
            Fault::GuardKill(_) | Fault::GuardTerm(_) | Fault::TakeAway | Fault::Failover => {}
        }
    }

    /// Sleeps `d` while keeping the guards running.
    fn pass(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while Instant::now() < until {
            self.keep_guards_running();
            std::thread::sleep(Duration::from_millis(20).min(until - Instant::now()));
        }
    }

    /// One round: one fault, or two at once on different targets, held for up to `LONGEST_FAULT`
    /// (a freeze up to `LONGEST_FREEZE`), healed, thaw first; then an app must beat `SETTLED`
    /// after the heal, within `LIVENESS` of it.
    fn round(&mut self) {
        let first = self.draw();
        let mut faults = vec![first];
        if self.rng.random_ratio(1, 3) {
            let second = self.draw();
            if second.target() != first.target() {
                faults.push(second);
            }
        }
        let longest = if faults.iter().any(|f| matches!(f, Fault::TreeFreeze(_))) {
            LONGEST_FREEZE
        } else {
            LONGEST_FAULT
        };
        let hold = self.rng.random_range(200..=longest.as_millis() as u64);
        faults.retain(|fault| {
            self.note(&format!("{} begin", fault.describe()));
            let applied = self.apply(*fault);
            if applied {
                *self.faults.entry(fault.kind()).or_default() += 1;
            } else {
                self.note(&format!("{} not_applied", fault.describe()));
            }
            applied
        });
        self.pass(Duration::from_millis(hold));
        faults.sort_by_key(|fault| !matches!(fault, Fault::TreeFreeze(_)));
        for fault in &faults {
            self.heal(*fault);
            self.note(&format!("{} end", fault.describe()));
        }
        let settled = now_ns() + SETTLED.as_nanos() as u64;
        let limit = Instant::now() + LIVENESS;
        while !checker::beat_after(&fs::read_to_string(&self.history).unwrap(), settled) {
            assert!(
                Instant::now() < limit,
                "seed {}: no app ran within {LIVENESS:?} of the heal\n{}",
                self.seed,
                self.logs()
            );
            self.pass(Duration::from_millis(50));
        }
        self.rounds += 1;
        // A quiet moment between rounds, so faults also land on a settled leader.
        let quiet = self.rng.random_range(0..1000);
        self.pass(Duration::from_millis(quiet));
    }

    fn logs(&self) -> String {
        let mut all = String::new();
        for (i, slot) in self.slots.iter().enumerate() {
            if let Some(guard) = &slot.guard {
                let log = guard.log_text();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                all += &format!("--- guard {i}, last lines:\n");
                for line in tail.into_iter().rev() {
                    all += line;
                    all += "\n";
                }
            }
        }
        all
    }

    /// Draws faults for `SENTINEL_NEMESIS_SECONDS`, then judges the history; panics, with the
    /// seed, on any violation.
    pub fn run(mut self) -> Summary {
        for i in 0..GUARDS {
            self.spawn(i);
        }
        let deadline = Instant::now() + Duration::from_secs(seconds());
        while Instant::now() < deadline {
            self.round();
        }
        let (summary, violations) = self.finish();
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nemesis");
        fs::create_dir_all(&out).unwrap();
        fs::write(
            out.join(format!("{}.txt", summary.backend)),
            format!("{}\n", summary.line()),
        )
        .unwrap();
        assert!(
            violations.is_empty(),
            "seed {}: {}",
            summary.seed,
            violations.join("\n\n")
        );
        assert!(summary.apps > 0, "seed {}: no app ever ran", summary.seed);
        summary
    }

    /// The lock taken away once, under an app that has run a second; the violations the history
    /// then shows. For checking that the whole chain, from the app to the checker, can fail.
    pub fn take_away_once(mut self) -> Vec<String> {
        for i in 0..GUARDS {
            self.spawn(i);
        }
        let started = now_ns();
        assert!(wait_until(Duration::from_secs(20), || checker::beat_after(
            &fs::read_to_string(&self.history).unwrap_or_default(),
            started + 1_000_000_000
        )));
        assert!(
            self.apply(Fault::TakeAway),
            "no holder to take the lock from"
        );
        self.pass(Duration::from_secs(3));
        self.finish().1
    }

    /// Stops every guard with SIGTERM, checks nothing of theirs is left, and judges the history:
    /// the summary, and the violations found.
    fn finish(mut self) -> (Summary, Vec<String>) {
        for slot in &mut self.slots {
            if let Some(guard) = &mut slot.guard {
                signal(guard.pid(), Signal::SIGTERM);
                let status = guard.wait(Duration::from_secs(20));
                *self.exits.entry(describe_exit(status)).or_default() += 1;
            }
            slot.guard = None;
        }
        let mut stray = Vec::new();
        let gone = wait_until(Duration::from_secs(5), || {
            stray = survivors(self.lab.dir.path());
            stray.is_empty()
        });
        assert!(
            gone,
            "seed {}: processes outlived their guards: {stray:?}",
            self.seed
        );
        let history = fs::read_to_string(&self.history).unwrap();
        let report = checker::check(&history);
        let summary = Summary {
            backend: self.backend.name(),
            seed: self.seed,
            seconds: seconds(),
            rounds: self.rounds,
            apps: report.apps,
            worst_takeover: Duration::from_nanos(report.worst_takeover_ns),
            overlaps: report.violations.len(),
            faults: std::mem::take(&mut self.faults),
            exits: std::mem::take(&mut self.exits),
        };
        eprintln!("{}", summary.line());
        (summary, report.violations)
    }
}

impl Drop for Nemesis {
    /// On a panic too: every guard is thawed, continued, killed and reaped (a frozen or stopped one
    /// could not be), then whatever of their trees is left is killed.
    fn drop(&mut self) {
        for slot in &mut self.slots {
            let _ = fs::write(slot.freezer.dir().join("freezer.state"), "THAWED");
            if let Some(guard) = slot.guard.take() {
                signal(guard.pid(), Signal::SIGCONT);
                drop(guard);
            }
        }
        let dir = self.lab.dir.path().to_owned();
        wait_until(Duration::from_secs(5), || {
            let left = survivors(&dir);
            for pid in &left {
                signal(*pid, Signal::SIGKILL);
            }
            left.is_empty()
        });
    }
}

/// What a run did: the counts a report shows.
pub struct Summary {
    pub backend: &'static str,
    pub seed: u64,
    pub seconds: u64,
    pub rounds: usize,
    pub apps: usize,
    pub worst_takeover: Duration,
    pub overlaps: usize,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, usize>,
    /// How the guards ended, by exit code or signal.
    pub exits: BTreeMap<String, usize>,
}

impl Summary {
    pub fn line(&self) -> String {
        let counts = |map: &BTreeMap<String, usize>| {
            map.iter()
                .map(|(k, n)| format!("{k}={n}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        format!(
            "nemesis backend={} seed={} seconds={} rounds={} apps={} worst_takeover={}ms overlaps={} faults: {} guard exits: {}",
            self.backend,
            self.seed,
            self.seconds,
            self.rounds,
            self.apps,
            self.worst_takeover.as_millis(),
            self.overlaps,
            counts(&self.faults),
            counts(&self.exits),
        )
    }
}

/// Reads a history and nothing else: it knows the line format, not the guard.
///
/// An app's life runs from its `start` to its `stop`, or, for one killed without a word, to the
/// last line it wrote (it may have lived a little longer: the witness lock, whose `overlap` line is
/// in the history, covers that tail exactly).
pub mod checker {
    use std::collections::HashMap;

    pub struct Report {
        pub apps: usize,
        pub violations: Vec<String>,
        /// The longest time from one app's last sign of life to the next app's start.
        pub worst_takeover_ns: u64,
    }

    struct Life {
        name: String,
        token: String,
        start: Option<u64>,
        last: u64,
        overlap: bool,
    }

    /// Whether an app beat after `after`. Lines are appended in about the order of their stamps,
    /// so the search stops a second before `after`.
    pub fn beat_after(history: &str, after: u64) -> bool {
        for line in history.lines().rev() {
            let mut words = line.split_whitespace();
            let Some(stamp) = words.next().and_then(|s| s.parse::<u64>().ok()) else {
                continue;
            };
            if stamp > after && words.next() == Some("app") && line.ends_with(" beat") {
                return true;
            }
            if stamp + 1_000_000_000 < after {
                return false;
            }
        }
        false
    }

    fn ms(ns: u64) -> String {
        format!("{}.{:03}s", ns / 1_000_000_000, ns / 1_000_000 % 1000)
    }

    /// The history from 5s before `at` to 1s after it (beats left out but the last one of each app),
    /// at most its last 80 lines: what led to a violation at `at`.
    fn window(history: &str, at: u64) -> String {
        let (from, to) = (at.saturating_sub(5_000_000_000), at + 1_000_000_000);
        let mut last_beat: HashMap<&str, &str> = HashMap::new();
        let mut shown = Vec::new();
        for line in history.lines() {
            let mut words = line.split_whitespace();
            let Some(stamp) = words.next().and_then(|s| s.parse::<u64>().ok()) else {
                continue;
            };
            if stamp < from || stamp > to {
                continue;
            }
            if line.ends_with(" beat") {
                last_beat.insert(line.split_whitespace().nth(2).unwrap_or(""), line);
            } else {
                shown.push(line);
            }
        }
        shown.extend(last_beat.values());
        shown.sort_by_key(|l| {
            l.split_whitespace()
                .next()
                .and_then(|s| s.parse::<u64>().ok())
        });
        let keep = shown.len().saturating_sub(80);
        shown.split_off(keep).join("\n")
    }

    pub fn check(history: &str) -> Report {
        let mut lives: Vec<Life> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut violations = Vec::new();
        for line in history.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let Some(stamp) = words.first().and_then(|s| s.parse::<u64>().ok()) else {
                violations.push(format!("unreadable line {line:?}"));
                continue;
            };
            if words.get(1) == Some(&"nemesis") {
                continue;
            }
            let [_, "app", name, token, what] = words[..] else {
                violations.push(format!("unreadable line {line:?}"));
                continue;
            };
            let i = *index.entry(name.to_owned()).or_insert_with(|| {
                lives.push(Life {
                    name: name.to_owned(),
                    token: token.to_owned(),
                    start: None,
                    last: stamp,
                    overlap: false,
                });
                lives.len() - 1
            });
            let life = &mut lives[i];
            life.last = life.last.max(stamp);
            match what {
                "start" if life.start.is_some() => {
                    violations.push(format!("app {name} started twice"));
                }
                "start" => life.start = Some(stamp),
                "overlap" => life.overlap = true,
                "beat" | "stop" => {}
                _ => violations.push(format!("unreadable line {line:?}")),
            }
        }
        for life in lives.iter().filter(|l| l.start.is_none()) {
            violations.push(format!("app {} wrote without a start", life.name));
        }
        lives.retain(|l| l.start.is_some());
        lives.sort_by_key(|l| l.start);
        let mut worst_takeover_ns = 0;
        // The life that ends last among those started before: any later start before its end
        // overlaps it.
        let mut latest: Option<&Life> = None;
        let mut last_token: Option<(u64, &Life)> = None;
        for life in &lives {
            let start = life.start.unwrap();
            if life.overlap {
                violations.push(format!(
                    "app {} started while a process of an earlier app's tree still held the witness lock\n{}",
                    life.name,
                    window(history, start)
                ));
            }
            if let Some(before) = latest {
                if start <= before.last {
                    violations.push(format!(
                        "app {} started at {} while app {} lived until {} ({} of overlap)\n{}",
                        life.name,
                        ms(start),
                        before.name,
                        ms(before.last),
                        ms(before.last - start),
                        window(history, start)
                    ));
                } else {
                    worst_takeover_ns = worst_takeover_ns.max(start - before.last);
                }
            }
            match life.token.parse::<u64>() {
                Err(_) => violations.push(format!("app {} got no fencing token", life.name)),
                Ok(token) => {
                    if let Some((previous, by)) = last_token {
                        if token <= previous {
                            violations.push(format!(
                                "app {} got fencing token {token}, not above app {}'s {previous}\n{}",
                                life.name,
                                by.name,
                                window(history, start)
                            ));
                        }
                    }
                    last_token = Some((token, life));
                }
            }
            if latest.is_none_or(|l| life.last > l.last) {
                latest = Some(life);
            }
        }
        Report {
            apps: lives.len(),
            violations,
            worst_takeover_ns,
        }
    }
}
