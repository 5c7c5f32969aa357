//! The guard's life: take the lock, start the app, then wait for whichever comes first of the app
//! ending, the lock being lost, a signal, or the max runtime; tear the app's tree down; release.
//! Scheduled runs (`schedule`) and supervising one app (`supervise`) are its two halves.

use std::sync::Arc;
use std::time::Duration;

use nix::unistd::Pid;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::backend::{
    self, Acquisition, Backoff, HeldLock, HolderInfo, LockRequest, Patience, ServingLock,
};
use crate::config::{Config, TakeoverDelay, Target, Wait};
use crate::deadline::{self, Deadline};
use crate::endpoints::Endpoints;
use crate::handoff::TreeGone;
use crate::held::{HeldSocket, Vouching};
use crate::holder::Holder;
use crate::metrics::{AcquireOutcome, Checks, Metrics};
use crate::notify;
use crate::outcome::Outcome;
use crate::record::Previous;
use crate::supervisor::{self, ends_wait, ParentWatch, SignalEvents, SpawnError};
use crate::vocab::{signal_name, CheckOutcome, ENV_SOCKET};

mod health;
mod schedule;
mod supervise;

/// Variables the app (and the watchdog) must never see: the first two may carry the backend's
/// credentials; with `NOTIFY_SOCKET` the app could tell systemd it is ready before it runs under the
/// lock, or speak for the guard after a loss (with `NotifyAccess=all`), so the guard alone speaks.
/// The health check's settings go too: its command may carry a token, and a guard the app runs
/// would inherit the check.
const HIDDEN_FROM_APP: &[&str] = &[
    "SENTINEL_GUARD_URL",
    "SENTINEL_GUARD_URL_FILE",
    crate::notify::SOCKET_VAR,
    "SENTINEL_GUARD_HEALTH_CMD",
    "SENTINEL_GUARD_HEALTH_INTERVAL",
    "SENTINEL_GUARD_HEALTH_TIMEOUT",
    "SENTINEL_GUARD_HEALTH_RETRIES",
    "SENTINEL_GUARD_HEALTH_START_PERIOD",
    // An operator's acceptance of a risk for this guard, not for a guard the app may run.
    "SENTINEL_GUARD_ALLOW_NO_CGROUP",
];

/// The exit a command that could not be executed ends the guard with: 127 when it (or its script's
/// interpreter) is not found, 126 when it cannot be executed, as a shell says.
fn command_outcome(error: &SpawnError) -> Outcome {
    match error {
        SpawnError::NotFound { .. } | SpawnError::InterpreterNotFound { .. } => Outcome::NotFound,
        SpawnError::NotExecutable { .. } => Outcome::NotExecutable,
    }
}

/// `parent` is the guard's parent when it started, for `--parent-death-signal`.
pub async fn run(config: &Config, endpoints: Option<Endpoints>, parent: Pid) -> Outcome {
    let holder = Holder::of_this_process();
    let backend = config.target.as_ref().map_or("none", |t| t.backend_name());
    let span = info_span!(
        "guard",
        name = %config.name,
        backend,
        holder_id = %holder.id,
    );
    let metrics = Metrics::new(
        config.name.as_str(),
        backend,
        config.target.is_none(),
        config.timings.check_timeout,
        config.schedule.map(|s| s.period),
        config.health.is_some(),
    );
    let vouching = Vouching::new(config.name.as_str(), backend, &holder.id);
    // Removed, with its directory, when the guard returns. Without it the guard still runs (a
    // read-only root with no runtime directory): the app is told of no socket, and `held` says so.
    let socket = span.in_scope(|| {
        let bound = HeldSocket::bind().and_then(|mut socket| {
            socket
                .serve(vouching.clone())
                .map(|()| socket)
                .map_err(|e| e.to_string())
        });
        bound
            .map_err(|why| {
                warn!(event = "held_socket_unavailable", tried = %why, "cannot make the app's socket ({ENV_SOCKET}); the app runs without it");
            })
            .ok()
    });
    let guard = Guard {
        config,
        holder: &holder,
        backend,
        observer: Arc::new(Reports {
            checks: metrics.checks(),
            metrics: metrics.clone(),
        }),
        metrics,
        vouching,
        app_socket: socket.as_ref().map(HeldSocket::path),
    };
    let outcome = guard.run(endpoints, parent).instrument(span.clone()).await;
    span.in_scope(|| {
        let exit_code = outcome.exit_code(config.held_exit_code, &config.exit_code_map);
        info!(
            event = "guard_exiting",
            outcome = %outcome,
            exit_code,
            "guard exiting"
        );
    });
    drop(socket);
    outcome
}

