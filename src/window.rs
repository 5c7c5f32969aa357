//! Scheduled runs (`--every`, `--once-per`): time cut into windows of one period, numbered on the
//! backend's clock, each claimed by at most one replica. A leaf module: the words and the arithmetic
//! the scheduler, the backends, `status` and the metrics share.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch, as the backend's clock tells them.
pub type UnixMicros = i64;

/// How windows are cut, and what to do when the backend cannot say whether one was claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub period: Duration,
    pub offset: Duration,
    pub mode: ScheduleMode,
    pub if_unavailable: IfUnavailable,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleMode {
    /// `--every`: a resident scheduler that tries every window and stays up between runs.
    Every,
    /// `--once-per`: one shot for a cron line; runs only if the current window is unclaimed.
    OncePer,
}

/// `--if-unavailable`: the per-job policy when the backend cannot be reached or cannot record a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IfUnavailable {
    /// Fail closed: the window is not run (a one-shot exits 69).
    Skip,
    /// Fail open: the command runs without any lock, after a loud warning.
    Run,
}

/// Window `index` is `[index * period + offset, (index + 1) * period + offset)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub index: i64,
    pub start: UnixMicros,
    pub end: UnixMicros,
}

impl Schedule {
    pub fn period_micros(&self) -> i64 {
        micros(self.period)
    }

    pub fn offset_micros(&self) -> i64 {
        micros(self.offset)
    }

    /// How close to a window's end a one-shot waits for the next window instead: a cron line that
    /// fires at a window's start on a host whose clock runs ahead of the backend's must still claim
    /// that window, not the one the backend is about to leave.
    pub fn settle(&self) -> Duration {
        (self.period / 10).min(Duration::from_secs(5))
    }

    /// The window that contains `now`.
    pub fn window_at(&self, now: UnixMicros) -> Window {
        let period = self.period_micros();
        let index = (now - self.offset_micros()).div_euclid(period);
        let start = index * period + self.offset_micros();
        Window {
            index,
            start,
            end: start + period,
        }
    }
}

impl Window {
    /// Time left until the next window starts, seen from `now`.
    pub fn until_end(&self, now: UnixMicros) -> Duration {
        Duration::from_micros((self.end - now).max(0) as u64)
    }

    /// RFC 3339 in UTC, as the app sees it in `SENTINEL_GUARD_WINDOW_START`.
    pub fn start_rfc3339(&self) -> String {
        rfc3339(self.start)
    }
}

fn micros(d: Duration) -> i64 {
    // Periods and offsets are bounded by configuration far below i64::MAX microseconds.
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// RFC 3339 in UTC with microseconds; times before the epoch (never a real clock) read as the epoch.
/// A time read from a backend, which no clock may mean (the year 10000 and after), is shown as its
/// number: RFC 3339 has four digits for the year.
pub fn rfc3339(at: UnixMicros) -> String {
    if at >= crate::vocab::RFC3339_END_SECS as i64 * 1_000_000 {
        return at.to_string();
    }
    let at = UNIX_EPOCH + Duration::from_micros(at.max(0) as u64);
    humantime::format_rfc3339_micros(at).to_string()
}

/// This host's clock: the file backend's windows, and the fallback when the backend cannot be asked.
pub fn local_now() -> UnixMicros {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, micros)
}

/// What became of one window on this replica: the log's `outcome=` and `runs_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowOutcome {
    /// This replica claimed the window and ran the command under the lock.
    Ran,
    /// Another replica (or an earlier run here) claimed the window.
    ClaimedElsewhere,
    /// The previous window's run still held the lock when this window started: skipped by everybody.
    Busy,
    /// The backend could not be reached or could not record the claim; the window was not run.
    UnavailableSkipped,
    /// The backend could not be reached or could not record the claim; the command ran without a lock.
    UnavailableRan,
}

impl WindowOutcome {
    pub const ALL: [WindowOutcome; 5] = [
        WindowOutcome::Ran,
        WindowOutcome::ClaimedElsewhere,
        WindowOutcome::Busy,
        WindowOutcome::UnavailableSkipped,
        WindowOutcome::UnavailableRan,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WindowOutcome::Ran => "ran",
            WindowOutcome::ClaimedElsewhere => "claimed_elsewhere",
            WindowOutcome::Busy => "busy",
            WindowOutcome::UnavailableSkipped => "unavailable_skipped",
            WindowOutcome::UnavailableRan => "unavailable_ran",
        }
    }
}

