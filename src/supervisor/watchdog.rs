//! The app's dead man's switch: a second process that stops the app's process group when the guard
//! can no longer do it itself.
//!
//! - **The guard dies** (even by SIGKILL): the app itself dies by PDEATHSIG, but what it forked would
//!   be orphaned. The guard's end of a pipe closes with it; the watchdog sees EOF and SIGKILLs the
//!   app's whole process group.
//! - **The guard freezes** (SIGSTOP, a stalled cgroup, a debugger): its lock still ends on the
//!   backend's schedule (the MySQL server frees it after `wait_timeout` of silence, a Redis lease
//!   expires). The guard keeps telling the watchdog by when its app must be dead if nothing more is
//!   heard; if that moment passes, the watchdog stops the app's group on its own: the stop signal,
//!   then SIGKILL at the deadline.
//!
//! - **The guard dies holding a MySQL lock**: once the app's group is gone, the watchdog ends the
//!   guard's server session with `KILL CONNECTION`, so the lock is free at once instead of when the
//!   server next looks at the dead client (after the outstanding check's `SLEEP`).
//!
//! The watchdog is the guard's own binary run as `sentinel-guard __watchdog`. On fd 3 it reads the
//! session to end (a length-prefixed URL, 0 for none, then the connection id and a timeout in ms),
//! then 8-byte CLOCK_MONOTONIC deadlines (`u64::MAX`: none; `STAND_DOWN`: the guard is done with
//! the app and exits normally). Only the pipe ends it.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
use nix::libc;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{killpg, signal, SigHandler, Signal};
use nix::time::{clock_gettime, ClockId};
use nix::unistd::{pipe2, Pid};
use tokio::time::Instant;
use tracing::{error, info, info_span, warn};

use crate::backend::OrphanSession;
use crate::config::SecretUrl;

/// The fd on which the watchdog reads deadlines.
const DEADLINE_FD: i32 = 3;
/// No deadline: the lock cannot run out under a frozen guard (a file lock, or no lock at all).
const NO_DEADLINE: u64 = u64::MAX;
/// The guard has stopped the app and is exiting on its own: the pipe's end is not a death.
const STAND_DOWN: u64 = u64::MAX - 1;
/// How long the watchdog waits for a killed app group to be gone before it frees the lock early.
const GROUP_GONE_WAIT: Duration = Duration::from_secs(2);
/// The watchdog starts stopping the app this long after the guard would have: a healthy guard acts
/// first and disarms it, so the two never signal the app together.
const SLACK: Duration = Duration::from_millis(200);

/// The guard's end: the watchdog's pid and the pipe that feeds it.
pub struct Watchdog {
    pipe: File,
    pid: Pid,
}

