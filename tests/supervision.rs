//! PID 1 duties: signal forwarding, grace then SIGKILL, reaping, process tree teardown, the exit-code
//! map and the max-runtime watchdog. Most run twice: as a plain child and as PID 1 of a new PID
//! namespace (`unshare --pid --fork --mount-proc`), as in a container.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

#[derive(Debug, Clone, Copy)]
enum Mode {
    Child,
    Pid1,
}

const MODES: [Mode; 2] = [Mode::Child, Mode::Pid1];

fn guard_args<'a>(name: &'a str, url: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--url", url, "--name", name];
    v.extend(fast_with(extra));
    v
}

fn command(lab: &Lab, mode: Mode, args: &[&str], app: &[&str]) -> Command {
    match mode {
        Mode::Child => lab.command(args, app),
        Mode::Pid1 => lab.command_as_pid1(args, app),
    }
}

#[test]
fn every_forwarded_signal_reaches_the_app() {
    let signals = [
        ("HUP", 1),
        ("USR1", 10),
        ("USR2", 12),
        ("WINCH", 28),
        ("TSTP", 20),
        ("CONT", 18),
        ("INT", 2),
        ("TERM", 15),
    ];
    for mode in MODES {
        let mut lab = Lab::new();
        let url = lab.file_url("sig.lock");
        let (trace, ready) = (lab.path("trace"), lab.path("ready"));
        let names: Vec<_> = signals.iter().map(|(name, _)| *name).collect();
        let app = signal_recorder(&trace, &ready, &names);
        let cmd = command(&lab, mode, &guard_args("sig", &url, &[]), &as_strs(&app));
        let mut guard = lab.start(cmd);
        assert!(
            wait_until(Duration::from_secs(5), || ready.exists()),
            "{mode:?}: app not ready"
        );
        let guard_pid = guard.pid();
        for (i, (name, number)) in signals.iter().enumerate() {
            send(guard_pid, *number);
            let recorded = wait_until(Duration::from_secs(3), || trace_lines(&trace).len() > i);
            assert!(
                recorded,
                "{mode:?}: {name} not received; trace {:?}; log:\n{}",
                trace_lines(&trace),
                guard.log_text()
            );
        }
        assert_eq!(trace_lines(&trace), names, "{mode:?}");
        assert_eq!(
            guard.code(Duration::from_secs(5)),
            0,
            "{mode:?}: {}",
            guard.log_text()
        );
    }
}

#[test]
fn forward_to_child_reaches_only_the_main_process() {
    for (forward_to, child_gets_it) in [("group", true), ("child", false)] {
        let mut lab = Lab::new();
        let url = lab.file_url("fwd.lock");
        let (trace, ready) = (lab.path("trace"), lab.path("ready"));
        let script = format!(
            "sh -c \"trap 'echo grandchild >> {t}' USR1; touch {r}.inner; while :; do sleep 0.02; done\" & \
             trap 'echo main >> {t}' USR1; touch {r}; while :; do sleep 0.02; done",
            t = trace.display(),
            r = ready.display()
        );
        let guard = lab.spawn(
            &guard_args(
                "fwd",
                &url,
                &["--forward-to", forward_to, "--grace-period", "1s"],
            ),
            &["sh", "-c", &script],
        );
        assert!(wait_until(Duration::from_secs(5), || ready.exists()
            && lab.path("ready.inner").exists()));
        guard.signal(10);
        assert!(wait_until(Duration::from_secs(3), || trace_lines(&trace)
            .contains(&"main".to_owned())));
        let grandchild = wait_until(Duration::from_millis(500), || {
            trace_lines(&trace).contains(&"grandchild".to_owned())
        });
        assert_eq!(
            grandchild,
            child_gets_it,
            "--forward-to {forward_to}: {:?}",
            trace_lines(&trace)
        );
    }
}

