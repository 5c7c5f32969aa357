//! The command-line contract: validation before any I/O, exit codes, the unguarded switch, and what
//! the app's environment may contain.

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::*;

/// A listener whose accept queue tells whether the guard tried to connect.
fn listener() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!(
        "mysql://u:topsecret-77@127.0.0.1:{}/db",
        listener.local_addr().unwrap().port()
    );
    (listener, url)
}

#[test]
fn each_bad_input_exits_2_names_it_and_contacts_nothing() {
    let (listener, url) = listener();
    let url = url.as_str();
    let cases: &[(&[&str], &str)] = &[
        (&["--name", "has space"], "--name"),
        (&["--name", &"x".repeat(65)], "--name"),
        (
            &["--name", "ok", "--grace-period", "ten seconds"],
            "--grace-period",
        ),
        (
            &["--name", "ok", "--check-interval", "10ms"],
            "--check-interval",
        ),
        (&["--name", "ok", "--check-timeout", "5"], "--check-timeout"),
        (
            &["--name", "ok", "--connect-timeout", "0s"],
            "--connect-timeout",
        ),
        (
            &["--name", "ok", "--stop-signal", "SIGNOPE"],
            "--stop-signal",
        ),
        (
            &["--name", "ok", "--held-exit-code", "256"],
            "--held-exit-code",
        ),
        (&["--name", "ok", "--log-format", "xml"], "--log-format"),
        (
            &["--name", "ok", "--exit-code-map", "143"],
            "--exit-code-map",
        ),
        (
            &["--name", "ok", "--grace-period", "1000years"],
            "grace-period",
        ),
    ];
    let mut lab = Lab::new();
    for (extra, named) in cases {
        let mut args = vec!["--url", url];
        args.extend_from_slice(extra);
        let (code, log) = lab.run(&args, &["true"], Duration::from_secs(5));
        assert_eq!(code, 2, "{extra:?}: {log}");
        assert!(
            log.contains(named),
            "{extra:?}: message does not name {named}: {log}"
        );
        assert!(!log.contains("topsecret-77"), "{log}");
    }
    for url in [
        "redis-ish://x",
        "not a url",
        "file://elsewhere/x.lock",
        "mysql://u@h:3306/db?bogus=1",
    ] {
        let (code, log) = lab.run(
            &["--url", url, "--name", "ok"],
            &["true"],
            Duration::from_secs(5),
        );
        assert_eq!(code, 2, "{url}: {log}");
        assert!(log.contains("--url"), "{url}: {log}");
    }
    let mut cmd = lab.command(&["--url", url, "--name", "ok"], &["true"]);
    cmd.env("SINGLE_INSTANCE_GUARD", "perhaps");
    let mut guard = lab.start(cmd);
    assert_eq!(guard.code(Duration::from_secs(5)), 2);
    assert!(guard.log_text().contains("SINGLE_INSTANCE_GUARD"));
    let (code, log) = lab.run(&["--name", "ok"], &["true"], Duration::from_secs(5));
    assert_eq!(code, 2);
    assert!(log.contains("--url"), "{log}");
    let (code, _) = lab.run(&["--url", url, "--name", "ok"], &[], Duration::from_secs(5));
    assert_eq!(code, 2, "a command is required");

    assert!(
        listener.accept().is_err(),
        "the guard connected despite a configuration error"
    );
}

