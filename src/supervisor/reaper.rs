//! The one place that calls `waitpid`. It reaps every child, including orphans reparented to the
//! guard, and keeps the main app's status for whoever asks.

use std::fmt;
use std::io;
use std::time::Duration;

use nix::libc;
use nix::unistd::Pid;
use tokio::signal::unix::{signal, Signal as SignalStream, SignalKind};
use tracing::debug;

use super::signals::signal_name;

/// Reaping also runs on this tick, in case a SIGCHLD was coalesced with one already handled.
const REAP_TICK: Duration = Duration::from_secs(1);

/// How the app ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppStatus {
    Exited(u8),
    Signaled(i32),
}

impl AppStatus {
    /// The shell's convention: the exit code, or 128+N for death by signal N.
    pub fn code(self) -> u8 {
        match self {
            AppStatus::Exited(code) => code,
            AppStatus::Signaled(signal) => 128u8.wrapping_add(signal as u8),
        }
    }
}

impl fmt::Display for AppStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AppStatus::Exited(code) => write!(f, "exited with code {code}"),
            AppStatus::Signaled(signal) => write!(f, "killed by {}", signal_name(*signal)),
        }
    }
}

pub struct Reaper {
    sigchld: SignalStream,
    main: Option<Pid>,
    main_status: Option<AppStatus>,
}

impl Reaper {
    /// Registers for SIGCHLD; must happen before the first child is spawned.
    pub fn register() -> io::Result<Reaper> {
        Ok(Reaper {
            sigchld: signal(SignalKind::child())?,
            main: None,
            main_status: None,
        })
    }

    pub fn track(&mut self, main: Pid) {
        self.main = Some(main);
    }

    pub fn main_status(&self) -> Option<AppStatus> {
        self.main_status
    }

    /// Collects every child that has ended, without blocking.
    pub fn reap(&mut self) {
        loop {
            let mut raw = 0;
            // SAFETY: plain syscall with a valid out-pointer. libc rather than nix: nix cannot
            // represent a death by a real-time signal and would lose that status.
            let pid = unsafe { libc::waitpid(-1, &mut raw, libc::WNOHANG) };
            if pid <= 0 {
                if pid < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return;
            }
            let status = if libc::WIFEXITED(raw) {
                AppStatus::Exited(libc::WEXITSTATUS(raw) as u8)
            } else if libc::WIFSIGNALED(raw) {
                AppStatus::Signaled(libc::WTERMSIG(raw))
            } else {
                continue;
            };
            if Some(Pid::from_raw(pid)) == self.main {
                self.main_status = Some(status);
            } else {
                debug!(pid, %status, "reaped descendant");
            }
        }
    }

    /// Resolves when the main app has ended. Cancel-safe: the status is kept once reaped.
    pub async fn main_exit(&mut self) -> AppStatus {
        loop {
            self.reap();
            if let Some(status) = self.main_status {
                return status;
            }
            self.child_event(REAP_TICK).await;
        }
    }

    /// Waits for a SIGCHLD, or at most `limit`.
    pub async fn child_event(&mut self, limit: Duration) {
        tokio::select! {
            _ = self.sigchld.recv() => {}
            _ = tokio::time::sleep(limit) => {}
        }
    }
}
