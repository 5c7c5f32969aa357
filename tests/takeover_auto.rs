//! `--takeover-delay auto`: when the backend takes the lock away (a DBA's KILL, a terminated
//! backend, a deleted key or lock file), a standby waits the bound the old holder recorded, so the
//! old app, which takes its time to stop, is dead before the new one starts; after a clean release
//! the lock record says so and the standby starts at once.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

const NAME: &str = "auto";

/// Records `start`, then on SIGTERM takes 0.7s to stop (within every fast grace period) before it records `stop`.
fn slow_app(trace: &Path, pidfile: &Path) -> Vec<String> {
    let script = format!(
        "trap 'sleep 0.7; echo stop $$ >> {trace}; exit 0' TERM; echo start $$ >> {trace}; \
         echo $$ > {pid}.tmp && mv {pid}.tmp {pid}; while :; do sleep 0.05; done",
        pid = pidfile.display(),
        trace = trace.display()
    );
    vec!["sh".into(), "-c".into(), script]
}

fn take_away(backend: &Backend) {
    match backend {
        Backend::Mysql(db) => {
            let id = db.holder_of(NAME).expect("the leader holds the lock");
            db.sql(&format!("KILL {id}"));
        }
        Backend::Postgres(db) => {
            let pid = db.holder_of(NAME).expect("the leader holds the lock");
            db.sql(&format!("SELECT pg_terminate_backend({pid})"));
        }
        Backend::Redis(redis) => {
            redis.cli(&["DEL", &format!("sentinel-guard:{{{NAME}}}")]);
        }
        Backend::File(_) => {
            let url = backend.url();
            fs::remove_file(url.trim_start_matches("file://")).unwrap();
        }
    }
}

fn args<'a>(backend: &Backend, url: &'a str) -> Vec<&'a str> {
    let mut args = vec!["--url", url, "--name", NAME, "--takeover-delay", "auto"];
    args.extend(backend.fast_args());
    args
}

/// A leader whose slow app runs, and a `--wait` standby behind it: (leader, standby, the shared
/// trace, the standby app's pid file).
fn leader_and_standby(
    lab: &mut Lab,
    args: &[&str],
) -> (GuardProcess, GuardProcess, PathBuf, PathBuf) {
    let trace = lab.path("trace");
    let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
    let leader = lab.spawn(args, &as_strs(&slow_app(&trace, &lead_pid)));
    read_pid(&lead_pid, Duration::from_secs(20));
    let standby = waiting_standby(lab, args, &as_strs(&slow_app(&trace, &standby_pid)));
    (leader, standby, trace, standby_pid)
}

#[test]
fn a_lock_taken_away_never_runs_two_apps_and_a_clean_release_hands_over_at_once() {
    for backend in Backend::all() {
        if let Backend::Postgres(db) = &backend {
            // PostgreSQL 15 and later give an ordinary role no CREATE in `public`: the table is made
            // by an administrator, as the guard's warning says (`lock_record_unavailable`).
            db.sql(
                "CREATE TABLE sentinel_guard_locks (name varchar(64) PRIMARY KEY, fence bigint NOT NULL, \
                 holder varchar(64) NOT NULL, state varchar(16) NOT NULL, bound_ms bigint NOT NULL, \
                 updated_at timestamptz NOT NULL); GRANT SELECT, INSERT, UPDATE ON sentinel_guard_locks TO guard",
            );
        }
        let mut lab = Lab::new();
        let url = backend.url();
        let args = args(&backend, &url);
        let (mut leader, mut standby, trace, standby_pid) = leader_and_standby(&mut lab, &args);

        take_away(&backend);
        assert_eq!(
            leader.code(Duration::from_secs(20)),
            75,
            "{}: {}",
            backend.name(),
            leader.log_text()
        );
        read_pid(&standby_pid, Duration::from_secs(30));
        assert_eq!(assert_no_overlap(&trace), 2, "{}", backend.name());
        let log = standby.log_text();
        assert!(
            log.contains("event=\"takeover_delayed\""),
            "{}: {log}",
            backend.name()
        );

        // The standby now leads; a third guard waits behind it and takes over at once after its
        // clean release.
        let third_pid = lab.path("third");
        let mut third = waiting_standby(&mut lab, &args, &as_strs(&slow_app(&trace, &third_pid)));
        let asked = Instant::now();
        standby.signal(15);
        assert_eq!(
            standby.code(Duration::from_secs(20)),
            0,
            "{}",
            backend.name()
        );
        read_pid(&third_pid, Duration::from_secs(20));
        assert!(
            asked.elapsed() < Duration::from_secs(3),
            "{}: the clean hand-over took {:?}: {}",
            backend.name(),
            asked.elapsed(),
            third.log_text()
        );
        assert!(
            third
                .log_text()
                .contains("event=\"takeover_delay_skipped\" reason=released"),
            "{}: {}",
            backend.name(),
            third.log_text()
        );
        assert_eq!(assert_no_overlap(&trace), 3, "{}", backend.name());
        third.signal(15);
        assert_eq!(third.code(Duration::from_secs(20)), 0);
    }
}

#[test]
fn without_a_lock_record_every_acquisition_waits_and_says_so_once() {
    // PostgreSQL's ordinary role may not create the table: the fallback.
    let backend = Backend::Postgres(common::postgres::Postgres::start());
    let mut lab = Lab::new();
    let url = backend.url();
    let args = args(&backend, &url);
    let (mut leader, mut standby, trace, standby_pid) = leader_and_standby(&mut lab, &args);
    leader.signal(15);
    assert_eq!(leader.code(Duration::from_secs(20)), 0);
    read_pid(&standby_pid, Duration::from_secs(20));
    assert_eq!(assert_no_overlap(&trace), 2);
    let log = standby.log_text();
    assert_eq!(
        log.matches("event=\"lock_record_unavailable\"").count(),
        1,
        "{log}"
    );
    assert!(
        log.contains("event=\"takeover_delayed\" reason=no_record"),
        "{log}"
    );
    standby.signal(15);
    assert_eq!(standby.code(Duration::from_secs(20)), 0);
}
