//! Scheduled jobs (`--every`, `--once-per`) against real servers and real processes: every window is
//! run by exactly one replica, restarts and repeated cron invocations never run a window twice,
//! skewed clocks do not matter (windows come from the server), a long run makes the windows during
//! it busy, and the unavailability policy is the job's choice.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::endpoints::Metrics;
use common::mariadb::MariaDb;
use common::postgres::Postgres;
use common::redis::Redis;
use common::{
    as_strs, assert_no_overlap, free_port, trace_lines, wait_until, Backend, GuardProcess, Lab,
};

const LONG: Duration = Duration::from_secs(30);

/// A private PostgreSQL whose guard account may create the windows table (PostgreSQL 15 lets no
/// one but the owner create in `public`).
fn postgres_granted() -> Postgres {
    let db = Postgres::start();
    db.sql(&format!(
        "GRANT CREATE ON SCHEMA public TO {}",
        common::postgres::USER
    ));
    db
}

/// One `#[test]` per backend for a check that takes the backend.
macro_rules! on_backends {
    ($check:ident: $($test:ident => $backend:expr),+ $(,)?) => {
        $(
            #[test]
            fn $test() {
                $check(&$backend);
            }
        )+
    };
}

on_backends!(each_window_exactly_once:
    three_replicas_run_each_window_exactly_once_on_mysql => Backend::Mysql(MariaDb::start()),
    three_replicas_run_each_window_exactly_once_on_postgres => Backend::Postgres(postgres_granted()),
    three_replicas_run_each_window_exactly_once_on_redis => Backend::Redis(Redis::start()),
    three_replicas_run_each_window_exactly_once_on_file => Backend::File(Lab::new()),
);

on_backends!(a_claimed_window_is_never_run_again:
    a_claimed_window_is_never_run_again_on_mysql => Backend::Mysql(MariaDb::start()),
    a_claimed_window_is_never_run_again_on_postgres => Backend::Postgres(postgres_granted()),
    a_claimed_window_is_never_run_again_on_redis => Backend::Redis(Redis::start()),
    a_claimed_window_is_never_run_again_on_file => Backend::File(Lab::new()),
);

on_backends!(skewed_clocks_do_not_matter:
    skewed_clocks_still_run_each_window_once_on_mysql => Backend::Mysql(MariaDb::start()),
    skewed_clocks_still_run_each_window_once_on_postgres => Backend::Postgres(postgres_granted()),
    skewed_clocks_still_run_each_window_once_on_redis => Backend::Redis(Redis::start()),
);

on_backends!(a_long_run_makes_the_next_windows_busy:
    a_long_run_makes_the_next_windows_busy_on_mysql => Backend::Mysql(MariaDb::start()),
    a_long_run_makes_the_next_windows_busy_on_postgres => Backend::Postgres(postgres_granted()),
    a_long_run_makes_the_next_windows_busy_on_redis => Backend::Redis(Redis::start()),
    a_long_run_makes_the_next_windows_busy_on_file => Backend::File(Lab::new()),
);

on_backends!(a_command_that_cannot_start_claims_no_window:
    a_command_that_cannot_start_claims_no_window_on_mysql => Backend::Mysql(MariaDb::start()),
    a_command_that_cannot_start_claims_no_window_on_postgres => Backend::Postgres(postgres_granted()),
    a_command_that_cannot_start_claims_no_window_on_redis => Backend::Redis(Redis::start()),
    a_command_that_cannot_start_claims_no_window_on_file => Backend::File(Lab::new()),
);

/// A job that records `start`/`stop` with its pid in `trace` (for the overlap check) and the window
/// it was given in `windows`, and runs for `seconds`.
fn job(lab: &Lab, seconds: &str) -> Vec<String> {
    let script = format!(
        "echo start $$ >> {trace}; echo $SENTINEL_GUARD_WINDOW $SENTINEL_GUARD_WINDOW_START >> {windows}; \
         sleep {seconds}; echo stop $$ >> {trace}",
        trace = lab.path("trace").display(),
        windows = lab.path("windows").display(),
    );
    vec!["sh".into(), "-c".into(), script]
}

/// How often each window index was run, from the `windows` file.
fn runs_per_window(lab: &Lab) -> BTreeMap<i64, usize> {
    let mut runs = BTreeMap::new();
    for line in trace_lines(&lab.path("windows")) {
        let index = line.split_whitespace().next().unwrap().parse().unwrap();
        *runs.entry(index).or_insert(0) += 1;
    }
    runs
}

