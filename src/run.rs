//! The guard's life: take the lock, start the app, then wait for whichever comes first of the app
//! ending, the lock being lost, a signal, or the max runtime; tear the app's tree down; release.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::backend::{
    self, Acquisition, Backoff, ClaimAnswer, ClaimRequest, HeldLock, HolderInfo, LockError,
    LockLoss, LockRequest, Patience,
};
use crate::config::{Config, TakeoverDelay, Target, Wait};
use crate::deadline::{self, AsyncBootTimer, Deadline};
use crate::endpoints::Endpoints;
use crate::handoff::{Farewell, TreeGone};
use crate::holder::Holder;
use crate::metrics::{AcquireOutcome, Checks, Metrics};
use crate::notify;
use crate::outcome::Outcome;
use crate::record::Previous;
use crate::supervisor::{
    self, ends_wait, is_shutdown, AppEnv, Event, ParentWatch, SignalEvents, SpawnError, StartError,
    Supervisor,
};
use crate::vocab::{signal_name, AppStatus, CheckOutcome, LossReason};
use crate::window::{self, IfUnavailable, Schedule, ScheduleMode, Window, WindowOutcome};

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
        config.schedule.map(|s| s.period),
    );
    let guard = Guard {
        config,
        holder: &holder,
        backend,
        observer: Arc::new(Reports {
            checks: metrics.checks(),
            metrics: metrics.clone(),
        }),
        metrics,
        stop_requested: Cell::new(false),
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
    /// A signal asked the guard to stop while an app ran: a scheduler starts no further run.
    stop_requested: Cell<bool>,
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
        if let Some(schedule) = &self.config.schedule {
            return self.scheduled(schedule, &mut signals).await;
        }
        let Some(target) = &self.config.target else {
            return self.supervise(None, &mut signals, None).await.outcome();
        };
        let mut rejoining = false;
        loop {
            let held = match self.take_lock(target, &mut signals, rejoining).await {
                Ok(held) => held,
                Err(outcome) => return outcome,
            };
            let finished = match self.takeover_delay(held, &mut signals).await {
                Ok(held) => self.supervise(Some(held), &mut signals, None).await,
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

    /// `--every` and `--once-per`: windows numbered on the backend's clock, each claimed by at most
    /// one replica and run under the lock with the usual supervision.
    async fn scheduled(&self, schedule: &Schedule, signals: &mut SignalEvents) -> Outcome {
        let timings = &self.config.timings;
        // The last window decided here, by the backend's numbering; and the last one decided by
        // this host's clock while the backend could not be asked (never tried again either).
        let (mut decided, mut decided_locally) = (None::<i64>, None::<i64>);
        // How often the current window's attempt came back empty-handed, and for which window.
        let mut attempts = (None::<i64>, 0u32);
        let mut first = true;
        loop {
            let clock = match &self.config.target {
                Some(target) => tokio::select! {
                    clock = backend::server_clock(target, timings) => clock,
                    signal = stop_request(signals) => return self.stopped_between_runs(schedule, signal),
                },
                None => Ok(window::local_now()),
            };
            let (window, tried) = match clock {
                Err(error) => {
                    // The backend's clock is unknown: this host's numbers the window meanwhile, and
                    // the backend is asked again soon, so a short outage does not cost a window.
                    let now = window::local_now();
                    let window = schedule.window_at(now);
                    if decided_locally == Some(window.index) {
                        let retry = window.until_end(now).min(UNAVAILABLE_RETRY);
                        if let Some(stopped) = self.nap(retry, schedule, signals).await {
                            return stopped;
                        }
                        continue;
                    }
                    decided_locally = Some(window.index);
                    let tried = self
                        .unavailable(schedule, &window, None, &error, signals)
                        .await;
                    (None, tried)
                }
                Ok(now) => {
                    let window = schedule.window_at(now);
                    let settling = first
                        && schedule.mode == ScheduleMode::OncePer
                        && window.until_end(now) <= schedule.settle();
                    first = false;
                    let done = decided.is_some_and(|d| window.index <= d)
                        || decided_locally == Some(window.index);
                    if settling || done {
                        // A millisecond past the next start, so the backend's clock is there too.
                        let nap = window.until_end(now) + Duration::from_millis(1);
                        if let Some(stopped) = self.nap(nap, schedule, signals).await {
                            return stopped;
                        }
                        continue;
                    }
                    let tried = match &self.config.target {
                        Some(target) => self.try_window(target, schedule, &window, signals).await,
                        None => {
                            self.run_window(None, WindowOutcome::Ran, schedule, &window, signals)
                                .await
                        }
                    };
                    (Some(window), tried)
                }
            };
            let index = window.map(|w| w.index);
            if attempts.0 != index {
                attempts = (index, 0);
            }
            let outcome = match tried {
                Tried::Stopped(outcome) => return outcome,
                Tried::Decided(outcome) => outcome,
                Tried::Retry if attempts.1 < MAX_LOOKS => {
                    attempts.1 += 1;
                    if let Some(stopped) = self.nap(LOOK_PAUSE, schedule, signals).await {
                        return stopped;
                    }
                    continue;
                }
                // The lock stayed held all this time with no claim of this window to show for it.
                Tried::Retry => {
                    if let Some(window) = &window {
                        self.window_decided(window, WindowOutcome::Busy, None, None);
                    }
                    Outcome::WindowNotOurs
                }
                Tried::NotNow(why) if attempts.1 < MAX_NOT_NOW => {
                    attempts.1 += 1;
                    debug!(
                        event = "window_not_now",
                        reason = why,
                        "the window could not be claimed now; looking again"
                    );
                    if let Some(stopped) = self.nap(NOT_NOW_PAUSE, schedule, signals).await {
                        return stopped;
                    }
                    continue;
                }
                Tried::NotNow(why) => {
                    return self.refused(&LockError::Unsafe(format!(
                        "every claim of the window its own clock names was refused ({why})"
                    )))
                }
            };
            if index.is_some() {
                decided = index;
            }
            if schedule.mode == ScheduleMode::OncePer || self.stop_requested.get() {
                return outcome;
            }
        }
    }

    /// Sleeps `nap`, unless a stop signal comes first: then the scheduler's outcome.
    async fn nap(
        &self,
        nap: Duration,
        schedule: &Schedule,
        signals: &mut SignalEvents,
    ) -> Option<Outcome> {
        tokio::select! {
            () = tokio::time::sleep(nap) => None,
            signal = stop_request(signals) => Some(self.stopped_between_runs(schedule, signal)),
        }
    }

    /// One window: take the lock without waiting, hold it for the takeover delay, claim the window
    /// under it, run the app.
    async fn try_window(
        &self,
        target: &Target,
        schedule: &Schedule,
        window: &Window,
        signals: &mut SignalEvents,
    ) -> Tried {
        let request = LockRequest {
            name: &self.config.name,
            timings: &self.config.timings,
            holder: self.holder,
            patience: Patience::None,
            observer: &self.observer,
        };
        let attempt = tokio::select! {
            attempt = backend::acquire(target, &request) => attempt,
            signal = stop_request(signals) => return Tried::Stopped(self.stopped_between_runs(schedule, signal)),
        };
        let held = match attempt {
            Ok(Acquisition::Acquired(held)) => held,
            Ok(Acquisition::HeldElsewhere(_)) => return self.held_elsewhere(target, window).await,
            Err(e) => {
                self.metrics.acquire(AcquireOutcome::Error);
                return match e {
                    LockError::NotALockFile(_) => {
                        error!(event = "acquire_failed", error = %e, "cannot take the lock; the app was not started");
                        Tried::Stopped(Outcome::Usage)
                    }
                    LockError::Unreachable(_) => {
                        self.unavailable(schedule, window, None, &e, signals).await
                    }
                    _ => Tried::Stopped(self.refused(&e)),
                };
            }
        };
        self.metrics.acquire(AcquireOutcome::Acquired);
        self.metrics.lock_taken(held.app_deadline());
        // Claimed only by the guard about to run it: after the delay, not before.
        let mut held = match self.takeover_delay(held, signals).await {
            Ok(held) => held,
            Err(Finished::Exit(Outcome::StoppedBeforeStart)) => {
                return Tried::Stopped(self.stopped_outcome(schedule))
            }
            Err(_) => return Tried::NotNow("the lock was lost during the takeover delay"),
        };
        let claim = self.claim_request(schedule, window);
        let answer = tokio::select! {
            answer = held.claim(&claim) => Some(answer),
            signal = stop_request(signals) => {
                warn!(event = "scheduler_stopped", signal = %signal_name(signal), "stopped while claiming the window; the app was not started");
                None
            }
        };
        let Some(answer) = answer else {
            self.release_unused(Some(held)).await;
            return Tried::Stopped(self.stopped_outcome(schedule));
        };
        match answer {
            Ok(ClaimAnswer::Ours) => {
                self.run_window(Some(held), WindowOutcome::Ran, schedule, window, signals)
                    .await
            }
            Ok(ClaimAnswer::Blocked(outcome, last)) => {
                self.release_unused(Some(held)).await;
                self.window_decided(window, outcome, Some(&last), None);
                Tried::Decided(Outcome::WindowNotOurs)
            }
            Ok(ClaimAnswer::NotNow(why)) => {
                self.release_unused(Some(held)).await;
                Tried::NotNow(why)
            }
            // A claim whose answer was lost may have been stored: the record says.
            Err(_) if self.claimed_by_us(target, window).await => {
                self.run_window(Some(held), WindowOutcome::Ran, schedule, window, signals)
                    .await
            }
            Err(e @ LockError::Unreachable(_)) => {
                self.unavailable(schedule, window, Some(held), &e, signals)
                    .await
            }
            Err(e) => {
                self.release_unused(Some(held)).await;
                Tried::Stopped(self.refused(&e))
            }
        }
    }

    /// Another replica holds the lock: it claimed this window, or a run of an earlier window goes
    /// on (busy), or it is claiming this window right now (look again shortly).
    async fn held_elsewhere(&self, target: &Target, window: &Window) -> Tried {
        let last = match self.last_claim(target).await {
            Ok(Some(last)) => last,
            Ok(None) => return Tried::Retry,
            Err(e) => {
                debug!(event = "claim_unreadable", error = %e, "cannot read the last claimed window");
                return Tried::Retry;
            }
        };
        let outcome = match last.blocks(window) {
            Some(outcome) => outcome,
            // An earlier window's run has not ended: it is what holds the lock.
            None if last.end.is_none() => WindowOutcome::Busy,
            None => return Tried::Retry,
        };
        self.window_decided(window, outcome, Some(&last), None);
        Tried::Decided(Outcome::WindowNotOurs)
    }

    /// The last window claimed under this guard's lock name.
    async fn last_claim(&self, target: &Target) -> Result<Option<window::Claim>, LockError> {
        let timings = &self.config.timings;
        backend::last_claim(
            target,
            &self.config.name,
            timings.connect_timeout,
            timings.check_timeout,
        )
        .await
    }

    /// Whether the backend recorded this guard's claim of `window` although the claim's answer was lost.
    async fn claimed_by_us(&self, target: &Target, window: &Window) -> bool {
        self.last_claim(target)
            .await
            .ok()
            .flatten()
            .is_some_and(|last| {
                last.window_start == window.start && last.holder_id == self.holder.id
            })
    }

    /// Runs the app for a window: under `held` (its claim recorded, or with `--if-unavailable run`
    /// when it could not be), or without any lock (unguarded, or the backend unreachable).
    async fn run_window(
        &self,
        held: Option<HeldLock>,
        outcome: WindowOutcome,
        schedule: &Schedule,
        window: &Window,
        signals: &mut SignalEvents,
    ) -> Tried {
        if outcome == WindowOutcome::Ran {
            self.window_decided(window, outcome, None, None);
        }
        let locked = held.is_some();
        let claim = self.claim_request(schedule, window);
        let ended = self.supervise(held, signals, Some(&claim)).await.outcome();
        let code = ended.exit_code(self.config.held_exit_code, &self.config.exit_code_map);
        if locked && outcome == WindowOutcome::Ran {
            self.metrics.run_ended(code);
        }
        info!(event = "run_ended", window = window.index, outcome = %ended, exit_code = code, "run of the window ended");
        Tried::Decided(ended)
    }

    /// The backend could not be reached or could not record the claim: the job's own policy decides.
    /// `held`: the lock, if it was taken before the claim failed; `run` then runs under it.
    async fn unavailable(
        &self,
        schedule: &Schedule,
        window: &Window,
        held: Option<HeldLock>,
        error: &LockError,
        signals: &mut SignalEvents,
    ) -> Tried {
        match schedule.if_unavailable {
            IfUnavailable::Skip => {
                self.release_unused(held).await;
                self.window_decided(window, WindowOutcome::UnavailableSkipped, None, Some(error));
                Tried::Decided(Outcome::Unavailable)
            }
            IfUnavailable::Run => {
                self.window_decided(window, WindowOutcome::UnavailableRan, None, Some(error));
                self.run_window(
                    held,
                    WindowOutcome::UnavailableRan,
                    schedule,
                    window,
                    signals,
                )
                .await
            }
        }
    }

    /// A backend that refuses the job (grants, a read-only server, an unreadable claim) will go on
    /// refusing: no policy runs the command on it; the scheduler ends with exit 69.
    fn refused(&self, error: &LockError) -> Outcome {
        error!(event = "window_refused", error = %error, "the backend refused the scheduled job; the app was not started");
        Outcome::Unavailable
    }

    /// One log line and one count per window decided on this replica.
    fn window_decided(
        &self,
        window: &Window,
        outcome: WindowOutcome,
        claim: Option<&window::Claim>,
        error: Option<&LockError>,
    ) {
        self.metrics.window(outcome);
        let (claimed_by, claimed_host) =
            claim.map_or(("", ""), |c| (c.holder_id.as_str(), c.host.as_str()));
        let error = error.map(ToString::to_string).unwrap_or_default();
        macro_rules! decided {
            ($level:ident, $message:expr) => {
                $level!(
                    event = "window_decision",
                    window = window.index,
                    window_start = %window.start_rfc3339(),
                    outcome = %outcome,
                    claimed_by,
                    claimed_host,
                    error = %error,
                    $message
                )
            };
        }
        match outcome {
            WindowOutcome::Ran if self.config.target.is_none() => {
                decided!(warn, "window started; running the app without a lock (SINGLE_INSTANCE_GUARD=false)")
            }
            WindowOutcome::Ran => decided!(info, "window claimed; starting the app"),
            WindowOutcome::ClaimedElsewhere => decided!(info, "window claimed elsewhere"),
            WindowOutcome::Busy => {
                decided!(info, "window skipped: a run of an earlier window held the lock when it started")
            }
            WindowOutcome::UnavailableSkipped => {
                decided!(error, "backend unavailable; the window is not run (--if-unavailable skip)")
            }
            WindowOutcome::UnavailableRan => decided!(
                warn,
                "backend unavailable; RUNNING THE COMMAND UNCLAIMED (--if-unavailable run), without the lock unless it was already taken: other replicas may run this window too"
            ),
        }
    }

    fn claim_request<'a>(&'a self, schedule: &'a Schedule, window: &'a Window) -> ClaimRequest<'a> {
        ClaimRequest {
            name: &self.config.name,
            schedule,
            window,
            holder: self.holder,
            timings: &self.config.timings,
        }
    }

    fn stopped_between_runs(&self, schedule: &Schedule, signal: i32) -> Outcome {
        warn!(event = "scheduler_stopped", signal = %signal_name(signal), "stopped while no run was going");
        self.stopped_outcome(schedule)
    }

    fn stopped_outcome(&self, schedule: &Schedule) -> Outcome {
        match schedule.mode {
            ScheduleMode::Every => Outcome::StoppedBetweenRuns,
            ScheduleMode::OncePer => Outcome::StoppedBeforeStart,
        }
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
            // A fixed delay is skipped only where it always was, after a Redis lease its owner
            // released (`HeldLock::released_cleanly`): a duration set by hand is waited as asked.
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
        info!(event = "takeover_delayed", reason = %reason, wait = %humantime::format_duration(delay), "lock acquired; the previous holder's app may still be stopping, so the app starts after the wait");
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
    async fn release(&self, held: Option<HeldLock>, gone: TreeGone) {
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

    /// Runs the app under `held` (or unguarded) until it ends or must stop; `window`, for a scheduled
    /// run, is told to the app and records how the run ended.
    async fn supervise(
        &self,
        mut held: Option<HeldLock>,
        signals: &mut SignalEvents,
        window: Option<&ClaimRequest<'_>>,
    ) -> Finished {
        let config = self.config;
        let mut set = vec![
            ("SENTINEL_GUARD_NAME", config.name.to_string()),
            ("SENTINEL_GUARD_BACKEND", self.backend.to_owned()),
            ("SENTINEL_GUARD_HOLDER_ID", self.holder.id.clone()),
        ];
        set.extend(held.iter().flat_map(HeldLock::app_env));
        if let Some(run) = window {
            set.push(("SENTINEL_GUARD_WINDOW", run.window.index.to_string()));
            set.push(("SENTINEL_GUARD_WINDOW_START", run.window.start_rfc3339()));
        }
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
                app_deadline.as_ref().map(|_| lock_deadline(&app_deadline)),
            )
            .await
        };
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
                self.release_unused(held).await;
                return match e {
                    StartError::Spawn(SpawnError::NotFound { .. }) => Outcome::NotFound,
                    StartError::Spawn(SpawnError::NotExecutable { .. }) => Outcome::NotExecutable,
                    StartError::Setup(_)
                    | StartError::Watchdog(_)
                    | StartError::DeadlinePassed
                    | StartError::CgroupJoin(_) => Outcome::Internal,
                }
                .into();
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
                            self.stop_requested.set(true);
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
            self.finish(app, held, ending, last_deadline, kill_at, window)
                .await
        }
        .instrument(app_span)
        .await
    }

    /// The one way out of supervision: stop the app's whole tree, then give the lock back if it is
    /// still ours, and say how the run ended.
    async fn finish(
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
            Ending::Lost(_) => Outcome::LockLost,
        };
        if still_ours {
            // The run's end is recorded under the lock, then it is given back.
            if let (Some(run), Some(lock)) = (window, held.as_mut()) {
                let code = outcome.exit_code(config.held_exit_code, &config.exit_code_map);
                if let Err(e) = lock.record_end(run, code).await {
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
            outcome => outcome.into(),
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
        Ending::MaxRuntime => {
            warn!(
                event = "max_runtime",
                max_runtime = %config.max_runtime.map(|d| humantime::format_duration(d).to_string()).unwrap_or_default(),
                "max runtime reached; stopping the app"
            );
            notify::stopping("stopping the app: max runtime reached");
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

/// Why no app of a lost acquisition is alive, for the rejoin's log: made only where no app was
/// started, or after its teardown (whose proof the release, if any, consumed).
enum AppGone {
    NeverStarted,
    Stopped,
}

/// What became of one window's attempt.
enum Tried {
    /// The window was decided on this replica; the outcome is what a one-shot exits with.
    Decided(Outcome),
    /// The lock is held by a replica that has not claimed the window yet: look again shortly.
    Retry,
    /// Nothing was decided: the backend's clock or the lock did not fit the window (why, in words).
    NotNow(&'static str),
    /// The scheduler must end now with this outcome (a stop signal, a refusing backend, a lock path
    /// that is not ours).
    Stopped(Outcome),
}

/// How often a claim that does not fit the window its backend's clock names is tried again, and how
/// long apart, before the scheduler gives up on a backend that refuses every claim.
const MAX_NOT_NOW: u32 = 3;
const NOT_NOW_PAUSE: Duration = Duration::from_millis(50);
/// How often, and how far apart, a replica that found the lock held without a claim of the window
/// looks again: the holder records its claim right after its takeover delay.
const MAX_LOOKS: u32 = 20;
const LOOK_PAUSE: Duration = Duration::from_millis(100);
/// How soon an unreachable backend is asked for its clock again.
const UNAVAILABLE_RETRY: Duration = Duration::from_secs(1);

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
