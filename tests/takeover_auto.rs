//! `--takeover-delay auto`, the default: when the backend takes the lock away (a DBA's KILL, a
//! terminated backend, a deleted key or lock file), a standby waits the bound the old holder
//! recorded, so the old app, which takes its time to stop, is dead before the new one starts; after
//! a clean release the lock record says so and the standby starts at once. Fencing tokens grow over
//! every acquisition, and a counter set back by hand stops the guard with exit 69.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

const NAME: &str = "auto";

/// Records `start` (and its fencing token beside the trace), then on SIGTERM takes 0.7s to stop
/// (within every fast grace period) before it records `stop`.
fn slow_app(trace: &Path, pidfile: &Path) -> Vec<String> {
    let script = format!(
        "trap 'sleep 0.7; echo stop $$ >> {trace}; exit 0' TERM; echo start $$ >> {trace}; \
         echo $SENTINEL_GUARD_FENCING_TOKEN >> {tokens}; \
         echo $$ > {pid}.tmp && mv {pid}.tmp {pid}; while :; do sleep 0.05; done",
        pid = pidfile.display(),
        trace = trace.display(),
        tokens = tokens_of(trace).display(),
    );
    vec!["sh".into(), "-c".into(), script]
}

/// Where the apps of a trace write their fencing tokens.
fn tokens_of(trace: &Path) -> PathBuf {
    trace.with_extension("tokens")
}

/// The tokens the apps were given, in order; each a number.
fn tokens(trace: &Path) -> Vec<u64> {
    fs::read_to_string(tokens_of(trace))
        .unwrap_or_default()
        .lines()
        .map(|line| line.parse().unwrap_or_else(|_| panic!("token {line:?}")))
        .collect()
}

fn assert_growing(tokens: &[u64], backend: &Backend) {
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "{}: fencing tokens {tokens:?}",
        backend.name()
    );
}

fn take_away(backend: &Backend) {
    take_away_at(backend, &backend.url());
}

/// Takes the lock of the guard at `url` away.
fn take_away_at(backend: &Backend, url: &str) {
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
            fs::remove_file(url.trim_start_matches("file://")).unwrap();
        }
        Backend::Etcd(_) | Backend::Sentinel(_) => unreachable!("not in Backend::all()"),
    }
}

/// Default takeover settings: no `--takeover-delay`.
fn args<'a>(backend: &Backend, url: &'a str) -> Vec<&'a str> {
    let mut args = vec!["--url", url, "--name", NAME];
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
        let mut lab = Lab::with_default_takeover();
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
        // The guard's log is written off the path to the app's start: the line may follow the app.
        assert!(
            wait_until(Duration::from_secs(5), || third
                .log_text()
                .contains("event=\"takeover_delay_skipped\" reason=released")),
            "{}: {}",
            backend.name(),
            third.log_text()
        );
        assert_eq!(assert_no_overlap(&trace), 3, "{}", backend.name());
        third.signal(15);
        assert_eq!(third.code(Duration::from_secs(20)), 0);
        let given = tokens(&trace);
        assert_eq!(given.len(), 3, "{}: {given:?}", backend.name());
        assert_growing(&given, &backend);
    }
}

#[test]
fn without_a_lock_record_every_acquisition_waits_and_says_so_once() {
    // A PostgreSQL role without CREATE in `public` (PostgreSQL 15's default); a MySQL account with
    // every grant on its database but CREATE.
    let mysql = common::mariadb::MariaDb::start();
    mysql.sql(
        "CREATE DATABASE app; CREATE USER 'nocreate'@'%' IDENTIFIED BY 'nocreate-pw'; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON app.* TO 'nocreate'@'%'",
    );
    let mysql_url = format!("mysql://nocreate:nocreate-pw@127.0.0.1:{}/app", mysql.port);
    let postgres = common::postgres::Postgres::start();
    postgres.sql("REVOKE CREATE ON SCHEMA public FROM guard");
    let postgres = Backend::Postgres(postgres);
    let postgres_url = postgres.url();
    let mysql = Backend::Mysql(mysql);
    for (backend, url) in [(&postgres, &postgres_url), (&mysql, &mysql_url)] {
        let mut lab = Lab::with_default_takeover();
        let args = args(backend, url);
        let (mut leader, mut standby, trace, standby_pid) = leader_and_standby(&mut lab, &args);
        take_away_at(backend, url);
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
        assert_eq!(
            log.matches("event=\"lock_record_unavailable\"").count(),
            1,
            "{}: {log}",
            backend.name()
        );
        assert!(
            log.contains("event=\"takeover_delayed\" reason=no_record"),
            "{}: {log}",
            backend.name()
        );
        standby.signal(15);
        assert_eq!(standby.code(Duration::from_secs(20)), 0);
        // Without a record the token is the server's clock: it still grows.
        assert_growing(&tokens(&trace), backend);
    }
}

/// Sets the lock's fencing counter back to 5, as a restore from an old backup would.
fn set_back(backend: &Backend) {
    match backend {
        Backend::Mysql(db) => {
            db.sql(&format!(
                "UPDATE mysql.sentinel_guard_locks SET fence = 5 WHERE name = '{NAME}'"
            ));
        }
        Backend::Postgres(db) => {
            db.sql(&format!(
                "UPDATE sentinel_guard_locks SET fence = 5 WHERE name = '{NAME}'"
            ));
        }
        Backend::Redis(redis) => {
            redis.cli(&["SET", &format!("sentinel-guard:{{{NAME}}}:fence"), "5"]);
        }
        Backend::File(_) => {
            let path = backend.url();
            let path = path.trim_start_matches("file://");
            let text = fs::read_to_string(path).unwrap();
            let start = text.find(" fence=").expect("a lock line") + " fence=".len();
            let end = start + text[start..].find(' ').unwrap();
            fs::write(path, format!("{}5{}", &text[..start], &text[end..])).unwrap();
        }
        Backend::Etcd(_) | Backend::Sentinel(_) => unreachable!("not in Backend::all()"),
    }
}