fn replicas(lab: &mut Lab, count: usize, args: &[&str], app: &[String]) -> Vec<GuardProcess> {
    (0..count).map(|_| lab.spawn(args, &as_strs(app))).collect()
}

fn logs(guards: &[GuardProcess]) -> String {
    guards.iter().map(GuardProcess::log_text).collect()
}

/// Waits for seven windows to run, then asserts each ran exactly once and none was skipped after
/// the first: the replicas start in the middle of a window, so the first run may still be going when
/// the next window starts, which makes that one busy.
fn consecutive_windows_each_run_once(lab: &Lab, guards: &[GuardProcess]) {
    let seven = wait_until(Duration::from_secs(40), || runs_per_window(lab).len() >= 7);
    let runs = runs_per_window(lab);
    assert!(
        seven,
        "fewer than seven windows ran: {runs:?}\n{}",
        logs(guards)
    );
    assert!(
        runs.values().all(|&n| n == 1),
        "a window ran twice: {runs:?}\n{}",
        logs(guards)
    );
    let after_first: Vec<i64> = runs.keys().skip(1).copied().collect();
    assert!(
        after_first.windows(2).all(|pair| pair[1] == pair[0] + 1),
        "a window was skipped: {runs:?}\n{}",
        logs(guards)
    );
}

/// Three `--every 2s` replicas for six windows: each window run exactly once, by any replica, with
/// no gap and no overlap.
fn each_window_exactly_once(backend: &Backend) {
    let mut lab = Lab::new();
    let url = backend.url();
    let args = [
        &["--url", &url, "--name", "every2s", "--every", "2s"][..],
        &backend.fast_args(),
    ]
    .concat();
    let app = job(&lab, "0.2");
    let guards = replicas(&mut lab, 3, &args, &app);
    consecutive_windows_each_run_once(&lab, &guards);
    assert_no_overlap(&lab.path("trace"));
    let text = logs(&guards);
    assert!(text.contains("window claimed elsewhere"), "{text}");
    // Every window start the app saw is the start of its window: windows of 2s on the server clock.
    for line in trace_lines(&lab.path("windows")) {
        let start = line.split_whitespace().nth(1).unwrap();
        let seconds: u32 = start[17..19].parse().unwrap();
        assert_eq!(
            seconds % 2,
            0,
            "window start {start} is not on a 2s boundary"
        );
    }
}

/// `--once-per 30d` five times runs once; a resident `--every 30d` scheduler started, SIGKILLed and
/// restarted inside the same window never runs it again; `status` shows the claim and its exit code.
fn a_claimed_window_is_never_run_again(backend: &Backend) {
    let mut lab = Lab::new();
    let url = backend.url();
    let app = job(&lab, "0");
    let once = [
        &["--url", &url, "--name", "hourly", "--once-per", "30d"][..],
        &backend.fast_args(),
    ]
    .concat();
    for attempt in 0..5 {
        let (code, log) = lab.run(&once, &as_strs(&app), LONG);
        assert_eq!(code, 0, "attempt {attempt}: {log}");
        if attempt > 0 {
            assert!(
                log.contains("window claimed elsewhere"),
                "attempt {attempt}: {log}"
            );
        }
    }
    assert_eq!(runs_per_window(&lab).values().sum::<usize>(), 1);

    let every = [
        &["--url", &url, "--name", "hourly", "--every", "30d"][..],
        &backend.fast_args(),
    ]
    .concat();
    for restart in 0..2 {
        let mut resident = lab.spawn(&every, &as_strs(&app));
        let decided = wait_until(LONG, || resident.log_text().contains("window_decision"));
        assert!(decided, "restart {restart}: {}", resident.log_text());
        assert!(
            resident.log_text().contains("window claimed elsewhere"),
            "restart {restart}: {}",
            resident.log_text()
        );
        common::send(resident.pid(), 9);
        resident.wait(LONG);
    }
    assert_eq!(runs_per_window(&lab).values().sum::<usize>(), 1);

    let text = status(&lab, &url, "hourly");
    assert!(text.contains("last_window_start="), "{text}");
    assert!(text.contains("last_window_exit_code=0"), "{text}");
    assert!(!text.contains(common::mariadb::PASSWORD), "{text}");
}

/// The `status` line of lock `name`.
fn status(lab: &Lab, url: &str, name: &str) -> String {
    let status = lab
        .command(&["status", "--url", url, "--name", name], &[])
        .stdout(std::process::Stdio::piped())
        .output()
        .unwrap();
    String::from_utf8_lossy(&status.stdout).into_owned()
}

