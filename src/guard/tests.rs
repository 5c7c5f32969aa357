//! The guard's life driven by a fake lock (`backend::fake`): the takeover delay in paused time;
//! supervision, with a real app, its real watchdog (this binary, see `main`) and real signals sent
//! by the test.

use super::*;
use crate::backend::fake;
use crate::cli::Cli;
use crate::config::Invocation;
use crate::vocab::AppStatus;
use clap::Parser;
use std::sync::atomic::Ordering;
use tokio::sync::mpsc;

/// The guard's configuration with `flags`, on a file lock that these tests never touch: the lock
/// is a fake (`backend::fake`).
fn config(flags: &[&str]) -> Config {
    configured(FAKE_URL, flags, &["true"])
}

/// A lock no test touches: the tests' locks are fakes.
const FAKE_URL: &str = "file:///nonexistent/fake.lock";

/// The guard's configuration with `flags`, running `command` under the lock at `url`.
fn configured(url: &str, flags: &[&str], command: &[&str]) -> Config {
    let mut args = vec!["sentinel-guard", "--url", url, "--name", "fake"];
    args.extend_from_slice(flags);
    args.push("--");
    args.extend_from_slice(command);
    match Invocation::from_cli(Cli::try_parse_from(args).unwrap(), None) {
        Ok(Invocation::Guard(config)) => *config,
        Ok(_) => panic!("not a guard's configuration: {flags:?}"),
        Err(e) => panic!("{flags:?} refused: {e}"),
    }
}

fn guard<'a>(config: &'a Config, holder: &'a Holder) -> Guard<'a> {
    let metrics = Metrics::new(
        config.name.as_str(),
        "file",
        false,
        config.timings.check_timeout,
        None,
        false,
    );
    Guard {
        config,
        holder,
        backend: "file",
        observer: Arc::new(Reports {
            checks: metrics.checks(),
            metrics: metrics.clone(),
        }),
        metrics,
        vouching: Vouching::new(config.name.as_str(), "file", &holder.id),
        app_socket: None,
    }
}

/// Signal events the test sends.
fn signals() -> (mpsc::UnboundedSender<i32>, SignalEvents) {
    let (sender, received) = mpsc::unbounded_channel();
    (sender, SignalEvents::from_test(received))
}

/// The lock was taken away from a holder whose app may still stop for 4s.
const TAKEN_AWAY: Previous = Previous::MayRun {
    bound: Duration::from_secs(4),
    why: "taken_away",
};

/// What happens 1s into the takeover delay.
enum AfterOneSecond {
    Nothing,
    LockTakenAway,
    Sigterm,
}

/// The takeover delay of a guard with `flags` that found `previous` in the lock record, in
/// paused time: its result, how long it took, and whether the lock was given back.
async fn takeover(
    flags: &[&str],
    previous: Previous,
    then: AfterOneSecond,
) -> (Result<HeldLock, Finished>, Duration, bool) {
    let (config, holder) = (config(flags), Holder::of_this_process());
    let (held, control) = fake::acquired(previous, Deadline::after(Duration::from_secs(3600)));
    let (sender, mut signals) = signals();
    let guard = guard(&config, &holder);
    let start = Instant::now();
    let ((result, took), ()) = tokio::join!(
        async {
            let result = guard.takeover_delay(held, &mut signals).await;
            (result, start.elapsed())
        },
        async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            match then {
                AfterOneSecond::Nothing => {}
                AfterOneSecond::LockTakenAway => control.take_away(),
                AfterOneSecond::Sigterm => sender.send(nix::libc::SIGTERM).unwrap(),
            }
        }
    );
    (result, took, control.given_back())
}

#[tokio::test(start_paused = true)]
async fn after_a_lock_taken_away_the_app_waits_the_previous_holders_bound() {
    let (result, took, given_back) = takeover(&[], TAKEN_AWAY, AfterOneSecond::Nothing).await;
    assert!(result.is_ok() && !given_back);
    assert_eq!(took, Duration::from_secs(4));
}

