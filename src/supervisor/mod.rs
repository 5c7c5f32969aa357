//! The supervised app: spawning it, forwarding signals, reaping, and tearing its whole tree down.

mod cgroup;
mod pause;
mod pidfd;
mod reaper;
mod signals;
mod spawn;
mod tree;
pub mod watchdog;

use std::collections::HashSet;
use std::sync::Once;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::{getpid, Pid};
use tracing::{debug, info, warn};

use crate::cli::ForwardTo;
use crate::deadline::{AsyncBootTimer, Deadline};
use crate::handoff::{Farewell, TreeGone};
use crate::vocab::{signal_name, AppStatus};
use cgroup::AppCgroup;
pub use signals::{ends_wait, is_shutdown, on_parent_death, ParentWatch, SignalEvents};
pub use spawn::{raise_descriptor_limit, resolve, AppEnv, SpawnError};
use spawn::{NotRun, NotStarted};
pub use tree::proc_is_ours;
use watchdog::{Message, Watchdog};

/// Teardown re-reads the guard's children at least this often; a SIGCHLD wakes it sooner.
const TEARDOWN_TICK: Duration = Duration::from_millis(100);
/// Outside teardown the reaper also runs on this tick, in case a SIGCHLD was coalesced.
const REAP_TICK: Duration = Duration::from_secs(1);
/// How long a stood-down watchdog gets to exit before it is killed.
const WATCHDOG_EXIT_WAIT: Duration = Duration::from_secs(1);

/// Makes the guard the reaper of every orphan below it. As PID 1 it already is.
pub fn become_subreaper() -> nix::Result<()> {
    if getpid().as_raw() != 1 {
        nix::sys::prctl::set_child_subreaper(true)?;
    }
    Ok(())
}

/// What ended supervision, as the guard sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    AppExited(AppStatus),
    /// The watchdog ended; `acted` when it stopped the app of an unresponsive guard.
    WatchdogEnded {
        acted: bool,
    },
    /// The health check started by `start_health_check` ended.
    HealthCheckEnded(AppStatus),
}

/// A finished teardown.
pub struct Stopped {
    pub app: Option<AppStatus>,
    /// The watchdog stopped the app itself at some point: the guard had been unresponsive while its
    /// lock ran out.
    pub watchdog_acted: bool,
    pub gone: TreeGone,
}

pub struct Supervisor {
    reaper: reaper::Reaper,
    app: Pid,
    forward_to: ForwardTo,
    watchdog: Watchdog,
    /// The watchdog's end was already reported by `next_event`.
    watchdog_reported: bool,
    /// Every process the app forks, `setsid` or not; none where no cgroup can be made.
    cgroup: Option<AppCgroup>,
    /// Where health checks run, below `cgroup`.
    checks: ChecksCgroups,
}

/// A cgroup of its own for each health check, below the app's. Never one for two checks: a process
/// born (`CLONE_INTO_CGROUP`) into a cgroup once emptied through `cgroup.kill` was seen killed at
/// birth (Linux 6.18), so a check never starts where an earlier one was swept.
#[derive(Default)]
struct ChecksCgroups {
    made: u64,
    current: Option<(AppCgroup, cgroup::Entry)>,
    /// Earlier checks' cgroups, removed once empty (their last processes may still be unreaped).
    spent: Vec<AppCgroup>,
}

impl ChecksCgroups {
    /// A fresh cgroup below `app` for the next check; none where it cannot be made.
    fn next(&mut self, app: &AppCgroup) -> Option<&cgroup::Entry> {
        self.retire();
        self.made += 1;
        let made = app
            .child(&format!("health-{}", self.made))
            .and_then(|c| c.entry().map(|e| (c, e)));
        match made {
            Ok(made) => self.current = Some(made),
            Err(e) => {
                debug!(error = %e, "no cgroup of its own for the health check; it runs in the app's");
            }
        }
        self.current.as_ref().map(|(_, entry)| entry)
    }

