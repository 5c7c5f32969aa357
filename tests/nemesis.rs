//! The nemesis's short form, one test per backend (`common::nemesis` says what it does), and a
//! check that its history checker can fail. `SENTINEL_NEMESIS_SECONDS` sets how long faults are
//! drawn per backend (default 40); `SENTINEL_NEMESIS_SEED` replays a run.

mod common;

use std::process::Command;

use common::etcd::Etcd;
use common::mariadb::MariaDb;
use common::nemesis::{self, Nemesis};
use common::postgres::Postgres;
use common::redis::Redis;
use common::sentinel::Sentinels;
use common::*;

/// The checker must be able to fail: histories that break each rule are caught, a clean one is not.
#[test]
fn the_checker_finds_each_kind_of_violation() {
    let clean =
        "100 app g0.1 5 start\n150 app g0.1 5 beat\n160 nemesis guard_sigkill guard=0 begin\n\
                 400 app g1.1 6 start\n450 app g1.1 6 beat\n500 app g1.1 6 stop\n";
    let report = nemesis::checker::check(clean);
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert_eq!((report.apps, report.worst_takeover_ns), (2, 250));
    assert!(nemesis::checker::beat_after(clean, 400) && !nemesis::checker::beat_after(clean, 450));

    let cases = [
        (
            "100 app a 5 start\n300 app a 5 beat\n200 app b 6 start\n",
            "lived until",
        ),
        (
            "100 app a 5 start\n200 app b 6 start\n210 app b 6 overlap\n",
            "witness",
        ),
        (
            "100 app a 6 start\n150 app a 6 stop\n200 app b 6 start\n",
            "not above",
        ),
        ("100 app a none start\n", "no fencing token"),
        ("100 app a 5 beat\n", "without a start"),
        ("garbage\n", "unreadable"),
    ];
    for (history, expected) in cases {
        let report = nemesis::checker::check(history);
        assert!(
            report.violations.iter().any(|v| v.contains(expected)),
            "{history:?}: {:?}",
            report.violations
        );
    }
}

fn needs_the_tools() {
    for tool in ["ip", "iptables", "nsenter", "python3"] {
        assert!(
            Command::new("sh")
                .args([
                    "-c",
                    &format!("command -v {tool} || test -x /usr/sbin/{tool}")
                ])
                .output()
                .is_ok_and(|o| o.status.success()),
            "{tool} is needed (.ci/run installs it)"
        );
    }
}

#[test]
fn nemesis_mysql() {
    needs_the_tools();
    Nemesis::new(Backend::Mysql(MariaDb::start())).run();
}

#[test]
fn nemesis_postgres() {
    needs_the_tools();
    Nemesis::new(Backend::Postgres(Postgres::start())).run();
}

#[test]
fn nemesis_redis() {
    needs_the_tools();
    Nemesis::new(Backend::Redis(Redis::start())).run();
}

/// A primary, two replicas and three sentinels: failovers, a primary frozen long enough to be
/// replaced and then thawed, nodes killed and restarted empty, on top of every guard fault.
#[test]
fn nemesis_redis_sentinel() {
    needs_the_tools();
    Nemesis::new(Backend::Sentinel(Sentinels::start())).run();
}

#[test]
fn nemesis_etcd() {
    needs_the_tools();
    Nemesis::new(Backend::Etcd(Etcd::cluster(3))).run();
}

#[test]
fn nemesis_file() {
    needs_the_tools();
    Nemesis::new(Backend::File(Lab::new())).run();
}

/// The whole chain, from the apps to the checker, can fail: with the takeover delay off, a `KILL` of
/// the leader's session lets a standby start its app while the leader's still stops (300ms), and
/// the nemesis must say so.
#[test]
fn the_nemesis_reports_the_overlap_a_takeover_delay_of_0s_allows() {
    needs_the_tools();
    // `Lab::new`: every guard runs with `--takeover-delay 0s`.
    let violations = Nemesis::in_lab(Backend::Mysql(MariaDb::start()), Lab::new()).take_away_once();
    assert!(
        violations
            .iter()
            .any(|v| v.contains("witness lock") || v.contains("lived until")),
        "no overlap found: {violations:?}"
    );
}