#[test]
fn app_ignoring_term_is_killed_after_the_grace_period() {
    for mode in MODES {
        let mut lab = Lab::new();
        let url = lab.file_url("stubborn.lock");
        let ready = lab.path("ready");
        let script = format!(
            "trap '' TERM; touch {}; while :; do sleep 0.02; done",
            ready.display()
        );
        let cmd = command(
            &lab,
            mode,
            &guard_args("stubborn", &url, &["--grace-period", "1s"]),
            &["sh", "-c", &script],
        );
        let mut guard = lab.start(cmd);
        assert!(wait_until(Duration::from_secs(5), || ready.exists()));
        let sent = Instant::now();
        guard.signal(15);
        assert_eq!(
            guard.code(Duration::from_secs(5)),
            137,
            "{mode:?}: {}",
            guard.log_text()
        );
        let took = sent.elapsed();
        assert!(
            took >= Duration::from_secs(1),
            "{mode:?}: killed before the grace period ended ({took:?})"
        );
    }
}

#[test]
fn lock_is_released_only_after_a_stubborn_grandchild_died() {
    for mode in MODES {
        let mut lab = Lab::new();
        let url = lab.file_url("tree.lock");
        let gpid = lab.path("gpid");
        // The main app exits at once, leaving a grandchild in its group that ignores SIGTERM.
        let script = format!(
            "sh -c \"trap '' TERM; echo \\$\\$ > {g}.tmp; mv {g}.tmp {g}; while :; do sleep 0.02; done\" & \
             while [ ! -s {g} ]; do sleep 0.01; done; exit 5",
            g = gpid.display()
        );
        let cmd = command(
            &lab,
            mode,
            &guard_args("tree", &url, &["--grace-period", "1s"]),
            &["sh", "-c", &script],
        );
        let mut guard = lab.start(cmd);
        let grandchild = outer_pid(guard.pid(), read_pid(&gpid, Duration::from_secs(5)));
        while alive(grandchild) {
            let (code, log) = lab.run(
                &guard_args("tree", &url, &[]),
                &["true"],
                Duration::from_secs(5),
            );
            if alive(grandchild) {
                assert_eq!(
                    code, 1,
                    "{mode:?}: lock free while the grandchild lives: {log}"
                );
            }
        }
        assert_eq!(
            guard.code(Duration::from_secs(5)),
            5,
            "{mode:?}: the main app's code is kept"
        );
        assert!(
            guard.log_text().contains("SIGKILL"),
            "{mode:?}: {}",
            guard.log_text()
        );
    }
}

#[test]
fn stop_signal_reaches_the_child_of_a_shell_wrapper() {
    let mut lab = Lab::new();
    let url = lab.file_url("wrapper.lock");
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let inner = recording_app(&trace, &pidfile);
    // The shell does not exec and does not pass TERM on: only the group signal reaches the app.
    let script = format!(
        "sh -c \"{}\"; echo wrapper-done",
        inner[2].replace('"', "\\\"")
    );
    let mut guard = lab.spawn(&guard_args("wrapper", &url, &[]), &["sh", "-c", &script]);
    let app = read_pid(&pidfile, Duration::from_secs(5));
    std::fs::remove_file(lab.path("wrapper.lock")).unwrap();
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        75,
        "{}",
        guard.log_text()
    );
    assert!(
        trace_lines(&trace).contains(&format!("stop {app}")),
        "{:?}",
        trace_lines(&trace)
    );
    assert!(!alive(app));
}

#[test]
fn escaped_setsid_descendant_is_killed_with_the_app() {
    for mode in MODES {
        let mut lab = Lab::new();
        let url = lab.file_url("escape.lock");
        let epid = lab.path("epid");
        let script = format!(
            "setsid sh -c \"trap '' TERM; echo \\$\\$ > {e}.tmp; mv {e}.tmp {e}; while :; do sleep 0.02; done\" & \
             while [ ! -s {e} ]; do sleep 0.01; done; exit 0",
            e = epid.display()
        );
        let cmd = command(
            &lab,
            mode,
            &guard_args("escape", &url, &["--grace-period", "500ms"]),
            &["sh", "-c", &script],
        );
        let mut guard = lab.start(cmd);
        let guard_pid = guard.pid();
        let escaped = outer_pid(guard_pid, read_pid(&epid, Duration::from_secs(5)));
        // Once the guard has exited, only its log can tell that it, not the kernel's teardown of the
        // namespace, killed the escapee: it must have needed SIGKILL after the grace period.
        assert_eq!(
            guard.code(Duration::from_secs(5)),
            0,
            "{mode:?}: {}",
            guard.log_text()
        );
        assert!(
            guard.log_text().contains("SIGKILL"),
            "{mode:?}: {}",
            guard.log_text()
        );
        assert!(
            !alive(escaped),
            "{mode:?}: setsid descendant {escaped} survived the guard"
        );
    }
}

