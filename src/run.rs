//! The guard's life: take the lock, start the app, then wait for whichever comes first of the app
//! ending, the lock being lost, a signal, or the max runtime; tear the app's tree down; release.

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::{sleep_until, Instant};
use tracing::{debug, error, info, info_span, warn, Instrument, Span};

use crate::backend::{self, Acquisition, HeldLock, LockRequest, Patience};
use crate::config::{Config, Wait};
use crate::endpoints::Endpoints;
use crate::holder::Holder;
use crate::metrics::{AcquireOutcome, Metrics, GUARD_FROZEN};
use crate::outcome::Outcome;
use crate::supervisor::{
    self, ends_wait, is_shutdown, signal_name, AppEnv, SignalEvents, SpawnError, StartError,
    Supervisor,
};

/// Variables the app must never see: they may carry the backend's credentials.
const HIDDEN_FROM_APP: &[&str] = &["SENTINEL_GUARD_URL", "SENTINEL_GUARD_URL_FILE"];

pub async fn run(config: &Config, endpoints: Option<Endpoints>) -> Outcome {
    let holder = Holder::of_this_process();
    let backend = config.target.as_ref().map_or("none", |t| t.backend_name());
    let span = info_span!(
        "guard",
        name = %config.name,
        backend,
        holder_id = %holder.id,
        app_pid = tracing::field::Empty,
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
        span: span.clone(),
    };
    let outcome = guard.run(endpoints).instrument(span.clone()).await;
    span.in_scope(|| {
        let exit_code = outcome.exit_code(config.held_exit_code, &config.exit_code_map);
        info!(
            event = "guard_exiting",
            ?outcome,
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
    span: Span,
}

impl Guard<'_> {
    async fn run(self, endpoints: Option<Endpoints>) -> Outcome {
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
        if let Err(e) = supervisor::become_subreaper() {
            error!(event = "setup_failed", error = %e, "cannot become child subreaper; orphans of the app could escape teardown");
            return Outcome::Internal;
        }
        let Some(target) = &self.config.target else {
            warn!(
                event = "unguarded",
                "SINGLE_INSTANCE_GUARD=false: running the app WITHOUT ANY LOCK; several copies may run at once. \
                 Never use this in production."
            );
            return self.supervise(None, &mut signals).await;
        };
        let patience = match self.config.wait {
            Wait::No => Patience::None,
            Wait::For(limit) => Patience::Until(Instant::now() + limit),
            Wait::Forever => Patience::Forever,
        };
        let request = LockRequest {
            name: &self.config.name,
            timings: &self.config.timings,
            holder: self.holder,
            patience,
            metrics: &self.metrics,
        };
        let attempt = tokio::select! {
            attempt = backend::acquire(target, &request) => attempt,
            signal = stop_request(&mut signals) => {
                warn!(event = "stopped_before_start", signal = %signal_name(signal), "stopped while taking the lock; the app was not started");
                return Outcome::StoppedBeforeStart;
            }
        };
        let held = match attempt {
            Ok(Acquisition::Acquired(held)) => {
                self.metrics.acquire(AcquireOutcome::Acquired);
                self.metrics.lock_taken(held.app_deadline());
                held
            }
            Ok(Acquisition::HeldElsewhere(holder)) => {
                warn!(
                    event = "lock_held_elsewhere",
                    holder = %holder,
                    exit_code = self.config.held_exit_code,
                    "lock is held by another instance; the app was not started"
                );
                return Outcome::HeldElsewhere;
            }
            Err(e) => {
                self.metrics.acquire(AcquireOutcome::Error);
                error!(event = "acquire_failed", error = %e, "cannot take the lock; the app was not started");
                return Outcome::Unavailable;
            }
        };
        match self.takeover_delay(held, &mut signals).await {
            Ok(held) => self.supervise(Some(held), &mut signals).await,
            Err(outcome) => outcome,
        }
    }

    /// Holds the lock for `--takeover-delay` before the app starts, unless the previous holder is known
    /// to have released it cleanly: a server that dropped the previous holder (KILL, restart, failover)
    /// freed the lock while that holder's app may still be inside its grace period.
    async fn takeover_delay(
        &self,
        mut held: HeldLock,
        signals: &mut SignalEvents,
    ) -> Result<HeldLock, Outcome> {
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
        tokio::select! {
            _ = tokio::time::sleep(delay) => Ok(held),
            loss = held.lost() => {
                self.metrics.lock_lost(loss.reason.as_str());
                error!(event = "lock_lost", reason = %loss.reason, detail = %loss.detail, "lock lost during the takeover delay; the app was not started");
                Err(Outcome::LockLost)
            }
            signal = stop_request(signals) => {
                warn!(event = "stopped_before_start", signal = %signal_name(signal), "stopped during the takeover delay; the app was not started");
                self.release(Some(held)).await;
                Err(Outcome::StoppedBeforeStart)
            }
        }
    }

    /// Gives the lock back; only called once nothing of the app is alive.
    async fn release(&self, held: Option<HeldLock>) {
        if let Some(lock) = held {
            let released = lock.release().await;
            self.metrics.lock_gone();
            if let Err(e) = released {
                warn!(event = "release_failed", error = %e, "lock release failed; the backend frees it when the guard's connection closes");
            }
        }
    }

    async fn supervise(&self, mut held: Option<HeldLock>, signals: &mut SignalEvents) -> Outcome {
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
        let mut app = match Supervisor::start(
            &config.command,
            &env,
            config.forward_to,
            (config.stop_signal, config.timings.grace_period),
            held.as_ref().and_then(HeldLock::orphan_session),
        ) {
            Ok(app) => app,
            Err(e) => {
                error!(event = "app_start_failed", error = %e, "app not started");
                self.release(held).await;
                return match e {
                    StartError::Spawn(SpawnError::NotFound { .. }) => Outcome::NotFound,
                    StartError::Spawn(SpawnError::NotExecutable { .. }) => Outcome::NotExecutable,
                    StartError::Setup(_) => Outcome::Internal,
                };
            }
        };
        self.span.record("app_pid", app.app_pid().as_raw());
        self.metrics.app_started();
        let max_runtime_at = config.max_runtime.map(|d| Instant::now() + d);
        let mut kill_at: Option<Instant> = None;
        let grace = config.timings.grace_period;
        let mut app_deadline = held.as_ref().and_then(HeldLock::app_deadline);
        if let Some(deadline) = &app_deadline {
            app.extend_watchdog(*deadline.borrow());
        }
        loop {
            tokio::select! {
                dead_by = next_deadline(&mut app_deadline) => app.extend_watchdog(dead_by),
                status = app.app_exit() => {
                    info!(event = "app_exited", %status, "app ended");
                    self.metrics.app_ended(Some(status));
                    app.stop_tree(config.stop_signal, grace).await;
                    // A guard that was frozen past its lock's deadline finds its app stopped by the
                    // watchdog: that is a lost lock, not an app that ended on its own.
                    if app_deadline.as_ref().is_some_and(|deadline| Instant::now() >= *deadline.borrow()) {
                        self.metrics.lock_lost(GUARD_FROZEN);
                        error!(event = "lock_lost", reason = GUARD_FROZEN, "the lock ran out while the guard was unresponsive; the watchdog stopped the app");
                        return Outcome::LockLost;
                    }
                    self.release(held).await;
                    return Outcome::AppExited(status);
                }
                loss = lost(&mut held) => {
                    // Counted before teardown, so /leader turns 503 the moment the lock is gone.
                    self.metrics.lock_lost(loss.reason.as_str());
                    error!(
                        event = "lock_lost",
                        reason = %loss.reason,
                        detail = %loss.detail,
                        "lock lost; stopping the app"
                    );
                    app.stop_tree(config.stop_signal, grace).await;
                    self.metrics.app_ended(app.app_status());
                    info!(event = "app_stopped", status = ?app.app_status().map(|s| s.to_string()), "app stopped after lock loss");
                    return Outcome::LockLost;
                }
                signal = signals.next() => {
                    app.forward(signal);
                    if is_shutdown(signal) && kill_at.is_none() {
                        kill_at = Some(Instant::now() + grace);
                    }
                }
                _ = at(kill_at) => {
                    warn!(event = "killing_app", grace = %humantime::format_duration(grace), "app still running after the grace period; sending SIGKILL");
                    app.stop_tree(Signal::SIGKILL, Duration::ZERO).await;
                    kill_at = None;
                }
                _ = at(max_runtime_at) => {
                    warn!(event = "max_runtime", max_runtime = ?config.max_runtime.map(|d| humantime::format_duration(d).to_string()), "max runtime reached; stopping the app");
                    app.stop_tree(config.stop_signal, grace).await;
                    self.metrics.app_ended(app.app_status());
                    info!(event = "app_stopped", status = ?app.app_status().map(|s| s.to_string()), "app stopped after max runtime");
                    self.release(held).await;
                    return Outcome::MaxRuntime;
                }
            }
        }
    }
}

/// The next moment the backend watcher sets for the app to be dead by.
async fn next_deadline(deadline: &mut Option<tokio::sync::watch::Receiver<Instant>>) -> Instant {
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

async fn at(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
