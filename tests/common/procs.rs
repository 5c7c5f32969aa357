//! Looking at processes and logs from outside, for the safety-net tests: a guard's children and its
//! watchdog, process states and groups, signals sent without a `kill` subprocess, and what a guard
//! logged about losing its lock.

use std::fs;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::wait_until;

/// `/proc/<pid>/stat` after the command name: (state, ppid, pgrp). The name is in parentheses and
/// may itself contain `) `, so the fields start after the *last* one.
fn stat(pid: i32) -> Option<(char, i32, i32)> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = text.rsplit_once(") ")?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some((state, ppid, pgrp))
}

/// The process's state letter (`R`, `S`, `T`, `Z`, ...), or `None` once it is gone.
pub fn state(pid: i32) -> Option<char> {
    stat(pid).map(|(state, _, _)| state)
}

fn all_pids() -> Vec<i32> {
    fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn live(state: char) -> bool {
    !matches!(state, 'Z' | 'X')
}

/// Live (not zombie) children of `parent`, whichever of its threads forked them.
pub fn children(parent: i32) -> Vec<i32> {
    all_pids()
        .into_iter()
        .filter(|pid| matches!(stat(*pid), Some((s, ppid, _)) if ppid == parent && live(s)))
        .collect()
}

/// The process's group, or `None` once it is gone.
pub fn group_of(pid: i32) -> Option<i32> {
    stat(pid).map(|(_, _, pgrp)| pgrp)
}

/// Live (not zombie) members of process group `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    all_pids()
        .into_iter()
        .filter(|pid| matches!(stat(*pid), Some((s, _, pgrp)) if pgrp == pgid && live(s)))
        .collect()
}

pub fn argv(pid: i32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|arg| !arg.is_empty())
                .map(|arg| String::from_utf8_lossy(arg).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The guard's watchdog: its child run as `<guard binary> __watchdog ...`. Waits up to `limit`,
/// since the guard spawns it right after the app.
pub fn watchdog_of(guard: i32, limit: Duration) -> i32 {
    let mut found = None;
    let seen = wait_until(limit, || {
        found = children(guard)
            .into_iter()
            .find(|pid| argv(*pid).get(1).map(String::as_str) == Some("__watchdog"));
        found.is_some()
    });
    assert!(
        seen,
        "guard {guard} has no __watchdog child within {limit:?}; children: {:?}",
        children(guard)
            .into_iter()
            .map(|p| (p, argv(p)))
            .collect::<Vec<_>>()
    );
    found.unwrap()
}

/// Sends `signal` straight from the test process, for steps where the few milliseconds a `kill`
/// subprocess takes matter. Panics if the process does not exist.
pub fn signal_now(pid: i32, signal: Signal) {
    kill(Pid::from_raw(pid), signal).unwrap_or_else(|e| panic!("kill({pid}, {signal}): {e}"));
}

/// The `reason` of every `lock_lost` event in a guard's log, from text lines
/// (`event=lock_lost reason=x` or `event="lock_lost" reason="x"`) and JSON lines alike.
pub fn lock_lost_reasons(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|line| {
            if line.trim_start().starts_with('{') {
                let value: serde_json::Value = serde_json::from_str(line).ok()?;
                (value["event"] == "lock_lost")
                    .then(|| value["reason"].as_str().map(str::to_owned))?
            } else {
                if !line.contains("event=lock_lost") && !line.contains("event=\"lock_lost\"") {
                    return None;
                }
                let (_, rest) = line.split_once(" reason=")?;
                let value = rest.split_whitespace().next()?;
                Some(value.trim_matches('"').to_owned())
            }
        })
        .collect()
}
