//! What the guard exposes to Prometheus. Every series carries the lock's `name` and `backend` and
//! nothing else unbounded: outcome, reason and kind labels come from fixed sets, created at zero up
//! front so `increase()` and `absent()` work from the first scrape.

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::deadline::Deadline;
use crate::vocab::{AppStatus, CheckOutcome, HealthState, LossReason};
use crate::window::WindowOutcome;

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `acquire_total{outcome}`: how an attempt to take the lock ended.
#[derive(Debug, Clone, Copy)]
pub enum AcquireOutcome {
    Acquired,
    Held,
    Error,
}

impl AcquireOutcome {
    const ALL: [AcquireOutcome; 3] = [
        AcquireOutcome::Acquired,
        AcquireOutcome::Held,
        AcquireOutcome::Error,
    ];

    fn as_str(self) -> &'static str {
        match self {
            AcquireOutcome::Acquired => "acquired",
            AcquireOutcome::Held => "held",
            AcquireOutcome::Error => "error",
        }
    }
}

type Labels = Vec<(&'static str, &'static str)>;

/// The checks a backend's watcher records; cheap to clone into its task.
#[derive(Clone)]
pub struct Checks {
    total: Family<Labels, Counter>,
    duration: Histogram,
}

impl Checks {
    /// The ownership checks' series.
    fn register(registry: &mut Registry) -> Checks {
        let checks = Checks {
            total: zeroed("outcome", CheckOutcome::ALL.map(CheckOutcome::as_str)),
            duration: Histogram::new([
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        };
        registry.register(
            "checks",
            "Ownership checks of the held lock, by outcome",
            checks.total.clone(),
        );
        registry.register(
        "check_duration_seconds",
        "Time an ownership check took to answer, excluding the deliberate server-side sleep (MySQL SLEEP, PostgreSQL pg_sleep)",
        checks.duration.clone(),
    );
        checks
    }

    /// `took` excludes any wait the check asks of the server on purpose (MySQL's `SLEEP`), so the
    /// histogram shows how close answers come to `--check-timeout`.
    pub fn record(&self, outcome: CheckOutcome, took: Duration) {
        inc(&self.total, "outcome", outcome.as_str());
        self.duration.observe(took.as_secs_f64());
    }
}

/// All of the guard's series, plus what `/leader` and `/healthz` answer from. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    lock_held: Gauge,
    acquire_total: Family<Labels, Counter>,
    lock_lost_total: Family<Labels, Counter>,
    checks: Checks,
    lease_remaining: Option<Gauge<f64, AtomicU64>>,
    app_running: Gauge,
    app_exits_total: Family<Labels, Counter>,
    /// By when the held lock must be proven again; read at scrape time for the lease gauge and health.
    deadline: Arc<Mutex<Option<watch::Receiver<Deadline>>>>,
    /// Only for scheduled runs (`--every`, `--once-per`).
    runs: Option<Runs>,
    /// Only with `--health-cmd`.
    health: Option<AppHealth>,
}

/// What the app's health checks show.
#[derive(Clone)]
struct AppHealth {
    checks_total: Family<Labels, Counter>,
    healthy: Gauge,
    unhealthy: Gauge,
}

/// What became of each window, and how this replica's last run ended.
#[derive(Clone)]
struct Runs {
    total: Family<Labels, Counter>,
    last_exit_code: Gauge,
    last_end: Gauge<f64, AtomicU64>,
}

impl Runs {
    /// The scheduled job's series, for windows of `period`.
    fn register(registry: &mut Registry, period: Duration) -> Runs {
        let runs = Runs {
            total: zeroed("outcome", WindowOutcome::ALL.map(WindowOutcome::as_str)),
            last_exit_code: Gauge::default(),
            last_end: Gauge::default(),
        };
        registry.register(
            "runs",
            "Windows of a scheduled job, by what became of them on this replica",
            runs.total.clone(),
        );
        registry.register(
            "last_run_exit_code",
            "Exit code of the last run this replica started (the guard's code for it)",
            runs.last_exit_code.clone(),
        );
        registry.register(
            "last_run_end_timestamp_seconds",
            "When the last run this replica started ended, in seconds since the Unix epoch",
            runs.last_end.clone(),
        );
        let seconds = Gauge::<f64, AtomicU64>::default();
        seconds.set(period.as_secs_f64());
        registry.register(
            "window_seconds",
            "--every or --once-per: the length of one window",
            seconds,
        );
        // With the last run's end, what tells "has not run for two windows" after a restart.
        let started = Gauge::<f64, AtomicU64>::default();
        started.set(unix_seconds(std::time::SystemTime::now()));
        registry.register(
            "scheduler_start_timestamp_seconds",
            "When this scheduler started, in seconds since the Unix epoch",
            started,
        );
        runs
    }
}

impl AppHealth {
    /// `--health-cmd`'s series.
    fn register(registry: &mut Registry) -> AppHealth {
        let health = AppHealth {
            checks_total: zeroed("outcome", ["passed", "failed"]),
            healthy: Gauge::default(),
            unhealthy: Gauge::default(),
        };
        registry.register(
            "health_checks",
            "--health-cmd runs, by outcome (a timeout is a failure)",
            health.checks_total.clone(),
        );
        registry.register(
            "app_healthy",
            "1 while the app's last health check passed",
            health.healthy.clone(),
        );
        registry.register(
            "app_unhealthy",
            "1 once --health-retries checks in a row failed: the guard is stepping down",
            health.unhealthy.clone(),
        );
        health
    }
}

impl Metrics {
    pub fn new(
        name: &str,
        backend: &'static str,
        unguarded: bool,
        check_timeout: Duration,
        window: Option<Duration>,
        health_checked: bool,
    ) -> Metrics {
        let labels = [
            (Cow::Borrowed("name"), Cow::Owned(name.to_owned())),
            (Cow::Borrowed("backend"), Cow::Borrowed(backend)),
        ];
        let mut registry = Registry::with_prefix_and_labels("sentinel_guard", labels.into_iter());
        let lock_held = Gauge::default();
        registry.register(
            "lock_held",
            "1 while this instance holds the lock",
            lock_held.clone(),
        );
        let acquire_total = zeroed("outcome", AcquireOutcome::ALL.map(AcquireOutcome::as_str));
        registry.register(
            "acquire",
            "Attempts to take the lock, by how they ended",
            acquire_total.clone(),
        );
        let lock_lost_total = zeroed("reason", LossReason::ALL.map(LossReason::as_str));
        registry.register(
            "lock_lost",
            "Locks lost while held, by reason",
            lock_lost_total.clone(),
        );
        let checks = Checks::register(&mut registry);
        let check_timeout_gauge = Gauge::<f64, AtomicU64>::default();
        check_timeout_gauge.set(check_timeout.as_secs_f64());
        registry.register(
            "check_timeout_seconds",
            "--check-timeout: how late a check may answer before the lock counts as lost",
            check_timeout_gauge,
        );
        let lease_remaining = (backend == "redis").then(|| {
            let gauge = Gauge::<f64, AtomicU64>::default();
            registry.register(
                "lease_remaining_seconds",
                "How long the Redis lease is known to stay ours without another renewal",
                gauge.clone(),
            );
            gauge
        });
        let app_running = Gauge::default();
        registry.register(
            "app_running",
            "1 while the supervised app runs",
            app_running.clone(),
        );
        let app_exits_total = zeroed("kind", ["exit", "signal"]);
        registry.register(
            "app_exits",
            "App ends, by whether it exited or was killed by a signal",
            app_exits_total.clone(),
        );
        let unguarded_gauge = Gauge::<i64>::default();
        unguarded_gauge.set(i64::from(unguarded));
        registry.register(
            "unguarded",
            "1 when SINGLE_INSTANCE_GUARD=false runs the app without any lock",
            unguarded_gauge,
        );
        let runs = window.map(|period| Runs::register(&mut registry, period));
        let health = health_checked.then(|| AppHealth::register(&mut registry));
        registry.register(
            "build",
            "The guard's version",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        Metrics {
            registry: Arc::new(registry),
            lock_held,
            acquire_total,
            lock_lost_total,
            checks,
            lease_remaining,
            app_running,
            app_exits_total,
            deadline: Arc::default(),
            runs,
            health,
        }
    }

    /// A window decided on this replica.
    pub fn window(&self, outcome: WindowOutcome) {
        if let Some(runs) = &self.runs {
            inc(&runs.total, "outcome", outcome.as_str());
        }
    }

    /// A run under the lock ended with `exit_code`: what the scheduled-job alert watches.
    pub fn run_ended(&self, exit_code: u8) {
        if let Some(runs) = &self.runs {
            runs.last_exit_code.set(i64::from(exit_code));
            runs.last_end
                .set(unix_seconds(std::time::SystemTime::now()));
        }
    }

    /// A health check ended; `state` is the app's health since.
    pub fn health_check(&self, passed: bool, state: HealthState) {
        if let Some(health) = &self.health {
            inc(
                &health.checks_total,
                "outcome",
                if passed { "passed" } else { "failed" },
            );
            health.healthy.set(i64::from(state == HealthState::Healthy));
            health
                .unhealthy
                .set(i64::from(state == HealthState::Unhealthy));
        }
    }

    /// Whether the app's health checks have made it unhealthy.
    pub fn is_app_unhealthy(&self) -> bool {
        self.health
            .as_ref()
            .is_some_and(|health| health.unhealthy.get() == 1)
    }

    pub fn checks(&self) -> Checks {
        self.checks.clone()
    }

    pub fn acquire(&self, outcome: AcquireOutcome) {
        inc(&self.acquire_total, "outcome", outcome.as_str());
    }

    /// The lock is ours; `deadline` is when ownership must next be proven, if the backend has one.
    pub fn lock_taken(&self, deadline: Option<watch::Receiver<Deadline>>) {
        *self.deadline.lock().expect("metrics lock") = deadline;
        self.lock_held.set(1);
    }

    pub fn lock_gone(&self) {
        *self.deadline.lock().expect("metrics lock") = None;
        self.lock_held.set(0);
    }

    pub fn lock_lost(&self, reason: LossReason) {
        inc(&self.lock_lost_total, "reason", reason.as_str());
        self.lock_gone();
    }

    pub fn app_started(&self) {
        self.app_running.set(1);
    }

    pub fn app_ended(&self, status: Option<AppStatus>) {
        self.app_running.set(0);
        // No app, no health to report: a guard that stepped down and waits again is not unhealthy.
        if let Some(health) = &self.health {
            health.healthy.set(0);
            health.unhealthy.set(0);
        }
        let kind = match status {
            Some(AppStatus::Exited(_)) => "exit",
            Some(AppStatus::Signaled(_)) => "signal",
            None => return,
        };
        inc(&self.app_exits_total, "kind", kind);
    }

    /// This instance holds the lock and its app runs: what a readiness probe admits to a Service.
    pub fn is_leader(&self) -> bool {
        self.lock_held.get() == 1 && self.app_running.get() == 1
    }

    /// Whether the lock logic keeps up: a held lock's deadline that has passed means the watcher
    /// has not proven ownership in time (the watchdog is about to, or did, stop the app).
    pub fn is_healthy(&self) -> bool {
        self.time_left().is_none_or(|left| !left.is_zero())
    }

    /// The OpenMetrics text of every series, with time-dependent gauges brought up to date.
    pub fn render(&self) -> String {
        if let Some(gauge) = &self.lease_remaining {
            gauge.set(self.time_left().unwrap_or_default().as_secs_f64());
        }
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }

    fn time_left(&self) -> Option<Duration> {
        let deadline = self.deadline.lock().expect("metrics lock");
        let at = *deadline.as_ref()?.borrow();
        Some(at.remaining())
    }
}

fn unix_seconds(at: std::time::SystemTime) -> f64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// A counter family with every label value of a fixed set present at zero.
fn zeroed(
    key: &'static str,
    values: impl IntoIterator<Item = &'static str>,
) -> Family<Labels, Counter> {
    let family = Family::<Labels, Counter>::default();
    for value in values {
        // Created at zero: the guard reports "never happened" rather than nothing.
        let _ = family.get_or_create(&vec![(key, value)]);
    }
    family
}

fn inc(family: &Family<Labels, Counter>, key: &'static str, value: &'static str) {
    family.get_or_create(&vec![(key, value)]).inc();
}
