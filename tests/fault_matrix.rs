//! The no-overlap proof: every fault, on every backend it applies to, for several rounds.
//!
//! Each round runs a leader and a `--wait` standby with default flags, both running an app that records
//! its start and stop in a shared trace and takes 500ms to stop. Then it injects one fault, measures
//! how long until the leader's app is dead (detect) and until the standby's app starts (takeover),
//! heals the fault, stops everything and checks: no two app lifetimes overlap, no app or guard
//! process outlives the round. Each test is one cell of the table in docs/guarantees.md (one fault on
//! one backend, `<fault>::<backend>`): it prints the cell and writes it to
//! `target/tmp/fault-matrix/<fault>/<backend>.md`. `SENTINEL_MATRIX_ROUNDS` sets the rounds (default 2).

mod common;

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::freeze::Freezer;
use common::mariadb::MariaDb;
use common::postgres::Postgres;
use common::proxy::Proxy;
use common::redis::Redis;
use common::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Mysql,
    Postgres,
    Redis,
    File,
    Etcd,
}

impl Kind {
    fn start(self) -> Backend {
        match self {
            Kind::Mysql => Backend::Mysql(MariaDb::start()),
            Kind::Postgres => Backend::Postgres(Postgres::start()),
            Kind::Redis => Backend::Redis(Redis::start()),
            Kind::File => Backend::File(Lab::new()),
            Kind::Etcd => Backend::Etcd(Etcd::cluster(3)),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    GuardKill,
    GuardFreeze,
    /// The guard, its app and its watchdog frozen together (the cgroup freezer, as `docker pause`),
    /// thawed once the standby holds the lock.
    TreeFreeze,
    ServerKill,
    ServerFreeze,
    ServerRestart,
    /// Redis restarted from a snapshot taken before the leader's lease, which holds an earlier
    /// holder's clean release.
    StaleSnapshot,
    ConnectionKill,
    ClientKill,
    KeyDelete,
    KeyOverwrite,
    LockFileDelete,
    LockFileReplace,
    Partition,
    /// A check's answer passed on as late as it still counts, then silence (issue 26, item 3).
    LateAnswer,
}

/// What a fault must lead to.
struct Expect {
    leader_stops: bool,
    standby_takes_over: bool,
}

fn port_of(backend: &Backend) -> u16 {
    match backend {
        Backend::Mysql(db) => db.port,
        Backend::Postgres(db) => db.port,
        Backend::Redis(redis) => redis.port,
        Backend::Etcd(etcd) => etcd.client_port(0),
        Backend::Sentinel(_) | Backend::File(_) => unreachable!("no server in the matrix"),
    }
}

fn url_via(backend: &Backend, port: u16) -> String {
    match backend {
        Backend::Mysql(db) => db.url_with_port(port),
        Backend::Postgres(db) => db.url_with_port(port),
        Backend::Redis(_) => format!("redis://127.0.0.1:{port}"),
        Backend::Etcd(_) => format!("etcd://127.0.0.1:{port}"),
        Backend::Sentinel(_) | Backend::File(_) => unreachable!("no server in the matrix"),
    }
}

/// Sends `signal` to every process of the server (PostgreSQL runs one per session).
fn signal_server(backend: &Backend, signal: i32) {
    match backend {
        Backend::Mysql(db) => send(db.pid(), signal),
        Backend::Postgres(db) => db.signal_all(signal),
        Backend::Redis(redis) => send(redis.pid(), signal),
        Backend::Etcd(etcd) => etcd.signal_all(signal),
        Backend::Sentinel(_) | Backend::File(_) => unreachable!("no server in the matrix"),
    }
}

/// An app that records `start`/`stop` like `recording_app`, but takes 500ms to stop: without the
/// takeover delay, a standby that starts the moment the server frees the lock would overlap it.
/// Every process of its tree holds `witness` locked (`flock` on an inherited descriptor), which the
/// kernel frees only when the last of them is dead: an app that finds it held records `overlap`.
/// That is the proof for a SIGKILLed app, which can record no stop of its own.
fn slow_stopping_app(trace: &Path, pidfile: &Path) -> Vec<String> {
    let script = format!(
        "exec 9>>{w}; flock -n -x 9 || echo overlap $$ >> {t}; \
         trap 'sleep 0.5; echo stop $$ >> {t}; exit 0' TERM; echo start $$ >> {t}; \
         echo $$ > {p}.tmp && mv {p}.tmp {p}; while :; do sleep 0.05; done",
        w = trace.with_extension("witness").display(),
        t = trace.display(),
        p = pidfile.display()
    );
    vec!["sh".into(), "-c".into(), script]
}

struct Measured {
    detect: Option<Duration>,
    takeover: Option<Duration>,
}

fn round(kind: Kind, fault: Fault, expect: &Expect) -> Measured {
    let mut backend = kind.start();
    let proxy = matches!(fault, Fault::Partition | Fault::LateAnswer)
        .then(|| Proxy::start(port_of(&backend)));
    let direct = backend.url();
    let leader_url = proxy
        .as_ref()
        .map_or(direct.clone(), |p| url_via(&backend, p.port));
    let mut lab = Lab::with_default_takeover();
    let trace = lab.path("trace");
    let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
    let args = |url: &str, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["--url", url, "--name", "matrix"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(backend.fast_args().iter().map(|s| s.to_string()));
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let leader_args = args(&leader_url, &[]);
    // The default takeover setting (`auto`): the record decides whether the standby waits.
    let standby_args = args(&direct, &[]);
    let cgroup = (fault == Fault::TreeFreeze).then(Freezer::create);
    if fault == Fault::StaleSnapshot {
        let Backend::Redis(redis) = &backend else {
            unreachable!()
        };
        let mut earlier = lab.spawn(&as_strs(&leader_args), &["true"]);
        assert_eq!(
            earlier.code(Duration::from_secs(10)),
            0,
            "{}",
            earlier.log_text()
        );
        redis.cli(&["SAVE"]);
    }
    let leader_cmd = lab.command(
        &as_strs(&leader_args),
        &as_strs(&slow_stopping_app(&trace, &lead_pid)),
    );
    let mut leader = lab.start(match &cgroup {
        Some(cgroup) => cgroup.command(&leader_cmd),
        None => leader_cmd,
    });
    // Declared after the leader so it is dropped first: a frozen guard could not be waited for.
    let cgroup = cgroup;
    // A fresh lock has no record, so the leader first waits its own bound (5.8s on MySQL and
    // PostgreSQL with these timings), and a loaded machine adds to it.
    let lead_app = read_pid(&lead_pid, Duration::from_secs(30));
    let mut standby = waiting_standby(
        &mut lab,
        &as_strs(&standby_args),
        &as_strs(&slow_stopping_app(&trace, &standby_pid)),
    );

    let faulted = Instant::now();
    match fault {
        Fault::GuardKill => leader.signal(9),
        Fault::GuardFreeze => leader.signal(19),
        Fault::TreeFreeze => cgroup.as_ref().unwrap().freeze(),
        Fault::ServerKill => match &mut backend {
            Backend::Mysql(db) => db.kill9(),
            Backend::Postgres(db) => db.kill9(),
            Backend::Redis(redis) => redis.kill9(),
            Backend::Etcd(_) | Backend::Sentinel(_) | Backend::File(_) => unreachable!(),
        },
        Fault::ServerFreeze => signal_server(&backend, 19),
        Fault::ServerRestart | Fault::StaleSnapshot => match &mut backend {
            Backend::Mysql(db) => db.restart(),
            Backend::Postgres(db) => db.restart(),
            Backend::Redis(redis) => redis.restart(),
            Backend::Etcd(_) | Backend::Sentinel(_) | Backend::File(_) => unreachable!(),
        },
        Fault::ConnectionKill => match &backend {
            Backend::Mysql(db) => {
                db.sql(&format!("KILL {}", db.holder_of("matrix").expect("held")));
            }
            Backend::Postgres(db) => {
                let pid = db.holder_of("matrix").expect("held");
                db.sql(&format!("SELECT pg_terminate_backend({pid})"));
            }
            _ => unreachable!(),
        },
        Fault::ClientKill => {
            let Backend::Redis(redis) = &backend else {
                unreachable!()
            };
            redis.cli(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
        }
        Fault::KeyDelete if kind == Kind::Etcd => {
            let Backend::Etcd(etcd) = &backend else {
                unreachable!()
            };
            let mut del = etcd.ctl();
            del.args(["del", "sentinel-guard/lock/matrix"]);
            must_run(del, "etcdctl del");
        }
        Fault::KeyDelete | Fault::KeyOverwrite => {
            let Backend::Redis(redis) = &backend else {
                unreachable!()
            };
            if fault == Fault::KeyDelete {
                redis.cli(&["DEL", "sentinel-guard:{matrix}"]);
            } else {
                redis.cli(&["SET", "sentinel-guard:{matrix}", "intruder"]);
            }
        }
        Fault::LockFileDelete | Fault::LockFileReplace => {
            let Backend::File(files) = &backend else {
                unreachable!()
            };
            let lock = files.path("backend.lock");
            fs::remove_file(&lock).unwrap();
            if fault == Fault::LockFileReplace {
                fs::write(&lock, "").unwrap();
            }
        }
        Fault::Partition => proxy.as_ref().unwrap().partition(),
        // The check's budget is check-interval 200ms + check-timeout 800ms, and the server answers
        // a check 200ms after the question: 700ms late, it arrives 900ms after it.
        Fault::LateAnswer => proxy
            .as_ref()
            .unwrap()
            .late_answer_then_silence(Duration::from_millis(700)),
    }

    let limit = Duration::from_secs(20);
    // A frozen tree stays frozen until the backend has given the lock to the standby (which then
    // holds it through its takeover delay); detection is measured from the thaw.
    let detect_from = if fault == Fault::TreeFreeze {
        assert!(
            wait_until(Duration::from_secs(40), || standby
                .log_text()
                .contains("event=\"takeover_delayed\"")),
            "{kind:?}: the standby never took the frozen leader's lock: {}",
            standby.log_text()
        );
        cgroup.as_ref().unwrap().thaw();
        Instant::now()
    } else {
        faulted
    };
    let detect = wait_until(limit, || !alive(lead_app)).then(|| detect_from.elapsed());
    // A SIGKILLed app records no stop. Its death is seen here by polling, which may come after the
    // standby's start; the witness lock is the exact check instead (see `slow_stopping_app`), so its
    // stand-in stop goes right after its start.
    // The trace is completed only once every app of the round is gone (below): the apps append to
    // it meanwhile.
    let sigkilled = detect.is_some() && !trace_lines(&trace).contains(&format!("stop {lead_app}"));
    assert_eq!(
        detect.is_some(),
        expect.leader_stops,
        "{kind:?} {fault:?}: leader app stopped? log:\n{}",
        leader.log_text()
    );
    // Heal what can be healed, so the standby can show whether it takes over.
    match fault {
        Fault::ServerFreeze => signal_server(&backend, 18),
        Fault::ServerKill => match &mut backend {
            Backend::Mysql(db) => db.restart(),
            Backend::Postgres(db) => db.restart(),
            Backend::Redis(redis) => redis.restart(),
            Backend::Etcd(_) | Backend::Sentinel(_) | Backend::File(_) => unreachable!(),
        },
        _ => {}
    }
    let takeover_limit = if expect.standby_takes_over {
        Duration::from_secs(40)
    } else {
        Duration::from_secs(4)
    };
    let takeover = wait_until(takeover_limit, || standby_pid.exists()).then(|| faulted.elapsed());
    assert_eq!(
        takeover.is_some(),
        expect.standby_takes_over,
        "{kind:?} {fault:?}: standby took over? log:\n{}",
        standby.log_text()
    );
    if fault == Fault::GuardFreeze || fault == Fault::TreeFreeze {
        leader.signal(18);
        assert_eq!(
            leader.code(Duration::from_secs(10)),
            75,
            "{kind:?}: resumed guard: {}",
            leader.log_text()
        );
    }

    for guard in [&mut leader, &mut standby] {
        if guard.child.try_wait().unwrap().is_none() {
            guard.signal(15);
            guard.wait(Duration::from_secs(10));
        }
    }
    let overlaps: Vec<_> = trace_lines(&trace)
        .into_iter()
        .filter(|line| line.starts_with("overlap "))
        .collect();
    assert!(
        overlaps.is_empty(),
        "{kind:?} {fault:?}: an app started while a process of the previous app's tree was alive: {overlaps:?}"
    );
    let checked = if sigkilled {
        let mut with_stop = Vec::new();
        for line in trace_lines(&trace) {
            let started = line == format!("start {lead_app}");
            with_stop.push(line);
            if started {
                with_stop.push(format!("stop {lead_app}"));
            }
        }
        let checked = trace.with_extension("checked");
        fs::write(&checked, with_stop.join("\n") + "\n").unwrap();
        checked
    } else {
        trace.clone()
    };
    assert_no_overlap(&checked);
    let stray = survivors(lab.dir.path());
    assert!(
        stray.is_empty(),
        "{kind:?} {fault:?}: processes outlived their guards: {stray:?}"
    );
    Measured { detect, takeover }
}

fn rounds() -> usize {
    std::env::var("SENTINEL_MATRIX_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(2)
}

fn show(samples: &[Option<Duration>]) -> String {
    let mut values: Vec<Duration> = samples.iter().flatten().copied().collect();
    if values.is_empty() {
        return "-".to_owned();
    }
    values.sort();
    let median = values[values.len() / 2];
    let max = values[values.len() - 1];
    format!("{} (max {})", ms(median), ms(max))
}

fn ms(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

/// Runs the rounds of `fault` on one backend and records the cell of its row,
/// `overlaps/orphans, detect, takeover`.
fn cell(fault: Fault, label: &str, kind: Kind, expect: Expect) {
    let measured: Vec<Measured> = (0..rounds()).map(|_| round(kind, fault, &expect)).collect();
    let detect: Vec<_> = measured.iter().map(|m| m.detect).collect();
    let takeover: Vec<_> = measured.iter().map(|m| m.takeover).collect();
    let line = format!(
        "| {label} | {kind:?} | 0 / 0; detect {}; takeover {} |",
        show(&detect),
        show(&takeover)
    );
    eprintln!("{line}");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("fault-matrix")
        .join(format!("{fault:?}"));
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(format!("{kind:?}.md")), format!("{line}\n")).unwrap();
}

/// A row of the matrix: a module named after the fault with one test per backend it applies to
/// (`<fault>::<backend>`), so the test runner spreads a row's cells over its threads.
macro_rules! row {
    ($row:ident, $fault:expr, $label:expr, [$($test:ident: $kind:ident => $expect:expr),+ $(,)?]) => {
        mod $row {
            use super::*;
            $(
                #[test]
                fn $test() {
                    cell($fault, $label, Kind::$kind, $expect);
                }
            )+
        }
    };
}

const STOPS_AND_HANDS_OVER: Expect = Expect {
    leader_stops: true,
    standby_takes_over: true,
};

row!(
    guard_sigkill,
    Fault::GuardKill,
    "guard SIGKILL",
    [
        mysql: Mysql => STOPS_AND_HANDS_OVER,
        postgres: Postgres => STOPS_AND_HANDS_OVER,
        redis: Redis => STOPS_AND_HANDS_OVER,
        file: File => STOPS_AND_HANDS_OVER,
        etcd: Etcd => STOPS_AND_HANDS_OVER,
    ]
);

// A frozen guard keeps its flock: no one else can take it, so the app may go on.
row!(
    guard_frozen,
    Fault::GuardFreeze,
    "guard SIGSTOP",
    [
        mysql: Mysql => STOPS_AND_HANDS_OVER,
        postgres: Postgres => STOPS_AND_HANDS_OVER,
        redis: Redis => STOPS_AND_HANDS_OVER,
        etcd: Etcd => STOPS_AND_HANDS_OVER,
    ]
);

// Thawed once the standby holds the lock: the old app must die at once (no grace period), before
// the standby's takeover delay ends. A frozen flock is never granted elsewhere: n/a for files.
row!(
    whole_tree_frozen,
    Fault::TreeFreeze,
    "whole tree frozen (cgroup freezer) past the lock's life; detect counted from the thaw",
    [
        mysql: Mysql => STOPS_AND_HANDS_OVER,
        postgres: Postgres => STOPS_AND_HANDS_OVER,
        redis: Redis => STOPS_AND_HANDS_OVER,
        etcd: Etcd => STOPS_AND_HANDS_OVER,
    ]
);

row!(
    server_sigkill_then_restart,
    Fault::ServerKill,
    "server SIGKILL, restarted",
    [
        mysql: Mysql => STOPS_AND_HANDS_OVER,
        postgres: Postgres => STOPS_AND_HANDS_OVER,
        redis: Redis => STOPS_AND_HANDS_OVER,
    ]
);

row!(
    server_frozen_then_resumed,
    Fault::ServerFreeze,
    "server SIGSTOP, resumed",
    [
        mysql: Mysql => STOPS_AND_HANDS_OVER,
        postgres: Postgres => STOPS_AND_HANDS_OVER,
        redis: Redis => STOPS_AND_HANDS_OVER,
        etcd: Etcd => STOPS_AND_HANDS_OVER,
    ]
);

row!(
    server_restart,
    Fault::ServerRestart,
    "server restart (Redis: empty)",
    [
        mysql: Mysql => STOPS_AND_HANDS_OVER,
        postgres: Postgres => STOPS_AND_HANDS_OVER,
        redis: Redis => STOPS_AND_HANDS_OVER,
    ]
);

// The snapshot's release marker is an earlier holder's: it must not let the standby start while
// the leader's app still stops.
row!(
    redis_restarted_from_a_stale_snapshot,
    Fault::StaleSnapshot,
    "Redis restarted from an older snapshot (an earlier clean release in it)",
    [
        redis: Redis => STOPS_AND_HANDS_OVER,
    ]
);

row!(
    connection_killed,
    Fault::ConnectionKill,
    "`KILL <conn>` / `pg_terminate_backend`",
    [
        mysql: Mysql => STOPS_AND_HANDS_OVER,
        postgres: Postgres => STOPS_AND_HANDS_OVER,
    ]
);

// A dropped connection is not a lost lease: the leader reconnects and keeps it.
row!(
    client_kill,
    Fault::ClientKill,
    "`CLIENT KILL` of the guard's connection",
    [
        redis: Redis => Expect { leader_stops: false, standby_takes_over: false, },
    ]
);

row!(
    key_deleted,
    Fault::KeyDelete,
    "key `DEL` (etcd: `etcdctl del`)",
    [
        redis: Redis => STOPS_AND_HANDS_OVER,
        etcd: Etcd => STOPS_AND_HANDS_OVER,
    ]
);

// The intruder's key never expires: the leader stops, and no guard may take over.
row!(
    key_overwritten,
    Fault::KeyOverwrite,
    "key overwritten",
    [
        redis: Redis => Expect { leader_stops: true, standby_takes_over: false, },
    ]
);

row!(
    lock_file_deleted,
    Fault::LockFileDelete,
    "lock file deleted",
    [
        file: File => STOPS_AND_HANDS_OVER,
    ]
);

row!(
    lock_file_replaced,
    Fault::LockFileReplace,
    "lock file replaced",
    [
        file: File => STOPS_AND_HANDS_OVER,
    ]
);

row!(
    network_partition,
    Fault::Partition,
    "network partition",
    [
        mysql: Mysql => STOPS_AND_HANDS_OVER,
        postgres: Postgres => STOPS_AND_HANDS_OVER,
        redis: Redis => STOPS_AND_HANDS_OVER,
        etcd: Etcd => STOPS_AND_HANDS_OVER,
    ]
);

row!(
    late_answer_then_silence,
    Fault::LateAnswer,
    "a check's answer 700ms late (within its budget), then silence",
    [
        mysql: Mysql => STOPS_AND_HANDS_OVER,
        postgres: Postgres => STOPS_AND_HANDS_OVER,
    ]
);
