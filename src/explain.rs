//! `sentinel-guard explain [the guard's flags]`: the timeline the guarantees rest on, for one
//! validated configuration. Every number comes from the functions the guard itself times its lock
//! with (`Timings`), so what is printed is what the guard does.

use std::time::Duration;

use serde_json::json;

use crate::config::{Config, TakeoverDelay, Target, Timings};
use crate::vocab::show_duration;

/// One kind of fault and what follows it, each a delay after `from` (none: never, or not this way).
struct Fault {
    fault: &'static str,
    /// What the delays are counted from.
    from: &'static str,
    /// The guard (or its watchdog) knows the lock is lost.
    noticed: Option<Duration>,
    /// The app's whole tree is dead at the latest.
    app_dead: Option<Duration>,
    /// The backend can grant the lock to another guard at the earliest.
    lock_free: Option<Duration>,
    /// The takeover delay a standby that gets the lock then waits before starting its app, with
    /// this configuration.
    delay: Option<Duration>,
    note: &'static str,
}

impl Fault {
    /// When a waiting standby's app may start, at the earliest after `from`.
    fn standby_starts(&self) -> Option<Duration> {
        Some(self.lock_free? + self.delay?)
    }

    /// Whether no standby's app can start before this app is dead.
    fn safe(&self) -> bool {
        match (self.app_dead, self.standby_starts()) {
            (_, None) => true,
            (None, Some(_)) => false,
            (Some(dead), Some(starts)) => dead <= starts,
        }
    }
}

/// A quantity the timeline is made of: its name, value and how the guard computes it.
struct Quantity {
    name: &'static str,
    value: Duration,
    formula: String,
}

pub fn render(config: &Config, json_output: bool) -> String {
    let Some(target) = &config.target else {
        let line = "SINGLE_INSTANCE_GUARD=false: no lock at all; every copy of the app runs";
        return if json_output {
            json!({"name": config.name.as_str(), "backend": "none", "unguarded": true, "note": line})
                .to_string()
        } else {
            format!("{line}\n")
        };
    };
    let t = &config.timings;
    let (quantities, faults) = match target {
        Target::Mysql(_) | Target::Postgres(_) => session(t, config.takeover_delay, target),
        Target::Redis(redis) => lease(
            t,
            config.takeover_delay,
            false,
            !redis.release_marker_survives_failover(),
        ),
        Target::Etcd(_) => lease(t, config.takeover_delay, true, false),
        Target::File(_) => file(t, config.takeover_delay),
    };
    let exceptions = exceptions(config, target);
    if json_output {
        let ms = |d: Option<Duration>| d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        return json!({
            "name": config.name.as_str(),
            "backend": target.backend_name(),
            "takeover_delay": match config.takeover_delay {
                TakeoverDelay::Auto => "auto".to_owned(),
                TakeoverDelay::Fixed(d) => show_duration(d),
            },
            "quantities": quantities.iter().map(|q| json!({
                "name": q.name, "ms": ms(Some(q.value)), "formula": q.formula,
            })).collect::<Vec<_>>(),
            "faults": faults.iter().map(|f| json!({
                "fault": f.fault, "from": f.from,
                "noticed_ms": ms(f.noticed), "app_dead_ms": ms(f.app_dead),
                "lock_free_ms": ms(f.lock_free), "takeover_delay_ms": ms(f.delay),
                "standby_starts_ms": ms(f.standby_starts()), "no_overlap": f.safe(), "note": f.note,
            })).collect::<Vec<_>>(),
            "exceptions": exceptions,
        })
        .to_string();
    }
    // `word` before a delay: "within" a bound, "after" an earliest moment.
    let show = |word: &str, d: Option<Duration>| match d {
        Some(d) if d.is_zero() => "at once".to_owned(),
        Some(d) => format!("{word} {}", show_duration(d)),
        None => "never".to_owned(),
    };
    let mut out = format!(
        "lock {} on {} ({}), takeover delay {}\n\nquantities:\n",
        config.name.as_str(),
        target.backend_name(),
        target.location(),
        match config.takeover_delay {
            TakeoverDelay::Auto => "auto".to_owned(),
            TakeoverDelay::Fixed(d) => show_duration(d),
        }
    );
    for q in &quantities {
        out.push_str(&format!(
            "  {}: {} = {}\n",
            q.name,
            show_duration(q.value),
            q.formula
        ));
    }
    out.push_str("\nfaults (each delay counted from the moment named):\n");
    for f in &faults {
        out.push_str(&format!(
            "  {}, from {}:\n    noticed {}; app dead {}; lock free elsewhere {}; standby's app starts {}{}\n",
            f.fault,
            f.from,
            show("within", f.noticed),
            show("within", f.app_dead),
            show("after", f.lock_free),
            show("after", f.standby_starts()),
            if f.safe() { "" } else { " -- OVERLAP POSSIBLE" },
        ));
        if !f.note.is_empty() {
            out.push_str(&format!("    ({})\n", f.note));
        }
    }
    out.push_str("\nexceptions:\n");
    for e in &exceptions {
        out.push_str(&format!("  - {e}\n"));
    }
    out
}

