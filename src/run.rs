//! The guard's life: take the lock, start the app, then wait for whichever comes first of the app
//! ending, the lock being lost, a signal, or the max runtime; tear the app's tree down; release.

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::backend::{self, Acquisition, Backoff, HeldLock, LockLoss, LockRequest, Patience};
use crate::config::{Config, Target, Wait};
use crate::deadline::{self, AsyncBootTimer, Deadline};
use crate::endpoints::Endpoints;
use crate::holder::Holder;
use crate::metrics::{AcquireOutcome, Metrics};
use crate::notify;
use crate::outcome::Outcome;
use crate::supervisor::watchdog::Farewell;
use crate::supervisor::{
    self, ends_wait, is_shutdown, AppEnv, Event, ParentWatch, SignalEvents, SpawnError, StartError,
    Supervisor, TreeGone,
};
use crate::vocab::{signal_name, AppStatus, LossReason};

/// Variables the app (and the watchdog) must never see: the first two may carry the backend's
/// credentials; with `NOTIFY_SOCKET` the app could tell systemd it is ready before it runs under the
/// lock, or speak for the guard after a loss (with `NotifyAccess=all`), so the guard alone speaks.
const HIDDEN_FROM_APP: &[&str] = &[
    "SENTINEL_GUARD_URL",
    "SENTINEL_GUARD_URL_FILE",
    crate::notify::SOCKET_VAR,
];

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
    );
    let guard = Guard {
        config,
        holder: &holder,
        backend,
        metrics,
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
    outcome
}

