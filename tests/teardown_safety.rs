//! The safety net around teardown: once the guard has decided to stop its app, nothing that happens
//! to the guard itself (frozen, its stderr blocked, its watchdog killed, its process group
//! signalled, SIGKILLed, unable to fork) may leave the app running once the lock can be granted
//! elsewhere.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::{pipe2, Pid};

use common::procs::{group_members, lock_lost_reasons, signal_now, state, watchdog_of};
use common::*;

const GRACE: Duration = Duration::from_secs(1);

/// An app that ignores SIGTERM (and so does every `sleep` it forks: an ignored disposition survives
/// exec), so only SIGKILL stops it; it writes its pid to `pidfile` once running.
fn stubborn_app(pidfile: &Path) -> Vec<String> {
    let script = format!(
        "trap '' TERM; echo $$ > {p}.tmp && mv {p}.tmp {p}; while :; do sleep 0.05; done",
        p = pidfile.display()
    );
    vec!["sh".into(), "-c".into(), script]
}

/// Whether nothing of the app's process group is left alive (zombies count as dead).
fn app_gone(app: i32) -> bool {
    !alive(app) && group_members(app).is_empty()
}

/// a. A guard SIGSTOPped in the middle of stopping its app (lock already lost, app ignoring the
/// stop signal) cannot send the SIGKILL due at the end of the grace period. Its watchdog stays
/// armed during teardown and must send it instead, by teardown start + grace.
#[test]
fn guard_stopped_during_teardown_still_kills_its_app() {
    let mut lab = Lab::new();
    let url = lab.file_url("teardown.lock");
    let pidfile = lab.path("app");
    let args = [
        "--url",
        url.as_str(),
        "--name",
        "teardown-stop",
        "--check-interval",
        "100ms",
        "--grace-period",
        "1s",
    ];
    let mut guard = lab.spawn(&args, &as_strs(&stubborn_app(&pidfile)));
    let app = read_pid(&pidfile, Duration::from_secs(10));
    watchdog_of(guard.pid(), Duration::from_secs(5));

    fs::remove_file(lab.path("teardown.lock")).unwrap();
    // The guard logs the loss right before it starts teardown; freeze it as soon as it has.
    assert!(
        wait_until(Duration::from_secs(5), || !lock_lost_reasons(
            &guard.log_text()
        )
        .is_empty()),
        "the guard never noticed its lock file was deleted; log:\n{}",
        guard.log_text()
    );
    signal_now(guard.pid(), Signal::SIGSTOP);

    // Teardown started before the loss was seen here, so this bound is later than the promised one.
    let dead = wait_until(GRACE + Duration::from_secs(1), || app_gone(app));
    // Resume the guard before asserting, so a failure shows its log rather than a stopped process.
    signal_now(guard.pid(), Signal::SIGCONT);
    assert!(
        dead,
        "the stopped guard's app (group {app}) outlived the grace period: {:?}; log:\n{}",
        group_members(app),
        guard.log_text()
    );
    let code = guard.code(Duration::from_secs(10));
    let log = guard.log_text();
    assert_eq!(code, 75, "log:\n{log}");
    assert!(
        lock_lost_reasons(&log).contains(&"lock_file_deleted".to_owned()),
        "log:\n{log}"
    );
}

/// Fills a pipe to capacity through a separate, non-blocking open file description of it
/// (`/proc/self/fd/N`), so the pipe's own descriptors, the guard's stderr among them, stay
/// blocking.
fn fill_pipe(end: &OwnedFd) -> File {
    let mut filler = OpenOptions::new()
        .write(true)
        .custom_flags(OFlag::O_NONBLOCK.bits())
        .open(format!("/proc/self/fd/{}", end.as_raw_fd()))
        .unwrap();
    // Whole pages first, then single bytes for whatever room a partial page leaves.
    for chunk in [&[b'x'; 4096][..], b"x"] {
        loop {
            match filler.write(chunk) {
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the pipe: {e}"),
            }
        }
    }
    filler
}