/// What a standby waits after acquiring when the record says the lock may have been taken away
/// from a holder whose bound is `bound`.
fn delay_after_loss(delay: TakeoverDelay, bound: Duration) -> Duration {
    match delay {
        TakeoverDelay::Auto => bound,
        TakeoverDelay::Fixed(d) => d,
    }
}

/// A guard killed whose watchdog stops the app's tree at once and hands the lock over once it is
/// gone (`tree_gone`): nothing to wait with `auto`; a fixed delay is skipped only after a release
/// (`HeldLock::released_cleanly`), so it is waited.
fn killed_cleanly(fault: &'static str, delay: TakeoverDelay, note: &'static str) -> Fault {
    Fault {
        fault,
        from: "the fault",
        noticed: Some(Duration::ZERO),
        app_dead: Some(Duration::ZERO),
        lock_free: Some(Duration::ZERO),
        delay: Some(match delay {
            TakeoverDelay::Auto => Duration::ZERO,
            TakeoverDelay::Fixed(d) => d,
        }),
        note,
    }
}

/// MySQL and PostgreSQL: a lock on a session the guard proves alive every check; the server ends a
/// silent session after the timeout the guard sets on it.
fn session(t: &Timings, delay: TakeoverDelay, target: &Target) -> (Vec<Quantity>, Vec<Fault>) {
    let bound = t.worst_answer_to_deadline();
    let session_timeout = Duration::from_secs(t.session_timeout_secs());
    let after_answer = t.worst_answer_to_deadline();
    let demoted = after_answer.saturating_sub(t.grace_period);
    let timeout_name = match target {
        Target::Mysql(_) => "wait_timeout",
        _ => "idle_session_timeout (and tcp_user_timeout, keepalive idle)",
    };
    let taken_away = delay_after_loss(delay, bound);
    let quantities = vec![
        Quantity {
            name: "detection bound",
            value: t.detection_bound(),
            formula: "--check-interval + --check-timeout: a check unanswered by then is a loss"
                .to_owned(),
        },
        Quantity {
            name: "grace period",
            value: t.grace_period,
            formula: "--grace-period: stop signal to SIGKILL".to_owned(),
        },
        Quantity {
            name: "recorded bound",
            value: bound,
            formula: "2s (a lock wait) + --check-interval + 2 x --check-timeout + grace period: the longest a holder's app may outlive a lock taken away while the server still answers (a primary demoted in place is noticed only by a later answer)".to_owned(),
        },
        Quantity {
            name: "server session timeout",
            value: session_timeout,
            formula: format!(
                "{timeout_name}, set by the guard on its session: 2s (a lock wait) + --check-interval + 2 x --check-timeout + --grace-period + 5s margin, in whole seconds"
            ),
        },
    ];
    let faults = vec![
        Fault {
            fault: "the guard's session is killed (KILL, pg_terminate_backend) or the server restarts",
            from: "the fault",
            noticed: Some(Duration::ZERO),
            app_dead: Some(t.grace_period),
            lock_free: Some(Duration::ZERO),
            delay: Some(taken_away),
            note: "the record still says held, or comes from another server incarnation: the standby waits the holder's recorded bound (or its own, if larger)",
        },
        Fault {
            fault: "the server falls silent or is partitioned from the guard",
            from: "the server's last answer",
            noticed: Some(after_answer.saturating_sub(t.grace_period)),
            app_dead: Some(after_answer),
            lock_free: Some(session_timeout),
            delay: Some(taken_away),
            note: "",
        },
        Fault {
            fault: "the guard is frozen (SIGSTOP, docker pause of the guard alone)",
            from: "the server's last answer",
            noticed: Some(after_answer.saturating_sub(t.grace_period)),
            app_dead: Some(after_answer),
            lock_free: Some(session_timeout),
            delay: Some(taken_away),
            note: "the watchdog stops the app on the guard's deadline",
        },
        killed_cleanly(
            "the guard is killed (SIGKILL, OOM)",
            delay,
            "the watchdog kills the app's tree, records tree_gone, then ends the session",
        ),
        Fault {
            fault: "the server is demoted in place (read_only, recovery) and another is promoted",
            from: "the demotion (before the new primary is promoted)",
            noticed: Some(demoted),
            app_dead: Some(demoted + t.grace_period),
            lock_free: Some(Duration::ZERO),
            delay: Some(taken_away),
            note: "a later check reads the new role; the new primary's record is from another server. A primary never demoted (an unplanned failover) is not noticed at all",
        },
    ];
    (quantities, faults)
}

