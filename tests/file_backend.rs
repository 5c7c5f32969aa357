//! The file backend: `flock` contention, guard death, and the lock file vanishing while held.

mod common;

use std::time::Duration;

use common::*;

fn args<'a>(url: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--url", url, "--name", "filelock"];
    v.extend(fast_with(extra));
    v
}

#[test]
fn second_instance_exits_with_the_held_code_and_names_the_holder() {
    let mut lab = Lab::new();
    let url = lab.file_url("app.lock");
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut first = lab.spawn(&args(&url, &[]), &as_strs(&recording_app(&trace, &pidfile)));
    read_pid(&pidfile, Duration::from_secs(5));

    let marker = lab.path("second-ran");
    let (code, log) = lab.run(
        &args(&url, &[]),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(5),
    );
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains(&format!("pid={}", first.pid())),
        "holder not named: {log}"
    );
    let (code, _) = lab.run(
        &args(&url, &["--held-exit-code", "3"]),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(5),
    );
    assert_eq!(code, 3);
    assert!(!marker.exists(), "a refused guard must never start its app");

    first.signal(15);
    assert_eq!(first.code(Duration::from_secs(5)), 0);
    let (code, log) = lab.run(
        &args(&url, &[]),
        &["touch", marker.to_str().unwrap()],
        Duration::from_secs(5),
    );
    assert_eq!(code, 0, "lock not free after the first guard ended: {log}");
    assert!(marker.exists());
}

#[test]
fn sigkill_of_the_guard_kills_the_app_and_frees_the_lock() {
    let mut lab = Lab::new();
    let url = lab.file_url("app.lock");
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(&args(&url, &[]), &as_strs(&recording_app(&trace, &pidfile)));
    let app = read_pid(&pidfile, Duration::from_secs(5));
    guard.signal(9);
    guard.wait(Duration::from_secs(5));
    assert!(
        wait_until(Duration::from_secs(2), || !alive(app)),
        "app outlived its SIGKILLed guard"
    );
    // The watchdog keeps the lock until it has seen the app's group gone, moments after.
    let mut last = (0, String::new());
    let freed = wait_until(Duration::from_secs(2), || {
        last = lab.run(&args(&url, &[]), &["true"], Duration::from_secs(5));
        last.0 == 0
    });
    assert!(freed, "lock not freed after the app died: {}", last.1);
}

#[test]
fn deleting_the_lock_file_is_a_lost_lock() {
    let mut lab = Lab::new();
    let url = lab.file_url("app.lock");
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(&args(&url, &[]), &as_strs(&recording_app(&trace, &pidfile)));
    let app = read_pid(&pidfile, Duration::from_secs(5));
    std::fs::remove_file(lab.path("app.lock")).unwrap();
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        75,
        "{}",
        guard.log_text()
    );
    assert!(
        guard.log_text().contains("reason=lock_file_deleted"),
        "{}",
        guard.log_text()
    );
    assert!(trace_lines(&trace).contains(&format!("stop {app}")));
    assert!(!alive(app));
}

#[test]
fn replacing_the_lock_file_is_a_lost_lock() {
    let mut lab = Lab::new();
    let url = lab.file_url("app.lock");
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut guard = lab.spawn(&args(&url, &[]), &as_strs(&recording_app(&trace, &pidfile)));
    read_pid(&pidfile, Duration::from_secs(5));
    std::fs::write(lab.path("new.lock"), "").unwrap();
    std::fs::rename(lab.path("new.lock"), lab.path("app.lock")).unwrap();
    assert_eq!(
        guard.code(Duration::from_secs(5)),
        75,
        "{}",
        guard.log_text()
    );
    assert!(
        guard.log_text().contains("reason=lock_file_replaced"),
        "{}",
        guard.log_text()
    );
}

#[test]
fn missing_lock_directory_exits_69_and_names_it() {
    let mut lab = Lab::new();
    let url = lab.file_url("no-such-dir/app.lock");
    let (code, log) = lab.run(&args(&url, &[]), &["true"], Duration::from_secs(5));
    assert_eq!(code, 69, "{log}");
    assert!(
        log.contains("no-such-dir") && log.contains("does not exist"),
        "{log}"
    );
}

#[test]
fn a_waiting_standby_follows_the_lock_file_replaced_under_it() {
    let mut lab = Lab::new();
    let url = lab.file_url("app.lock");
    // The file is held by another program, which keeps holding the old file after the path moves on.
    // In a process group of its own, so that flock's `sleep` dies with it at the end.
    use std::os::unix::process::CommandExt;
    let mut holder = std::process::Command::new("flock")
        .arg(lab.path("app.lock"))
        .args(["sleep", "30"])
        .process_group(0)
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(5), || {
        std::fs::read_to_string("/proc/locks")
            .unwrap()
            .contains(&format!(" {} ", holder.id()))
    }));
    let (trace, pidfile) = (lab.path("trace"), lab.path("pid"));
    let mut standby = lab.spawn(
        &args(&url, &["--wait"]),
        &as_strs(&recording_app(&trace, &pidfile)),
    );
    assert!(wait_until(Duration::from_secs(5), || standby
        .log_text()
        .contains("waiting")));
    assert!(!pidfile.exists(), "{}", standby.log_text());
    std::fs::write(lab.path("new.lock"), "").unwrap();
    std::fs::rename(lab.path("new.lock"), lab.path("app.lock")).unwrap();
    // A new guard would lock the file the path names now, so the standby takes that one.
    read_pid(&pidfile, Duration::from_secs(5));
    assert!(
        holder.try_wait().unwrap().is_none(),
        "the old file is still held"
    );
    standby.signal(15);
    assert_eq!(
        standby.code(Duration::from_secs(10)),
        0,
        "{}",
        standby.log_text()
    );
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(holder.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    holder.wait().unwrap();
}

/// A lock file another user made (root, with the default 0644) cannot be opened by a guard of
/// another user: exit 69, naming the file's owner and mode and what every guard of the lock needs.
#[test]
fn a_lock_file_of_another_user_is_refused_with_its_owner_and_mode() {
    use std::os::unix::fs::PermissionsExt;
    let shared = tempfile::Builder::new()
        .prefix("sg-shared-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let url = format!("file://{}", shared.path().join("shared.lock").display());
    let mut lab = Lab::new();
    let (code, log) = lab.run(
        &["--url", &url, "--name", "shared"],
        &["true"],
        Duration::from_secs(10),
    );
    assert_eq!(code, 0, "{log}");
    let inner = lab.command(&["--url", &url, "--name", "shared"], &["true"]);
    let mut cmd = std::process::Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(inner.get_program())
        .args(inner.get_args())
        // Nobody may make a cgroup here: what that costs is not what this test is about.
        .env("SENTINEL_GUARD_ALLOW_NO_CGROUP", "true");
    let mut guard = lab.start(cmd);
    let code = guard.code(Duration::from_secs(10));
    let log = guard.log_text();
    assert_eq!(code, 69, "{log}");
    assert!(log.contains("belongs to uid 0 with mode 0644"), "{log}");
    assert!(log.contains("a group they share with mode 0660"), "{log}");
}