fn monotonic_ns() -> u64 {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC is always available");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// A tokio instant as CLOCK_MONOTONIC nanoseconds, which every process on the host shares.
fn as_monotonic_ns(at: Instant) -> u64 {
    let now = Instant::now();
    let base = monotonic_ns();
    if at >= now {
        base + (at - now).as_nanos() as u64
    } else {
        base.saturating_sub((now - at).as_nanos() as u64)
    }
}

impl Watchdog {
    /// Starts the watchdog for the app's group, with no deadline yet. `context` names the lock
    /// (`SENTINEL_GUARD_NAME`, `_BACKEND`, `_HOLDER_ID`) so the watchdog's log lines say whose app
    /// it acts on.
    pub fn spawn(
        app_group: Pid,
        (stop_signal, grace): (Signal, Duration),
        context: &[(&str, String)],
        session: Option<&OrphanSession>,
    ) -> io::Result<Watchdog> {
        // Close-on-exec, so the app never inherits an end: a stray write end would keep the pipe
        // open after the guard died.
        let (read_end, write_end) = pipe2(OFlag::O_CLOEXEC)?;
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg("__watchdog")
            .arg(app_group.as_raw().to_string())
            .arg(stop_signal.as_str())
            .arg(grace.as_nanos().to_string())
            .envs(context.iter().map(|(k, v)| (k, v)))
            .env(crate::logging::FORMAT_VAR, crate::logging::format_name())
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let source = read_end.as_raw_fd();
        // SAFETY: between fork and exec only async-signal-safe calls, no allocation.
        unsafe {
            cmd.pre_exec(move || {
                // dup2 clears close-on-exec on the copy, so only fd 3 reaches the watchdog.
                if source == DEADLINE_FD {
                    fcntl(
                        BorrowedFd::borrow_raw(source),
                        FcntlArg::F_SETFD(FdFlag::empty()),
                    )?;
                } else if libc::dup2(source, DEADLINE_FD) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        drop(read_end);
        let mut pipe = File::from(write_end);
        // Written before any deadline; far below the pipe's capacity, so it never blocks.
        pipe.write_all(&encode_session(session))?;
        Ok(Watchdog {
            pipe,
            pid: Pid::from_raw(child.id() as i32),
        })
    }

    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// Moves the deadline; called every time the lock is proven again.
    pub fn extend(&mut self, dead_by: Instant) {
        self.send(as_monotonic_ns(dead_by));
    }

    /// The guard is stopping the app itself: no more deadline. The watchdog stays until the guard
    /// exits, as the switch for a guard killed during teardown.
    pub fn disarm(&mut self) {
        self.send(NO_DEADLINE);
    }

    /// The app is stopped and the guard exits on its own: no session to end when the pipe closes.
    pub fn stand_down(&mut self) {
        self.send(STAND_DOWN);
    }

    fn send(&mut self, deadline: u64) {
        if let Err(e) = self.pipe.write_all(&deadline.to_le_bytes()) {
            error!(event = "watchdog_unreachable", error = %e, "cannot reach the watchdog");
        }
    }
}

fn encode_session(session: Option<&OrphanSession>) -> Vec<u8> {
    let Some(session) = session else {
        return 0u32.to_le_bytes().to_vec();
    };
    let url = session.url.expose().as_bytes();
    let mut bytes = Vec::with_capacity(url.len() + 12);
    bytes.extend_from_slice(&(url.len() as u32).to_le_bytes());
    bytes.extend_from_slice(url);
    bytes.extend_from_slice(&session.connection_id.to_le_bytes());
    let timeout_ms = u32::try_from(session.timeout.as_millis()).unwrap_or(u32::MAX);
    bytes.extend_from_slice(&timeout_ms.to_le_bytes());
    bytes
}

fn read_u32(pipe: &mut File) -> io::Result<u32> {
    let mut buf = [0u8; 4];
    pipe.read_exact(&mut buf)?;
    Ok(u32::from_le_bytes(buf))
}

fn decode_session(pipe: &mut File) -> io::Result<Option<OrphanSession>> {
    let len = read_u32(pipe)? as usize;
    if len == 0 {
        return Ok(None);
    }
    let mut url = vec![0u8; len];
    pipe.read_exact(&mut url)?;
    let url = String::from_utf8(url).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok(Some(OrphanSession {
        url: SecretUrl::new(url),
        connection_id: read_u32(pipe)?,
        timeout: Duration::from_millis(u64::from(read_u32(pipe)?)),
    }))
}

/// `sentinel-guard __watchdog <app-group> <stop-signal> <grace-ns>`.
pub fn main(args: &[String]) -> ExitCode {
    let parsed = (|| {
        let group: i32 = args.first()?.parse().ok()?;
        let signal: Signal = args.get(1)?.parse().ok()?;
        let grace: u64 = args.get(2)?.parse().ok()?;
        Some((Pid::from_raw(group), signal, grace))
    })();
    let Some((group, stop_signal, grace)) = parsed else {
        eprintln!("sentinel-guard: __watchdog is internal to the guard");
        return ExitCode::from(crate::outcome::EXIT_USAGE);
    };
    // Only the pipe ends the watchdog: a signal meant for the guard's group must not disarm it.
    for ignored in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ] {
        // SAFETY: SIG_IGN installs no handler code.
        let _ = unsafe { signal(ignored, SigHandler::SigIgn) };
    }
    // SAFETY: fd 3 was handed over by the guard and is owned by this process alone.
    let mut pipe = File::from(unsafe { OwnedFd::from_raw_fd(DEADLINE_FD) });
    let context = |key| std::env::var(key).unwrap_or_default();
    let _span = info_span!(
        "watchdog",
        name = context("SENTINEL_GUARD_NAME"),
        backend = context("SENTINEL_GUARD_BACKEND"),
        holder_id = context("SENTINEL_GUARD_HOLDER_ID"),
        app_pid = group.as_raw(),
    )
    .entered();
    match decode_session(&mut pipe) {
        Ok(session) => watch(pipe, group, stop_signal, grace, session),
        // The guard died before it finished the hand-over.
        Err(_) => guard_gone(group, None),
    }
    ExitCode::SUCCESS
}

fn watch(
    mut pipe: File,
    group: Pid,
    stop_signal: Signal,
    grace_ns: u64,
    mut session: Option<OrphanSession>,
) {
    let mut dead_by = NO_DEADLINE;
    let mut buf = [0u8; 8];
    loop {
        let timeout = if dead_by >= STAND_DOWN {
            PollTimeout::NONE
        } else {
            let stop_at = dead_by
                .saturating_sub(grace_ns)
                .saturating_add(SLACK.as_nanos() as u64)
                .min(dead_by);
            let now = monotonic_ns();
            if now >= stop_at {
                return stop_group(group, stop_signal, dead_by);
            }
            PollTimeout::from(((stop_at - now) / 1_000_000 + 1).min(u64::from(u16::MAX)) as u16)
        };
        let mut fds = [PollFd::new(pipe.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(0) | Err(Errno::EINTR) => continue,
            Ok(_) => {}
            Err(_) => return,
        }
        match pipe.read_exact(&mut buf) {
            Ok(()) => dead_by = u64::from_le_bytes(buf),
            Err(_) => return guard_gone(group, session.as_ref()),
        }
        if dead_by == STAND_DOWN {
            session = None;
        }
    }
}

/// The guard has exited; if it died without tearing the app down, nothing else will. If it died
/// holding a MySQL lock, its session is ended once nothing of the app is left.
fn guard_gone(group: Pid, session: Option<&OrphanSession>) {
    if killpg(group, Signal::SIGKILL).is_ok() {
        warn!(
            event = "watchdog_killed_orphans",
            "guard gone; watchdog killed what was left of the app's process group"
        );
    }
    let Some(session) = session else { return };
    let deadline = std::time::Instant::now() + GROUP_GONE_WAIT;
    while super::tree::live_group_members(group) > 0 {
        if std::time::Instant::now() >= deadline {
            warn!(
                event = "watchdog_left_session",
                connection_id = session.connection_id,
                "app processes outlived SIGKILL; the server frees the lock when it notices the dead session"
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    match session.end() {
        Ok(()) => info!(
            event = "watchdog_ended_session",
            connection_id = session.connection_id,
            "guard died holding the lock; watchdog ended its session so the lock is free at once"
        ),
        Err(e) => warn!(
            event = "watchdog_left_session",
            connection_id = session.connection_id,
            error = %e,
            "cannot end the dead guard's session; the server frees the lock when it notices"
        ),
    }
}

fn stop_group(group: Pid, stop_signal: Signal, dead_by: u64) {
    error!(
        event = "watchdog_stopping_app",
        reason = crate::metrics::GUARD_FROZEN,
        "guard unresponsive while its lock runs out; watchdog stopping the app"
    );
    let _ = killpg(group, stop_signal);
    loop {
        let now = monotonic_ns();
        if now >= dead_by || killpg(group, None) == Err(Errno::ESRCH) {
            break;
        }
        std::thread::sleep(Duration::from_nanos((dead_by - now).min(10_000_000)));
    }
    if killpg(group, Signal::SIGKILL).is_ok() {
        info!(
            event = "watchdog_killed_app",
            "watchdog sent SIGKILL at the lock's deadline"
        );
    }
}
