//! `sentinel-guard explain`: the timeline of a configuration, from the guard's own rules; it
//! contacts nothing, so no server is needed.

mod common;

use std::process::Output;

use common::Lab;

fn explain(lab: &Lab, args: &[&str]) -> Output {
    let mut all = vec!["explain"];
    all.extend_from_slice(args);
    lab.command(&all, &[])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .output()
        .unwrap()
}

fn json(lab: &Lab, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--format", "json"];
    all.extend_from_slice(args);
    let out = explain(lab, &all);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn fault<'a>(explained: &'a serde_json::Value, starts: &str) -> &'a serde_json::Value {
    explained["faults"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["fault"].as_str().unwrap().starts_with(starts))
        .unwrap_or_else(|| panic!("no fault {starts:?}: {explained}"))
}

#[test]
fn the_defaults_leave_no_overlap_on_any_backend_and_the_numbers_are_the_guards() {
    let lab = Lab::with_default_takeover();
    let file = lab.file_url("x.lock");
    for url in [
        "mysql://guard:pw@db.example:3306/app",
        "postgres://guard:pw@db.example/app",
        "redis://cache.example:6379",
        "redis+sentinel://s1.example:26379,s2.example:26379/mymaster",
        "etcd://e1.example:2379",
        file.as_str(),
    ] {
        let mut cmd = lab.command(
            &["explain", "--format", "json", "--url", url, "--name", "n"],
            &[],
        );
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let out = cmd.output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let explained: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(explained["takeover_delay"], "auto", "{url}");
        for f in explained["faults"].as_array().unwrap() {
            assert_eq!(f["no_overlap"], true, "{url}: {f}");
        }
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.contains(":pw@"), "{url}: a password printed: {text}");
    }
    // MySQL with the defaults: detection 1s + 2s, the server's wait_timeout 2 + 1 + 2x2 + 10 + 5,
    // and the recorded bound 2 + 1 + 2x2 + 10.
    let mysql = json(
        &lab,
        &["--url", "mysql://guard:pw@db.example/app", "--name", "n"],
    );
    let quantity = |name: &str| {
        mysql["quantities"]
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["name"] == name)
            .unwrap()["ms"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(quantity("detection bound"), 3_000);
    assert_eq!(quantity("server session timeout"), 22_000);
    let killed = fault(&mysql, "the guard's session is killed");
    assert_eq!(killed["app_dead_ms"], 10_000);
    assert_eq!(killed["standby_starts_ms"], 17_000);
    // Redis with the defaults: the lease relied on is 30s less 400ms.
    let redis = json(&lab, &["--url", "redis://cache.example", "--name", "n"]);
    let silent = fault(&redis, "the server falls silent");
    assert_eq!(silent["app_dead_ms"], 29_600);
    assert_eq!(silent["lock_free_ms"], 30_000);
}

#[test]
fn a_takeover_delay_too_short_is_shown_as_a_possible_overlap() {
    let lab = Lab::with_default_takeover();
    let args = [
        "--url",
        "mysql://guard:pw@db.example/app",
        "--name",
        "n",
        "--takeover-delay",
        "2s",
    ];
    let out = explain(&lab, &args);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("OVERLAP POSSIBLE"), "{text}");
    assert!(text.contains("--takeover-delay 2s"), "{text}");
    let mysql = json(&lab, &args);
    assert_eq!(
        fault(&mysql, "the guard's session is killed")["no_overlap"],
        false
    );
    assert_eq!(fault(&mysql, "the guard is killed")["no_overlap"], true);
}

#[test]
fn a_configuration_the_guard_refuses_is_refused_with_the_same_reason() {
    let lab = Lab::with_default_takeover();
    for args in [
        vec![
            "--url",
            "redis://cache.example",
            "--name",
            "n",
            "--ttl",
            "3s",
        ],
        vec![
            "--url",
            "mysql://guard:pw@db.example/app",
            "--name",
            "n",
            "--grace-period",
            "2h",
        ],
        vec!["--url", "file:rel.lock", "--name", "n"],
        vec!["--name", "n"],
    ] {
        let guard = lab
            .command(&args, &["true"])
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let explained = explain(&lab, &args);
        assert_eq!(guard.status.code(), Some(2), "{args:?}");
        assert_eq!(explained.status.code(), Some(2), "{args:?}");
        assert_eq!(
            String::from_utf8_lossy(&explained.stderr),
            String::from_utf8_lossy(&guard.stderr),
            "{args:?}"
        );
        assert!(explained.stdout.is_empty());
    }
    let nested = explain(&lab, &["status", "--name", "n"]);
    assert_eq!(nested.status.code(), Some(2));
}
