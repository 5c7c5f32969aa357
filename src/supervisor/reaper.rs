//! The one place that waits for children. It reaps every child that ends, including orphans handed
//! to the guard, but the app's main process: that one is only looked at (`WNOWAIT`) until the whole
//! tree is gone, so its pid, which is also the app's process group id, cannot be given to another
//! process while the guard may still signal the group.

use std::io;
use std::time::Duration;

use nix::libc;
use nix::unistd::Pid;
use tokio::signal::unix::{signal, Signal as SignalStream, SignalKind};
use tracing::debug;

use super::tree;
use crate::vocab::AppStatus;

pub struct Reaper {
    sigchld: SignalStream,
    app: Option<Pid>,
    app_status: Option<AppStatus>,
    watchdog: Option<Pid>,
    watchdog_status: Option<AppStatus>,
    /// The health check running, and how the last one ended until it is taken.
    health_check: Option<Pid>,
    health_check_status: Option<AppStatus>,
}

impl Reaper {
    /// Registers for SIGCHLD; must happen before the first child is spawned.
    pub fn register() -> io::Result<Reaper> {
        Ok(Reaper {
            sigchld: signal(SignalKind::child())?,
            app: None,
            app_status: None,
            watchdog: None,
            watchdog_status: None,
            health_check: None,
            health_check_status: None,
        })
    }

    pub fn track_app(&mut self, app: Pid) {
        self.app = Some(app);
    }

    pub fn track_watchdog(&mut self, watchdog: Pid) {
        self.watchdog = Some(watchdog);
    }

    pub fn track_health_check(&mut self, check: Pid) {
        self.health_check = Some(check);
        self.health_check_status = None;
    }

    /// The running health check, unreaped: its pid, and group id, are still its own.
    pub fn health_check(&self) -> Option<Pid> {
        self.health_check
    }

    /// How the last health check ended, once.
    pub fn take_health_check_status(&mut self) -> Option<AppStatus> {
        self.health_check_status.take()
    }

    pub fn app_status(&self) -> Option<AppStatus> {
        self.app_status
    }

    pub fn watchdog_status(&self) -> Option<AppStatus> {
        self.watchdog_status
    }

    /// Reaps every child that has ended but the app, notes whether the app has ended, and returns the
    /// children still alive other than the app and the watchdog: what is left of the app's tree
    /// besides the app itself (a health check running counts, and is stopped with it). An error when the guard's children cannot be read: what is left is
    /// then unknown, which is never "nothing".
    pub fn reap(&mut self) -> io::Result<Vec<Pid>> {
        // The app first: its children are handed to the guard in the same step that makes it a
        // zombie, so once it is seen ended, the children list read next already holds them. The
        // other order could see the app ended but not yet its children, and call the tree gone.
        if let (Some(app), None) = (self.app, self.app_status) {
            self.app_status = peek(app);
        }
        let mut alive = Vec::new();
        for child in tree::children()? {
            if Some(child) == self.app {
                continue;
            }
            let is_watchdog = Some(child) == self.watchdog;
            let is_health_check = Some(child) == self.health_check;
            match wait(child, libc::WNOHANG) {
                Some(status) if is_watchdog => {
                    self.watchdog_status = Some(status);
                    // Reaped: its pid is free for any process now, which must not be mistaken for it.
                    self.watchdog = None;
                }
                Some(status) if is_health_check => {
                    self.health_check_status = Some(status);
                    self.health_check = None;
                }
                Some(status) => debug!(pid = child.as_raw(), %status, "reaped descendant"),
                None if is_watchdog => {}
                None => alive.push(child),
            }
        }
        Ok(alive)
    }

    /// Reaps the app's main process, which must have ended (or been SIGKILLed): the last step of a
    /// teardown, or of a start whose process refused to run the command.
    pub fn reap_app(&mut self) {
        if let Some(app) = self.app.take() {
            if let Some(status) = wait(app, 0) {
                self.app_status = Some(status);
            }
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

/// `waitpid(pid, flags)`: the child's status once it has ended and is reaped.
fn wait(pid: Pid, flags: i32) -> Option<AppStatus> {
    loop {
        let mut raw = 0;
        // SAFETY: plain syscall with a valid out-pointer. libc rather than nix: nix cannot
        // represent a death by a real-time signal and would lose that status.
        let reaped = unsafe { libc::waitpid(pid.as_raw(), &mut raw, flags) };
        if reaped < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return if reaped == pid.as_raw() {
            AppStatus::from_wait(raw)
        } else {
            None
        };
    }
}

/// The status of a child that has ended, left unreaped.
fn peek(pid: Pid) -> Option<AppStatus> {
    // SAFETY: siginfo_t is plain data; waitid fills it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let flags = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
    // SAFETY: valid out-pointer; P_PID with a child's pid.
    let result = unsafe { libc::waitid(libc::P_PID, pid.as_raw() as libc::id_t, &mut info, flags) };
    // SAFETY: si_pid and si_status are valid for SIGCHLD siginfo, which waitid fills.
    if result != 0 || unsafe { info.si_pid() } != pid.as_raw() {
        return None;
    }
    let status = unsafe { info.si_status() };
    match info.si_code {
        libc::CLD_EXITED => Some(AppStatus::Exited(status as u8)),
        libc::CLD_KILLED | libc::CLD_DUMPED => Some(AppStatus::Signaled(status)),
        _ => None,
    }
}