#[test]
fn unresponsive_server_exits_69_within_connect_timeout() {
    // The kernel completes the TCP handshake from the backlog, but no MySQL greeting ever comes.
    let (_listener, url) = listener();
    let mut lab = Lab::new();
    let started = Instant::now();
    let (code, log) = lab.run(
        &["--url", &url, "--name", "ok", "--connect-timeout", "500ms"],
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 69, "{log}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    assert!(!log.contains("topsecret-77"), "{log}");
    assert!(log.contains("u:***@"), "{log}");
}

#[test]
fn refused_connection_exits_69() {
    let port = free_port();
    let mut lab = Lab::new();
    let url = format!("mysql://u:p@127.0.0.1:{port}/db");
    let (code, log) = lab.run(
        &["--url", &url, "--name", "ok"],
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 69, "{log}");
}

#[test]
fn exit_status_passes_through() {
    let mut lab = Lab::new();
    let url = lab.file_url("codes.lock");
    // execvp's rules, which the guard's own exec keeps: a file without `#!` runs under /bin/sh, a
    // file without the execute bit is 126, an empty name is not found.
    let script = lab.path("no-shebang");
    std::fs::write(&script, "exit 9\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let plain = lab.path("not-executable");
    std::fs::write(&plain, "exit 0\n").unwrap();
    let (script, plain) = (script.display().to_string(), plain.display().to_string());
    let cases: &[(&[&str], i32)] = &[
        (&[&script], 9),
        (&[&plain], 126),
        (&[""], 127),
        (&["sh", "-c", "exit 7"], 7),
        (&["sh", "-c", "kill -9 $$"], 137),
        (&["sh", "-c", "kill -15 $$"], 143),
        (&["/"], 126),
        (&["/definitely/not/here"], 127),
        (&["definitely-not-on-path-xyz"], 127),
    ];
    for (app, expected) in cases {
        let (code, log) = lab.run(
            &["--url", &url, "--name", "codes"],
            app,
            Duration::from_secs(5),
        );
        assert_eq!(code, *expected, "{app:?}: {log}");
    }
    let (_, log) = lab.run(
        &["--url", &url, "--name", "codes"],
        &["definitely-not-on-path-xyz"],
        Duration::from_secs(5),
    );
    assert!(
        log.contains("definitely-not-on-path-xyz"),
        "127 must name the command: {log}"
    );
}

/// The look-up before the lock searches `PATH` as exec does: past a script whose interpreter is
/// missing (and past a file that is not executable) to the next entry that runs.
#[test]
fn the_command_look_up_searches_path_as_exec_does() {
    use std::os::unix::fs::PermissionsExt;
    let mut lab = Lab::new();
    let url = lab.file_url("path.lock");
    let (first, second, third) = (lab.path("a"), lab.path("b"), lab.path("c"));
    for (dir, script, mode) in [
        (&first, "#!/nonexistent/interpreter\n", 0o755),
        (&second, "#!/bin/sh\nexit 3\n", 0o644),
        (&third, "#!/bin/sh\nexit 5\n", 0o755),
    ] {
        std::fs::create_dir(dir).unwrap();
        let tool = dir.join("sg-tool");
        std::fs::write(&tool, script).unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let path = format!(
        "{}:{}:{}:{}",
        first.display(),
        second.display(),
        third.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = lab.command(&["--url", &url, "--name", "path"], &["sg-tool"]);
    cmd.env("PATH", &path);
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        5,
        "{}",
        guard.log_text()
    );
    std::fs::remove_file(third.join("sg-tool")).unwrap();
    let mut cmd = lab.command(&["--url", &url, "--name", "path"], &["sg-tool"]);
    cmd.env("PATH", &path);
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        126,
        "a denied candidate wins, as for exec: {}",
        guard.log_text()
    );
}

#[test]
fn unguarded_mode_runs_the_app_while_the_lock_is_held_elsewhere() {
    let mut lab = Lab::new();
    let url = lab.file_url("held.lock");
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let _holder = lab.spawn(
        &["--url", &url, "--name", "dev"],
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    read_pid(&pidfile, Duration::from_secs(5));

    let env_dump = lab.path("env");
    let mut cmd = lab.command(
        &["--name", "dev"],
        &["sh", "-c", &format!("env > {}", env_dump.display())],
    );
    cmd.env("SINGLE_INSTANCE_GUARD", "FALSE")
        .env("SENTINEL_GUARD_URL", &url);
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        0,
        "{}",
        guard.log_text()
    );
    assert!(
        guard.log_text().contains("WITHOUT ANY LOCK"),
        "{}",
        guard.log_text()
    );
    let env = std::fs::read_to_string(&env_dump).unwrap();
    assert!(env.contains("SENTINEL_GUARD_BACKEND=none"), "{env}");
    assert!(!env.contains("SENTINEL_GUARD_URL"), "{env}");
}

#[test]
fn the_app_gets_identity_but_never_the_url() {
    let mut lab = Lab::new();
    let url = lab.file_url("env.lock");
    let url_file = lab.path("url");
    std::fs::write(&url_file, format!("{url}\n")).unwrap();
    let env_dump = lab.path("env");
    let mut cmd = lab.command(
        &["--name", "envcheck"],
        &["sh", "-c", &format!("env > {}", env_dump.display())],
    );
    cmd.env("SENTINEL_GUARD_URL_FILE", &url_file);
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        0,
        "{}",
        guard.log_text()
    );
    let env = std::fs::read_to_string(&env_dump).unwrap();
    assert!(env.contains("SENTINEL_GUARD_NAME=envcheck"), "{env}");
    assert!(env.contains("SENTINEL_GUARD_BACKEND=file"), "{env}");
    assert!(env.contains("SENTINEL_GUARD_HOLDER_ID="), "{env}");
    assert!(!env.contains("SENTINEL_GUARD_URL"), "{env}");

    let (code, log) = lab.run(
        &[
            "--url",
            &url,
            "--url-file",
            url_file.to_str().unwrap(),
            "--name",
            "x",
        ],
        &["true"],
        Duration::from_secs(5),
    );
    assert_eq!(code, 2, "--url and --url-file conflict: {log}");
}

/// `file:rel.lock` is no relative path to the URL parser but `/rel.lock`: refused, and nothing is
/// created at the root or in the working directory.
#[test]
fn a_relative_file_url_is_refused_and_locks_nothing() {
    let mut lab = Lab::new();
    let unique = format!("sg-rel-{}.lock", std::process::id());
    for url in [format!("file:{unique}"), format!("file:./{unique}")] {
        let mut cmd = lab.command(&["--url", &url, "--name", "rel"], &["true"]);
        cmd.current_dir(lab.path(""));
        let mut guard = lab.start(cmd);
        let code = guard.code(Duration::from_secs(5));
        let log = guard.log_text();
        assert_eq!(code, 2, "{url}: {log}");
        assert!(log.contains("file:///abs/path.lock"), "{url}: {log}");
        assert!(!std::path::Path::new("/").join(&unique).exists(), "{url}");
        assert!(!lab.path(&unique).exists(), "{url}");
    }
}

/// A URL file holds one URL: a second line is refused (not joined into the URL), and what is wrong
/// with the URL is said of the file.
#[test]
fn a_url_file_with_two_lines_is_refused_naming_the_file() {
    let mut lab = Lab::new();
    let url_file = lab.path("url");
    let lock = lab.file_url("two.lock");
    std::fs::write(&url_file, format!("{lock}\nsecond line\n")).unwrap();
    let file = url_file.to_str().unwrap();
    let (code, log) = lab.run(
        &["--url-file", file, "--name", "two"],
        &["true"],
        Duration::from_secs(5),
    );
    assert_eq!(code, 2, "{log}");
    assert!(log.contains(&format!("--url-file {file}: line 2")), "{log}");
    std::fs::write(&url_file, "nosuch://host/x\n").unwrap();
    let (code, log) = lab.run(
        &["--url-file", file, "--name", "two"],
        &["true"],
        Duration::from_secs(5),
    );
    assert_eq!(code, 2, "{log}");
    assert!(
        log.contains(&format!("--url-file {file}: unsupported scheme")),
        "{log}"
    );
    std::fs::write(&url_file, format!("\n  {lock}  \r\n\n")).unwrap();
    let (code, log) = lab.run(
        &["--url-file", file, "--name", "two"],
        &["true"],
        Duration::from_secs(5),
    );
    assert_eq!(
        code, 0,
        "surrounding whitespace and blank lines are trimmed: {log}"
    );
}

/// Each error says what is wrong in words an operator can act on, at once, and no more than once.
#[test]
fn error_texts_say_what_is_wrong_and_what_to_do() {
    let redis = common::redis::Redis::start();
    let plain = redis.url();
    // Claimed and never listened on: a port of the kernel's would soon be another test's.
    let closed = free_port();
    let mut lab = Lab::new();
    let cases: Vec<(String, i32, &str, &str)> = vec![
        (
            format!("mysql://u:topsecret-77@127.0.0.1:{closed}/db"),
            69,
            "Connection refused",
            "Input/output error: Input/output error",
        ),
        (
            format!("redis://127.0.0.1:{closed}"),
            69,
            "Connection refused",
            "timed out",
        ),
        (
            "redis:/127.0.0.1".to_owned(),
            2,
            "starts with redis://",
            "unsupported scheme",
        ),
        (
            "mysql:127.0.0.1/db".to_owned(),
            2,
            "starts with mysql://",
            "unsupported scheme",
        ),
        (
            format!("postgres://u:topsecret-77@127.0.0.1:{closed}/db?foo=bar"),
            2,
            "unknown parameter \"foo\"",
            "invalid connection string",
        ),
        (
            format!("mysql://u:topsecret-77@127.0.0.1:{closed}/db?ssl-mode=REQUIRED"),
            2,
            "require_ssl=true",
            "REQUIRED",
        ),
        (
            plain.replacen("redis://", "rediss://", 1),
            69,
            "is it redis://?",
            "topsecret",
        ),
        (
            format!("{plain}/99"),
            69,
            "beyond the server's `databases` setting",
            "unreachable",
        ),
    ];
    for (url, code, says, never) in cases {
        let started = Instant::now();
        let (got, log) = lab.run(
            &["--url", &url, "--name", "e", "--connect-timeout", "2s"],
            &["true"],
            Duration::from_secs(10),
        );
        assert_eq!(got, code, "{url}: {log}");
        assert!(log.contains(says), "{url}: does not say {says:?}: {log}");
        assert!(!log.contains(never), "{url}: says {never:?}: {log}");
        assert!(!log.contains("topsecret-77"), "{url}: {log}");
        if says.contains("refused") {
            assert!(
                started.elapsed() < Duration::from_secs(1),
                "{url}: a refused connection took {:?}",
                started.elapsed()
            );
        }
    }
}

/// `--url` on the command line wins over `SENTINEL_GUARD_URL_FILE` in the environment (and the other
/// way round); both in the environment is refused; `status` reads the same way, and calls a file
/// that is no lock file what the guard calls it (exit 2, not "free"); no arguments at all get a tip.
#[test]
fn the_command_line_wins_over_the_environment_and_status_agrees_with_the_guard() {
    let mut lab = Lab::new();
    let (cli_url, env_url) = (lab.file_url("cli.lock"), lab.file_url("env.lock"));
    let url_file = lab.path("url");
    std::fs::write(&url_file, format!("{env_url}\n")).unwrap();
    let mut cmd = lab.command(&["--url", &cli_url, "--name", "w"], &["true"]);
    cmd.env("SENTINEL_GUARD_URL_FILE", &url_file);
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(10)),
        0,
        "{}",
        guard.log_text()
    );
    assert!(lab.path("cli.lock").exists() && !lab.path("env.lock").exists());

    let mut cmd = lab.command(
        &["--url-file", url_file.to_str().unwrap(), "--name", "w"],
        &["true"],
    );
    cmd.env("SENTINEL_GUARD_URL", &cli_url);
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(10)),
        0,
        "{}",
        guard.log_text()
    );
    assert!(lab.path("env.lock").exists());

    let mut cmd = lab.command(&["--name", "w"], &["true"]);
    cmd.env("SENTINEL_GUARD_URL", &cli_url)
        .env("SENTINEL_GUARD_URL_FILE", &url_file);
    let mut guard = lab.start(cmd);
    assert_eq!(
        guard.code(Duration::from_secs(10)),
        2,
        "{}",
        guard.log_text()
    );
    assert!(
        guard.log_text().contains("both set"),
        "{}",
        guard.log_text()
    );

    let foreign = lab.path("foreign");
    std::fs::write(&foreign, "not a lock\n").unwrap();
    let foreign_url = format!("file://{}", foreign.display());
    let status = lab
        .command(&["status", "--url", &foreign_url, "--name", "w"], &[])
        .output()
        .unwrap();
    assert_eq!(status.status.code(), Some(2));
    assert_eq!(std::fs::read_to_string(&foreign).unwrap(), "not a lock\n");

    let bare = std::process::Command::new(GUARD).output().unwrap();
    assert_eq!(bare.status.code(), Some(2));
    let said = String::from_utf8_lossy(&bare.stderr);
    assert!(
        said.contains("or a subcommand: status, held, explain, man, completions"),
        "{said}"
    );
}

#[test]
fn status_takes_the_guards_check_timeout_minimum() {
    let lab = Lab::new();
    let url = lab.file_url("min.lock");
    let lock = [
        "--url",
        url.as_str(),
        "--name",
        "m",
        "--check-timeout",
        "1ms",
    ];
    let status: Vec<&str> = std::iter::once("status").chain(lock).collect();
    let guard: Vec<&str> = lock.into_iter().chain(["--", "true"]).collect();
    for args in [status, guard] {
        let out = lab
            .command(&args, &[])
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(
            said.contains("--check-timeout 1ms is below the minimum of 100ms"),
            "{args:?}: {said}"
        );
    }
}
