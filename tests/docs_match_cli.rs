//! The documentation cannot drift from the CLI: every option and environment variable the binary
//! knows is in README.md, and the man page and completions are generated from the same definition.

mod common;

use std::collections::BTreeSet;
use std::process::Command;

use common::GUARD;

fn help(args: &[&str]) -> String {
    let out = Command::new(GUARD).args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn words_starting(text: &str, prefix: &str, allowed: impl Fn(char) -> bool) -> BTreeSet<String> {
    text.match_indices(prefix)
        .map(|(at, _)| {
            let rest = &text[at + prefix.len()..];
            let end = rest.find(|c: char| !allowed(c)).unwrap_or(rest.len());
            format!("{prefix}{}", &rest[..end])
        })
        .collect()
}

#[test]
fn every_option_and_env_var_in_help_is_in_the_readme() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let text = help(&["--help"]) + &help(&["status", "--help"]);
    let options = words_starting(&text, "--", |c| c.is_ascii_lowercase() || c == '-');
    let env_vars = words_starting(&text, "SENTINEL_GUARD_", |c| {
        c.is_ascii_uppercase() || c == '_'
    });
    assert!(
        options.len() > 15 && env_vars.len() > 15,
        "help parsing broke: {options:?} {env_vars:?}"
    );
    let missing: Vec<_> = options
        .iter()
        .chain(&env_vars)
        .filter(|w| !["--help", "--version", "--"].contains(&w.as_str()))
        .filter(|w| !readme.contains(w.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md does not document: {missing:?}"
    );
}

#[test]
fn man_page_and_completions_are_generated() {
    assert!(help(&["man"]).contains(".TH sentinel-guard 1"));
    for shell in ["bash", "zsh", "fish"] {
        let script = help(&["completions", shell]);
        assert!(
            script.contains("takeover-delay"),
            "{shell} completion lacks options"
        );
    }
}

#[test]
fn man_page_lists_every_environment_variable_and_cites_no_unshipped_page() {
    let man = help(&["man"]);
    let text = help(&["--help"]) + &help(&["status", "--help"]);
    let mut env_vars = words_starting(&text, "SENTINEL_GUARD_", |c| {
        c.is_ascii_uppercase() || c == '_'
    });
    env_vars.extend(
        [
            "SINGLE_INSTANCE_GUARD",
            "SENTINEL_GUARD_LOG",
            "SENTINEL_GUARD_BACKEND",
            "SENTINEL_GUARD_HOLDER_ID",
            "SENTINEL_GUARD_FENCING_TOKEN",
        ]
        .map(String::from),
    );
    let environment = man
        .split(".SH ENVIRONMENT")
        .nth(1)
        .expect("no ENVIRONMENT section");
    let missing: Vec<_> = env_vars
        .iter()
        .filter(|v| !environment.contains(&format!("\\fB{v}\\fR")))
        .collect();
    assert!(missing.is_empty(), "man page ENVIRONMENT lacks {missing:?}");
    // The only page shipped is sentinel-guard(1) itself.
    let cited: Vec<_> = man
        .lines()
        .filter(|l| !l.starts_with(".TH"))
        .filter(|l| l.contains("(1)") || l.contains("(8)") || l.contains("(5)"))
        .collect();
    assert!(cited.is_empty(), "man page cites other pages: {cited:?}");
}

/// The exit codes `--help` prints (from the code's one table), as (code, meaning).
fn exit_codes_in_help() -> Vec<(String, String)> {
    let text = help(&["--help"]);
    let table = text
        .split("Exit codes:")
        .nth(1)
        .expect("an exit code table");
    table
        .lines()
        .filter_map(|line| line.strip_prefix("  ")?.split_once(": "))
        .map(|(code, meaning)| (code.to_owned(), meaning.to_owned()))
        .collect()
}

#[test]
fn the_man_page_and_readme_give_the_exit_codes_of_help() {
    let codes = exit_codes_in_help();
    assert!(codes.len() >= 10, "{codes:?}");
    let man = help(&["man"]);
    let status = man
        .split(".SH \"EXIT STATUS\"")
        .nth(1)
        .and_then(|rest| rest.split(".SH ").next())
        .expect("an EXIT STATUS section");
    let roff = |text: &str| text.replace('-', "\\-");
    for (code, meaning) in &codes {
        assert!(
            status.contains(&format!(".TP\n\\fB{}\\fR\n{}", roff(code), roff(meaning))),
            "man page lacks exit {code}: {status}"
        );
    }
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme
        .split("\n## Exit codes\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("README.md has an exit code section");
    let first_cells: Vec<&str> = section
        .lines()
        .filter_map(|row| row.strip_prefix("| ")?.split(" |").next())
        .collect();
    for (code, _) in codes.iter().filter(|(code, _)| code.parse::<u8>().is_ok()) {
        assert!(
            first_cells.iter().any(|cell| cell
                .split(|c: char| !c.is_ascii_digit())
                .any(|word| word == code)),
            "README.md's exit table has no row for {code}: {first_cells:?}"
        );
    }
    assert!(man.contains(".SH \"EXAMPLES\""), "no EXAMPLES section");
    assert!(
        man.contains("[OPTIONS] \\-\\- <COMMAND>"),
        "the synopsis shows the --"
    );
}