struct Guard<'a> {
    config: &'a Config,
    holder: &'a Holder,
    backend: &'static str,
    metrics: Metrics,
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
        let Some(target) = &self.config.target else {
            warn!(
                event = "unguarded",
                "SINGLE_INSTANCE_GUARD=false: running the app WITHOUT ANY LOCK; several copies may run at once. \
                 Never use this in production."
            );
            return self.supervise(None, &mut signals).await.outcome();
        };
        let mut rejoining = false;
        loop {
            let held = match self.take_lock(target, &mut signals, rejoining).await {
                Ok(held) => held,
                Err(outcome) => return outcome,
            };
            let finished = match self.takeover_delay(held, &mut signals).await {
                Ok(held) => self.supervise(Some(held), &mut signals).await,
                Err(finished) => finished,
            };
            match finished {
                Finished::LockLost(gone) if self.config.rejoin => {
                    self.rejoin(gone);
                    rejoining = true;
                }
                finished => return finished.outcome(),
            }
        }
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
                metrics: &self.metrics,
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
            AppGone::Stopped(_tree) => "the app's process tree is gone",
        };
        info!(
            event = "rejoining",
            app, "lock lost; waiting for the lock again as a standby (--rejoin)"
        );
        notify::status("lock lost; waiting for the lock again as a standby");
    }

    /// Holds the lock for `--takeover-delay` before the app starts, unless the previous holder is known
    /// to have released it cleanly: a server that dropped the previous holder (KILL, restart, failover)
    /// freed the lock while that holder's app may still be inside its grace period.
    async fn takeover_delay(
        &self,
        mut held: HeldLock,
        signals: &mut SignalEvents,
    ) -> Result<HeldLock, Finished> {
        let delay = self.config.takeover_delay;
        if delay.is_zero() {
            return Ok(held);
        }
        if held.previous_release_was_clean() {
            info!(
                event = "takeover_delay_skipped",
                "previous holder released the lock cleanly; no takeover delay needed"
            );
            return Ok(held);
        }
        info!(event = "takeover_delay", delay = %humantime::format_duration(delay), "lock acquired; holding it for the takeover delay before starting the app");
        notify::status(&format!(
            "lock acquired; holding it for the takeover delay ({}) before starting the app",
            humantime::format_duration(delay)
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
    async fn release(&self, held: Option<HeldLock>, gone: &TreeGone) {
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

    async fn supervise(&self, mut held: Option<HeldLock>, signals: &mut SignalEvents) -> Finished {
        let config = self.config;
        let mut set = vec![
            ("SENTINEL_GUARD_NAME", config.name.to_string()),
            ("SENTINEL_GUARD_BACKEND", self.backend.to_owned()),
            ("SENTINEL_GUARD_HOLDER_ID", self.holder.id.clone()),
        ];
        set.extend(held.iter().flat_map(HeldLock::app_env));
        let env = AppEnv {
            remove: HIDDEN_FROM_APP,
            set,
        };
        let mut app_deadline = held.as_ref().and_then(HeldLock::app_deadline);
        let lock_deadline = |rx: &Option<watch::Receiver<Deadline>>| {
            rx.as_ref().map_or(Deadline::NEVER, |rx| *rx.borrow())
        };
        // Made before the app starts: a guard that cannot time its lock must not run it.
        let mut deadline_timer = match AsyncBootTimer::new(lock_deadline(&app_deadline)) {
            Ok(timer) => timer,
            Err(e) => {
                error!(event = "setup_failed", error = %e, "cannot create the lock's deadline timer; the app was not started");
                self.release_unused(held).await;
                return Outcome::Internal.into();
            }
        };
        if let Some(loss) = held.as_ref().and_then(HeldLock::known_lost) {
            self.metrics.lock_lost(loss.reason);
            error!(event = "lock_lost", reason = %loss.reason, detail = %loss.detail, "lock lost before the app was started; the app was not started");
            return Finished::LockLost(AppGone::NeverStarted);
        }
        let started = {
            let farewell = match &held {
                Some(lock) => lock.farewell(),
                None => Farewell::none(),
            };
            Supervisor::start(
                &config.command,
                &env,
                config.forward_to,
                (config.stop_signal, config.timings.grace_period),
                &farewell,
            )
            .await
        };
        let mut app = match started {
            Ok(app) => app,
            Err(StartError::Watchdog { error, gone }) => {
                error!(event = "app_start_failed", error = %error, "cannot start the watchdog; the app was killed before the lock is given back");
                self.release(held, &gone).await;
                return Outcome::Internal.into();
            }
            Err(e) => {
                error!(event = "app_start_failed", error = %e, "app not started");
                self.release_unused(held).await;
                return match e {
                    StartError::Spawn(SpawnError::NotFound { .. }) => Outcome::NotFound,
                    StartError::Spawn(SpawnError::NotExecutable { .. }) => Outcome::NotExecutable,
                    StartError::Setup(_) | StartError::Watchdog { .. } => Outcome::Internal,
                }
                .into();
            }
        };
        // Each app has its own span, so no line of a later acquisition (with --rejoin) names it.
        let app_span = info_span!("app", app_pid = app.app_pid().as_raw());
        async {
            self.metrics.app_started();
            notify::ready(&match held {
                Some(_) => format!(
                    "running: lock {} held by this guard ({}), app pid {}",
                    config.name,
                    self.holder.id,
                    app.app_pid()
                ),
                None => format!("running unguarded (no lock), app pid {}", app.app_pid()),
            });
            if app_deadline.is_some() {
                app.lock_deadline(lock_deadline(&app_deadline));
            }
            let max_runtime_at = config.max_runtime.map(Deadline::after);
            let mut kill_at: Option<Deadline> = None;
            let ending = loop {
                tokio::select! {
                    // The lock's deadline first: after a freeze, a passed deadline is acted on before any
                    // later one, or any other event, is read.
                    biased;
                    () = deadline_timer.fired() => break Ending::Lost(LockLoss {
                        reason: LossReason::DeadlinePassed,
                        detail: "ownership was not proven again before the lock's deadline".to_owned(),
                    }),
                    dead_by = next_deadline(&mut app_deadline) => {
                        app.lock_deadline(dead_by);
                        if let Err(e) = deadline_timer.arm(dead_by) {
                            // The watchdog still holds the deadline; the next proof re-arms the timer.
                            warn!(event = "timer_failed", error = %e, "cannot re-arm the lock's deadline timer");
                        }
                    }
                    event = app.next_event() => break match event {
                        Event::AppExited(status) => Ending::AppExited(status),
                        Event::WatchdogEnded { acted: true } => Ending::Lost(LockLoss {
                            reason: LossReason::GuardFrozen,
                            detail: "the watchdog stopped the app while the guard was unresponsive".to_owned(),
                        }),
                        Event::WatchdogEnded { acted: false } => Ending::Lost(LockLoss {
                            reason: LossReason::WatchdogDied,
                            detail: "the watchdog process exited; the app may not run without it".to_owned(),
                        }),
                    },
                    loss = lost(&mut held) => break Ending::Lost(loss),
                    signal = signals.next() => {
                        app.forward(signal);
                        if is_shutdown(signal) && kill_at.is_none() {
                            kill_at = Some(Deadline::after(config.timings.grace_period));
                            notify::stopping(&format!("stopping: {} forwarded to the app", signal_name(signal)));
                        }
                    }
                    () = at(kill_at) => {
                        app.kill_all();
                        warn!(event = "killing_app", grace = %humantime::format_duration(config.timings.grace_period), "app still running after the grace period; sent SIGKILL");
                        kill_at = None;
                    }
                    () = at(max_runtime_at) => break Ending::MaxRuntime,
                }
            };
            let last_deadline = lock_deadline(&app_deadline);
            self.finish(app, held, ending, last_deadline, kill_at).await
        }
        .instrument(app_span)
        .await
    }

    /// The one way out of supervision: stop the app's whole tree, then give the lock back if it is
    /// still ours, and say how the run ended.
    async fn finish(
        &self,
        mut app: Supervisor,
        held: Option<HeldLock>,
        ending: Ending,
        lock_deadline: Deadline,
        kill_at: Option<Deadline>,
    ) -> Finished {
        let config = self.config;
        let grace_ends = kill_at.unwrap_or_else(|| Deadline::after(config.timings.grace_period));
        let (signal, kill_by) = match &ending {
            // A passed deadline is final: no grace, whatever is alive is killed now.
            Ending::Lost(loss)
                if matches!(
                    loss.reason,
                    LossReason::DeadlinePassed | LossReason::GuardFrozen
                ) =>
            {
                (Signal::SIGKILL, Deadline::now())
            }
            _ => (config.stop_signal, grace_ends.min(lock_deadline)),
        };
        // Counted before teardown, so /leader turns 503 the moment the lock is gone or the app ends.
        match &ending {
            Ending::Lost(loss) => {
                self.metrics.lock_lost(loss.reason);
                if loss.reason != LossReason::WatchdogDied {
                    app.lock_lost();
                }
            }
            Ending::AppExited(status) => self.metrics.app_ended(Some(*status)),
            Ending::MaxRuntime => {}
        }
        let stopped = app
            .stop(signal, kill_by, || match &ending {
                Ending::Lost(loss) => {
                    error!(
                        event = "lock_lost",
                        reason = %loss.reason,
                        detail = %loss.detail,
                        "lock lost; stopping the app"
                    );
                    notify::stopping(&format!("stopping the app after lock loss ({})", loss.reason));
                }
                Ending::AppExited(status) => {
                    info!(event = "app_exited", %status, "app ended");
                    notify::stopping(&format!("app {status}; stopping"));
                }
                Ending::MaxRuntime => {
                    warn!(
                        event = "max_runtime",
                        max_runtime = %config.max_runtime.map(|d| humantime::format_duration(d).to_string()).unwrap_or_default(),
                        "max runtime reached; stopping the app"
                    );
                    notify::stopping("stopping the app: max runtime reached");
                }
            })
            .await;
        if !matches!(ending, Ending::AppExited(_)) {
            self.metrics.app_ended(stopped.app);
        }
        let status = stopped
            .app
            .map_or_else(|| "unknown".to_owned(), |s| s.to_string());
        info!(event = "app_stopped", status = %status, "app process tree is gone");
        // A lock already counted as lost (its deadline passed, the watchdog acted) is not counted
        // again; an app that seemed to end on its own was in fact stopped by the watchdog.
        if stopped.watchdog_acted && !matches!(&ending, Ending::Lost(_)) {
            // The guard learns it from the watchdog itself, not from a deadline that may have moved.
            self.metrics.lock_lost(LossReason::GuardFrozen);
            error!(
                event = "lock_lost",
                reason = %LossReason::GuardFrozen,
                "the lock ran out while the guard was unresponsive; the watchdog stopped the app"
            );
            return Finished::LockLost(AppGone::Stopped(stopped.gone));
        }
        match ending {
            Ending::AppExited(status) => {
                self.release(held, &stopped.gone).await;
                Outcome::AppExited(status).into()
            }
            Ending::MaxRuntime => {
                self.release(held, &stopped.gone).await;
                Outcome::MaxRuntime.into()
            }
            // The lock is still ours, but the app may not run without its watchdog.
            Ending::Lost(loss) if loss.reason == LossReason::WatchdogDied => {
                self.release(held, &stopped.gone).await;
                Finished::LockLost(AppGone::Stopped(stopped.gone))
            }
            // Dropping the lock closes what is left of it; it is not ours to give back.
            Ending::Lost(_) => Finished::LockLost(AppGone::Stopped(stopped.gone)),
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
}

impl Finished {
    fn outcome(self) -> Outcome {
        match self {
            Finished::Exit(outcome) => outcome,
            Finished::LockLost(_) => Outcome::LockLost,
        }
    }
}

impl From<Outcome> for Finished {
    fn from(outcome: Outcome) -> Finished {
        Finished::Exit(outcome)
    }
}

/// Why no app of a lost acquisition is alive: rejoining needs one of these.
enum AppGone {
    NeverStarted,
    /// Its teardown finished.
    Stopped(TreeGone),
}

/// Why supervision ended.
enum Ending {
    AppExited(AppStatus),
    Lost(LockLoss),
    MaxRuntime,
}

/// The next moment the backend watcher sets for the app to be dead by.
async fn next_deadline(deadline: &mut Option<watch::Receiver<Deadline>>) -> Deadline {
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

async fn lost(held: &mut Option<HeldLock>) -> backend::LockLoss {
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