/// A command that is not found, or a script whose interpreter is missing, exits 127 before anything
/// is claimed, and a resident scheduler ends instead of failing every window. A command that fails
/// only at exec (a script whose interpreter is itself a script with a missing interpreter, which
/// only the kernel finds out) ends the scheduler with 127 and leaves that in the window's record,
/// and the window is not counted: the fixed command still runs in it.
fn a_command_that_cannot_start_claims_no_window(backend: &Backend) {
    let mut lab = Lab::new();
    let url = backend.url();
    let with = |schedule: &[&'static str]| {
        [
            &["--url", &url, "--name", "cannotstart"][..],
            schedule,
            &backend.fast_args(),
        ]
        .concat()
    };
    let bad_interpreter = lab.path("bad-interpreter.sh");
    std::fs::write(&bad_interpreter, "#!/nonexistent/interpreter\necho ran\n").unwrap();
    let nested = lab.path("nested.sh");
    std::fs::write(
        &nested,
        format!("#!{}\necho ran\n", bad_interpreter.display()),
    )
    .unwrap();
    for script in [&bad_interpreter, &nested] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(script, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    let once = with(&["--once-per", "30d"]);
    for (command, why) in [
        ("nosuchcmd-xyz", "command not found: nosuchcmd-xyz"),
        (
            bad_interpreter.to_str().unwrap(),
            "its interpreter /nonexistent/interpreter (from its #! line) is not found",
        ),
    ] {
        let (code, log) = lab.run(&once, &[command], LONG);
        assert_eq!(code, 127, "{log}");
        assert!(log.contains("event=\"app_start_failed\""), "{log}");
        assert!(log.contains(why), "{log}");
        assert!(!log.contains("window_decision"), "{log}");
    }
    assert!(
        !status(&lab, &url, "cannotstart").contains("last_window_start="),
        "nothing was claimed"
    );
    let (code, log) = lab.run(&with(&["--every", "1s"]), &["nosuchcmd-xyz"], LONG);
    assert_eq!(code, 127, "a resident scheduler ends: {log}");

    // Claimed, then not run: the kernel alone finds out.
    let (code, log) = lab.run(&once, &[nested.to_str().unwrap()], LONG);
    assert_eq!(code, 127, "{log}");
    assert!(log.contains("event=\"window_not_run\""), "{log}");
    let text = status(&lab, &url, "cannotstart");
    assert!(text.contains("last_window_exit_code=127"), "{text}");
    assert!(text.contains("last_window_finished_at="), "{text}");
    assert!(text.contains("last_window_not_started=true"), "{text}");

    // Not counted: the fixed command runs in that same window, once.
    let (code, log) = lab.run(&once, &as_strs(&job(&lab, "0")), LONG);
    assert_eq!(code, 0, "the fixed command runs in the same window: {log}");
    assert_eq!(runs_per_window(&lab).values().sum::<usize>(), 1, "{log}");
    let (code, log) = lab.run(&once, &as_strs(&job(&lab, "0")), LONG);
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("window claimed elsewhere"), "{log}");
    assert_eq!(runs_per_window(&lab).values().sum::<usize>(), 1, "{log}");
    let text = status(&lab, &url, "cannotstart");
    assert!(text.contains("last_window_exit_code=0"), "{text}");
    assert!(!text.contains("not_started"), "{text}");
}

/// One replica's clock 90s ahead, another's 90s behind, a third on time: windows come from the
/// server's clock, so each is still run exactly once.
fn skewed_clocks_do_not_matter(backend: &Backend) {
    let mut lab = Lab::new();
    let url = backend.url();
    let args = [
        &["--url", &url, "--name", "skewed", "--every", "2s"][..],
        &backend.fast_args(),
    ]
    .concat();
    let app = job(&lab, "0.2");
    let mut guards = Vec::new();
    for skew in ["+90s", "-90s"] {
        let mut cmd = lab.command(&args, &as_strs(&app));
        common::skew_wall_clock(&mut cmd, skew);
        guards.push(lab.start(cmd));
    }
    guards.push(lab.spawn(&args, &as_strs(&app)));
    consecutive_windows_each_run_once(&lab, &guards);
    // The skewed replicas' clocks really were skewed (their log lines are stamped by them)...
    for (guard, skew) in guards.iter().zip([90.0, -90.0]) {
        let text = guard.log_text();
        let stamp = text.split_whitespace().next().expect("a log line");
        let logged = humantime::parse_rfc3339(stamp).expect("an RFC 3339 time");
        let ahead = match logged.duration_since(std::time::SystemTime::now()) {
            Ok(ahead) => ahead.as_secs_f64(),
            Err(behind) => -behind.duration().as_secs_f64(),
        };
        assert!(
            (ahead - skew).abs() < 60.0,
            "skew {skew}s, log stamped {ahead:.0}s off: {text}"
        );
    }
    // ...and they took part: each decided windows, with the server's numbers.
    for guard in &guards[..2] {
        assert!(
            guard.log_text().contains("window_decision"),
            "{}",
            guard.log_text()
        );
    }
}