#[test]
fn daemonized_grandchildren_leave_no_zombies() {
    for mode in MODES {
        let mut lab = Lab::new();
        let url = lab.file_url("zombies.lock");
        let done = lab.path("done");
        let script = format!(
            "i=0; while [ $i -lt 200 ]; do (sleep 0.01 &); i=$((i+1)); done; touch {}; while :; do sleep 0.05; done",
            done.display()
        );
        let cmd = command(
            &lab,
            mode,
            &guard_args("zombies", &url, &[]),
            &["sh", "-c", &script],
        );
        let mut guard = lab.start(cmd);
        assert!(
            wait_until(Duration::from_secs(20), || done.exists()),
            "{mode:?}: forking did not finish"
        );
        let guard_pid = guard.pid();
        let reaped = wait_until(Duration::from_secs(3), || zombie_children(guard_pid) == 0);
        assert!(
            reaped,
            "{mode:?}: {} zombies left under the guard",
            zombie_children(guard_pid)
        );
        guard.signal(15);
        guard.wait(Duration::from_secs(5));
    }
}

#[test]
fn exit_code_map_rewrites_the_apps_status() {
    let mut lab = Lab::new();
    let url = lab.file_url("map.lock");
    let (code, log) = lab.run(
        &guard_args("map", &url, &["--exit-code-map", "143=0,1=9"]),
        &["sh", "-c", "kill -15 $$"],
        Duration::from_secs(5),
    );
    assert_eq!(code, 0, "{log}");
    let mut cmd = lab.command(&["--url", &url, "--name", "map"], &["sh", "-c", "exit 1"]);
    cmd.env("SENTINEL_GUARD_EXIT_CODE_MAP", "143=0,1=9");
    let mut guard = lab.start(cmd);
    assert_eq!(guard.code(Duration::from_secs(5)), 9);
}

#[test]
fn max_runtime_stops_the_app_and_exits_124() {
    let mut lab = Lab::new();
    let url = lab.file_url("watchdog.lock");
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let started = Instant::now();
    let (code, log) = lab.run(
        &guard_args("watchdog", &url, &["--max-runtime", "700ms"]),
        &as_strs(&recording_app(&trace, &pidfile)),
        Duration::from_secs(10),
    );
    assert_eq!(code, 124, "{log}");
    assert!(started.elapsed() >= Duration::from_millis(700));
    let app = read_pid(&pidfile, Duration::from_secs(1));
    assert!(
        trace_lines(&trace).contains(&format!("stop {app}")),
        "stopped gracefully"
    );
}

/// The guard in a new session whose controlling terminal is a pty on its stdin, as `docker run -it`
/// or an interactive shell gives (`setsid -c`); and the pty's master end, to type on.
fn in_terminal(lab: &mut Lab, args: &[&str], app: &[&str]) -> (GuardProcess, std::fs::File) {
    let pty = nix::pty::openpty(None, None).unwrap();
    let inner = lab.command(args, app);
    let mut cmd = Command::new("setsid");
    cmd.arg("-c")
        .arg(inner.get_program())
        .args(inner.get_args());
    for (key, value) in inner.get_envs() {
        if value.is_none() {
            cmd.env_remove(key);
        }
    }
    cmd.stdin(std::fs::File::from(pty.slave.try_clone().unwrap()));
    cmd.stdout(std::fs::File::from(pty.slave));
    (lab.start(cmd), std::fs::File::from(pty.master))
}

#[test]
fn ctrl_c_on_a_terminal_reaches_the_app_directly() {
    let mut lab = Lab::new();
    let url = lab.file_url("tty.lock");
    let (trace, ready) = (lab.path("trace"), lab.path("ready"));
    let app = signal_recorder(&trace, &ready, &["INT"]);
    let (mut guard, mut master) =
        in_terminal(&mut lab, &guard_args("tty", &url, &[]), &as_strs(&app));
    assert!(
        wait_until(Duration::from_secs(5), || ready.exists()),
        "{}",
        guard.log_text()
    );
    std::io::Write::write_all(&mut master, b"\x03").unwrap();
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        0,
        "{}",
        guard.log_text()
    );
    assert_eq!(trace_lines(&trace), ["INT"]);
    // The terminal sent SIGINT to the app's foreground group; the guard had nothing to forward.
    assert!(
        !guard.log_text().contains("signal forwarded"),
        "{}",
        guard.log_text()
    );
}

