//! Scheduled runs: one window at a time, claimed under the lock, run, recorded.

use std::time::Duration;

use tracing::{debug, error, info, warn};

use crate::backend::{
    self, Acquisition, ClaimAnswer, ClaimRequest, HeldLock, LockError, LockRequest, Patience,
};
use crate::config::Target;
use crate::metrics::AcquireOutcome;
use crate::outcome::Outcome;
use crate::supervisor::SignalEvents;
use crate::vocab::signal_name;
use crate::window::{self, IfUnavailable, RunExit, Schedule, ScheduleMode, Window, WindowOutcome};

use super::{stop_request, Finished, Guard};

impl Guard<'_> {
    /// `--every` and `--once-per`: windows numbered on the backend's clock, each claimed by at most
    /// one replica and run under the lock with the usual supervision.
    pub(super) async fn scheduled(
        &self,
        schedule: &Schedule,
        signals: &mut SignalEvents,
    ) -> Outcome {
        let mut progress = Progress {
            decided: None,
            decided_locally: None,
            attempts: (None, 0),
            first: true,
        };
        loop {
            let (window, tried) = match self.next_try(schedule, signals, &mut progress).await {
                Step::Tried(window, tried) => (window, tried),
                Step::Nap(nap) => {
                    if let Some(stopped) = self.nap(nap, schedule, signals).await {
                        return stopped;
                    }
                    continue;
                }
                Step::Stopped(outcome) => return outcome,
            };
            let index = window.map(|w| w.index);
            if progress.attempts.0 != index {
                progress.attempts = (index, 0);
            }
            let outcome = match tried {
                Tried::Stopped(outcome) => return outcome,
                Tried::Decided(outcome) => outcome,
                Tried::Retry if progress.attempts.1 < MAX_LOOKS => {
                    progress.attempts.1 += 1;
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
                Tried::NotNow(why) if progress.attempts.1 < MAX_NOT_NOW => {
                    progress.attempts.1 += 1;
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
                progress.decided = index;
            }
            if schedule.mode == ScheduleMode::OncePer || signals.shutdown_asked() {
                return outcome;
            }
        }
    }

    /// Reads the backend's clock and tries the window it names, unless that one is decided (or
    /// about to end, at the start of `--once-per`): then how long to wait for the next.
    async fn next_try(
        &self,
        schedule: &Schedule,
        signals: &mut SignalEvents,
        progress: &mut Progress,
    ) -> Step {
        let clock = match &self.config.target {
            Some(target) => tokio::select! {
                clock = backend::server_clock(target, &self.config.timings) => clock,
                signal = stop_request(signals) => return Step::Stopped(self.stopped_between_runs(schedule, signal)),
            },
            None => Ok(window::local_now()),
        };
        match clock {
            Err(error) => {
                // The backend's clock is unknown: this host's numbers the window meanwhile, and the
                // backend is asked again soon, so a short outage does not cost a window.
                let now = window::local_now();
                let window = schedule.window_at(now);
                if progress.decided_locally == Some(window.index) {
                    return Step::Nap(window.until_end(now).min(UNAVAILABLE_RETRY));
                }
                progress.decided_locally = Some(window.index);
                let tried = self
                    .unavailable(schedule, &window, None, &error, signals)
                    .await;
                Step::Tried(None, tried)
            }
            Ok(now) => {
                let window = schedule.window_at(now);
                let settling = progress.first
                    && schedule.mode == ScheduleMode::OncePer
                    && window.until_end(now) <= schedule.settle();
                progress.first = false;
                let done = progress.decided.is_some_and(|d| window.index <= d)
                    || progress.decided_locally == Some(window.index);
                if settling || done {
                    // A millisecond past the next start, so the backend's clock is there too.
                    return Step::Nap(window.until_end(now) + Duration::from_millis(1));
                }
                let tried = match &self.config.target {
                    Some(target) => self.try_window(target, schedule, &window, signals).await,
                    None => {
                        self.run_window(None, WindowOutcome::Ran, schedule, &window, signals)
                            .await
                    }
                };
                Step::Tried(Some(window), tried)
            }
        }
    }

    /// Sleeps `nap`, unless a stop signal comes first: then the scheduler's outcome.
    pub(super) async fn nap(
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
    pub(super) async fn try_window(
        &self,
        target: &Target,
        schedule: &Schedule,
        window: &Window,
        signals: &mut SignalEvents,
    ) -> Tried {
        // Looked at again for each window, before the lock is taken: a resident scheduler's
        // command can vanish between windows, and a window is claimed only for a command that can
        // start.
        if let Err(outcome) = self.command_runs() {
            return Tried::Stopped(outcome);
        }
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
            Err(e) => return self.not_acquired(e, schedule, window, signals).await,
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
            // A claim a failover may lose: the job's policy for a backend that cannot record the
            // claim decides. Skipped, the claim (if the primary has it) says its command never
            // started, so that another replica may still run the window.
            Ok(ClaimAnswer::Unkept(why)) => {
                if matches!(schedule.if_unavailable, IfUnavailable::Skip) {
                    self.never_started(&mut held, &claim).await;
                }
                let why = LockError::Unreachable(why.to_owned());
                self.unavailable(schedule, window, Some(held), &why, signals)
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

    /// The lock could not be taken for the window: `e` says whether the job's policy for an
    /// unavailable backend decides, or the scheduler stops.
    async fn not_acquired(
        &self,
        e: LockError,
        schedule: &Schedule,
        window: &Window,
        signals: &mut SignalEvents,
    ) -> Tried {
        self.metrics.acquire(AcquireOutcome::Error);
        match e {
            LockError::NotALockFile(_) => {
                error!(event = "acquire_failed", error = %e, "cannot take the lock; the app was not started");
                Tried::Stopped(Outcome::Usage)
            }
            LockError::Unreachable(_) => {
                self.unavailable(schedule, window, None, &e, signals).await
            }
            _ => Tried::Stopped(self.refused(&e)),
        }
    }

    /// Marks a claim the backend may not keep as never started, so that another replica may still
    /// run the window if the claim survives.
    async fn never_started(&self, held: &mut HeldLock, claim: &ClaimRequest<'_>) {
        let config = self.config;
        let exit = RunExit {
            code: Outcome::Unavailable.exit_code(config.held_exit_code, &config.exit_code_map),
            started: false,
        };
        if let Err(e) = held.record_end(claim, exit).await {
            warn!(event = "run_end_unrecorded", window = claim.window.index, error = %e, "cannot mark the unkept claim as never started");
        }
    }

    /// Another replica holds the lock: it claimed this window, or a run of an earlier window goes
    /// on (busy), or it is claiming this window right now (look again shortly).
    pub(super) async fn held_elsewhere(&self, target: &Target, window: &Window) -> Tried {
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
    pub(super) async fn last_claim(
        &self,
        target: &Target,
    ) -> Result<Option<window::Claim>, LockError> {
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
    pub(super) async fn claimed_by_us(&self, target: &Target, window: &Window) -> bool {
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
    pub(super) async fn run_window(
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
        if matches!(ended, Outcome::NotFound | Outcome::NotExecutable) {
            // Not a run: nothing of the command ran. A scheduler that cannot start its command
            // ends, rather than claim and fail every window after this one.
            error!(
                event = "window_not_run",
                window = window.index,
                exit_code = code,
                "the window's command could not be started; the scheduler ends"
            );
            return Tried::Stopped(ended);
        }
        if locked && outcome == WindowOutcome::Ran {
            self.metrics.run_ended(code);
        }
        info!(event = "run_ended", window = window.index, outcome = %ended, exit_code = code, "run of the window ended");
        Tried::Decided(ended)
    }

    /// The backend could not be reached or could not record the claim: the job's own policy decides.
    /// `held`: the lock, if it was taken before the claim failed; `run` then runs under it.
    pub(super) async fn unavailable(
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
    pub(super) fn refused(&self, error: &LockError) -> Outcome {
        error!(event = "window_refused", error = %error, "the backend refused the scheduled job; the app was not started");
        Outcome::Unavailable
    }

    /// One log line and one count per window decided on this replica.
    pub(super) fn window_decided(
        &self,
        window: &Window,
        outcome: WindowOutcome,
        claim: Option<&window::Claim>,
        error: Option<&LockError>,
    ) {
        self.metrics.window(outcome);
        // Fields with nothing to say are left out of the line.
        let claimed_by = claim.map(|c| c.holder_id.as_str());
        let claimed_host = claim.map(|c| c.host.as_str());
        let error = error.map(tracing::field::display);
        macro_rules! decided {
            ($level:ident, $message:expr) => {
                $level!(
                    event = "window_decision",
                    window = window.index,
                    window_start = %window.start_rfc3339(),
                    outcome = %outcome,
                    claimed_by,
                    claimed_host,
                    error,
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
                decided!(error, "backend unavailable, or it could not keep the claim; the window is not run")
            }
            WindowOutcome::UnavailableRan => decided!(
                warn,
                "backend unavailable; RUNNING THE COMMAND UNCLAIMED (--if-unavailable run), without the lock unless it was already taken: other replicas may run this window too"
            ),
        }
    }

    pub(super) fn claim_request<'a>(
        &'a self,
        schedule: &'a Schedule,
        window: &'a Window,
    ) -> ClaimRequest<'a> {
        ClaimRequest {
            name: &self.config.name,
            schedule,
            window,
            holder: self.holder,
            timings: &self.config.timings,
        }
    }

    pub(super) fn stopped_between_runs(&self, schedule: &Schedule, signal: i32) -> Outcome {
        warn!(event = "scheduler_stopped", signal = %signal_name(signal), "stopped while no run was going");
        self.stopped_outcome(schedule)
    }

    pub(super) fn stopped_outcome(&self, schedule: &Schedule) -> Outcome {
        match schedule.mode {
            ScheduleMode::Every => Outcome::StoppedBetweenRuns,
            ScheduleMode::OncePer => Outcome::StoppedBeforeStart,
        }
    }
}

/// What became of one window's attempt.
pub(super) enum Tried {
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

/// Where the scheduler is.
struct Progress {
    /// The last window decided here, by the backend's numbering.
    decided: Option<i64>,
    /// The last window decided by this host's clock while the backend could not be asked (never
    /// tried again either).
    decided_locally: Option<i64>,
    /// How often the current window's attempt came back empty-handed, and for which window.
    attempts: (Option<i64>, u32),
    /// No window has been looked at yet.
    first: bool,
}

/// What one look at the clock led to.
enum Step {
    /// The window was tried (`None`: numbered by this host's clock, the backend's being unknown).
    Tried(Option<Window>, Tried),
    /// Nothing to try before this long.
    Nap(Duration),
    Stopped(Outcome),
}
