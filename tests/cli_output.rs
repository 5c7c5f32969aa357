//! What the guard prints for people: a closed stdout is a normal end, a command given without `--`
//! gets the form that works, log lines speak the words of the exit-code table, and
//! `--parent-death-signal` acts when the guard's own parent dies.

mod common;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// Runs the guard with its stdout a pipe whose reader is already gone, as `| head -c1` leaves it.
fn into_closed_pipe(args: &[&str]) -> (i32, String) {
    let mut child = Command::new(GUARD)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = exit_within(&mut child, Duration::from_secs(20)).expect("guard hung");
    (status.code().unwrap_or(-1), stderr)
}

#[test]
fn a_closed_stdout_is_a_normal_end_for_man_completions_and_status() {
    let lab = Lab::new();
    for args in [
        &["man"][..],
        &["completions", "bash"],
        &["completions", "zsh"],
    ] {
        let (code, stderr) = into_closed_pipe(args);
        assert_eq!(code, 0, "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?} printed: {stderr}");
    }
    // `status` keeps its own answer (3: free) and says nothing about the pipe.
    let url = lab.file_url("free.lock");
    let (code, stderr) = into_closed_pipe(&["status", "--url", &url, "--name", "x"]);
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.is_empty(), "status printed: {stderr}");
    // And through a real `head -c1`, as an operator types it.
    let out = Command::new("sh")
        .args(["-c", &format!("{GUARD} man | head -c1 >/dev/null")])
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn a_command_without_the_separator_gets_a_hint_showing_it() {
    let mut lab = Lab::new();
    let url = lab.file_url("hint.lock");
    let cmd = lab.command(&["--url", &url, "--name", "x", "./app", "--flag"], &[]);
    let mut guard = lab.start(cmd);
    assert_eq!(guard.code(Duration::from_secs(10)), 2);
    let log = guard.log_text();
    assert!(
        log.contains("put the command after `--`: sentinel-guard [OPTIONS] -- <COMMAND> [ARGS]..."),
        "{log}"
    );
    assert!(log.contains("./app"), "{log}");
    // A mistyped option is not a command: no hint about `--` there.
    let cmd = lab.command(&["--url", &url, "--name", "x", "--nope"], &["true"]);
    let mut guard = lab.start(cmd);
    assert_eq!(guard.code(Duration::from_secs(10)), 2);
    assert!(!guard.log_text().contains("put the command after"));
}

/// flock's habit (`-w 30`) and `-w5s` leave `--wait`'s value where clap does not take it: the error
/// says the form that works.
#[test]
fn a_wait_value_without_equals_gets_a_hint_showing_it() {
    let mut lab = Lab::new();
    let url = lab.file_url("wait-hint.lock");
    for (args, value) in [
        (&["--wait", "30s"][..], "30s"),
        (&["-w", "30s"], "30s"),
        (&["-w5s"], "5s"),
    ] {
        let args = [&["--url", url.as_str(), "--name", "x"][..], args].concat();
        let cmd = lab.command(&args, &["true"]);
        let mut guard = lab.start(cmd);
        assert_eq!(guard.code(Duration::from_secs(10)), 2, "{args:?}");
        let log = guard.log_text();
        assert!(
            log.contains(&format!(
                "--wait takes its duration after `=`: --wait={value}"
            )),
            "{args:?}: {log}"
        );
        assert!(!log.contains("put the command after"), "{args:?}: {log}");
    }
}

