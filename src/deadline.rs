//! The one clock a lock's life is measured on.
//!
//! `CLOCK_BOOTTIME` rather than `CLOCK_MONOTONIC`: the monotonic clock stops while the host is
//! suspended, but the backend (a MySQL server's `wait_timeout`, a Redis key's ttl) keeps counting, so
//! a deadline on the monotonic clock would come late after a resume by exactly the time the backend
//! needed to free the lock. Boottime is shared by every process on the host, so the guard can hand a
//! deadline to its watchdog as a plain number.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::time::Duration;

use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use nix::time::{clock_gettime, ClockId as Clock};
use tokio::io::unix::AsyncFd;

/// A moment on `CLOCK_BOOTTIME`, in nanoseconds. Arithmetic saturates: a moment too far to represent
/// is "never", which is the safe reading for every deadline it is used for (a passed deadline is
/// never produced by overflow).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline(u64);

impl Deadline {
    pub const NEVER: Deadline = Deadline(u64::MAX);

    pub fn now() -> Deadline {
        // CLOCK_BOOTTIME exists on every kernel this program runs on (Linux >= 2.6.39).
        let now = clock_gettime(Clock::CLOCK_BOOTTIME).unwrap_or_else(|_| TimeSpec::new(0, 0));
        Deadline::from_timespec(now)
    }