    /// SIGKILL to whatever the current check left in its cgroup.
    fn sweep(&self) {
        if let Some((cgroup, _)) = &self.current {
            if !cgroup.is_empty().unwrap_or(false) {
                let _ = cgroup.kill();
            }
        }
    }

    /// The current check's cgroup joins the spent ones; those that are empty are removed.
    fn retire(&mut self) {
        self.spent
            .extend(self.current.take().map(|(cgroup, _)| cgroup));
        self.spent.retain(|cgroup| !cgroup.remove());
    }
}

impl Supervisor {
    /// Spawns the watchdog, then the app, which tells the watchdog its group before it runs the
    /// command; `stop_signal` and `grace` are what the watchdog uses if it ever has to stop the app
    /// itself, `farewell` what it does for the lock if the guard dies, `app_deadline` by when the app
    /// must be dead unless ownership is proven again (none: no lock), `cgroup_required` whether the
    /// app may run where no cgroup can be made for it (see `check_app_cgroup`).
    pub async fn start(
        command: &[std::ffi::OsString],
        env: &AppEnv<'_>,
        forward_to: ForwardTo,
        stop: (Signal, Duration),
        farewell: &Farewell<'_>,
        app_deadline: Option<Deadline>,
        cgroup_required: bool,
    ) -> Result<Supervisor, StartError> {
        let mut reaper = reaper::Reaper::register().map_err(StartError::Setup)?;
        let (cgroup, entry) = app_cgroup(cgroup_required)?.unzip();
        // Without its dead man's switch the app must not run.
        let mut watchdog =
            match Watchdog::spawn(stop, &env.set, env.remove, farewell, cgroup.as_ref()) {
                Ok(watchdog) => watchdog,
                Err(e) => {
                    if let Some(cgroup) = &cgroup {
                        cgroup.remove();
                    }
                    return Err(StartError::Watchdog(e));
                }
            };
        reaper.track_watchdog(watchdog.pid());
        // The deadline goes first, before the app is forked: a guard frozen from here on is already
        // backed by the watchdog, which acts on a passed deadline whatever else it has heard.
        if let Some(app_deadline) = app_deadline {
            watchdog.send(Message::AppDeadline(app_deadline));
        }
        let not_after = app_deadline.unwrap_or(Deadline::NEVER);
        pause::at(pause::Point::BeforeFork);
        let app = match spawn::spawn(command, env, watchdog.app_link(), not_after, entry.as_ref()) {
            Ok(app) => {
                pause::at(pause::Point::AfterSpawn);
                app
            }
            Err(NotRun {
                why: not_started,
                process,
            }) => {
                // Which side refused: the app's process on its own clock, or the watchdog by
                // ending first (told apart for the tests of the window before the fork).
                let noticed_by = match not_started {
                    NotStarted::WatchdogGone => "watchdog",
                    _ => "app_process",
                };
                let mut error = start_error(not_started, cgroup.as_ref(), &mut watchdog, not_after);
                // The app's process may have told the watchdog its group: it is reaped only once the
                // watchdog has exited, so that nothing the watchdog signals meanwhile is another's.
                // Killed first (unreaped, its pid and group are still its own): whatever it was
                // about to do, the wait for it below cannot hang.
                if let Some(process) = process {
                    reaper.track_app(process);
                    let _ = killpg(process, Signal::SIGKILL);
                    let _ = kill(process, Signal::SIGKILL);
                }
                watchdog.send(Message::StandDown);
                debug!(event = "app_not_started", noticed_by, error = %error, "the command was not run; waiting for the watchdog to stand down");
                // A watchdog that acted found the deadline passed: the lock is lost, whatever else
                // went wrong.
                if await_watchdog(&mut reaper, &watchdog).await {
                    error = StartError::DeadlinePassed;
                }
                reaper.reap_app();
                if let Some(cgroup) = &cgroup {
                    cgroup.remove();
                }
                return Err(error);
            }
        };
        watchdog.app_started();
        reaper.track_app(app);
        info!(
            event = "app_started",
            app_pid = app.as_raw(),
            watchdog_pid = watchdog.pid().as_raw(),
            "app started"
        );
        Ok(Supervisor {
            reaper,
            app,
            forward_to,
            watchdog,
            watchdog_reported: false,
            cgroup,
            checks: ChecksCgroups::default(),
        })
    }

