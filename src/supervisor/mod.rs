//! The supervised app: spawning it, forwarding signals, reaping, and tearing its whole tree down.

mod reaper;
mod signals;
mod spawn;
mod tree;
pub mod watchdog;

use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::{getpid, Pid};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::backend::OrphanSession;
use crate::cli::ForwardTo;
pub use reaper::AppStatus;
pub use signals::{ends_wait, is_shutdown, signal_name, SignalEvents};
pub use spawn::{AppEnv, SpawnError};

/// How often teardown re-reads the process tree while waiting for it to empty.
const TEARDOWN_POLL: Duration = Duration::from_millis(10);

/// Makes the guard the reaper of every orphan below it. As PID 1 it already is.
pub fn become_subreaper() -> nix::Result<()> {
    if getpid().as_raw() != 1 {
        nix::sys::prctl::set_child_subreaper(true)?;
    }
    Ok(())
}

pub struct Supervisor {
    reaper: reaper::Reaper,
    app: Pid,
    guard: Pid,
    forward_to: ForwardTo,
    watchdog: watchdog::Watchdog,
}

impl Supervisor {
    /// Spawns the app, then its watchdog; `stop_signal` and `grace` are what the watchdog uses if it
    /// ever has to stop the app itself, `session` what it ends if the guard dies holding the lock.
    pub fn start(
        command: &[std::ffi::OsString],
        env: &AppEnv<'_>,
        forward_to: ForwardTo,
        stop: (Signal, Duration),
        session: Option<&OrphanSession>,
    ) -> Result<Supervisor, StartError> {
        let mut reaper = reaper::Reaper::register().map_err(StartError::Setup)?;
        let app = spawn::spawn(command, env).map_err(StartError::Spawn)?;
        reaper.track(app);
        let watchdog = match watchdog::Watchdog::spawn(app, stop, &env.set, session) {
            Ok(watchdog) => watchdog,
            Err(e) => {
                // Without its dead man's switch the app must not run.
                let _ = killpg(app, Signal::SIGKILL);
                return Err(StartError::Setup(e));
            }
        };
        info!(
            event = "app_started",
            app_pid = app.as_raw(),
            watchdog_pid = watchdog.pid().as_raw(),
            "app started"
        );
        Ok(Supervisor {
            reaper,
            app,
            guard: getpid(),
            forward_to,
            watchdog,
        })
    }

    /// Tells the watchdog by when the app must be dead should the guard freeze.
    pub fn extend_watchdog(&mut self, dead_by: Instant) {
        self.watchdog.extend(dead_by);
    }

    pub fn app_pid(&self) -> Pid {
        self.app
    }

    /// Resolves when the main app process has ended. Cancel-safe.
    pub async fn app_exit(&mut self) -> AppStatus {
        self.reaper.main_exit().await
    }

    pub fn forward(&self, signal: i32) {
        let name = signal_name(signal);
        let target = match self.forward_to {
            ForwardTo::Group => -self.app.as_raw(),
            ForwardTo::Child => self.app.as_raw(),
        };
        // Raw kill(2): nix's Signal cannot carry real-time signals.
        // SAFETY: kill(2) with a pid and a signal number has no memory-safety preconditions.
        let result = unsafe { nix::libc::kill(target, signal) };
        if result == 0 {
            info!(event = "signal_forwarded", signal = %name, target, "signal forwarded");
        } else {
            // ESRCH: the app is already gone, which its exit status will tell.
            debug!(signal = %name, target, error = %Errno::last(), "signal not forwarded");
        }
    }

    /// Stops everything below the guard: `signal` to the app's group and to every descendant that
    /// left it, up to `grace` for them to exit, then SIGKILL until nothing is left. Returns only once
    /// no process of the app is alive, so the lock may be released.
    pub async fn stop_tree(&mut self, signal: Signal, grace: Duration) {
        // The guard stops the app itself now, at its own pace.
        self.watchdog.disarm();
        let deadline = Instant::now() + grace;
        if self.signal_tree(signal) {
            info!(event = "stopping_app", signal = %signal, grace = %humantime::format_duration(grace), "stopping app process tree");
        }
        loop {
            self.reaper.reap();
            if self.app_processes().is_empty() {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            self.reaper
                .child_event(TEARDOWN_POLL.min(deadline - now))
                .await;
        }
        if !grace.is_zero() {
            warn!(event = "killing_app", grace = %humantime::format_duration(grace), "app processes outlived the grace period; sending SIGKILL");
        }
        loop {
            self.signal_tree(Signal::SIGKILL);
            if self.guard.as_raw() == 1 {
                // As PID 1 of a namespace, this also reaches anything that escaped the tree scan.
                let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
            }
            self.reaper.reap();
            if self.app_processes().is_empty() {
                return;
            }
            self.reaper.child_event(TEARDOWN_POLL).await;
        }
    }

    /// Signals the app's group, and each live descendant outside it. Returns whether anything was alive.
    fn signal_tree(&self, signal: Signal) -> bool {
        let live = self.app_processes();
        let _ = killpg(self.app, signal);
        for process in live.iter().filter(|p| p.pgid != self.app) {
            let _ = kill(process.pid, signal);
        }
        !live.is_empty()
    }

    /// Every live process below the guard but its own watchdog.
    fn app_processes(&self) -> Vec<tree::Descendant> {
        let mut live = tree::live_descendants(self.guard);
        live.retain(|p| p.pid != self.watchdog.pid());
        live
    }

    pub fn app_status(&self) -> Option<AppStatus> {
        self.reaper.main_status()
    }
}

impl Drop for Supervisor {
    /// Every way out of supervision stops the app first; from here the guard exits on its own, and
    /// its watchdog must not take the pipe's end for a death.
    fn drop(&mut self) {
        self.watchdog.stand_down();
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot watch for child exits: {0}")]
    Setup(std::io::Error),
    #[error(transparent)]
    Spawn(SpawnError),
}