/// Once a scheduled run is over, the terminal's foreground is the guard's again: Ctrl-C stops the
/// scheduler waiting for its next window.
#[test]
fn ctrl_c_on_a_terminal_stops_a_scheduler_between_runs() {
    let mut lab = Lab::new();
    let url = lab.file_url("tty-every.lock");
    let ran = lab.path("ran");
    let app = format!("touch {}", ran.display());
    let (mut guard, mut master) = in_terminal(
        &mut lab,
        &guard_args("tty-every", &url, &["--every", "1h"]),
        &["sh", "-c", &app],
    );
    assert!(
        wait_until(Duration::from_secs(20), || guard
            .log_text()
            .contains("event=\"run_ended\"")),
        "{}",
        guard.log_text()
    );
    assert!(ran.exists());
    std::io::Write::write_all(&mut master, b"\x03").unwrap();
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        0,
        "{}",
        guard.log_text()
    );
    assert!(
        guard.log_text().contains("signal=SIGINT"),
        "{}",
        guard.log_text()
    );
}

/// `--grace-period 0s` with an app that exits on its own: the watchdog's backstop kill at the same
/// moment finds nothing alive, which is no alarm.
#[test]
fn a_clean_exit_with_no_grace_period_raises_no_watchdog_alarm() {
    let mut lab = Lab::new();
    let url = lab.file_url("nograce.lock");
    for round in 0..5 {
        let (code, log) = lab.run(
            &guard_args("nograce", &url, &["--grace-period", "0s"]),
            &["true"],
            Duration::from_secs(10),
        );
        assert_eq!(code, 0, "round {round}: {log}");
        assert!(!log.contains("watchdog_killed_app"), "round {round}: {log}");
    }
}

#[test]
fn sigkill_of_the_guard_kills_the_apps_whole_process_group() {
    let mut lab = Lab::new();
    let url = lab.file_url("orphans.lock");
    let gpid = lab.path("gpid");
    // The grandchild has no PDEATHSIG of its own; only the watchdog can reach it.
    let script = format!(
        "sleep 1000 & echo $! > {g}.tmp; mv {g}.tmp {g}; wait",
        g = gpid.display()
    );
    let guard = lab.spawn(&guard_args("orphans", &url, &[]), &["sh", "-c", &script]);
    let grandchild = read_pid(&gpid, Duration::from_secs(5));
    guard.signal(9);
    assert!(
        wait_until(Duration::from_secs(2), || !alive(grandchild)),
        "grandchild {grandchild} outlived its SIGKILLed guard"
    );
}

#[test]
fn an_app_that_kills_its_guard_as_it_starts_leaves_nothing_running() {
    let mut lab = Lab::new();
    let url = lab.file_url("first.lock");
    let gpid = lab.path("gpid");
    // The app's first act: fork a grandchild (no death signal of its own), then SIGKILL the guard,
    // before the guard has done anything after starting it. The watchdog was started before the
    // app, so it already knows the app's group.
    let script = format!(
        "sleep 1000 & echo $! > {g}.tmp; mv {g}.tmp {g}; kill -9 $PPID; wait",
        g = gpid.display()
    );
    let mut guard = lab.spawn(&guard_args("first", &url, &[]), &["sh", "-c", &script]);
    let grandchild = read_pid(&gpid, Duration::from_secs(5));
    assert_eq!(
        guard.wait(Duration::from_secs(5)).signal(),
        Some(9),
        "the app SIGKILLed its guard"
    );
    assert!(
        wait_until(Duration::from_secs(2), || !alive(grandchild)),
        "grandchild {grandchild} outlived its SIGKILLed guard"
    );
    // The watchdog frees the file lock once it has seen the app's cgroup empty, a moment after
    // the grandchild's death: the next guard gets it within a few seconds.
    let (code, log) = lab.run(
        &guard_args("first", &url, &["--wait=3s"]),
        &["true"],
        Duration::from_secs(5),
    );
    assert_eq!(code, 0, "lock not freed after the tree was gone: {log}");
}