    pub fn app_pid(&self) -> Pid {
        self.app
    }

    /// Tells the watchdog by when the app must be dead should the guard freeze.
    pub fn move_app_deadline(&mut self, app_deadline: Deadline) {
        self.watchdog.send(Message::AppDeadline(app_deadline));
    }

    /// Tells the watchdog the lock is no longer ours: nothing of it to free on the guard's death.
    pub fn lock_lost(&mut self) {
        self.watchdog.send(Message::LockLost);
    }

    /// Resolves when the app's main process ends or the watchdog does. Cancel-safe.
    pub async fn next_event(&mut self) -> Event {
        loop {
            // Unreadable children change nothing here: the app's own exit is read by its pid.
            let _ = self.reaper.reap();
            if self.watchdog.jammed() && !self.watchdog_reported {
                self.watchdog_reported = true;
                return Event::WatchdogEnded { acted: false };
            }
            if let (Some(status), false) = (self.reaper.watchdog_status(), self.watchdog_reported) {
                self.watchdog_reported = true;
                return Event::WatchdogEnded {
                    acted: watchdog::acted(status),
                };
            }
            if let Some(status) = self.reaper.app_status() {
                return Event::AppExited(status);
            }
            if let Some(status) = self.reaper.take_health_check_status() {
                return Event::HealthCheckEnded(status);
            }
            self.reaper.child_event(REAP_TICK).await;
        }
    }

    /// Starts a health check, `/bin/sh -c command`, whose end `next_event` reports. One runs at a
    /// time. It runs in a cgroup of its own below the app's, so a check that is killed or has ended
    /// leaves nothing behind (`end_health_check`), `setsid` or not (where that cannot be made, in
    /// the app's); where the app has no cgroup, in a process group of its own, and only the shell
    /// dies with the guard.
    pub fn start_health_check(&mut self, command: &str, env: &AppEnv<'_>) -> std::io::Result<Pid> {
        let app_entry;
        let entry = match &self.cgroup {
            Some(app) => match self.checks.next(app) {
                Some(entry) => Some(entry),
                // Never outside every cgroup of the app: where it cannot have one of its own the
                // check runs in the app's, and what it leaves in the background is stopped with
                // the app, not when the check ends. One that cannot get in there either has failed.
                None => {
                    app_entry = app.entry()?;
                    Some(&app_entry)
                }
            },
            None => {
                static SAID: Once = Once::new();
                if getpid().as_raw() != 1 {
                    SAID.call_once(|| warn!(event = "health_check_uncontained", "no cgroup for the health check: what it starts in the background outlives a guard killed by SIGKILL"));
                }
                None
            }
        };
        let argv = ["/bin/sh".into(), "-c".into(), command.into()];
        let pid = spawn::spawn_helper(&argv, env, entry)?;
        self.reaper.track_health_check(pid);
        Ok(pid)
    }

    /// SIGKILL to the running health check and everything it started; its end is still reported.
    pub fn kill_health_check(&self) {
        if let Some(check) = self.reaper.health_check() {
            let _ = killpg(check, Signal::SIGKILL);
        }
        self.checks.sweep();
    }

    /// SIGKILL to whatever an ended health check left in its cgroup.
    pub fn end_health_check(&self) {
        self.checks.sweep();
    }