/// The quantities of a lease's timeline.
fn lease_quantities(t: &Timings) -> Vec<Quantity> {
    let validity = t.lease_validity();
    let stop_at = validity.saturating_sub(t.grace_period);
    vec![
        Quantity {
            name: "lease",
            value: t.ttl,
            formula: "--ttl".to_owned(),
        },
        Quantity {
            name: "renewal interval",
            value: t.renew_interval,
            formula: "--renew-interval (default ttl/3)".to_owned(),
        },
        Quantity {
            name: "drift margin",
            value: t.lease_drift_margin(),
            formula: "ttl/100 + 100ms, for clock-rate drift and scheduling".to_owned(),
        },
        Quantity {
            name: "lease relied on",
            value: validity,
            formula: "ttl - drift margin after each confirmed renewal was sent: the app's deadline"
                .to_owned(),
        },
        Quantity {
            name: "stop begins",
            value: stop_at,
            formula: "lease relied on - grace period after the last confirmed renewal, if none since"
                .to_owned(),
        },
        Quantity {
            name: "recorded bound",
            value: t.ttl + t.grace_period,
            formula: "ttl + grace period: what a holder records as the longest its app may outlive the lock".to_owned(),
        },
    ]
}

/// Redis and etcd: a lease the guard renews; the app is stopped before the lease can run out.
fn lease(
    t: &Timings,
    delay: TakeoverDelay,
    etcd: bool,
    failover_loses_lease: bool,
) -> (Vec<Quantity>, Vec<Fault>) {
    let validity = t.lease_validity();
    let bound = t.ttl + t.grace_period;
    let stop_at = validity.saturating_sub(t.grace_period);
    let quantities = lease_quantities(t);
    // A renewal is due every renew-interval and bounded by check-timeout, whatever it asks (Redis:
    // the sentinels, the script that reads the role, `ROLE` where `INFO` is refused); a "not owner"
    // answer counts however late it comes.
    let noticed_loss = t.renew_interval + t.check_timeout;
    let stopped_after_loss = (noticed_loss + t.grace_period).min(validity);
    let taken_away = delay_after_loss(delay, bound);
    let mut faults = vec![
        Fault {
            fault: if etcd {
                "the key is deleted"
            } else {
                "the key is deleted, evicted, or lost with a server restarted empty"
            },
            from: "the fault",
            noticed: Some(noticed_loss),
            app_dead: Some(stopped_after_loss),
            lock_free: Some(Duration::ZERO),
            delay: Some(taken_away),
            note: "the next renewal finds the key gone",
        },
        Fault {
            fault: "the server falls silent, is partitioned from the guard, or the guard is frozen",
            from: "the last confirmed renewal",
            noticed: Some(stop_at),
            app_dead: Some(validity),
            lock_free: Some(t.ttl),
            delay: Some(taken_away),
            note: if etcd {
                "the lease runs out on the server; the record still says held"
            } else {
                "the lease runs out on the server; the record says expired"
            },
        },
    ];
    faults.push(if etcd {
        killed_cleanly(
            "the guard is killed (SIGKILL, OOM)",
            delay,
            "the watchdog kills the app's tree, records tree_gone and revokes the lease",
        )
    } else {
        Fault {
            fault: "the guard is killed (SIGKILL, OOM)",
            from: "the last confirmed renewal",
            noticed: Some(Duration::ZERO),
            app_dead: Some(validity),
            lock_free: Some(t.ttl),
            delay: Some(taken_away),
            note: "the watchdog kills the app's tree; the lease runs out on its own",
        }
    });
    if failover_loses_lease {
        faults.push(Fault {
            fault: "a failover to a replica that lacks the lease",
            from: "the failover",
            noticed: Some(noticed_loss),
            app_dead: Some(stopped_after_loss),
            lock_free: Some(Duration::ZERO),
            delay: Some(taken_away),
            note: "without --redis-min-replicas the new primary may not have the lease",
        });
    }
    (quantities, faults)
}

