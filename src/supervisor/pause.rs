//! Pause points, for the tests of the windows around the app's start: in a debug build, with
//! `SENTINEL_TEST_PAUSE_AT=<point>` in its environment, the guard stops itself (SIGSTOP, every
//! thread) when it reaches that point, so a test can hold it frozen exactly there while the lock
//! runs out, then continue it. A release build has no pause points: `at` does nothing and the
//! variable is not read. A guard that is PID 1 of its namespace cannot stop itself (the kernel
//! drops the signal), so there the points do nothing either.

/// Where the guard can be held.
#[derive(Clone, Copy)]
pub enum Point {
    /// The watchdog has the lock's deadline; the app's process is not forked yet (`before_fork`).
    BeforeFork,
    /// The app's process has been forked and told the watchdog its group, and the guard has done
    /// nothing since (`after_spawn`): where the first deadline used to be sent.
    AfterSpawn,
}

pub fn at(point: Point) {
    #[cfg(debug_assertions)]
    {
        let name = match point {
            Point::BeforeFork => "before_fork",
            Point::AfterSpawn => "after_spawn",
        };
        if std::env::var_os("SENTINEL_TEST_PAUSE_AT").is_some_and(|v| v == name) {
            let _ =
                nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGSTOP);
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = point;
}
