//! A second process that stops the app if the guard itself freezes (SIGSTOP, a stalled cgroup, a
//! debugger). A frozen guard cannot stop its app, yet its lock still ends on the backend's schedule:
//! the MySQL server frees it after `wait_timeout` of silence, a Redis lease expires. So the guard keeps
//! telling this watchdog by when its app must be dead if nothing more is heard; if that moment passes,
//! the watchdog stops the app's group (stop signal, then SIGKILL at the deadline) on its own.
//!
//! The watchdog is the guard's own binary run as `sentinel-guard __watchdog`, a child killed with the
//! guard (PDEATHSIG), reading 8-byte CLOCK_MONOTONIC deadlines from a pipe on fd 3. When the guard
//! closes the pipe (it stops the app itself, or ends), the watchdog exits quietly.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
use nix::libc;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::prctl;
use nix::sys::signal::{killpg, signal, SigHandler, Signal};
use nix::time::{clock_gettime, ClockId};
use nix::unistd::{getpid, getppid, pipe2, Pid};
use tokio::time::Instant;
use tracing::{error, info};

/// The fd on which the watchdog reads deadlines.
const DEADLINE_FD: i32 = 3;
/// The watchdog starts stopping the app this long after the guard would have: a healthy guard acts
/// first and disarms it, so the two never signal the app together.
const SLACK: Duration = Duration::from_millis(200);

/// The guard's end: a child process and the pipe that feeds it.
pub struct Watchdog {
    pipe: File,
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
    /// Starts the watchdog for the app's group. Must run on the guard's main thread (PDEATHSIG).
    pub fn spawn(
        app_group: Pid,
        stop_signal: Signal,
        grace: Duration,
        dead_by: Instant,
    ) -> io::Result<Watchdog> {
        // Close-on-exec, so the app never inherits an end: a stray write end would keep the watchdog
        // from ever seeing the guard close the pipe.
        let (read_end, write_end) = pipe2(OFlag::O_CLOEXEC)?;
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg("__watchdog")
            .arg(app_group.as_raw().to_string())
            .arg(stop_signal.as_str())
            .arg(grace.as_nanos().to_string())
            .arg(as_monotonic_ns(dead_by).to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let guard_pid = getpid();
        let source = read_end.as_raw_fd();
        // SAFETY: between fork and exec only async-signal-safe calls, no allocation.
        unsafe {
            cmd.pre_exec(move || {
                prctl::set_pdeathsig(Signal::SIGKILL)?;
                if getppid() != guard_pid {
                    let _ = nix::sys::signal::raise(Signal::SIGKILL);
                }
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
        cmd.spawn()?;
        drop(read_end);
        Ok(Watchdog {
            pipe: File::from(write_end),
        })
    }

    /// Moves the deadline; called every time the lock is proven again.
    pub fn extend(&mut self, dead_by: Instant) {
        if let Err(e) = self.pipe.write_all(&as_monotonic_ns(dead_by).to_le_bytes()) {
            error!(error = %e, "cannot reach the watchdog");
        }
    }
}

/// `sentinel-guard __watchdog <app-group> <stop-signal> <grace-ns> <dead-by-ns>`.
pub fn main(args: &[String]) -> ExitCode {
    let parsed = (|| {
        let group: i32 = args.first()?.parse().ok()?;
        let signal: Signal = args.get(1)?.parse().ok()?;
        let grace: u64 = args.get(2)?.parse().ok()?;
        let dead_by: u64 = args.get(3)?.parse().ok()?;
        Some((Pid::from_raw(group), signal, grace, dead_by))
    })();
    let Some((group, stop_signal, grace, dead_by)) = parsed else {
        eprintln!("sentinel-guard: __watchdog is internal to the guard");
        return ExitCode::from(crate::outcome::EXIT_USAGE);
    };
    // Only the guard ends the watchdog: by closing the pipe, or by dying (PDEATHSIG).
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
    let pipe = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(DEADLINE_FD) };
    watch(File::from(pipe), group, stop_signal, grace, dead_by);
    ExitCode::SUCCESS
}

fn watch(mut pipe: File, group: Pid, stop_signal: Signal, grace_ns: u64, mut dead_by: u64) {
    let mut buf = [0u8; 8];
    loop {
        let stop_at = dead_by
            .saturating_sub(grace_ns)
            .saturating_add(SLACK.as_nanos() as u64)
            .min(dead_by);
        let now = monotonic_ns();
        if now >= stop_at {
            return stop_group(group, stop_signal, dead_by);
        }
        let wait_ms = ((stop_at - now) / 1_000_000 + 1).min(u64::from(u16::MAX)) as u16;
        let mut fds = [PollFd::new(pipe.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(wait_ms)) {
            Ok(0) | Err(Errno::EINTR) => continue,
            Ok(_) => {}
            Err(_) => return,
        }
        match pipe.read_exact(&mut buf) {
            Ok(()) => dead_by = u64::from_le_bytes(buf),
            // The guard closed the pipe: it is stopping the app itself, or it is gone.
            Err(_) => return,
        }
    }
}

fn stop_group(group: Pid, stop_signal: Signal, dead_by: u64) {
    error!(
        app_group = group.as_raw(),
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
            app_group = group.as_raw(),
            "watchdog sent SIGKILL at the lock's deadline"
        );
    }
}