/// Asked for JSON, every answer is JSON: a refused configuration (`--log-format json`), a status
/// error (`--format json`), and a status whose numbers are numbers and times RFC 3339.
#[test]
fn json_asked_for_is_what_comes_out_errors_included() {
    let mut lab = Lab::new();
    let (code, log) = lab.run(
        &[
            "--url",
            "file:relative.lock",
            "--name",
            "j",
            "--log-format",
            "json",
        ],
        &["true"],
        Duration::from_secs(5),
    );
    assert_eq!(code, 2, "{log}");
    let line: serde_json::Value = serde_json::from_str(log.trim()).expect("one JSON line");
    assert_eq!(line["event"], "config_invalid", "{log}");
    assert!(
        line["error"].as_str().unwrap().contains("absolute path"),
        "{log}"
    );

    // Claimed and never listened on: a port of the kernel's would soon be another test's.
    let url = format!("redis://127.0.0.1:{}", common::free_port());
    let out = lab
        .command(
            &[
                "status",
                "--url",
                &url,
                "--name",
                "j",
                "--format",
                "json",
                "--connect-timeout",
                "500ms",
            ],
            &[],
        )
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert!(answer["state"].is_null(), "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("unreachable"),
        "{answer}"
    );

    let lock = lab.file_url("j.lock");
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut holder = lab.spawn(
        &["--url", &lock, "--name", "j"],
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    read_pid(&pidfile, Duration::from_secs(10));
    let out = lab
        .command(
            &["status", "--url", &lock, "--name", "j", "--format", "json"],
            &[],
        )
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["holder"]["pid"], holder.pid(), "{answer}");
    let started = answer["holder"]["started"].as_str().unwrap_or_default();
    assert!(humantime::parse_rfc3339(started).is_ok(), "{answer}");
    // The held message's holder is an object in a JSON log, not a line of words.
    let (code, log) = lab.run(
        &["--url", &lock, "--name", "j", "--log-format", "json"],
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 1, "{log}");
    let held: serde_json::Value = log
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|line| line["event"] == "lock_held_elsewhere")
        .expect("a lock_held_elsewhere line");
    assert_eq!(held["holder"]["pid"], holder.pid().to_string(), "{held}");
    holder.signal(15);
    assert_eq!(holder.code(Duration::from_secs(10)), 0);
}

/// The `guard_exiting` line of a text-format log.
fn exit_line(log: &str) -> String {
    let line = log
        .lines()
        .find(|l| l.contains("event=\"guard_exiting\"") || l.contains("event=guard_exiting"))
        .unwrap_or_else(|| panic!("no guard_exiting line: {log}"));
    line.to_owned()
}

/// No Rust Debug dump in a line: no `Word(`, `Some(`, `Ok(`, `{ field:`.
fn assert_plain(log: &str) {
    for line in log.lines() {
        let debugish = line
            .split(|c: char| !c.is_ascii_alphanumeric() && c != '(')
            .any(|w| {
                w.ends_with('(') && w.len() > 1 && w.chars().next().unwrap().is_ascii_uppercase()
            });
        assert!(
            !debugish && !line.contains(" { "),
            "Debug value in a log line: {line}"
        );
    }
}

#[test]
fn text_logs_use_the_exit_code_tables_words() {
    let mut lab = Lab::new();
    let url = lab.file_url("words.lock");
    let (code, log) = lab.run(
        &["--url", &url, "--name", "words"],
        &["sh", "-c", "exit 3"],
        Duration::from_secs(20),
    );
    assert_eq!(code, 3, "{log}");
    let line = exit_line(&log);
    assert!(line.contains("outcome=app exited with code 3"), "{line}");
    assert_plain(&log);

    let (code, log) = lab.run(
        &["--url", "mysql://u:pw@127.0.0.1:1/db", "--name", "words"],
        &["true"],
        Duration::from_secs(20),
    );
    assert_eq!(code, 69, "{log}");
    assert!(
        exit_line(&log).contains("outcome=backend unavailable"),
        "{log}"
    );
    assert_plain(&log);

    let url_held = lab.file_url("held.lock");
    let holder = lab.spawn(&["--url", &url_held, "--name", "held"], &["sleep", "30"]);
    let held = lab.path("held.lock");
    assert!(wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&held).is_ok_and(|s| s.contains("holder_id"))
    }));
    let (code, log) = lab.run(
        &["--url", &url_held, "--name", "held"],
        &["true"],
        Duration::from_secs(20),
    );
    assert_eq!(code, 1, "{log}");
    assert!(
        exit_line(&log).contains("outcome=lock held elsewhere"),
        "{log}"
    );
    assert_plain(&log);
    drop(holder);
}

