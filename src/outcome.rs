//! How a run ended, and the one table that turns that into the guard's exit code.

use crate::config::ExitCodeMap;
use crate::vocab::{
    AppStatus, EXIT_INTERNAL, EXIT_LOCK_LOST, EXIT_MAX_RUNTIME, EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND, EXIT_UNAVAILABLE, EXIT_UNHEALTHY, EXIT_USAGE,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The app ran and ended on its own or after a forwarded signal.
    AppExited(AppStatus),
    /// Another instance holds the lock; the app was never started.
    HeldElsewhere,
    /// The backend could not be reached, refused the guard, or is unsafe; the app was never started.
    Unavailable,
    /// The lock was lost while the app ran; the app was stopped.
    LockLost,
    /// `--max-runtime` expired; the app was stopped.
    MaxRuntime,
    /// `--health-cmd` failed `--health-retries` times in a row; the app was stopped and the lock
    /// released.
    Unhealthy,
    /// The command does not exist.
    NotFound,
    /// The command exists but cannot be executed.
    NotExecutable,
    /// A signal asked the guard to stop before the app was started (while taking or waiting for the
    /// lock): reported like a held lock, since no app ran.
    StoppedBeforeStart,
    /// `--once-per`: the current window was already claimed, or the previous run still holds the
    /// lock; the app was not started, and nothing is wrong.
    WindowNotOurs,
    /// `--every`: a signal stopped the scheduler while no run was going.
    StoppedBetweenRuns,
    /// The guard itself could not set up (signal handlers, runtime).
    Internal,
    /// The invocation names something unusable that only showed when it was touched (a lock path
    /// that is a symbolic link or someone else's file); nothing was changed.
    Usage,
}

impl std::fmt::Display for Outcome {
    /// The words of the exit-code table in the README.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::AppExited(status) => write!(f, "app {status}"),
            Outcome::HeldElsewhere => f.write_str("lock held elsewhere"),
            Outcome::Unavailable => f.write_str("backend unavailable"),
            Outcome::LockLost => f.write_str("lock lost"),
            Outcome::MaxRuntime => f.write_str("max runtime reached"),
            Outcome::Unhealthy => f.write_str("app unhealthy; stepped down"),
            Outcome::NotFound => f.write_str("command not found"),
            Outcome::NotExecutable => f.write_str("command not executable"),
            Outcome::StoppedBeforeStart => f.write_str("stopped before the app started"),
            Outcome::WindowNotOurs => f.write_str("window claimed elsewhere or busy"),
            Outcome::StoppedBetweenRuns => f.write_str("scheduler stopped between runs"),
            Outcome::Internal => f.write_str("internal error"),
            Outcome::Usage => f.write_str("usage error"),
        }
    }
}

impl Outcome {
    pub fn exit_code(self, held_exit_code: u8, map: &ExitCodeMap) -> u8 {
        match self {
            Outcome::AppExited(status) => map.apply(status.code()),
            Outcome::HeldElsewhere | Outcome::StoppedBeforeStart => held_exit_code,
            Outcome::WindowNotOurs | Outcome::StoppedBetweenRuns => 0,
            Outcome::Unavailable => EXIT_UNAVAILABLE,
            Outcome::LockLost => EXIT_LOCK_LOST,
            Outcome::MaxRuntime => EXIT_MAX_RUNTIME,
            Outcome::Unhealthy => EXIT_UNHEALTHY,
            Outcome::NotFound => EXIT_NOT_FOUND,
            Outcome::NotExecutable => EXIT_NOT_EXECUTABLE,
            Outcome::Internal => EXIT_INTERNAL,
            Outcome::Usage => EXIT_USAGE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_documented_table() {
        let map = ExitCodeMap::parse(&["143=0".into()]).unwrap();
        let none = ExitCodeMap::default();
        assert_eq!(
            Outcome::AppExited(AppStatus::Exited(7)).exit_code(1, &none),
            7
        );
        assert_eq!(
            Outcome::AppExited(AppStatus::Signaled(9)).exit_code(1, &none),
            137
        );
        assert_eq!(
            Outcome::AppExited(AppStatus::Signaled(15)).exit_code(1, &map),
            0
        );
        assert_eq!(Outcome::HeldElsewhere.exit_code(1, &map), 1);
        assert_eq!(Outcome::HeldElsewhere.exit_code(3, &map), 3);
        assert_eq!(Outcome::Unavailable.exit_code(1, &map), 69);
        assert_eq!(Outcome::LockLost.exit_code(1, &map), 75);
        assert_eq!(Outcome::MaxRuntime.exit_code(1, &map), 124);
        assert_eq!(Outcome::Unhealthy.exit_code(1, &map), 76);
        assert_eq!(Outcome::NotExecutable.exit_code(1, &map), 126);
        assert_eq!(Outcome::NotFound.exit_code(1, &map), 127);
        assert_eq!(Outcome::StoppedBeforeStart.exit_code(3, &map), 3);
        assert_eq!(Outcome::Usage.exit_code(1, &map), 2);
        assert_eq!(Outcome::WindowNotOurs.exit_code(3, &map), 0);
        assert_eq!(Outcome::StoppedBetweenRuns.exit_code(3, &map), 0);
    }
}
