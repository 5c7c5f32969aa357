//! Bad input and hostile neighbours never do harm: a lock path that names someone else's file or a
//! planted symbolic link, a flood of connections to the metrics port, a connection id reused after a
//! MySQL restart, a server-wide statement time limit, a watchdog run by hand.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::endpoints::status;
use common::mariadb::MariaDb;
use common::procs::watchdog_of;
use common::*;

/// An app that writes its pid and sleeps until stopped.
fn sleeper(pidfile: &std::path::Path) -> Vec<String> {
    let script = format!("echo $$ > {}; exec sleep 600", pidfile.display());
    vec!["sh".to_owned(), "-c".to_owned(), script]
}

/// SIGTERM ends the guard the usual way: forwarded, and the app's death by it is the exit code.
fn stops_on_sigterm(guard: &mut GuardProcess) {
    guard.signal(15);
    assert_eq!(
        guard.code(Duration::from_secs(15)),
        143,
        "{}",
        guard.log_text()
    );
}

fn refused_with_exit_2(lab: &mut Lab, path: &std::path::Path, expected: &str) -> String {
    let url = format!("file://{}", path.display());
    let (code, log) = lab.run(
        &["--url", &url, "--name", "x"],
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 2, "{}: {log}", path.display());
    assert!(log.contains(expected), "{}: {log}", path.display());
    assert!(log.contains(&path.display().to_string()), "{log}");
    log
}

#[test]
fn a_lock_path_naming_someone_elses_file_leaves_it_untouched() {
    let mut lab = Lab::new();
    let victim = lab.path("victim.conf");
    fs::write(&victim, "important config\n").unwrap();
    refused_with_exit_2(&mut lab, &victim, "not a sentinel-guard lock file");
    assert_eq!(fs::read_to_string(&victim).unwrap(), "important config\n");

    // A symbolic link is never followed, even to an empty file the guard could have used.
    let target = lab.path("target");
    fs::write(&target, "precious\n").unwrap();
    let link = lab.path("evil.lock");
    symlink(&target, &link).unwrap();
    refused_with_exit_2(&mut lab, &link, "symbolic link");
    assert_eq!(fs::read_to_string(&target).unwrap(), "precious\n");
    let dangling = lab.path("dangling.lock");
    symlink(lab.path("nowhere"), &dangling).unwrap();
    refused_with_exit_2(&mut lab, &dangling, "symbolic link");
    assert!(
        !lab.path("nowhere").exists(),
        "a dangling link was followed"
    );

    let dir = lab.path("a-directory");
    fs::create_dir(&dir).unwrap();
    refused_with_exit_2(&mut lab, &dir, "directory");
}

#[test]
fn new_and_own_lock_files_are_used_and_stay_recognisable() {
    let mut lab = Lab::new();
    let lock = lab.path("fresh.lock");
    let url = format!("file://{}", lock.display());
    let record = lab.path("record");
    let script = format!("cat {} > {}", lock.display(), record.display());
    for round in 0..2 {
        let (code, log) = lab.run(
            &["--url", &url, "--name", "x"],
            &["sh", "-c", &script],
            Duration::from_secs(10),
        );
        assert_eq!(code, 0, "round {round}: {log}");
        let held = fs::read_to_string(&record).unwrap();
        assert!(
            held.starts_with("# sentinel-guard lock file\nholder_id="),
            "{held:?}"
        );
    }
    let mode = fs::metadata(&lock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & 0o022, 0, "lock file is writable by others: {mode:o}");
    let released = fs::read_to_string(&lock).unwrap();
    // The token of the last acquisition: at least the host clock in microseconds when it was drawn.
    let fence: u64 = released
        .strip_prefix("# sentinel-guard lock file\nlock_state=released fence=")
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "a released lock keeps the magic line and its lock record, no holder: {released:?}"
            )
        });
    assert!(fence > 1_700_000_000_000_000, "{released:?}");
    // An empty file (created by an operator, say) is taken as a lock file too.
    let empty = lab.path("empty.lock");
    fs::write(&empty, "").unwrap();
    let (code, log) = lab.run(
        &[
            "--url",
            &format!("file://{}", empty.display()),
            "--name",
            "x",
        ],
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 0, "{log}");
}

/// A client that sends a request one byte every 200ms, never finishing it.
fn slow_loris(port: u16, until: Instant) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let request =
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        while Instant::now() < until {
            let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            };
            for byte in request {
                if Instant::now() >= until || stream.write_all(&[*byte]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    })
}