#[tokio::test(start_paused = true)]
async fn after_the_previous_app_is_known_gone_the_app_starts_at_once() {
    let gone = Previous::Gone("released");
    let (result, took, _) = takeover(&[], gone, AfterOneSecond::Nothing).await;
    assert!(result.is_ok());
    assert_eq!(took, Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn a_fixed_delay_is_waited_even_after_a_release_the_record_cannot_vouch_for() {
    let flags = ["--takeover-delay", "30s"];
    let gone = Previous::Gone("released");
    let (result, took, _) = takeover(&flags, gone, AfterOneSecond::Nothing).await;
    assert!(result.is_ok());
    assert_eq!(took, Duration::from_secs(30));
}

#[tokio::test(start_paused = true)]
async fn a_lock_lost_during_the_wait_starts_no_app_and_ends_the_wait_at_once() {
    let (result, took, _) = takeover(&[], TAKEN_AWAY, AfterOneSecond::LockTakenAway).await;
    assert!(matches!(
        result,
        Err(Finished::LockLost(AppGone::NeverStarted))
    ));
    assert_eq!(took, Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_stop_during_the_wait_gives_the_unused_lock_back() {
    let (result, took, given_back) = takeover(&[], TAKEN_AWAY, AfterOneSecond::Sigterm).await;
    assert!(matches!(
        result,
        Err(Finished::Exit(Outcome::StoppedBeforeStart))
    ));
    assert_eq!(took, Duration::from_secs(1));
    assert!(given_back);
}

/// Runs the test `name` (its path below `guard::tests`) alone in a process of its own, this binary
/// again, and, like the guard, a child subreaper: supervision reaps every child of its process and
/// the watchdog signals every descendant of it, so no other test may share that process. True in
/// that process, where the test's body runs; elsewhere, asserts that it passed there.
fn in_own_process(name: &str) -> bool {
    const ALONE: &str = "SENTINEL_GUARD_TEST_ALONE";
    let name = format!("guard::tests::{name}");
    if std::env::var_os(ALONE).is_some_and(|alone| alone == name.as_str()) {
        supervisor::become_subreaper().unwrap();
        return true;
    }
    let status = std::process::Command::new("/proc/self/exe")
        .args([name.as_str(), "--exact", "--test-threads=1"])
        .env(ALONE, &name)
        .status()
        .unwrap();
    assert!(status.success(), "{name} failed in its own process");
    false
}

/// A lock held for an hour, whose record says the previous app is gone.
fn held_for_an_hour() -> (HeldLock, fake::Control) {
    fake::acquired(
        Previous::Gone("released"),
        Deadline::after(Duration::from_secs(3600)),
    )
}

/// An app (`sh -c`) that starts a child, writes both pids to `dir/pids`, then runs `then`.
fn recording_app(dir: &std::path::Path, then: &str) -> String {
    let dir = dir.display();
    format!(
        "sleep 1000 & echo $$ $! > '{dir}/pids.new' && mv '{dir}/pids.new' '{dir}/pids'; {then}"
    )
}

/// The pids the app wrote, once it has (within 10s).
async fn app_pids(dir: &std::path::Path) -> Vec<i32> {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(text) = std::fs::read_to_string(dir.join("pids")) {
            return text
                .split_whitespace()
                .map(|p| p.parse().unwrap())
                .collect();
        }
        assert!(Instant::now() < until, "the app never wrote its pids");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether none of `pids` runs: each is gone or a zombie. The test's process is the subreaper
/// that reaps them, so a pid cannot have been reused while the test looks.
fn all_gone(pids: &[i32]) -> bool {
    pids.iter().all(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            state.starts_with('Z')
        })
    })
}

/// This process's watchdog: its child whose first argument is `__watchdog`.
fn watchdog_pid() -> i32 {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let parent = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .nth(1);
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            parent == Some(me.as_str()) && cmdline.split(|b| *b == 0).nth(1) == Some(b"__watchdog")
        })
        .expect("the guard runs a watchdog")
}

/// What one supervision ended with: how, after how long, the app's pids, and whether they were all
/// gone when the lock was given back (false when it was not).
struct Supervised {
    finished: Finished,
    took: Duration,
    pids: Vec<i32>,
    gone_at_release: bool,
}