/// The lock layer's reports, as the outside sees them: metrics, and the service manager's status.
struct Reports {
    checks: Checks,
    metrics: Metrics,
}

impl backend::Observer for Reports {
    fn check(&self, outcome: CheckOutcome, took: std::time::Duration) {
        self.checks.record(outcome, took);
    }

    fn held_elsewhere(&self) {
        self.metrics.acquire(AcquireOutcome::Held);
    }

    fn waiting(&self, holder: &HolderInfo) {
        notify::status(&format!("waiting for the lock held by {holder}"));
    }
}

struct Guard<'a> {
    config: &'a Config,
    holder: &'a Holder,
    backend: &'static str,
    metrics: Metrics,
    /// What the lock layer reports, turned into metrics and the service manager's status.
    observer: Arc<dyn backend::Observer>,
    /// The socket the app is told of, which `vouching` answers on.
    app_socket: Option<std::path::PathBuf>,
    /// What the app's socket answers: whether the lock is held, and for how long it is promised.
    vouching: Vouching,
}

impl Guard<'_> {
    async fn run(self, endpoints: Option<Endpoints>, parent: Pid) -> Outcome {
        if let Some(endpoints) = endpoints {
            if let Err(e) = endpoints.serve(self.metrics.clone()) {
                error!(event = "metrics_failed", error = %e, "cannot serve the metrics endpoint");
                return Outcome::Internal;
            }
        }
        // Handlers first: from here on no signal kills the guard and no child goes unreaped.
        let mut signals = match SignalEvents::register() {
            Ok(signals) => signals,
            Err(e) => {
                error!(event = "setup_failed", error = %e, "cannot install signal handlers");
                return Outcome::Internal;
            }
        };
        if let Some(signal) = self.config.parent_death_signal {
            match supervisor::on_parent_death(signal, parent) {
                Ok(ParentWatch::AlreadyGone) => {
                    warn!(event = "parent_died", signal = %signal_name(signal as i32), "the guard's parent died before it started; acting on the parent death signal")
                }
                Ok(watch) => {
                    info!(event = "parent_death_signal", signal = %signal_name(signal as i32), pid1 = (watch == ParentWatch::Unseen), "the guard receives this signal when its parent dies")
                }
                Err(e) => {
                    error!(event = "setup_failed", error = %e, "cannot set the parent death signal");
                    return Outcome::Internal;
                }
            }
        }
        supervisor::raise_descriptor_limit();
        if let Err(e) = supervisor::become_subreaper() {
            error!(event = "setup_failed", error = %e, "cannot become child subreaper; orphans of the app could escape teardown");
            return Outcome::Internal;
        }
        if !supervisor::proc_is_ours() {
            error!(
                event = "setup_failed",
                "/proc shows another PID namespace than the guard's own, so the app's processes cannot be found by pid; mount /proc for this namespace (unshare --mount-proc)"
            );
            return Outcome::Internal;
        }
        // Refused before any lock is taken: nothing would stop a process of the app that left its
        // group once a SIGKILLed guard's lock goes to another holder.
        let required = self.config.cgroup_required(self.config.target.is_some());
        if let Err(reason) = supervisor::check_app_cgroup(required) {
            error!(
                event = "app_cgroup_unavailable",
                reason = %reason,
                "no cgroup can be made for the app and the guard is not PID 1: a process of the app that leaves its process group \
                 (setsid, a double fork) would outlive a guard killed by SIGKILL and could run beside the next holder's app; \
                 run the guard as PID 1 of its container, give it a writable cgroup (root with /sys/fs/cgroup writable, \
                 systemd Delegate=yes), or pass --allow-no-cgroup to accept that"
            );
            return Outcome::Usage;
        }
        if self.config.target.is_none() {
            warn!(
                event = "unguarded",
                "SINGLE_INSTANCE_GUARD=false: running the app WITHOUT ANY LOCK; several copies may run at once. \
                 Never use this in production."
            );
        }
        if self.config.target.is_some()
            && self.config.takeover_delay == TakeoverDelay::Fixed(Duration::ZERO)
        {
            warn!(
                event = "takeover_delay_off",
                "--takeover-delay 0s: when the backend takes the lock away (a KILL, a failover, a deleted key or file), \
                 a new holder may start its app while this one's is still stopping; --takeover-delay auto waits for it"
            );
        }
        for option in &self.config.ignored_options {
            warn!(event = "option_not_applicable", option = %option, "the option does not apply to this backend and is ignored");
        }
        // A command that cannot be executed is found out before any lock is taken or any window
        // claimed, with the exit code its exec would have given.
        if let Err(outcome) = self.command_runs() {
            return outcome;
        }
        if let Some(schedule) = &self.config.schedule {
            return self.scheduled(schedule, &mut signals).await;
        }
        let Some(target) = &self.config.target else {
            return self.supervise(None, &mut signals, None).await.outcome();
        };
        self.acquisitions(&mut signals, async |signals, rejoining| {
            self.take_lock(target, signals, rejoining).await
        })
        .await
    }

    /// One acquisition after another, each taken by `take` (told whether the guard is rejoining):
    /// the takeover delay, the app's run, and with `--rejoin` the wait for the next.
    async fn acquisitions(
        &self,
        signals: &mut SignalEvents,
        mut take: impl AsyncFnMut(&mut SignalEvents, bool) -> Result<HeldLock, Outcome>,
    ) -> Outcome {
        let mut rejoining = false;
        loop {
            let held = match take(signals, rejoining).await {
                Ok(held) => held,
                Err(outcome) => return outcome,
            };
            let finished = match self.takeover_delay(held, signals).await {
                Ok(held) => self.supervise(Some(held), signals, None).await,
                Err(finished) => finished,
            };
            match finished {
                Finished::LockLost(gone) if self.config.rejoin => {
                    self.rejoin(gone);
                    rejoining = true;
                }
                Finished::SteppedDown if self.config.rejoin => {
                    info!(
                        event = "rejoining",
                        "stepped down after the app was unhealthy; waiting for the lock again as a standby (--rejoin)"
                    );
                    notify::status("stepped down; waiting for the lock again as a standby");
                    rejoining = true;
                }
                finished => return finished.outcome(),
            }
        }
    }

    /// Whether the command can be executed, as `supervisor::resolve` finds out; the outcome to end
    /// with, said, when it cannot.
    fn command_runs(&self) -> Result<(), Outcome> {
        supervisor::resolve(&self.config.command).map_err(|e| {
            error!(event = "app_start_failed", error = %e, "the command cannot be executed; the app was not started");
            command_outcome(&e)
        })
    }

    /// Takes the lock, waiting for it as `--wait` allows. A guard rejoining after a loss retries a
    /// failing backend with backoff instead of exiting 69: the backend's failure is often what took
    /// the lock away (a restart, a failover), and no app runs meanwhile.
    async fn take_lock(
        &self,
        target: &Target,
        signals: &mut SignalEvents,
        rejoining: bool,
    ) -> Result<HeldLock, Outcome> {
        let patience = match self.config.wait {
            Wait::No => Patience::None,
            // Too far to represent is as good as forever.
            Wait::For(limit) => Instant::now()
                .checked_add(limit)
                .map_or(Patience::Forever, Patience::Until),
            Wait::Forever => Patience::Forever,
        };
        let mut backoff = Backoff::new();
        loop {
            let request = LockRequest {
                name: &self.config.name,
                timings: &self.config.timings,
                holder: self.holder,
                patience,
                observer: &self.observer,
            };
            let attempt = tokio::select! {
                attempt = backend::acquire(target, &request) => attempt,
                signal = stop_request(signals) => {
                    warn!(event = "stopped_before_start", signal = %signal_name(signal), "stopped while taking the lock; the app was not started");
                    return Err(Outcome::StoppedBeforeStart);
                }
            };
            match attempt {
                Ok(Acquisition::Acquired(held)) => {
                    self.metrics.acquire(AcquireOutcome::Acquired);
                    self.metrics.lock_taken(held.app_deadline());
                    return Ok(held);
                }
                Ok(Acquisition::HeldElsewhere(holder)) => {
                    warn!(
                        event = "lock_held_elsewhere",
                        holder = %holder,
                        exit_code = self.config.held_exit_code,
                        "lock is held by another instance; the app was not started"
                    );
                    return Err(Outcome::HeldElsewhere);
                }
                Err(e @ backend::LockError::NotALockFile(_)) => {
                    self.metrics.acquire(AcquireOutcome::Error);
                    error!(event = "acquire_failed", error = %e, "cannot take the lock; the app was not started");
                    return Err(Outcome::Usage);
                }
                // `--wait=DUR` bounds these retries too; then the backend is as unusable as at start.
                Err(e) if rejoining && !patience.exhausted() => {
                    self.metrics.acquire(AcquireOutcome::Error);
                    tokio::select! {
                        () = backoff.pause(&e, patience) => {}
                        signal = stop_request(signals) => {
                            warn!(event = "stopped_before_start", signal = %signal_name(signal), "stopped while waiting for the lock backend; the app was not started");
                            return Err(Outcome::StoppedBeforeStart);
                        }
                    }
                }
                Err(e) => {
                    self.metrics.acquire(AcquireOutcome::Error);
                    error!(event = "acquire_failed", error = %e, "cannot take the lock; the app was not started");
                    return Err(Outcome::Unavailable);
                }
            }
        }
    }

    /// After a lost lock with `--rejoin`: nothing of the app is alive (`gone` says so), so the guard
    /// waits for the lock again as a standby; a new acquisition starts a new app.
    fn rejoin(&self, gone: AppGone) {
        let app = match gone {
            AppGone::NeverStarted => "no app was started",
            AppGone::Stopped => "the app's process tree is gone",
        };
        info!(
            event = "rejoining",
            app, "lock lost; waiting for the lock again as a standby (--rejoin)"
        );
        notify::status("lock lost; waiting for the lock again as a standby");
    }

    /// Holds the lock before the app starts while the previous holder's app may still be stopping:
    /// a server that dropped that holder (KILL, restart, failover), a deleted key or lock file, freed
    /// the lock while its app may still be inside its grace period. `--takeover-delay auto` waits
    /// the bound that holder recorded; a duration waits that long; neither waits after a clean
    /// hand-over, which the lock record proves.
    async fn takeover_delay(
        &self,
        mut held: HeldLock,
        signals: &mut SignalEvents,
    ) -> Result<HeldLock, Finished> {
        let previous = held.previous();
        let (delay, reason) = match (self.config.takeover_delay, previous) {
            // A fixed delay is skipped only after a lease its owner released where that record
            // survives a failover (Redis, etcd: `HeldLock::released_cleanly`): a duration set by
            // hand is otherwise waited as asked.
            (TakeoverDelay::Fixed(delay), _) if !held.released_cleanly() => {
                (delay, previous.reason())
            }
            (TakeoverDelay::Fixed(_), _) | (TakeoverDelay::Auto, Previous::Gone(_)) => {
                let reason = previous.reason();
                info!(
                    event = "takeover_delay_skipped",
                    reason = %reason,
                    "the previous holder's app is gone; no takeover delay needed"
                );
                return Ok(held);
            }
            (TakeoverDelay::Auto, Previous::MayRun { bound, why }) => (bound, why),
        };
        if delay.is_zero() {
            return Ok(held);
        }
        info!(event = "takeover_delayed", reason = %reason, wait = %crate::vocab::show_duration(delay), "lock acquired; the previous holder's app may still be stopping, so the app starts after the wait");
        notify::status(&format!(
            "lock acquired; holding it for the takeover delay ({}) before starting the app",
            crate::vocab::show_duration(delay)
        ));
        tokio::select! {
            // A loss reported as the delay ends must win over the delay's end.
            biased;
            loss = held.lost() => {
                self.metrics.lock_lost(loss.reason);
                error!(event = "lock_lost", reason = %loss.reason, detail = %loss.detail, "lock lost during the takeover delay; the app was not started");
                Err(Finished::LockLost(AppGone::NeverStarted))
            }
            signal = stop_request(signals) => {
                warn!(event = "stopped_before_start", signal = %signal_name(signal), "stopped during the takeover delay; the app was not started");
                self.release_unused(Some(held)).await;
                Err(Finished::Exit(Outcome::StoppedBeforeStart))
            }
            _ = tokio::time::sleep(delay) => Ok(held),
        }
    }

    /// Gives the lock back once nothing of the app is alive, which `gone` proves.
    async fn release(&self, held: Option<ServingLock>, gone: TreeGone) {
        if let Some(lock) = held {
            self.released(lock.release(gone).await);
        }
    }

    /// Gives back a lock under which no app was started.
    async fn release_unused(&self, held: Option<HeldLock>) {
        if let Some(lock) = held {
            self.released(lock.release_unused().await);
        }
    }

    fn released(&self, result: Result<(), backend::LockError>) {
        self.metrics.lock_gone();
        if let Err(e) = result {
            warn!(event = "release_failed", error = %e, "lock release failed; the backend frees it when the guard's connection closes");
        }
    }
}