/// b. With stderr a pipe nobody reads, every log line the guard writes would block it. Logging must
/// never stand between a lost lock and the kill: the app, which ignores SIGTERM, is SIGKILLed at
/// the end of the grace period, and the guard still exits.
#[test]
fn full_stderr_pipe_does_not_delay_the_kill() {
    let db = mariadb::MariaDb::start();
    let lab = Lab::new();
    let url = db.url();
    let name = "stderr-full";
    let mut args = vec!["--url", url.as_str(), "--name", name];
    args.extend(fast_with(&["--grace-period", "1s"]));
    let pidfile = lab.path("app");
    let (read_end, write_end) = pipe2(OFlag::O_CLOEXEC).unwrap();
    let mut cmd = lab.command(&args, &as_strs(&stubborn_app(&pidfile)));
    // Trace level, so the guard has as much to say as possible while its stderr is full.
    cmd.env("SENTINEL_GUARD_LOG", "trace")
        .stderr(Stdio::from(write_end));
    let mut guard = GuardProcess {
        child: cmd.spawn().unwrap(),
        // Its stderr is the pipe: there is no log file to show.
        log: lab.path("stderr-is-a-pipe"),
    };
    drop(cmd); // The test keeps no write end of its own beyond the filler below.
    let app = read_pid(&pidfile, Duration::from_secs(15));
    let connection = db.holder_of(name).expect("the guard holds the lock");

    let _filler = fill_pipe(&read_end);
    db.sql(&format!("KILL {connection}"));
    let killed = Instant::now();
    let dead = wait_until(GRACE + Duration::from_secs(1), || app_gone(app));
    assert!(
        dead,
        "with its stderr full, the guard let its app (group {app}) outlive the grace period: {:?}",
        group_members(app)
    );
    // It may spend a moment trying to flush its logs before it gives up on them.
    let code = guard.code(Duration::from_secs(10));
    assert_eq!(code, 75, "exited {:?} after the KILL", killed.elapsed());
    drop(read_end);
}

/// c. The watchdog is the guard's safety net; without it the guard must not go on holding the lock
/// and running the app. It stops the app the normal way (stop signal, grace period), releases, and
/// reports the loss; the standby takes over only after the app has stopped.
#[test]
fn watchdog_killed_stops_the_app_and_hands_over() {
    for backend in [
        Backend::File(Lab::new()),
        Backend::Mysql(mariadb::MariaDb::start()),
    ] {
        let mut lab = Lab::new();
        let LeaderAndStandby {
            mut leader,
            lead_app,
            mut standby,
            standby_pid,
            trace,
        } = LeaderAndStandby::start(&mut lab, &backend, "watchdog-died");

        let watchdog = watchdog_of(leader.pid(), Duration::from_secs(5));
        signal_now(watchdog, Signal::SIGKILL);

        let code = leader.code(Duration::from_secs(10));
        let log = leader.log_text();
        assert_eq!(code, 75, "{}: log:\n{log}", backend.name());
        assert!(
            lock_lost_reasons(&log).contains(&"watchdog_died".to_owned()),
            "{}: log:\n{log}",
            backend.name()
        );
        read_pid(&standby_pid, Duration::from_secs(10));
        assert!(
            trace_lines(&trace).contains(&format!("stop {lead_app}")),
            "{}: the app was not stopped with the stop signal: {:?}",
            backend.name(),
            trace_lines(&trace)
        );
        assert_eq!(assert_no_overlap(&trace), 2, "{}", backend.name());

        standby.signal(15);
        assert_eq!(
            standby.code(Duration::from_secs(10)),
            0,
            "{}: {}",
            backend.name(),
            standby.log_text()
        );
    }
}

/// d. A signal sent to the guard's whole process group (`kill -TERM -<pgid>`, as a shell's job
/// control or a process manager may do) also reaches the watchdog, which shares the guard's group.
/// Besides SIGTERM, signals whose default action is to terminate and that the guard merely
/// forwards (USR1, USR2, ALRM) are sent first: the watchdog ignores every catchable signal.
/// It must shrug it off: the guard forwards the signal, the app ends on its own terms, and the
/// guard exits with the app's code, with no talk of a dead watchdog.
#[test]
fn signal_to_the_guards_group_spares_the_watchdog() {
    let mut lab = Lab::new();
    let url = lab.file_url("group.lock");
    let (trace, pidfile) = (lab.path("trace"), lab.path("app"));
    // Ignores the merely forwarded signals; on SIGTERM records the stop, then takes a second to
    // exit: time in which the watchdog must still be alive.
    let script = format!(
        "trap '' USR1 USR2 ALRM; trap 'echo stop $$ >> {t}; sleep 1; exit 42' TERM; \
         echo start $$ >> {t}; \
         echo $$ > {p}.tmp && mv {p}.tmp {p}; while :; do sleep 0.05; done",
        t = trace.display(),
        p = pidfile.display()
    );
    let args = [
        "--url",
        url.as_str(),
        "--name",
        "group-signal",
        "--grace-period",
        "5s",
    ];
    let mut cmd = lab.command(&args, &["sh", "-c", &script]);
    // Its own group, so that signalling the group does not signal this test.
    cmd.process_group(0);
    let mut guard = lab.start(cmd);
    let app = read_pid(&pidfile, Duration::from_secs(10));
    let guard_pid = guard.pid();
    let watchdog = watchdog_of(guard_pid, Duration::from_secs(5));

    for signal in [
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGALRM,
        Signal::SIGTERM,
    ] {
        killpg(Pid::from_raw(guard_pid), signal).unwrap();
    }
    // The watchdog got each signal in the same kill(2) as the guard, before the app could hear of
    // SIGTERM through the guard: by the time the app records its stop, a watchdog killed by one of
    // them would be gone.
    assert!(
        wait_until(Duration::from_secs(5), || trace_lines(&trace)
            .contains(&format!("stop {app}"))),
        "the guard did not forward SIGTERM to its app; log:\n{}",
        guard.log_text()
    );
    assert!(
        alive(watchdog),
        "the watchdog died of a signal sent to the guard's group (state {:?}); log:\n{}",
        state(watchdog),
        guard.log_text()
    );

    let code = guard.code(Duration::from_secs(10));
    let log = guard.log_text();
    assert_eq!(
        code, 42,
        "the guard must exit with the app's code; log:\n{log}"
    );
    assert!(!log.contains("watchdog_died"), "log:\n{log}");
    // Once the guard is done, so is its watchdog.
    assert!(
        wait_until(Duration::from_secs(5), || !alive(watchdog)),
        "watchdog {watchdog} outlived its guard"
    );
}