    pub fn forward(&self, signal: i32) {
        let name = signal_name(signal);
        let target = match self.forward_to {
            ForwardTo::Group => -self.app.as_raw(),
            ForwardTo::Child => self.app.as_raw(),
        };
        // Raw kill(2): nix's Signal cannot carry real-time signals. The app's pid is not reaped
        // before teardown ends, so it cannot name another process here.
        // SAFETY: kill(2) with a pid and a signal number has no memory-safety preconditions.
        let result = unsafe { nix::libc::kill(target, signal) };
        if result == 0 {
            info!(event = "signal_forwarded", signal = %name, target, "signal forwarded");
        } else {
            // ESRCH: the app is already gone, which its exit status will tell.
            debug!(signal = %name, target, error = %Errno::last(), "signal not forwarded");
        }
    }

    /// SIGKILL to the app's group and every other process left below the guard; supervision goes
    /// on until the app's exit is seen.
    pub fn kill_all(&mut self) {
        let _ = signal_app(self.app, self.cgroup.as_ref(), Signal::SIGKILL);
        for pid in self.reaper.reap().unwrap_or_default() {
            let _ = kill(pid, Signal::SIGKILL);
        }
    }

    /// Stops everything below the guard: `signal` to the app's group and to every process that left
    /// it, then SIGKILL at `kill_by` (at once if it has passed), until nothing is left. The watchdog
    /// stays armed with `kill_by` throughout and stands down only once the tree is gone.
    /// `announce` logs why, once the first signal is out: kill first, log after.
    pub async fn stop(
        mut self,
        signal: Signal,
        kill_by: Deadline,
        announce: impl FnOnce(),
    ) -> Stopped {
        self.watchdog.send(Message::KillBy(kill_by));
        let gone = teardown(
            &mut self.reaper,
            (self.app, self.cgroup.as_ref()),
            signal,
            kill_by,
            announce,
        )
        .await;
        self.watchdog.send(Message::StandDown);
        let watchdog_acted = await_watchdog(&mut self.reaper, &self.watchdog).await;
        // The checks' cgroups first: the app's cannot be removed while it has one below it.
        self.checks.retire();
        if let Some(cgroup) = &self.cgroup {
            cgroup.remove();
        }
        spawn::reclaim_terminal(self.app);
        // Only now may the app's pid, and with it its group id, be given to another process.
        self.reaper.reap_app();
        Stopped {
            app: self.reaper.app_status(),
            watchdog_acted,
            gone,
        }
    }
}

/// What a start the app's process refused (`why`) means to the guard.
fn start_error(
    why: NotStarted,
    cgroup: Option<&AppCgroup>,
    watchdog: &mut Watchdog,
    not_after: Deadline,
) -> StartError {
    match why {
        NotStarted::Command(e) => StartError::Spawn(e),
        NotStarted::DeadlinePassed => StartError::DeadlinePassed,
        NotStarted::CgroupJoin => StartError::CgroupJoin(
            cgroup
                .map(|c| c.dir().display().to_string())
                .unwrap_or_default(),
        ),
        // A watchdog that acted on the passed deadline before the app's process could tell it its
        // group: the same refusal, seen from the other side.
        NotStarted::WatchdogGone if not_after.has_passed() => StartError::DeadlinePassed,
        NotStarted::WatchdogGone => StartError::Watchdog(watchdog.exec_error()),
    }
}

/// Waits for the stood-down watchdog to exit; returns whether it ever acted.
async fn await_watchdog(reaper: &mut reaper::Reaper, watchdog: &Watchdog) -> bool {
    let until = Deadline::after(WATCHDOG_EXIT_WAIT);
    loop {
        let _ = reaper.reap();
        if let Some(status) = reaper.watchdog_status() {
            return watchdog::acted(status);
        }
        if until.has_passed() {
            // It is the guard's own child, so its pid is still its own: no one else is hit.
            let _ = kill(watchdog.pid(), Signal::SIGKILL);
        }
        reaper.child_event(TEARDOWN_TICK).await;
    }
}