/// `guard` started in the background by `sh -c script`, which writes the guard's pid to a file:
/// the shell is the guard's parent. Returns the shell and the guard's pid.
fn under_shell(lab: &Lab, guard: &Command) -> (Child, i32) {
    let pidfile = lab.path("guard.pid");
    // `sh -c SCRIPT $0 $@...`: $0 is the pid file, $@ the guard's command line.
    let mut shell = Command::new("sh");
    shell
        .args(["-c", "\"$@\" & echo $! > \"$0\"; wait"])
        .arg(&pidfile)
        .arg(guard.get_program())
        .args(guard.get_args())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(lab.path("guard.log")).unwrap());
    for (key, value) in guard.get_envs() {
        match value {
            Some(value) => shell.env(key, value),
            None => shell.env_remove(key),
        };
    }
    let shell = shell.spawn().unwrap();
    (shell, read_pid(&pidfile, Duration::from_secs(10)))
}

fn guard_log(lab: &Lab) -> String {
    std::fs::read_to_string(lab.path("guard.log")).unwrap()
}

/// A guard with `--parent-death-signal signal` around an app recording `recorded`, started by a shell
/// that is SIGKILLed once the app runs. Returns the lab, the app's trace and the guard's pid.
fn parent_killed_under(signal: &str, recorded: &[&str]) -> (Lab, std::path::PathBuf, i32) {
    let lab = Lab::new();
    let url = lab.file_url("pdeath.lock");
    let (trace, ready) = (lab.path("trace"), lab.path("ready"));
    let app = signal_recorder(&trace, &ready, recorded);
    let args = [
        "--url",
        &url,
        "--name",
        "pdeath",
        "--parent-death-signal",
        signal,
    ];
    let (mut parent, guard) = under_shell(&lab, &lab.command(&args, &as_strs(&app)));
    assert!(wait_until(Duration::from_secs(10), || ready.exists()));
    assert!(trace_lines(&trace).is_empty());
    send(parent.id() as i32, SIGKILL);
    parent.wait().unwrap();
    (lab, trace, guard)
}

#[test]
fn the_parent_death_signal_is_forwarded_when_the_guards_parent_is_killed() {
    let (lab, trace, guard) = parent_killed_under("USR1", &["USR1", "TERM"]);
    assert!(
        wait_until(Duration::from_secs(10), || trace_lines(&trace) == ["USR1"]),
        "app got {:?}",
        trace_lines(&trace)
    );
    // USR1 is only forwarded: the app and the guard keep running until a stop.
    assert!(alive(guard));
    send(guard, SIGTERM);
    assert!(wait_until(Duration::from_secs(10), || !alive(guard)));
    assert_eq!(trace_lines(&trace), ["USR1", "TERM"]);
    let log = guard_log(&lab);
    assert!(log.contains("parent_death_signal"), "{log}");
}

#[test]
fn a_parent_death_signal_of_term_stops_the_app_and_ends_the_guard() {
    let (mut lab, trace, guard) = parent_killed_under("TERM", &["TERM"]);
    assert!(
        wait_until(Duration::from_secs(10), || !alive(guard)),
        "the guard outlived its parent"
    );
    assert_eq!(trace_lines(&trace), ["TERM"]);
    // The lock is free again: another guard takes it at once.
    let url = lab.file_url("pdeath.lock");
    let (code, log) = lab.run(
        &["--url", &url, "--name", "pdeath"],
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 0, "{log}");
}

const SIGKILL: i32 = 9;
const SIGTERM: i32 = 15;