#[test]
fn a_flooded_metrics_port_never_starves_the_guard() {
    // The test itself needs room for its 2,000 sockets.
    let (_, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    let db = MariaDb::start();
    let mut lab = Lab::new();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let url = db.url();
    let pidfile = lab.path("app");
    let args = [
        &[
            "--url",
            url.as_str(),
            "--name",
            "flooded",
            "--metrics-addr",
            &addr,
        ][..],
        FAST,
    ]
    .concat();
    let cmd = lab.command(&args, &as_strs(&sleeper(&pidfile)));
    // The guard as an operator would start it: the usual soft limit of 1024 descriptors.
    let cmd = launched_by(&cmd, "prlimit", &["--nofile=1024:"]);
    let mut guard = lab.start(cmd);
    let app = read_pid(&pidfile, Duration::from_secs(15));
    assert!(wait_until(Duration::from_secs(10), || status(
        port, "/leader"
    ) == Some(200)));

    let mut idle: Vec<TcpStream> = Vec::new();
    for _ in 0..2000 {
        if let Ok(stream) = TcpStream::connect(("127.0.0.1", port)) {
            idle.push(stream);
        }
    }
    assert!(idle.len() > 1500, "only {} connections opened", idle.len());
    let until = Instant::now() + Duration::from_secs(5);
    let loris = slow_loris(port, until);
    let mut probes = 0;
    while Instant::now() < until {
        let asked = Instant::now();
        let answer = status(port, "/leader");
        assert_eq!(
            answer,
            Some(200),
            "/leader did not answer 200 during the flood (after {:?}); log:\n{}",
            asked.elapsed(),
            guard.log_text()
        );
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "/leader took {:?}",
            asked.elapsed()
        );
        probes += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(probes > 20);
    drop(idle);
    loris.join().unwrap();
    assert!(alive(app), "the app was stopped during the flood");
    assert!(
        db.holder_of("flooded").is_some(),
        "the lock was lost during the flood"
    );
    let log = guard.log_text();
    assert!(!log.contains("Too many open files"), "{log}");
    assert!(!log.contains("lock_lost"), "{log}");
    stops_on_sigterm(&mut guard);
}

#[test]
fn the_watchdog_never_kills_a_strangers_session_after_a_server_restart() {
    let mut db = MariaDb::start();
    let mut lab = Lab::new();
    let url = db.url();
    let pidfile = lab.path("app");
    let stubborn = format!(
        "trap '' TERM; echo $$ > {}; while :; do sleep 0.05; done",
        pidfile.display()
    );
    let args = [
        &["--url", url.as_str(), "--name", "reused"][..],
        &fast_with(&["--grace-period", "60s"]),
    ]
    .concat();
    let guard = lab.spawn(&args, &["sh", "-c", &stubborn]);
    read_pid(&pidfile, Duration::from_secs(15));
    let watchdog = watchdog_of(guard.pid(), Duration::from_secs(5));
    let old_id = db.holder_of("reused").expect("held");

    // The guard loses its session and goes on stopping an app that ignores SIGTERM (60s grace).
    db.restart();
    assert!(wait_until(Duration::from_secs(10), || guard
        .log_text()
        .contains("event=\"lock_lost\"")));
    // A stranger's session takes the old connection id; ids start again after a restart.
    let mut stranger: Option<Child> = None;
    for _ in 0..(old_id + 20) {
        let mut session = db
            .client("SELECT CONNECTION_ID(); SELECT SLEEP(600)")
            .arg("--unbuffered")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut first = [0u8; 32];
        let n = session.stdout.as_mut().unwrap().read(&mut first).unwrap();
        let id: u64 = String::from_utf8_lossy(&first[..n])
            .trim()
            .lines()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        if id == old_id {
            stranger = Some(session);
            break;
        }
        let _ = session.kill();
        let _ = session.wait();
        assert!(
            id < old_id,
            "connection ids passed {old_id} without reusing it"
        );
    }
    let mut stranger = stranger.expect("no session took the old id");

    guard.signal(9);
    // The watchdog kills what is left of the app, then decides about the session, then exits.
    assert!(wait_until(Duration::from_secs(10), || !alive(watchdog)));
    // Give a (wrong) farewell every chance to land.
    let alive_after = !wait_until(Duration::from_secs(3), || {
        stranger.try_wait().unwrap().is_some()
    });
    assert!(
        alive_after,
        "the stranger's session was killed; log:\n{}",
        guard.log_text()
    );
    assert_eq!(
        db.sql(&format!(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = {old_id}"
        )),
        "1"
    );
    let _ = stranger.kill();
    let _ = stranger.wait();
}

#[test]
fn a_server_wide_statement_time_limit_does_not_end_the_check() {
    // Every statement longer than 0.5s would be cut off, the check's 1s SLEEP included.
    let db = MariaDb::start_with(&["--max-statement-time=0.5"]);
    let mut lab = Lab::new();
    let url = db.url();
    let pidfile = lab.path("app");
    let args = [
        &["--url", url.as_str(), "--name", "limited"][..],
        &fast_with(&["--check-interval", "1s"]),
    ]
    .concat();
    let mut guard = lab.spawn(&args, &as_strs(&sleeper(&pidfile)));
    let app = read_pid(&pidfile, Duration::from_secs(15));
    // Four checks' worth of time: each would have failed at 0.5s.
    let lost = wait_until(Duration::from_secs(4), || {
        guard.log_text().contains("lock_lost")
    });
    assert!(!lost, "{}", guard.log_text());
    assert!(alive(app));
    stops_on_sigterm(&mut guard);
}

#[test]
fn the_watchdog_holds_no_credentials_and_cannot_be_run_by_hand() {
    let db = MariaDb::start();
    let mut lab = Lab::new();
    let pidfile = lab.path("app");
    let mut cmd = lab.command(
        &[&["--name", "secret"][..], FAST].concat(),
        &as_strs(&sleeper(&pidfile)),
    );
    cmd.env("SENTINEL_GUARD_URL", db.url());
    let mut guard = lab.start(cmd);
    read_pid(&pidfile, Duration::from_secs(15));
    let watchdog = watchdog_of(guard.pid(), Duration::from_secs(5));
    let environ = fs::read(format!("/proc/{watchdog}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(!environ.contains("SENTINEL_GUARD_URL"), "{environ}");
    assert!(!environ.contains(common::mariadb::PASSWORD), "{environ}");
    guard.signal(15);
    guard.wait(Duration::from_secs(15));

    // By hand, fd 3 is not the guard's pipe: refused, whatever the arguments.
    for args in [
        &["__watchdog", "4242", "SIGTERM", "0"][..],
        &["__watchdog", "1", "SIGTERM", "0"],
    ] {
        let out = std::process::Command::new(GUARD)
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("internal"),
            "{args:?}"
        );
    }
}
