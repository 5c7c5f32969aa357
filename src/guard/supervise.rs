//! Supervising one app: wait for its end, a lost lock, a signal or the max runtime, then stop its
//! whole tree and give the lock back if it is still ours.

use nix::sys::signal::Signal;
use tokio::sync::watch;
use tracing::{error, info, info_span, warn, Instrument};

use crate::backend::{ClaimRequest, HeldLock, LockLoss};
use crate::config::Config;
use crate::deadline::{AsyncBootTimer, Deadline};
use crate::handoff::Farewell;
use crate::notify;
use crate::outcome::Outcome;
use crate::supervisor::{is_shutdown, AppEnv, Event, SignalEvents, StartError, Supervisor};
use crate::vocab::{
    signal_name, AppStatus, HealthState, LossReason, ENV_BACKEND, ENV_HOLDER_ID, ENV_NAME,
    ENV_SOCKET, ENV_WINDOW, ENV_WINDOW_START,
};
use crate::window::RunExit;

use super::health::{CheckEnd, Health, Verdict};
use super::{at, command_outcome, lost, next_deadline, AppGone, Finished, Guard, HIDDEN_FROM_APP};

impl Guard<'_> {
    /// Runs the app under `held` (or unguarded) until it ends or must stop; `window`, for a scheduled
    /// run, is told to the app and records how the run ended.
    pub(super) async fn supervise(
        &self,
        mut held: Option<HeldLock>,
        signals: &mut SignalEvents,
        window: Option<&ClaimRequest<'_>>,
    ) -> Finished {
        let config = self.config;
        let mut set = vec![
            (ENV_NAME, config.name.to_string()),
            (ENV_BACKEND, self.backend.to_owned()),
            (ENV_HOLDER_ID, self.holder.id.clone()),
        ];
        // Without a socket of its own, the app must not ask one it inherited (a guard's app that
        // runs a guard) about another lock.
        let mut remove = HIDDEN_FROM_APP.to_vec();
        match &self.app_socket {
            Some(path) => set.push((ENV_SOCKET, path.display().to_string())),
            None => remove.push(ENV_SOCKET),
        }
        set.extend(held.iter().flat_map(HeldLock::app_env));
        if let Some(run) = window {
            set.push((ENV_WINDOW, run.window.index.to_string()));
            set.push((ENV_WINDOW_START, run.window.start_rfc3339()));
        }
        let env = AppEnv {
            remove: &remove,
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
        // Said before the app can ask: it is told "held" from its first question on.
        match &held {
            Some(lock) => self.vouching.held(lock, config.timings.grace_period),
            None => self.vouching.unguarded(),
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
                app_deadline.as_ref().map(|_| lock_deadline(&app_deadline)),
            )
            .await
        };
        if started.is_err() {
            self.vouching.not_held("the app was not started");
        }
        let mut app = match started {
            Ok(app) => app,
            Err(StartError::DeadlinePassed) => {
                // Not ours to give back: dropping the lock closes what is left of it.
                self.metrics.lock_lost(LossReason::DeadlinePassed);
                error!(event = "lock_lost", reason = %LossReason::DeadlinePassed, detail = "the lock's deadline passed before the command could run", "lock lost before the app was started; the app was not started");
                return Finished::LockLost(AppGone::NeverStarted);
            }
            Err(e) => {
                error!(event = "app_start_failed", error = %e, "app not started");
                let outcome = match e {
                    StartError::Spawn(e) => command_outcome(&e),
                    StartError::Setup(_)
                    | StartError::Watchdog(_)
                    | StartError::DeadlinePassed
                    | StartError::CgroupJoin(_) => Outcome::Internal,
                };
                // A claimed window whose command never ran says so in its record, under the lock
                // while it is still known to be ours.
                let ours = held
                    .as_ref()
                    .is_some_and(|lock| lock.known_lost().is_none());
                if let (Some(run), Some(lock), true) = (window, held.as_mut(), ours) {
                    let exit = RunExit {
                        code: outcome.exit_code(config.held_exit_code, &config.exit_code_map),
                        started: false,
                    };
                    if let Err(e) = lock.record_end(run, exit).await {
                        warn!(event = "run_end_unrecorded", window = run.window.index, error = %e, "cannot record that the window's command did not start");
                    }
                }
                self.release_unused(held).await;
                return outcome.into();
            }
        };
        // Each app has its own span, so no line of a later acquisition (with --rejoin) names it.
        let app_span = info_span!(
            "app",
            app_pid = app.app_pid().as_raw(),
            window = window.map(|run| run.window.index)
        );
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
            let max_runtime_at = config.max_runtime.map(Deadline::after);
            let mut kill_at: Option<Deadline> = None;
            let mut health = config
                .health
                .as_ref()
                .map(|check| Health::new(check, Deadline::now()));
            let ending = loop {
                let next_check = health.as_ref().and_then(Health::next_check);
                let check_kill_at = health.as_ref().and_then(Health::kill_at);
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
                    event = app.next_event() => match event {
                        Event::AppExited(status) => break Ending::AppExited(status),
                        Event::WatchdogEnded { acted: true } => break Ending::Lost(LockLoss {
                            reason: LossReason::GuardFrozen,
                            detail: "the watchdog stopped the app while the guard was unresponsive".to_owned(),
                        }),
                        Event::WatchdogEnded { acted: false } => break Ending::Lost(LockLoss {
                            reason: LossReason::WatchdogDied,
                            detail: "the watchdog process exited; the app may not run without it".to_owned(),
                        }),
                        Event::HealthCheckEnded(status) => {
                            // What the check left behind goes with it.
                            app.end_health_check();
                            if let Some(health) = health.as_mut() {
                                let end = if status == AppStatus::Exited(0) { CheckEnd::Passed } else { CheckEnd::Failed };
                                let verdict = health.ended(end, Deadline::now());
                                if let Some(ending) = self.health_said(health, verdict, &status.to_string()) {
                                    break ending;
                                }
                            }
                        }
                    },
                    loss = lost(&mut held) => break Ending::Lost(loss),
                    signal = signals.next() => {
                        app.forward(signal);
                        if is_shutdown(signal) && kill_at.is_none() {
                            self.stop_requested.set(true);
                            // A stop asked for is not undone by a check: none runs from here on.
                            app.kill_health_check();
                            health = None;
                            kill_at = Some(Deadline::after(config.timings.grace_period));
                            notify::stopping(&format!("stopping: {} forwarded to the app", signal_name(signal)));
                        }
                    }
                    () = at(kill_at) => {
                        app.kill_all();
                        warn!(event = "killing_app", grace = %crate::vocab::show_duration(config.timings.grace_period), "app still running after the grace period; sent SIGKILL");
                        kill_at = None;
                    }
                    () = at(max_runtime_at) => break Ending::MaxRuntime,
                    () = at(next_check) => {
                        let (Some(health), Some(check)) = (health.as_mut(), config.health.as_ref()) else { continue };
                        let (verdict, how) = if health.running() {
                            (health.lingers(Deadline::now()), "killed at its timeout, and still not ended".to_owned())
                        } else {
                            match app.start_health_check(&check.command, &env) {
                                Ok(_) => {
                                    // Timed from its exec, not from before the fork.
                                    health.started(Deadline::now());
                                    continue;
                                }
                                Err(e) => (health.ended(CheckEnd::Failed, Deadline::now()), format!("could not start: {e}")),
                            }
                        };
                        if let Some(ending) = self.health_said(health, verdict, &how) {
                            break ending;
                        }
                    }
                    () = at(check_kill_at) => {
                        let Some(health) = health.as_mut() else { continue };
                        // Kill first, count after.
                        app.kill_health_check();
                        let verdict = health.timed_out(Deadline::now());
                        let how = format!("still running after {}; killed", crate::vocab::show_duration(health.timeout()));
                        if let Some(ending) = self.health_said(health, verdict, &how) {
                            break ending;
                        }
                    }
                }
            };
            let last_deadline = lock_deadline(&app_deadline);
            self.finish(app, held, ending, last_deadline, kill_at, window)
                .await
        }
        .instrument(app_span)
        .await
    }

    /// The one way out of supervision: stop the app's whole tree, then give the lock back if it is
    /// still ours, and say how the run ended.
    pub(super) async fn finish(
        &self,
        mut app: Supervisor,
        mut held: Option<HeldLock>,
        ending: Ending,
        lock_deadline: Deadline,
        kill_at: Option<Deadline>,
        window: Option<&ClaimRequest<'_>>,
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
        // Before the first signal: an app that asks from here on is told the lock is not held.
        self.vouching.not_held(match &ending {
            Ending::Lost(loss) => format!("the lock was lost ({})", loss.reason),
            Ending::Unhealthy { .. } => {
                "the app is unhealthy; the guard is stepping down".to_owned()
            }
            Ending::AppExited(_) | Ending::MaxRuntime => "the app is being stopped".to_owned(),
        });
        // Counted before teardown, so /leader turns 503 the moment the lock is gone or the app ends.
        match &ending {
            Ending::Lost(loss) => {
                self.metrics.lock_lost(loss.reason);
                if loss.reason != LossReason::WatchdogDied {
                    app.lock_lost();
                }
            }
            Ending::AppExited(status) => self.metrics.app_ended(Some(*status)),
            Ending::MaxRuntime | Ending::Unhealthy { .. } => {}
        }
        // Still ours unless lost: after a watchdog that died, the app may not run without it, but
        // the lock holds.
        let still_ours =
            !matches!(&ending, Ending::Lost(loss) if loss.reason != LossReason::WatchdogDied);
        let stopped = app
            .stop(signal, kill_by, || {
                // A lock that will be given back gets ready for that while the tree is torn down.
                if let (true, Some(lock)) = (still_ours, held.as_ref()) {
                    lock.release_coming();
                }
                announce(&ending, config)
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
            return Finished::LockLost(AppGone::Stopped);
        }
        let outcome = match &ending {
            Ending::AppExited(status) => Outcome::AppExited(*status),
            Ending::MaxRuntime => Outcome::MaxRuntime,
            Ending::Unhealthy { .. } => Outcome::Unhealthy,
            Ending::Lost(_) => Outcome::LockLost,
        };
        if still_ours {
            // The run's end is recorded under the lock, then it is given back.
            if let (Some(run), Some(lock)) = (window, held.as_mut()) {
                let exit = RunExit {
                    code: outcome.exit_code(config.held_exit_code, &config.exit_code_map),
                    started: true,
                };
                if let Err(e) = lock.record_end(run, exit).await {
                    warn!(event = "run_end_unrecorded", window = run.window.index, error = %e, "cannot record how the window's run ended");
                }
            }
            self.release(held, stopped.gone).await;
        } else if let Some(run) = window {
            drop(stopped.gone);
            // A lost lock is dropped, which closes what is left of it: it is not ours to give
            // back, nor to record the run's end under.
            warn!(
                event = "run_end_unrecorded",
                window = run.window.index,
                "the lock was lost: the window's claim keeps no exit code"
            );
        }
        match outcome {
            Outcome::LockLost => Finished::LockLost(AppGone::Stopped),
            Outcome::Unhealthy => Finished::SteppedDown,
            outcome => outcome.into(),
        }
    }

    /// Counts a check's end in the metrics and logs a change of the app's health (one line per
    /// change); the ending when the app is now unhealthy, whose line `announce` writes once the
    /// first signal is out. `how` says how the check ended.
    fn health_said(&self, health: &Health<'_>, verdict: Verdict, how: &str) -> Option<Ending> {
        if let Some(end) = verdict.counted {
            self.metrics
                .health_check(end == CheckEnd::Passed, health.state());
        }
        let (failures, retries) = (health.failures(), health.retries());
        match verdict.change {
            None => {
                tracing::debug!(
                    event = "health_check",
                    check = how,
                    failures,
                    "health check ended"
                );
                None
            }
            Some(HealthState::Unhealthy) => Some(Ending::Unhealthy {
                check: how.to_owned(),
                failures,
            }),
            Some(state @ (HealthState::Healthy | HealthState::Starting)) => {
                info!(
                    event = "app_health",
                    state = state.as_str(),
                    check = how,
                    "the app's health check passed"
                );
                None
            }
            Some(state @ HealthState::Failing) => {
                warn!(
                    event = "app_health",
                    state = state.as_str(),
                    check = how,
                    failures,
                    retries,
                    "the app's health check failed"
                );
                None
            }
        }
    }
}