    fn from_timespec(ts: TimeSpec) -> Deadline {
        let secs = u64::try_from(ts.tv_sec()).unwrap_or(0);
        let nanos = u64::try_from(ts.tv_nsec()).unwrap_or(0);
        Deadline(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
    }

    /// `d` from now.
    pub fn after(d: Duration) -> Deadline {
        Deadline::now() + d
    }

    pub const fn from_nanos(nanos: u64) -> Deadline {
        Deadline(nanos)
    }

    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// Whether this moment has come. `NEVER` never passes.
    pub fn has_passed(self) -> bool {
        self != Deadline::NEVER && Deadline::now() >= self
    }

    /// How long until this moment; zero once it has passed.
    pub fn remaining(self) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(Deadline::now().0))
    }

    /// How long ago this moment was; zero while it is still ahead.
    pub fn elapsed(self) -> Duration {
        Duration::from_nanos(Deadline::now().0.saturating_sub(self.0))
    }

    /// This moment moved `d` earlier, not before the clock's origin.
    pub fn minus(self, d: Duration) -> Deadline {
        if self == Deadline::NEVER {
            return self;
        }
        Deadline(self.0.saturating_sub(nanos(d)))
    }

    fn timespec(self) -> TimeSpec {
        let secs = (self.0 / 1_000_000_000).min(i64::MAX as u64) as i64;
        TimeSpec::new(secs, (self.0 % 1_000_000_000) as i64)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl std::ops::Add<Duration> for Deadline {
    type Output = Deadline;

    fn add(self, d: Duration) -> Deadline {
        Deadline(self.0.saturating_add(nanos(d)))
    }
}

/// A `CLOCK_BOOTTIME` timer as a descriptor: it fires at its moment even when that moment passed
/// while the host was suspended or the process frozen, unlike a timer on the monotonic clock.
pub struct BootTimer {
    fd: TimerFd,
    armed: Deadline,
}

impl BootTimer {
    pub fn new() -> io::Result<BootTimer> {
        let fd = TimerFd::new(
            ClockId::CLOCK_BOOTTIME,
            TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
        )?;
        Ok(BootTimer {
            fd,
            armed: Deadline::NEVER,
        })
    }

    /// Sets the moment the timer fires at; `NEVER` disarms it.
    pub fn arm(&mut self, at: Deadline) -> io::Result<()> {
        self.armed = at;
        if at == Deadline::NEVER {
            self.fd.unset()?;
            return Ok(());
        }
        // An absolute moment of zero would disarm the timer: the clock's origin has long passed.
        let at = at.max(Deadline(1));
        self.fd.set(
            Expiration::OneShot(at.timespec()),
            TimerSetTimeFlags::TFD_TIMER_ABSTIME,
        )?;
        Ok(())
    }

    pub fn armed(&self) -> Deadline {
        self.armed
    }
}

impl AsFd for BootTimer {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for BootTimer {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_fd().as_raw_fd()
    }
}

/// A `BootTimer` for the guard's runtime.
pub struct AsyncBootTimer {
    timer: AsyncFd<BootTimer>,
}

impl AsyncBootTimer {
    pub fn new(at: Deadline) -> io::Result<AsyncBootTimer> {
        let mut timer = BootTimer::new()?;
        timer.arm(at)?;
        // SAFETY: the timer owns its descriptor for as long as the AsyncFd owns the timer, and
        // `as_raw_fd` always returns that one descriptor.
        let timer =
            unsafe { AsyncFd::register_with_interest(timer, tokio::io::Interest::READABLE) }
                .map_err(io::Error::from)?;
        Ok(AsyncBootTimer { timer })
    }

    pub fn arm(&mut self, at: Deadline) -> io::Result<()> {
        self.timer.get_mut().arm(at)
    }

    pub fn armed(&self) -> Deadline {
        self.timer.get_ref().armed()
    }

    /// Resolves once the armed moment has come; never while disarmed. Cancel-safe.
    pub async fn fired(&mut self) {
        loop {
            if self.armed().has_passed() {
                return;
            }
            let Ok(mut ready) = self.timer.readable_mut().await else {
                return std::future::pending().await;
            };
            // Draining the expiration count; readiness is re-armed for the next setting.
            let mut count = [0u8; 8];
            let _ = ready.try_io(|timer| {
                nix::unistd::read(timer.get_ref().as_fd(), &mut count).map_err(io::Error::from)
            });
        }
    }
}

/// Sleeps until `at` on the boot clock.
pub async fn sleep_until(at: Deadline) {
    match AsyncBootTimer::new(at) {
        Ok(mut timer) => timer.fired().await,
        // No descriptor to spare: the monotonic clock still bounds the wait, short only by a suspend.
        Err(_) => tokio::time::sleep(at.remaining()).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_to_never_and_zero() {
        let now = Deadline::now();
        assert_eq!(now + Duration::MAX, Deadline::NEVER);
        assert_eq!(
            Deadline::from_nanos(5).minus(Duration::from_secs(1)),
            Deadline::from_nanos(0)
        );
        assert_eq!(
            Deadline::NEVER.minus(Duration::from_secs(1)),
            Deadline::NEVER
        );
        assert!(!Deadline::NEVER.has_passed());
        assert!(Deadline::from_nanos(1).has_passed());
    }

    #[test]
    fn remaining_and_elapsed_are_never_negative() {
        let ahead = Deadline::after(Duration::from_secs(60));
        assert!(ahead.remaining() > Duration::from_secs(59));
        assert_eq!(ahead.elapsed(), Duration::ZERO);
        let past = Deadline::now().minus(Duration::from_secs(60));
        assert_eq!(past.remaining(), Duration::ZERO);
        assert!(past.elapsed() >= Duration::from_secs(60));
    }

    #[test]
    fn boot_clock_moves_forward() {
        let a = Deadline::now();
        std::thread::sleep(Duration::from_millis(2));
        assert!(Deadline::now() > a);
    }

    #[tokio::test]
    async fn timer_fires_at_a_moment_that_has_passed_and_not_before_one_ahead() {
        let mut timer = AsyncBootTimer::new(Deadline::now().minus(Duration::from_secs(1))).unwrap();
        tokio::time::timeout(Duration::from_secs(1), timer.fired())
            .await
            .expect("a passed moment fires at once");
        let at = Deadline::after(Duration::from_millis(30));
        timer.arm(at).unwrap();
        timer.fired().await;
        assert!(at.has_passed());
        timer.arm(Deadline::NEVER).unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(50), timer.fired())
                .await
                .is_err(),
            "a disarmed timer never fires"
        );
    }
}