/// How a run under one acquisition of the lock ended.
enum Finished {
    /// The guard exits with this.
    Exit(Outcome),
    /// The lock was lost and no app of this acquisition is alive: exit 75, or with `--rejoin` wait
    /// for the lock again.
    LockLost(AppGone),
    /// The app was unhealthy: it was stopped and the lock released; exit 76, or with `--rejoin`
    /// wait for the lock again.
    SteppedDown,
}

impl Finished {
    fn outcome(self) -> Outcome {
        match self {
            Finished::Exit(outcome) => outcome,
            Finished::LockLost(_) => Outcome::LockLost,
            Finished::SteppedDown => Outcome::Unhealthy,
        }
    }
}

impl From<Outcome> for Finished {
    fn from(outcome: Outcome) -> Finished {
        Finished::Exit(outcome)
    }
}

/// Why no app of a lost acquisition is alive, for the rejoin's log: made only where no app was
/// started, or after its teardown (whose proof the release, if any, consumed).
enum AppGone {
    NeverStarted,
    Stopped,
}

/// The next moment the backend watcher sets for the app to be dead by.
async fn next_app_deadline(deadline: &mut Option<watch::Receiver<Deadline>>) -> Deadline {
    if let Some(rx) = deadline {
        if rx.changed().await.is_ok() {
            return *rx.borrow_and_update();
        }
    }
    // No deadline, or the watcher has ended, which `lost` reports.
    std::future::pending().await
}

/// The next signal that asks the guard to stop while no app runs yet; others have no one to go to.
async fn stop_request(signals: &mut SignalEvents) -> i32 {
    loop {
        let signal = signals.next().await;
        if ends_wait(signal) {
            return signal;
        }
        debug!(event = "signal_ignored", signal = %signal_name(signal), "signal ignored: no app is running yet");
    }
}

async fn lost(held: Option<&mut HeldLock>) -> backend::LockLoss {
    match held {
        Some(lock) => lock.lost().await,
        None => std::future::pending().await,
    }
}

async fn at(deadline: Option<Deadline>) {
    match deadline {
        Some(deadline) => deadline::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