/// A run that lasts over two windows: the windows that start during it are busy on every replica,
/// and the next run starts only in a later window, never alongside.
fn a_long_run_makes_the_next_windows_busy(backend: &Backend) {
    let mut lab = Lab::new();
    let url = backend.url();
    let args = [
        &["--url", &url, "--name", "long", "--every", "2s"][..],
        &backend.fast_args(),
    ]
    .concat();
    let app = job(&lab, "4.5");
    let guards = replicas(&mut lab, 3, &args, &app);
    let two = wait_until(Duration::from_secs(40), || runs_per_window(&lab).len() >= 2);
    let runs = runs_per_window(&lab);
    assert!(two, "fewer than two runs: {runs:?}\n{}", logs(&guards));
    let indices: Vec<i64> = runs.keys().copied().collect();
    assert!(
        indices.windows(2).all(|w| w[1] - w[0] >= 3),
        "a window during a run was run: {indices:?}\n{}",
        logs(&guards)
    );
    assert_no_overlap(&lab.path("trace"));
    let busy = guards
        .iter()
        .filter(|g| g.log_text().contains("outcome=busy"))
        .count();
    assert_eq!(
        busy,
        3,
        "every replica skips the busy windows:\n{}",
        logs(&guards)
    );
}

/// The backend is down: `skip` does not run (a one-shot exits 69), `run` runs without a lock with a
/// warning and a metric; a resident `skip` scheduler runs again once the backend is back.
#[test]
fn unavailable_backend_follows_the_jobs_policy() {
    let mut redis = Redis::start();
    let url = redis.url();
    redis.kill9();
    let mut lab = Lab::new();
    let app = job(&lab, "0");
    let base = [
        "--url",
        url.as_str(),
        "--name",
        "policy",
        "--connect-timeout",
        "300ms",
    ];

    let skip = [&base[..], &["--once-per", "30d"]].concat();
    let (code, log) = lab.run(&skip, &as_strs(&app), LONG);
    assert_eq!(code, 69, "{log}");
    assert!(log.contains("outcome=unavailable_skipped"), "{log}");
    assert!(runs_per_window(&lab).is_empty());

    let run = [&base[..], &["--once-per", "30d", "--if-unavailable", "run"]].concat();
    let (code, log) = lab.run(&run, &as_strs(&app), LONG);
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("RUNNING THE COMMAND UNCLAIMED"), "{log}");
    assert_eq!(runs_per_window(&lab).len(), 1);

    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let resident = [
        &base[..],
        &[
            "--every",
            "1s",
            "--if-unavailable",
            "run",
            "--metrics-addr",
            &addr,
        ],
    ]
    .concat();
    let mut open = lab.spawn(&resident, &as_strs(&app));
    let counted = wait_until(LONG, || {
        Metrics::scrape(port).is_some_and(|m| {
            m.value(
                "sentinel_guard_runs_total",
                &[("outcome", "unavailable_ran")],
            ) >= 1.0
        })
    });
    assert!(counted, "{}", open.log_text());
    common::send(open.pid(), 15);
    open.wait(LONG);

    let before = runs_per_window(&lab).values().sum::<usize>();
    let resident = [&base[..], &["--every", "1s"]].concat();
    let closed = lab.spawn(&resident, &as_strs(&app));
    assert!(wait_until(LONG, || closed
        .log_text()
        .contains("outcome=unavailable_skipped")));
    assert_eq!(
        runs_per_window(&lab).values().sum::<usize>(),
        before,
        "skip ran the job"
    );
    redis.restart();
    let ran = wait_until(LONG, || closed.log_text().contains("outcome=ran"));
    assert!(ran, "{}", closed.log_text());
}