/// Says why the app is being stopped, once the first signal is out.
fn announce(ending: &Ending, config: &Config) {
    match ending {
        Ending::Lost(loss) => {
            error!(
                event = "lock_lost",
                reason = %loss.reason,
                detail = %loss.detail,
                "lock lost; stopping the app"
            );
            notify::stopping(&format!(
                "stopping the app after lock loss ({})",
                loss.reason
            ));
        }
        Ending::AppExited(status) => {
            info!(event = "app_exited", %status, "app ended");
            notify::stopping(&format!("app {status}; stopping"));
        }
        Ending::Unhealthy { check, failures } => {
            error!(
                event = "app_health",
                state = HealthState::Unhealthy.as_str(),
                check = %check,
                failures,
                "the app's health check failed too many times in a row; stopping the app and releasing the lock"
            );
            notify::stopping("stopping the app: it is unhealthy; the lock will be released");
        }
        Ending::MaxRuntime => {
            warn!(
                event = "max_runtime",
                max_runtime = %config.max_runtime.map(crate::vocab::show_duration).unwrap_or_default(),
                "max runtime reached; stopping the app"
            );
            notify::stopping("stopping the app: max runtime reached");
        }
    }
}

/// Why supervision ended.
pub(super) enum Ending {
    AppExited(AppStatus),
    Lost(LockLoss),
    MaxRuntime,
    /// `--health-cmd` failed `--health-retries` times in a row (`failures`, the last as `check`
    /// says): the lock is still ours, and is released once the app's tree is gone.
    Unhealthy {
        check: String,
        failures: u32,
    },
}