impl fmt::Display for WindowOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The last claimed window of a lock, as the backend records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub window_start: UnixMicros,
    /// The claiming guard's holder id.
    pub holder_id: String,
    pub host: String,
    pub claimed_at: UnixMicros,
    /// Set once the run has ended with the lock still held; `None` while it runs, or if it was cut
    /// short by a lost lock.
    pub end: Option<RunEnd>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunEnd {
    pub exit_code: u8,
    pub finished_at: UnixMicros,
    /// False when the command could not be executed at all (after the claim: the look-up before it
    /// found nothing wrong): nothing ran, so the claim holds no window.
    pub started: bool,
}

/// How a claimed window's run ended, as its guard records it (the backend dates it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunExit {
    pub code: u8,
    /// False when the command could not be executed at all: nothing ran, so the claim holds no
    /// window.
    pub started: bool,
}

impl RunExit {
    /// The exit code as a table's integer column keeps it: negated for a command that never started.
    pub fn stored(self) -> i16 {
        let code = i16::from(self.code);
        if self.started {
            code
        } else {
            -code
        }
    }

    /// What a claim kept as text adds after its end for a command that never started.
    pub fn text_mark(self) -> &'static str {
        if self.started {
            ""
        } else {
            " not_started=1"
        }
    }
}

impl RunEnd {
    /// What `RunExit::stored` wrote, and when.
    pub fn from_stored(code: i64, finished_at: UnixMicros) -> RunEnd {
        RunEnd {
            exit_code: u8::try_from(code.unsigned_abs()).unwrap_or(u8::MAX),
            finished_at,
            started: code >= 0,
        }
    }
}

impl Claim {
    /// One line of `key=value` words, for backends that keep the claim as text (a Redis value, the
    /// lock file). Its keys differ from the holder record's, so a reader of either never mixes them.
    pub fn encode(&self) -> String {
        let mut line = format!(
            "{} claimed_at={}",
            Claim::head(self.window_start, &self.holder_id, &self.host),
            self.claimed_at
        );
        if let Some(end) = self.end {
            line.push_str(&format!(
                " exit_code={} finished_at={}{}",
                end.exit_code,
                end.finished_at,
                RunExit {
                    code: end.exit_code,
                    started: end.started
                }
                .text_mark()
            ));
        }
        line
    }

    /// The start of `encode`'s line: what a claim says before the backend's clock dates it.
    pub fn head(window_start: UnixMicros, holder_id: &str, host: &str) -> String {
        format!("window_start={window_start} claimed_by={holder_id} claimed_host={host}")
    }

    /// Reads what `encode` wrote; anything else is `None`.
    /// (A claim kept as text says `not_started=1` after its end when the command never started.)
    pub fn parse(line: &str) -> Option<Claim> {
        let field = |key: &str| {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        };
        let end = match (field("exit_code"), field("finished_at")) {
            (Some(code), Some(at)) => Some(RunEnd {
                exit_code: code.parse().ok()?,
                finished_at: at.parse().ok()?,
                started: field("not_started").is_none(),
            }),
            _ => None,
        };
        Some(Claim {
            window_start: field("window_start")?.parse().ok()?,
            holder_id: field("claimed_by")?.to_owned(),
            host: field("claimed_host")?.to_owned(),
            claimed_at: field("claimed_at")?.parse().ok()?,
            end,
        })
    }

    /// Whether this claim, the last one recorded, keeps `window` from being claimed: `window` or a
    /// later one is already claimed, or the claimed run ended after `window` had started (windows
    /// that start during a run are skipped by everybody). `None`: `window` may be claimed.
    pub fn blocks(&self, window: &Window) -> Option<WindowOutcome> {
        // Nothing ran under it: the window it named may be claimed again, by any replica; claims
        // still only move forward, so an earlier window stays claimed elsewhere.
        if self.end.is_some_and(|end| !end.started) {
            (self.window_start > window.start).then_some(WindowOutcome::ClaimedElsewhere)
        } else if self.window_start >= window.start {
            Some(WindowOutcome::ClaimedElsewhere)
        } else if self.end.is_some_and(|end| end.finished_at >= window.start) {
            Some(WindowOutcome::Busy)
        } else {
            None
        }
    }

