//! Supervising one app: wait for its end, a lost lock, a signal or the max runtime, then stop its
//! whole tree and give the lock back if it is still ours.

use nix::sys::signal::Signal;
use tokio::sync::watch;
use tracing::{error, info, info_span, warn, Instrument};

use crate::backend::{ClaimRequest, HeldLock, LockLoss, ServingLock};
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
use super::{
    at, command_outcome, lost, next_app_deadline, AppGone, Finished, Guard, HIDDEN_FROM_APP,
};

impl Guard<'_> {
    /// Runs the app under `held` (or unguarded) until it ends or must stop; `window`, for a scheduled
    /// run, is told to the app and records how the run ended.
    pub(super) async fn supervise(
        &self,
        mut held: Option<HeldLock>,
        signals: &mut SignalEvents,
        window: Option<&ClaimRequest<'_>>,
    ) -> Finished {
        let (set, remove) = self.app_env(held.as_ref(), window);
        let env = AppEnv {
            remove: &remove,
            set,
        };
        let app_deadlines = held.as_ref().and_then(HeldLock::app_deadline);
        // Made before the app starts: a guard that cannot time its lock must not run it.
        let deadline_timer = match AsyncBootTimer::new(app_deadline_now(&app_deadlines)) {
            Ok(timer) => timer,
            Err(e) => {
                error!(event = "setup_failed", error = %e, "cannot create the lock's deadline timer; the app was not started");
                self.release_unused(held).await;
                return Outcome::Internal.into();
            }
        };
        let mut app = match self
            .start_app(&mut held, &env, &app_deadlines, window)
            .await
        {
            Ok(app) => app,
            Err(finished) => return finished,
        };
        let mut held = held.map(HeldLock::serving);
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
                    self.config.name,
                    self.holder.id,
                    app.app_pid()
                ),
                None => format!("running unguarded (no lock), app pid {}", app.app_pid()),
            });
            let mut watch = Watch {
                deadline_timer,
                app_deadlines,
                kill_at: None,
                max_runtime_at: self.config.max_runtime.map(Deadline::after),
                health: self
                    .config
                    .health
                    .as_ref()
                    .map(|check| Health::new(check, Deadline::now())),
            };
            let ending = self
                .until_ending(&mut watch, &mut app, &mut held, signals, &env)
                .await;
            let app_deadline = app_deadline_now(&watch.app_deadlines);
            self.finish(app, held, ending, app_deadline, watch.kill_at, window)
                .await
        }
        .instrument(app_span)
        .await
    }

    /// The app's environment: what the guard sets, and what it removes.
    fn app_env(
        &self,
        held: Option<&HeldLock>,
        window: Option<&ClaimRequest<'_>>,
    ) -> (Vec<(&'static str, String)>, Vec<&'static str>) {
        let mut set = vec![
            (ENV_NAME, self.config.name.to_string()),
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
        set.extend(held.into_iter().flat_map(HeldLock::app_env));
        if let Some(run) = window {
            set.push((ENV_WINDOW, run.window.index.to_string()));
            set.push((ENV_WINDOW_START, run.window.start_rfc3339()));
        }
        (set, remove)
    }

    /// Starts the app under `held`, unless the lock is already known lost or its deadline passed;
    /// without an app, how the run ended (the lock given back if it was not lost).
    async fn start_app(
        &self,
        held: &mut Option<HeldLock>,
        env: &AppEnv<'_>,
        app_deadlines: &Option<watch::Receiver<Deadline>>,
        window: Option<&ClaimRequest<'_>>,
    ) -> Result<Supervisor, Finished> {
        let config = self.config;
        if let Some(loss) = held.as_ref().and_then(HeldLock::known_lost) {
            self.metrics.lock_lost(loss.reason);
            error!(event = "lock_lost", reason = %loss.reason, detail = %loss.detail, "lock lost before the app was started; the app was not started");
            return Err(Finished::LockLost(AppGone::NeverStarted));
        }
        // Said before the app can ask: it is told "held" from its first question on.
        match held.as_ref() {
            Some(lock) => self.vouching.held(lock, config.timings.grace_period),
            None => self.vouching.unguarded(),
        }
        let started = {
            let farewell = match held.as_ref() {
                Some(lock) => lock.farewell(),
                None => Farewell::none(),
            };
            Supervisor::start(
                &config.command,
                env,
                config.forward_to,
                (config.stop_signal, config.timings.grace_period),
                &farewell,
                app_deadlines
                    .as_ref()
                    .map(|_| app_deadline_now(app_deadlines)),
                config.cgroup_required(held.is_some()),
            )
            .await
        };
        let e = match started {
            Ok(app) => return Ok(app),
            Err(e) => e,
        };
        self.vouching.not_held("the app was not started");
        if let StartError::DeadlinePassed = e {
            // Not ours to give back: dropping the lock closes what is left of it.
            self.metrics.lock_lost(LossReason::DeadlinePassed);
            error!(event = "lock_lost", reason = %LossReason::DeadlinePassed, detail = "the lock's deadline passed before the command could run", "lock lost before the app was started; the app was not started");
            return Err(Finished::LockLost(AppGone::NeverStarted));
        }
        error!(event = "app_start_failed", error = %e, "app not started");
        let outcome = match e {
            StartError::Spawn(e) => command_outcome(&e),
            StartError::Setup(_)
            | StartError::Watchdog(_)
            | StartError::DeadlinePassed
            | StartError::CgroupJoin(_)
            | StartError::NoCgroup(_) => Outcome::Internal,
        };
        // A claimed window whose command never ran says so in its record, under the lock while it
        // is still known to be ours.
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
        self.release_unused(held.take()).await;
        Err(outcome.into())
    }

    /// Waits for what ends the app's run: its exit, a lost lock or passed deadline, the max
    /// runtime, an unhealthy verdict. Meanwhile it forwards signals, moves the lock's deadline, runs
    /// the health checks, and kills the app a grace period after a stop was asked for.
    async fn until_ending(
        &self,
        watch: &mut Watch<'_>,
        app: &mut Supervisor,
        held: &mut Option<ServingLock>,
        signals: &mut SignalEvents,
        env: &AppEnv<'_>,
    ) -> Ending {
        let config = self.config;
        loop {
            let next_check = watch.health.as_ref().and_then(Health::next_check);
            let check_kill_at = watch.health.as_ref().and_then(Health::kill_at);
            tokio::select! {
                // The lock's deadline first: after a freeze, a passed deadline is acted on before any
                // later one, or any other event, is read.
                biased;
                () = watch.deadline_timer.fired() => break Ending::Lost(LockLoss {
                    reason: LossReason::DeadlinePassed,
                    detail: "ownership was not proven again before the lock's deadline".to_owned(),
                }),
                app_deadline = next_app_deadline(&mut watch.app_deadlines) => {
                    app.move_app_deadline(app_deadline);
                    if let Err(e) = watch.deadline_timer.arm(app_deadline) {
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
                        if let Some(health) = watch.health.as_mut() {
                            let end = if status == AppStatus::Exited(0) { CheckEnd::Passed } else { CheckEnd::Failed };
                            let verdict = health.ended(end, Deadline::now());
                            if let Some(ending) = self.health_said(health, verdict, &status.to_string()) {
                                break ending;
                            }
                        }
                    }
                },
                loss = lost(held.as_deref_mut()) => break Ending::Lost(loss),
                signal = signals.next() => {
                    app.forward(signal);
                    if is_shutdown(signal) && watch.kill_at.is_none() {
                        // A stop asked for is not undone by a check: none runs from here on.
                        app.kill_health_check();
                        watch.health = None;
                        watch.kill_at = Some(Deadline::after(config.timings.grace_period));
                        notify::stopping(&format!("stopping: {} forwarded to the app", signal_name(signal)));
                    }
                }
                () = at(watch.kill_at) => {
                    app.kill_all();
                    warn!(event = "killing_app", grace = %crate::vocab::show_duration(config.timings.grace_period), "app still running after the grace period; sent SIGKILL");
                    watch.kill_at = None;
                }
                () = at(watch.max_runtime_at) => break Ending::MaxRuntime,
                () = at(next_check) => {
                    if let Some(ending) = self.health_check_due(watch, app, env) {
                        break ending;
                    }
                }
                () = at(check_kill_at) => {
                    let Some(health) = watch.health.as_mut() else { continue };
                    // Kill first, count after.
                    app.kill_health_check();
                    let verdict = health.timed_out(Deadline::now());
                    let how = format!("still running after {}; killed", crate::vocab::show_duration(health.timeout()));
                    if let Some(ending) = self.health_said(health, verdict, &how) {
                        break ending;
                    }
                }
            }
        }
    }

    /// The health check is due: started, unless the last one still lingers after its kill, or it
    /// cannot be started (a failed check); the ending if that makes the app unhealthy.
    fn health_check_due(
        &self,
        watch: &mut Watch<'_>,
        app: &mut Supervisor,
        env: &AppEnv<'_>,
    ) -> Option<Ending> {
        let (Some(health), Some(check)) = (watch.health.as_mut(), self.config.health.as_ref())
        else {
            return None;
        };
        let (verdict, how) = if health.running() {
            (
                health.lingers(Deadline::now()),
                "killed at its timeout, and still not ended".to_owned(),
            )
        } else {
            match app.start_health_check(&check.command, env) {
                Ok(_) => {
                    // Timed from its exec, not from before the fork.
                    health.started(Deadline::now());
                    return None;
                }
                Err(e) => (
                    health.ended(CheckEnd::Failed, Deadline::now()),
                    format!("could not start: {e}"),
                ),
            }
        };
        self.health_said(health, verdict, &how)
    }

    /// The one way out of supervision: stop the app's whole tree, then give the lock back if it is
    /// still ours, and say how the run ended.
    pub(super) async fn finish(
        &self,
        mut app: Supervisor,
        mut held: Option<ServingLock>,
        ending: Ending,
        app_deadline: Deadline,
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
            _ => (config.stop_signal, grace_ends.min(app_deadline)),
        };
        self.tell_ending(&ending, &mut app);
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

    /// Before the first signal: the app's socket, the metrics and the watchdog learn how the run ends.
    fn tell_ending(&self, ending: &Ending, app: &mut Supervisor) {
        // Before the first signal: an app that asks from here on is told the lock is not held.
        self.vouching.not_held(match ending {
            Ending::Lost(loss) => format!("the lock was lost ({})", loss.reason),
            Ending::Unhealthy { .. } => {
                "the app is unhealthy; the guard is stepping down".to_owned()
            }
            Ending::AppExited(_) | Ending::MaxRuntime => "the app is being stopped".to_owned(),
        });
        // Counted before teardown, so /leader turns 503 the moment the lock is gone or the app ends.
        match ending {
            Ending::Lost(loss) => {
                self.metrics.lock_lost(loss.reason);
                if loss.reason != LossReason::WatchdogDied {
                    app.lock_lost();
                }
            }
            Ending::AppExited(status) => self.metrics.app_ended(Some(*status)),
            Ending::MaxRuntime | Ending::Unhealthy { .. } => {}
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

/// What supervision waits on besides the app, the lock and signals.
struct Watch<'a> {
    /// Fires at the app's deadline, re-armed at each proof of ownership.
    deadline_timer: AsyncBootTimer,
    /// The app's deadlines as the backend proves ownership again; none unguarded.
    app_deadlines: Option<watch::Receiver<Deadline>>,
    /// When the app is killed, a grace period after a stop was asked for.
    kill_at: Option<Deadline>,
    max_runtime_at: Option<Deadline>,
    /// `--health-cmd`, until a stop is asked for.
    health: Option<Health<'a>>,
}

/// The app's deadline now; never, unguarded.
fn app_deadline_now(rx: &Option<watch::Receiver<Deadline>>) -> Deadline {
    rx.as_ref().map_or(Deadline::NEVER, |rx| *rx.borrow())
}