/// e. A SIGKILLed guard on the file backend: its app must be dead before the flock is free. The
/// standby's app, as its very first action, looks at the old app's pid and records an overlap if it
/// is still alive and not a zombie. Repeated, since any overlap lies in a window of microseconds.
#[test]
fn guard_sigkill_never_hands_over_to_a_live_app() {
    const ROUNDS: usize = 50;
    for round in 0..ROUNDS {
        let mut lab = Lab::new();
        let url = lab.file_url("kill.lock");
        let (lead_pid, standby_pid) = (lab.path("lead"), lab.path("standby"));
        let (beats, overlap) = (lab.path("beats"), lab.path("overlap"));
        let args = [
            "--url",
            url.as_str(),
            "--name",
            "sigkill-rounds",
            "--check-interval",
            "100ms",
        ];
        let leader_app = format!(
            "echo $$ > {p}.tmp && mv {p}.tmp {p}; while :; do echo beat >> {b}; sleep 0.01; done",
            p = lead_pid.display(),
            b = beats.display()
        );
        // Shell builtins only before the check, so it runs within a millisecond of the app's exec.
        let standby_app = format!(
            "read -r p < {lead}; s=; read -r s 2>/dev/null < /proc/$p/stat; \
             st=${{s##*\") \"}}; st=${{st%% *}}; \
             if [ -n \"$s\" ] && [ \"$st\" != Z ] && [ \"$st\" != X ]; then \
             echo \"OVERLAP $p $st\" >> {o}; fi; \
             echo $$ > {sb}.tmp && mv {sb}.tmp {sb}; exec sleep 600",
            lead = lead_pid.display(),
            o = overlap.display(),
            sb = standby_pid.display()
        );
        let mut leader = lab.spawn(&args, &["sh", "-c", &leader_app]);
        let lead_app = read_pid(&lead_pid, Duration::from_secs(10));
        let mut standby = waiting_standby(&mut lab, &args, &["sh", "-c", &standby_app]);

        signal_now(leader.pid(), Signal::SIGKILL);
        read_pid(&standby_pid, Duration::from_secs(10));
        let overlaps = fs::read_to_string(&overlap).unwrap_or_default();
        assert!(
            overlaps.is_empty(),
            "round {round}: the standby's app started while the SIGKILLed guard's app ran: {overlaps}"
        );

        assert!(
            wait_until(Duration::from_secs(5), || app_gone(lead_app)),
            "round {round}: the SIGKILLed guard's app group outlived it: {:?}",
            group_members(lead_app)
        );
        leader.wait(Duration::from_secs(5));
        standby.signal(15);
        standby.wait(Duration::from_secs(10));
    }
}

/// The unprivileged user the guard runs as in (f): one no process on the host uses, so the
/// RLIMIT_NPROC count (per real uid, every thread included) is the guard's alone.
const NPROC_UID: u32 = 64_917;

/// Live and zombie processes whose real uid is `uid`; a zombie still counts against RLIMIT_NPROC
/// until it is reaped.
fn processes_of(uid: u32) -> Vec<i32> {
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().next()?.parse::<u32>().ok())
                == Some(uid)
        })
        .collect()
}

/// `guard <args> -- <app>` run as `NPROC_UID` with no supplementary groups. setpriv execs, so the
/// guard keeps the pid.
fn unprivileged(lab: &Lab, args: &[&str], app: &[&str]) -> Command {
    let uid = NPROC_UID.to_string();
    launched_by(
        // Its uid may make no cgroup here: what that costs is not what these tests are about.
        lab.command(args, app)
            .env("SENTINEL_GUARD_ALLOW_NO_CGROUP", "true"),
        "setpriv",
        &["--reuid", &uid, "--regid", &uid, "--clear-groups", "--"],
    )
}