/// A guard with `flags` supervising `sh -c script` (which writes its pids: `recording_app`) under a
/// fake lock held for an hour, while `meanwhile`, given the app's pids, the lock's control and the
/// signal sender, acts. Within 30s: a guard that misses what `meanwhile` did fails, not hangs.
async fn supervised(
    flags: &[&str],
    script: &str,
    dir: &std::path::Path,
    meanwhile: impl AsyncFnOnce(&[i32], &fake::Control, &mpsc::UnboundedSender<i32>),
) -> Supervised {
    let config = configured(FAKE_URL, flags, &["sh", "-c", script]);
    let holder = Holder::of_this_process();
    let guard = guard(&config, &holder);
    let (held, control) = held_for_an_hour();
    let (sender, mut signals) = signals();
    let pids = std::sync::Mutex::new(Vec::new());
    let gone_at_release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let start = Instant::now();
    let run = async {
        tokio::join!(guard.supervise(Some(held), &mut signals, None), async {
            let app = app_pids(dir).await;
            *pids.lock().unwrap() = app.clone();
            let seen = Arc::clone(&gone_at_release);
            let watched = app.clone();
            control.on_release(move || seen.store(all_gone(&watched), Ordering::SeqCst));
            meanwhile(&app, &control, &sender).await
        })
    };
    let (finished, ()) = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("supervision ended within 30s");
    Supervised {
        finished,
        took: start.elapsed(),
        pids: pids.into_inner().unwrap(),
        gone_at_release: gone_at_release.load(Ordering::SeqCst) && control.given_back(),
    }
}

#[tokio::test]
async fn the_apps_exit_code_passes_through_and_the_lock_is_given_back() {
    if !in_own_process("the_apps_exit_code_passes_through_and_the_lock_is_given_back") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // It ends once the test has seen it run.
    let go = dir.path().join("go");
    let then = format!(
        "while [ ! -e '{}' ]; do sleep 0.01; done; kill $!; exit 7",
        go.display()
    );
    let script = recording_app(dir.path(), &then);
    let run = supervised(&[], &script, dir.path(), async |_, _, _| {
        std::fs::write(&go, "").unwrap()
    })
    .await;
    assert!(matches!(
        run.finished,
        Finished::Exit(Outcome::AppExited(AppStatus::Exited(7)))
    ));
    assert!(run.gone_at_release);
}

#[tokio::test]
async fn a_lock_lost_while_the_app_runs_stops_the_whole_tree_and_is_not_given_back() {
    if !in_own_process("a_lock_lost_while_the_app_runs_stops_the_whole_tree_and_is_not_given_back")
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = recording_app(dir.path(), "wait");
    let flags = ["--grace-period", "5s"];
    let run = supervised(
        &flags,
        &script,
        dir.path(),
        async |_, lock: &fake::Control, _| lock.take_away(),
    )
    .await;
    assert!(matches!(run.finished, Finished::LockLost(AppGone::Stopped)));
    assert!(all_gone(&run.pids), "left running: {:?}", run.pids);
    assert!(!run.gone_at_release, "a lost lock was given back");
}

#[tokio::test]
async fn a_passed_deadline_kills_the_tree_at_once_with_no_grace() {
    if !in_own_process("a_passed_deadline_kills_the_tree_at_once_with_no_grace") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Deaf to the stop signal: only a SIGKILL ends it before its 60s grace.
    let script = format!("trap '' TERM; {}", recording_app(dir.path(), "wait"));
    let flags = ["--grace-period", "60s"];
    let run = supervised(
        &flags,
        &script,
        dir.path(),
        async |_, lock: &fake::Control, _| lock.move_app_deadline(Deadline::now()),
    )
    .await;
    assert!(matches!(run.finished, Finished::LockLost(AppGone::Stopped)));
    assert!(run.took < Duration::from_secs(10), "took {:?}", run.took);
    assert!(all_gone(&run.pids), "left running: {:?}", run.pids);
}