    /// What `status` shows of it: `key=value` facts in a fixed order.
    pub fn facts(&self) -> Vec<(&'static str, String)> {
        let mut facts = vec![
            ("last_window_start", rfc3339(self.window_start)),
            ("last_window_holder_id", self.holder_id.clone()),
            ("last_window_host", self.host.clone()),
            ("last_window_claimed_at", rfc3339(self.claimed_at)),
        ];
        match self.end {
            Some(end) => {
                facts.push(("last_window_exit_code", end.exit_code.to_string()));
                facts.push(("last_window_finished_at", rfc3339(end.finished_at)));
                if !end.started {
                    facts.push(("last_window_not_started", "true".to_owned()));
                }
            }
            None => facts.push(("last_window_exit_code", "none".to_owned())),
        }
        facts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every(period: u64, offset: u64) -> Schedule {
        Schedule {
            period: Duration::from_secs(period),
            offset: Duration::from_secs(offset),
            mode: ScheduleMode::Every,
            if_unavailable: IfUnavailable::Skip,
        }
    }

    #[test]
    fn windows_are_numbered_from_the_epoch_plus_the_offset() {
        let daily_at_two = every(86_400, 7_200);
        let s = 1_000_000;
        // 2026-11-30T01:00:00Z still belongs to the window that started on the 29th at 02:00.
        let w = daily_at_two.window_at(1_796_000_400 * s);
        assert_eq!(w.start_rfc3339(), "2026-11-29T02:00:00.000000Z");
        assert_eq!(w.end - w.start, 86_400 * s);
        let next = daily_at_two.window_at(w.end);
        assert_eq!(next.index, w.index + 1);
        assert_eq!(next.start_rfc3339(), "2026-11-30T02:00:00.000000Z");
        // The last microsecond of a window is still in it.
        assert_eq!(daily_at_two.window_at(w.end - 1), w);
        assert_eq!(w.until_end(w.end - 1), Duration::from_micros(1));
        assert_eq!(w.until_end(w.end + 5), Duration::ZERO);
        // Before the offset on day 0, the window is number -1: floor division, not truncation.
        assert_eq!(daily_at_two.window_at(3_600 * s).index, -1);
    }

    #[test]
    fn a_claim_blocks_its_window_later_ones_and_windows_its_run_overlapped() {
        let hourly = every(3_600, 0);
        let s = 1_000_000;
        let claimed = hourly.window_at(3_600 * 100 * s);
        let next = hourly.window_at(claimed.end);
        let claim = |end: Option<i64>| Claim {
            window_start: claimed.start,
            holder_id: "a".into(),
            host: "h".into(),
            claimed_at: claimed.start + 5,
            end: end.map(|finished_at| RunEnd {
                exit_code: 0,
                finished_at,
                started: true,
            }),
        };
        assert_eq!(
            claim(None).blocks(&claimed),
            Some(WindowOutcome::ClaimedElsewhere)
        );
        // Still running, as far as the record says: the next window is decided by the lock.
        assert_eq!(claim(None).blocks(&next), None);
        assert_eq!(claim(Some(next.start - 1)).blocks(&next), None);
        assert_eq!(
            claim(Some(next.start)).blocks(&next),
            Some(WindowOutcome::Busy)
        );
        assert_eq!(hourly.settle(), Duration::from_secs(5));
        assert_eq!(every(2, 0).settle(), Duration::from_millis(200));
    }

    #[test]
    fn claims_round_trip_and_do_not_read_as_a_holder() {
        let claim = Claim {
            window_start: 1_796_000_000_000_000,
            holder_id: "00ff".into(),
            host: "web-1".into(),
            claimed_at: 1_796_000_000_000_123,
            end: Some(RunEnd {
                exit_code: 3,
                finished_at: 1_796_000_001_000_000,
                started: true,
            }),
        };
        assert_eq!(Claim::parse(&claim.encode()), Some(claim.clone()));
        assert_eq!(rfc3339(i64::MAX), i64::MAX.to_string());
        let never_started = Claim {
            end: claim.end.map(|end| RunEnd {
                started: false,
                ..end
            }),
            ..claim.clone()
        };
        assert_eq!(
            Claim::parse(&never_started.encode()),
            Some(never_started.clone())
        );
        let window = Window {
            index: 0,
            start: claim.window_start,
            end: claim.window_start + 3_600_000_000,
        };
        assert_eq!(never_started.blocks(&window), None, "nothing ran under it");
        let earlier = Window {
            index: -1,
            start: window.start - 3_600_000_000,
            end: window.start,
        };
        assert_eq!(
            never_started.blocks(&earlier),
            Some(WindowOutcome::ClaimedElsewhere),
            "claims only move forward"
        );
        assert_eq!(claim.blocks(&window), Some(WindowOutcome::ClaimedElsewhere));
        for (exit_code, started) in [(127, false), (0, true), (126, false), (255, true)] {
            let stored = RunExit {
                code: exit_code,
                started,
            }
            .stored();
            let back = RunEnd::from_stored(i64::from(stored), 7);
            assert_eq!((back.exit_code, back.started), (exit_code, started));
        }
        let running = Claim { end: None, ..claim };
        assert_eq!(Claim::parse(&running.encode()), Some(running.clone()));
        assert!(crate::holder::Holder::parse(&running.encode()).is_none());
        assert!(Claim::parse("holder_id=1 host=x pid=2 started=3").is_none());
    }
}