fn flock_now(path: &Path) -> Option<Flock<File>> {
    let file = OpenOptions::new().read(true).write(true).open(path).ok()?;
    Flock::lock(file, FlockArg::LockExclusiveNonblock).ok()
}

/// f. A fork fails once the lock is taken (EAGAIN under RLIMIT_NPROC): first the watchdog's, then,
/// with room for one fork, the app's after the watchdog's. The watchdog is forked before the app, so
/// the app must never run in either case: the guard exits 70 (no watchdog) or 126 (the command could
/// not be started), stands down and reaps a watchdog it had started, and frees the lock.
///
/// The limit is set on the running guard while it waits for the lock (`prlimit --pid`), from the
/// tasks (threads of every process of its uid) it has then (T), one of them the thread that waits
/// in `flock` and ends once the lock is granted: RLIMIT_NPROC = T - 1 + room leaves room for `room`
/// forks after acquiring.
/// The limit counts every process of `NPROC_UID`: the tests that set it run one at a time.
static NPROC_UID_IN_USE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn fork_failure_after_acquiring(room: usize) -> (i32, String, bool) {
    let _one_at_a_time = NPROC_UID_IN_USE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut lab = Lab::new();
    fs::set_permissions(lab.dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let lock_path = lab.path("nproc.lock");
    fs::write(&lock_path, "").unwrap();
    fs::set_permissions(&lock_path, fs::Permissions::from_mode(0o666)).unwrap();
    let url = lab.file_url("nproc.lock");
    let args = ["--url", url.as_str(), "--name", "nproc", "--wait"];
    // A single process that never forks, and leaves a mark if it ever runs.
    let ran = lab.path("app-ran");
    let script = format!("touch {}; exec sleep 600", ran.display());
    let app = ["sh", "-c", script.as_str()];
    // Zombies of an earlier run count against the limit until init reaps them.
    assert!(
        wait_until(Duration::from_secs(10), || processes_of(NPROC_UID)
            .is_empty()),
        "uid {NPROC_UID} already has processes: {:?}",
        processes_of(NPROC_UID)
    );

    let ours = flock_now(&lock_path).expect("the lock file is free");
    let mut guard = lab.start(unprivileged(&lab, &args, &app));
    assert!(
        wait_until(Duration::from_secs(10), || guard
            .log_text()
            .contains("waiting")),
        "the guard never waited: {}",
        guard.log_text()
    );
    let tasks: usize = processes_of(NPROC_UID)
        .iter()
        .map(|pid| {
            fs::read_dir(format!("/proc/{pid}/task"))
                .map(|d| d.count())
                .unwrap_or(0)
        })
        .sum();
    let limit = (tasks - 1 + room).to_string();
    // As the guard's own uid: lowering the limit of one's own process needs no privilege.
    let uid = NPROC_UID.to_string();
    let set = Command::new("setpriv")
        .args([
            "--reuid",
            &uid,
            "--regid",
            &uid,
            "--clear-groups",
            "--",
            "prlimit",
        ])
        .args([
            "--pid",
            &guard.pid().to_string(),
            &format!("--nproc={limit}:{limit}"),
        ])
        .status()
        .unwrap();
    assert!(set.success(), "prlimit failed");
    drop(ours);

    let code = guard.code(Duration::from_secs(10));
    let log = guard.log_text();
    assert!(
        wait_until(Duration::from_secs(5), || processes_of(NPROC_UID)
            .iter()
            .all(|pid| !alive(*pid))),
        "left running after the guard exited: {:?}; log:\n{log}",
        processes_of(NPROC_UID)
    );
    assert!(
        flock_now(&lock_path).is_some(),
        "the lock is still held after the guard exited; log:\n{log}"
    );
    (code, log, ran.exists())
}

#[test]
fn watchdog_fork_failure_never_starts_the_app() {
    let (code, log, ran) = fork_failure_after_acquiring(0);
    assert_eq!(code, 70, "log:\n{log}");
    assert!(log.contains("cannot start the watchdog"), "log:\n{log}");
    assert!(!ran, "the app ran without its watchdog; log:\n{log}");
}

#[test]
fn app_fork_failure_after_the_watchdog_stands_the_watchdog_down() {
    let (code, log, ran) = fork_failure_after_acquiring(1);
    assert_eq!(
        code, 126,
        "the watchdog's fork should have taken the one fork left; log:\n{log}"
    );
    assert!(
        log.contains("Resource temporarily unavailable"),
        "log:\n{log}"
    );
    assert!(!ran, "log:\n{log}");
}