#[tokio::test]
async fn a_dead_watchdog_stops_the_app_and_the_lock_is_given_back_after_it() {
    if !in_own_process("a_dead_watchdog_stops_the_app_and_the_lock_is_given_back_after_it") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = recording_app(dir.path(), "wait");
    let flags = ["--grace-period", "5s"];
    let run = supervised(&flags, &script, dir.path(), async |_, _, _| {
        let watchdog = Pid::from_raw(watchdog_pid());
        nix::sys::signal::kill(watchdog, nix::sys::signal::SIGKILL).unwrap();
    })
    .await;
    assert!(matches!(run.finished, Finished::LockLost(AppGone::Stopped)));
    assert!(run.gone_at_release, "given back before the tree was gone");
}

#[tokio::test]
async fn a_stop_signal_reaches_the_app_and_its_exit_is_the_guards() {
    if !in_own_process("a_stop_signal_reaches_the_app_and_its_exit_is_the_guards") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "trap 'kill $!; exit 3' TERM; {}",
        recording_app(dir.path(), "wait")
    );
    let run = supervised(
        &[],
        &script,
        dir.path(),
        async |_, _, signals: &mpsc::UnboundedSender<i32>| {
            signals.send(nix::libc::SIGTERM).unwrap()
        },
    )
    .await;
    assert!(matches!(
        run.finished,
        Finished::Exit(Outcome::AppExited(AppStatus::Exited(3)))
    ));
    assert!(run.gone_at_release);
}

#[tokio::test]
async fn after_a_loss_with_rejoin_the_guard_waits_for_the_lock_again_and_runs_a_new_app() {
    if !in_own_process(
        "after_a_loss_with_rejoin_the_guard_waits_for_the_lock_again_and_runs_a_new_app",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let ran = ran.display();
    // The first app runs until the lock is lost; the second exits 4 at once.
    let script = format!(
        "[ -e '{ran}' ] && exit 4; touch '{ran}'; {}",
        recording_app(dir.path(), "wait")
    );
    let config = configured(FAKE_URL, &["--wait", "--rejoin"], &["sh", "-c", &script]);
    let holder = Holder::of_this_process();
    let guard = guard(&config, &holder);
    let (_sender, mut signals) = signals();
    let (first, first_control) = held_for_an_hour();
    let (second, second_control) = held_for_an_hour();
    let mut locks = std::collections::VecDeque::from([first, second]);
    let mut rejoining_seen = Vec::new();
    // The acquiring step is the test's: `take_lock` has a test of its own below.
    let run = async {
        tokio::join!(
            guard.acquisitions(&mut signals, async |_, rejoining| {
                rejoining_seen.push(rejoining);
                locks.pop_front().ok_or(Outcome::Internal)
            }),
            async {
                app_pids(dir.path()).await;
                first_control.take_away();
            }
        )
    };
    let (outcome, ()) = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the guard ended within 30s");
    assert_eq!(outcome, Outcome::AppExited(AppStatus::Exited(4)));
    assert_eq!(rejoining_seen, [false, true]);
    assert!(!first_control.given_back() && second_control.given_back());
}

#[tokio::test]
async fn a_signal_while_waiting_for_the_lock_starts_no_app() {
    let dir = tempfile::tempdir().unwrap();
    let url = url::Url::from_file_path(dir.path().join("lock")).unwrap();
    let (first, second) = (
        configured(url.as_str(), &[], &["true"]),
        configured(url.as_str(), &["--wait"], &["true"]),
    );
    let holder = Holder::of_this_process();
    let (sender, mut signals) = signals();
    let target = first.target.as_ref().unwrap();
    let holding = guard(&first, &holder)
        .take_lock(target, &mut signals, false)
        .await
        .unwrap_or_else(|outcome| panic!("the first guard could not take the lock: {outcome}"));
    let waiting = guard(&second, &holder);
    let start = Instant::now();
    let (waited, ()) = tokio::join!(waiting.take_lock(target, &mut signals, false), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        sender.send(nix::libc::SIGTERM).unwrap();
    });
    assert!(matches!(waited, Err(Outcome::StoppedBeforeStart)));
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(holding.release_unused().await.is_ok());
}