/// Signals the app's group, its cgroup and what else is left below the guard until nothing is:
/// `signal` first, SIGKILL from `kill_by` on. Kill first, log after. Waits on SIGCHLD and the boot
/// clock only.
async fn teardown(
    reaper: &mut reaper::Reaper,
    (app, cgroup): (Pid, Option<&AppCgroup>),
    signal: Signal,
    kill_by: Deadline,
    announce: impl FnOnce(),
) -> TreeGone {
    let mut current = if kill_by.has_passed() {
        Signal::SIGKILL
    } else {
        signal
    };
    let mut signalled: HashSet<Pid> = signal_app(app, cgroup, current).into_iter().collect();
    announce();
    // The first signal is out: the tasks `announce` woke run now (the lock's getting ready for its
    // release opens a connection), not once the tree is gone, which a tree that is already gone
    // (an app that ended on its own) would be at the first look, before anything else could run.
    tokio::task::yield_now().await;
    let mut kill_timer = AsyncBootTimer::new(kill_by).ok();
    let mut logged = false;
    let mut unreadable_logged = false;
    loop {
        let (left, known) = match reaper.reap() {
            Ok(left) => (left, true),
            // Fail closed: with the children unknown, the tree is not gone. The group is signalled
            // again and the children read again on the next tick.
            Err(e) => {
                let _ = signal_app(app, cgroup, current);
                if !unreadable_logged {
                    unreadable_logged = true;
                    warn!(event = "children_unreadable", error = %e, "cannot read the guard's children from /proc; the lock stays held until they can be read");
                }
                (Vec::new(), false)
            }
        };
        // A cgroup whose state cannot be read is not empty either.
        let cgroup_empty = cgroup.is_none_or(|cgroup| cgroup.is_empty().unwrap_or(false));
        if known && reaper.app_status().is_some() && left.is_empty() && cgroup_empty {
            return TreeGone::seen_by_teardown();
        }
        // Processes that left the app's group, and orphans handed to the guard: each gets the
        // current signal once. They are the guard's children, unreaped, so their pids are theirs.
        // The cgroup's members outside the group (a setsid'd process whose parent still runs is
        // in no list of the guard's) are known only by a number read from its list: pinned first.
        let in_cgroup = cgroup.and_then(|cgroup| cgroup.members().ok());
        if let Some(in_cgroup) = &in_cgroup {
            signalled.retain(|pid| left.contains(pid) || in_cgroup.contains(pid));
        }
        for pid in left {
            if signalled.insert(pid) {
                let _ = kill(pid, current);
            }
        }
        if let (Some(cgroup), Some(in_cgroup)) = (cgroup, in_cgroup) {
            let outside: Vec<Pid> = in_cgroup
                .into_iter()
                .filter(|pid| !signalled.contains(pid))
                .filter(|pid| nix::unistd::getpgid(Some(*pid)).is_ok_and(|group| group != app))
                .collect();
            signalled.extend(pidfd::signal_listed(&outside, || cgroup.members(), current));
        }
        if !logged {
            logged = true;
            info!(event = "stopping_app", signal = %current, kill_in = %crate::vocab::show_duration(kill_by.remaining()), "stopping app process tree");
        }
        let sigkill_due = async {
            match kill_timer.as_mut() {
                _ if current == Signal::SIGKILL => std::future::pending().await,
                Some(timer) => timer.fired().await,
                // No timer descriptor to spare: the tick re-checks the clock below.
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = reaper.child_event(TEARDOWN_TICK) => {}
            _ = sigkill_due => {}
        }
        if current != Signal::SIGKILL && kill_by.has_passed() {
            current = Signal::SIGKILL;
            signalled.clear();
            signalled.extend(signal_app(app, cgroup, current));
            warn!(
                event = "killing_app",
                "app processes outlived their stop deadline; sending SIGKILL"
            );
        }
    }
}

/// The app's group, the app itself should it have left its group, and what of its cgroup is outside
/// the group; returns the processes signalled outside it. The app's pid is not reaped before
/// teardown ends, so neither number can name another process.
fn signal_app(app: Pid, cgroup: Option<&AppCgroup>, signal: Signal) -> Vec<Pid> {
    let _ = killpg(app, signal);
    if nix::unistd::getpgid(Some(app)).is_ok_and(|group| group != app) {
        let _ = kill(app, signal);
    }
    match cgroup {
        Some(cgroup) if signal == Signal::SIGKILL && cgroup.kill().is_ok() => Vec::new(),
        Some(cgroup) => cgroup.signal_outside(app, signal),
        None => Vec::new(),
    }
}

/// The app's cgroup, and the ways in for the app's process.
fn make_app_cgroup() -> Result<(AppCgroup, cgroup::Entry), String> {
    AppCgroup::create().and_then(|cgroup| match cgroup.entry() {
        Ok(entry) => Ok((cgroup, entry)),
        Err(e) => {
            let reason = format!("{}: {e}", cgroup.dir().display());
            cgroup.remove();
            Err(reason)
        }
    })
}

/// Whether a process that leaves the app's group (`setsid`, a double fork) dies with the rest once
/// the guard is SIGKILLed: as PID 1 the kernel ends every process of the namespace with the guard,
/// otherwise only a cgroup of the app's holds such a process. Where neither holds, the reason; when
/// the app may run so (`required` false) it is also said once, as a warning.
pub fn check_app_cgroup(required: bool) -> Result<(), String> {
    if getpid().as_raw() == 1 {
        return Ok(());
    }
    match make_app_cgroup() {
        Ok((cgroup, _)) => {
            if !cgroup.remove() {
                debug!(cgroup = %cgroup.dir().display(), "the cgroup made to try cannot be removed; it is left empty");
            }
            Ok(())
        }
        Err(reason) => app_cgroup_missing(reason, required),
    }
}

/// `check_app_cgroup`'s verdict on a cgroup that could not be made.
fn app_cgroup_missing(reason: String, required: bool) -> Result<(), String> {
    static SAID: Once = Once::new();
    if getpid().as_raw() == 1 {
        SAID.call_once(|| {
            debug!(reason = %reason, "no cgroup for the app; as PID 1 the kernel stops the whole namespace with the guard");
        });
        return Ok(());
    }
    if required {
        return Err(reason);
    }
    SAID.call_once(|| {
        warn!(event = "app_cgroup_unavailable", reason = %reason, "no cgroup can be made for the app: a process of it that leaves its process group (setsid, a double fork) outlives a guard killed by SIGKILL");
    });
    Ok(())
}

/// The app's cgroup, and the ways in for the app's process; none where no cgroup can be made and
/// the app may run without one (see `check_app_cgroup`).
fn app_cgroup(required: bool) -> Result<Option<(AppCgroup, cgroup::Entry)>, StartError> {
    match make_app_cgroup() {
        Ok(made) => Ok(Some(made)),
        Err(reason) => app_cgroup_missing(reason, required)
            .map(|()| None)
            .map_err(StartError::NoCgroup),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot watch for child exits: {0}")]
    Setup(std::io::Error),
    #[error(transparent)]
    Spawn(SpawnError),
    /// The watchdog could not be started, so the app was not.
    #[error("cannot start the watchdog: {0}")]
    Watchdog(std::io::Error),
    /// The lock's deadline passed before the command could run (the guard was frozen on the way).
    #[error("the lock's deadline passed before the command could run")]
    DeadlinePassed,
    /// No cgroup could be made for the app, which may not run without one (`--allow-no-cgroup`).
    #[error("no cgroup can be made for the app ({0}) and --allow-no-cgroup is not given")]
    NoCgroup(String),
    /// The guard made the app's cgroup, but the app's process could not move itself into it.
    #[error("the app's process could not move itself into the app's cgroup {0}")]
    CgroupJoin(String),
}