/// A MySQL user without CREATE is told the exact statement to run once, and the grants.
#[test]
fn mysql_user_without_create_is_given_the_sql() {
    let db = MariaDb::start();
    db.sql(
        "CREATE USER 'limited'@'%' IDENTIFIED BY 'limited-pw-77aa'; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON mysql.* TO 'limited'@'%';",
    );
    let url = db.url().replace(
        &format!("{}:{}", common::mariadb::USER, common::mariadb::PASSWORD),
        "limited:limited-pw-77aa",
    );
    let mut lab = Lab::new();
    let app = job(&lab, "0");
    // A refusal is not an outage: even `--if-unavailable run` does not run the command on it.
    for policy in ["skip", "run"] {
        let (code, log) = lab.run(
            &[
                "--url",
                &url,
                "--name",
                "nocreate",
                "--once-per",
                "30d",
                "--if-unavailable",
                policy,
            ],
            &as_strs(&app),
            LONG,
        );
        assert_eq!(code, 69, "{policy}: {log}");
        assert!(
            log.contains("CREATE TABLE IF NOT EXISTS sentinel_guard_windows"),
            "{policy}: {log}"
        );
        assert!(
            log.contains("GRANT SELECT, INSERT, UPDATE, DELETE"),
            "{log}"
        );
        assert!(!log.contains("limited-pw-77aa"), "{log}");
    }
    assert!(runs_per_window(&lab).is_empty());
    assert!(!Path::new(&lab.path("trace")).exists());
}

/// PostgreSQL 15's default: only the schema's owner creates tables in `public`. The guard's account
/// is told the statement to run once, and the grants.
#[test]
fn postgres_user_without_create_is_given_the_sql() {
    let db = Postgres::start();
    // PostgreSQL 15's default for an ordinary role, which the harness widens.
    db.sql("REVOKE CREATE ON SCHEMA public FROM guard");
    let url = db.url();
    let mut lab = Lab::new();
    let app = job(&lab, "0");
    let (code, log) = lab.run(
        &["--url", &url, "--name", "nocreate", "--once-per", "30d"],
        &as_strs(&app),
        LONG,
    );
    assert_eq!(code, 69, "{log}");
    assert!(
        log.contains("CREATE TABLE IF NOT EXISTS sentinel_guard_windows"),
        "{log}"
    );
    assert!(
        log.contains("GRANT SELECT, INSERT, UPDATE, DELETE"),
        "{log}"
    );
    assert!(!log.contains(common::postgres::PASSWORD), "{log}");
    assert!(runs_per_window(&lab).is_empty());
}

/// Redis with `--redis-min-replicas 1`: a window's claim the replica did not acknowledge could be
/// lost in a failover and the window claimed again elsewhere, so it is not run (skipped, exit 69,
/// `claim_unreplicated`); its claim says the command never started, so with the replica back the
/// window runs, once.
#[test]
fn a_claim_the_replicas_lack_is_skipped_and_the_window_runs_once_later() {
    let primary = Redis::start();
    let replica = Redis::start_with(&[
        "--replicaof".to_owned(),
        "127.0.0.1".to_owned(),
        primary.port.to_string(),
    ]);
    let linked = || {
        replica
            .cli(&["INFO", "replication"])
            .contains("master_link_status:up")
    };
    assert!(wait_until(LONG, linked), "the replica never linked");
    let mut lab = Lab::new();
    let runs = lab.path("runs");
    let url = primary.url();
    let args = [
        "--url",
        &url,
        "--name",
        "unkept",
        "--redis-min-replicas",
        "1",
        "--once-per",
        "30d",
        // The claim comes after the takeover delay: time to stop the replica once the lease (and
        // its WAIT) went through.
        "--takeover-delay",
        "3s",
    ];
    let append = format!("echo ran >> {}", runs.display());
    let app = ["sh", "-c", &append];
    let mut guard = lab.spawn(&args, &app);
    assert!(
        wait_until(LONG, || guard.log_text().contains("takeover_delayed")),
        "{}",
        guard.log_text()
    );
    common::send(replica.pid(), 19);
    let code = guard.code(LONG);
    common::send(replica.pid(), 18);
    let log = guard.log_text();
    assert_eq!(code, 69, "{log}");
    assert!(log.contains("event=\"claim_unreplicated\""), "{log}");
    assert!(log.contains("outcome=unavailable_skipped"), "{log}");
    assert!(!runs.exists(), "the unkept window ran: {log}");

    assert!(wait_until(LONG, linked), "the replica never came back");
    let (code, log) = lab.run(&args, &app, LONG);
    assert_eq!(code, 0, "{log}");
    let (_, log) = lab.run(&args, &app, LONG);
    assert!(log.contains("outcome=claimed_elsewhere"), "{log}");
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "ran\n");
}