/// Deletes the lock's record, as the set-back error says to.
fn delete_record(backend: &Backend) {
    match backend {
        Backend::Mysql(db) => {
            db.sql(&format!(
                "DELETE FROM mysql.sentinel_guard_locks WHERE name = '{NAME}'"
            ));
        }
        Backend::Postgres(db) => {
            db.sql(&format!(
                "DELETE FROM sentinel_guard_locks WHERE name = '{NAME}'"
            ));
        }
        Backend::Redis(redis) => {
            let lock = format!("sentinel-guard:{{{NAME}}}");
            redis.cli(&["DEL", &format!("{lock}:clean"), &format!("{lock}:lease")]);
        }
        Backend::File(_) => {
            let path = backend.url();
            fs::remove_file(path.trim_start_matches("file://")).unwrap();
        }
        Backend::Etcd(_) | Backend::Sentinel(_) => unreachable!("not in Backend::all()"),
    }
}

#[test]
fn a_fencing_counter_set_back_by_hand_starts_no_app_and_exits_69() {
    for backend in Backend::all() {
        let mut lab = Lab::with_default_takeover();
        let url = backend.url();
        let args = args(&backend, &url);
        let tokens = lab.path("tokens");
        let app = format!("echo $SENTINEL_GUARD_FENCING_TOKEN >> {}", tokens.display());
        let run = |lab: &mut Lab| {
            let mut guard = lab.spawn(&args, &["sh", "-c", &app]);
            let code = guard.code(Duration::from_secs(20));
            (code, guard.log_text())
        };
        for _ in 0..2 {
            let (code, log) = run(&mut lab);
            assert_eq!(code, 0, "{}: {log}", backend.name());
        }
        set_back(&backend);
        let (code, log) = run(&mut lab);
        assert_eq!(code, 69, "{}: {log}", backend.name());
        assert!(log.contains("was set back"), "{}: {log}", backend.name());
        // Refused before the app: it recorded no token.
        let given = fs::read_to_string(&tokens).unwrap();
        assert_eq!(given.lines().count(), 2, "{}: {given}", backend.name());
        // As the error says: delete the record, and the next holder's token is still above every
        // token given before.
        delete_record(&backend);
        let (code, log) = run(&mut lab);
        assert_eq!(code, 0, "{}: {log}", backend.name());
        let given: Vec<u64> = fs::read_to_string(&tokens)
            .unwrap()
            .lines()
            .map(|line| line.parse().unwrap())
            .collect();
        assert_eq!(given.len(), 3, "{}: {given:?}", backend.name());
        assert_growing(&given, &backend);
        // `status` shows the record: released, with the last token given.
        let out = std::process::Command::new(GUARD)
            .args(["status", "--url", &url, "--name", NAME])
            .output()
            .unwrap();
        let line = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(3), "{}: {line}", backend.name());
        assert!(
            line.contains("record_state=released")
                && line.contains(&format!("fencing_token={}", given[2])),
            "{}: {line}",
            backend.name()
        );
    }
}

/// A Redis grant whose answer never reached the guard (each answer held back past
/// `--check-timeout`, so the guard gave up on it and on its connection) is found again by the
/// retry, which is answered as the grant was: after a clean release, the app starts at once,
/// not after this guard's own bound.
#[test]
fn a_redis_grant_whose_answer_was_lost_still_knows_the_release_before_it() {
    let redis = common::redis::Redis::start();
    let proxy = common::proxy::Proxy::start(redis.port);
    let mut lab = Lab::with_default_takeover();
    let direct = redis.url();
    let args = fast_with(REDIS_LEASE);
    let with_url = |url: &str| {
        let mut all = vec!["--url", url, "--name", NAME, "--wait"];
        all.extend_from_slice(&args);
        all.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    // The first holder releases cleanly: the record says so.
    let (code, log) = lab.run(
        &as_strs(&with_url(&direct)),
        &["true"],
        Duration::from_secs(20),
    );
    assert_eq!(code, 0, "{log}");

    // Every chunk waits 300ms each way: a round trip (600ms) outlasts --check-timeout (500ms).
    proxy.set_delay(Duration::from_millis(300), Duration::ZERO);
    let through_proxy = direct.replace(&format!(":{}", redis.port), &format!(":{}", proxy.port));
    let started = lab.path("started");
    let app = format!(
        "trap 'exit 0' TERM; touch '{}'; sleep 1000 & wait",
        started.display()
    );
    let mut guard = lab.spawn(&as_strs(&with_url(&through_proxy)), &["sh", "-c", &app]);
    let key = format!("sentinel-guard:{{{NAME}}}");
    assert!(
        wait_until(Duration::from_secs(20), || redis.cli(&["EXISTS", &key])
            == "1"),
        "the grant never reached the server: {}",
        guard.log_text()
    );
    proxy.set_delay(Duration::ZERO, Duration::ZERO);
    assert!(
        wait_until(Duration::from_secs(10), || started.exists()),
        "{}",
        guard.log_text()
    );
    // The guard's log is written off the path to the app's start: the line may follow the app.
    assert!(
        wait_until(Duration::from_secs(5), || guard
            .log_text()
            .contains("event=\"takeover_delay_skipped\" reason=released")),
        "{}",
        guard.log_text()
    );
    let log = guard.log_text();
    assert!(!log.contains("event=\"takeover_delayed\""), "{log}");
    guard.signal(15);
    assert_eq!(guard.code(Duration::from_secs(20)), 0);
}