/// A local `flock`: the kernel holds it as long as a descriptor of the guard's (or its watchdog's)
/// is open; the guard checks the path still names the file it locked.
fn file(t: &Timings, delay: TakeoverDelay) -> (Vec<Quantity>, Vec<Fault>) {
    let bound = t.detection_bound() + t.grace_period;
    let quantities = vec![
        Quantity {
            name: "path check",
            value: t.check_interval,
            formula: "--check-interval: how often the guard checks the path still names its file"
                .to_owned(),
        },
        Quantity {
            name: "recorded bound",
            value: bound,
            formula: "--check-interval + --check-timeout + grace period".to_owned(),
        },
    ];
    let faults = vec![
        Fault {
            fault: "the lock file is deleted or replaced",
            from: "the fault",
            noticed: Some(t.check_interval),
            app_dead: Some(t.check_interval + t.grace_period),
            lock_free: Some(Duration::ZERO),
            delay: Some(delay_after_loss(delay, bound)),
            note: "a new file has no record: the standby waits its own bound",
        },
        Fault {
            fault: "the guard is frozen (SIGSTOP), on a local file system",
            from: "the fault",
            noticed: None,
            app_dead: None,
            lock_free: None,
            delay: None,
            note: "the kernel keeps a frozen guard's flock: no one else can take it meanwhile",
        },
        killed_cleanly(
            "the guard is killed (SIGKILL, OOM), on a local file system",
            delay,
            "the watchdog keeps the locked descriptor until the app's tree is gone; the next holder, holding the kernel's lock, knows the tree is gone",
        ),
    ];
    (quantities, faults)
}

/// The exceptions docs/guarantees.md states, those that apply to this configuration.
fn exceptions(config: &Config, target: &Target) -> Vec<String> {
    let mut said = Vec::new();
    if let TakeoverDelay::Fixed(d) = config.takeover_delay {
        said.push(format!(
            "--takeover-delay {}: when the backend takes the lock away, a standby starts its app after {} whatever the old app's bound; the faults marked OVERLAP POSSIBLE show where that is too short",
            show_duration(d),
            show_duration(d)
        ));
    }
    said.push(
        "a whole tree frozen past its deadline (docker pause, a suspended VM) runs its app again for a moment when thawed"
            .to_owned(),
    );
    match target {
        Target::Redis(redis) if !redis.release_marker_survives_failover() => said.push(
            "Redis failover without --redis-min-replicas: the new primary may not have the lease; the takeover delay covers it, and no hand-over is instant"
                .to_owned(),
        ),
        Target::Redis(redis) => {
            if redis.topology() != "primary" {
                said.push(
                    "Redis failover with --redis-min-replicas: the lease survives only if the promoted replica acknowledged it and the servers' clocks agree; otherwise as without it"
                        .to_owned(),
                );
            }
            said.push(
                "Redis: the server's wall clock stepped forward expires the lease early; the takeover delay covers it"
                    .to_owned(),
            );
        }
        Target::Mysql(_) | Target::Postgres(_) => said.push(
            "where the lock record cannot be kept (no database in the URL, no CREATE), every acquisition waits the standby's own bound"
                .to_owned(),
        ),
        Target::File(_) => said.push(
            "on a network or user-space file system (NFS, SMB, FUSE) the server may drop a lock while its descriptors stay open: the next holder waits the larger bound, and a frozen guard's lock is not kept"
                .to_owned(),
        ),
        Target::Etcd(_) => {}
    }
    said
}
