//! The man page, generated from the clap definition so it cannot drift from `--help`: clap_mangen's
//! sections, plus what it does not write itself: the subcommands without references to per-command
//! pages (none is shipped), every environment variable, and the exit codes.

use std::io::{self, Write};

use clap::{Arg, Command};
use clap_mangen::Man;

use crate::cli::{APP_ENV, ENV_ONLY, EXAMPLES};
use crate::vocab::EXIT_STATUS;

pub fn render(cmd: Command, out: &mut dyn Write) -> io::Result<()> {
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let man = Man::new(cmd.clone());
    man.render_title(out)?;
    man.render_name_section(out)?;
    render_synopsis(&mut cmd, out)?;
    man.render_description_section(out)?;
    man.render_options_section(out)?;
    render_subcommands(&cmd, out)?;
    render_environment(&cmd, out)?;
    render_table(out, "EXIT STATUS", EXIT_STATUS)?;
    render_table(out, "EXAMPLES", EXAMPLES)?;
    man.render_version_section(out)
}

/// The usage lines `--help` prints, which show the `--` before the command (clap_mangen's synopsis
/// lists every option and leaves it out).
fn render_synopsis(cmd: &mut Command, out: &mut dyn Write) -> io::Result<()> {
    writeln!(out, ".SH SYNOPSIS")?;
    let usage = cmd.render_usage().to_string();
    for line in usage.lines() {
        let line = line.trim_start_matches("Usage:").trim();
        writeln!(out, ".PP\n\\fB{}\\fR", roff_text(line))?;
    }
    Ok(())
}

/// A section of tagged paragraphs from one of the code's tables.
fn render_table(out: &mut dyn Write, title: &str, rows: &[(&str, &str)]) -> io::Result<()> {
    writeln!(out, ".SH \"{title}\"")?;
    for (tag, text) in rows {
        writeln!(out, ".TP\n\\fB{}\\fR\n{}", roff_text(tag), roff_text(text))?;
    }
    Ok(())
}

/// Each subcommand with its usage and options, on this page.
fn render_subcommands(cmd: &Command, out: &mut dyn Write) -> io::Result<()> {
    writeln!(out, ".SH SUBCOMMANDS")?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let mut sub = sub.clone();
        let usage = sub.render_usage().to_string();
        let usage = usage.trim_start_matches("Usage:").trim();
        writeln!(out, ".TP\n\\fB{}\\fR", roff_text(usage))?;
        if let Some(about) = sub.get_about() {
            writeln!(out, "{}", roff_text(&about.to_string()))?;
        }
        for arg in sub.get_arguments().filter(|a| !shown_elsewhere(a)) {
            let Some(long) = arg.get_long() else { continue };
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            writeln!(out, ".RS\n.TP\n\\fB\\-\\-{}\\fR", roff_text(long))?;
            writeln!(out, "{}\n.RE", roff_text(&help))?;
        }
    }
    Ok(())
}

/// An argument `status` shares with the guard (documented under OPTIONS), or clap's own `--help`.
fn shown_elsewhere(arg: &Arg) -> bool {
    arg.is_hide_set() || arg.get_env().is_some() || arg.get_id() == "help"
}

/// Every variable an option reads (from the guard's and the subcommands' definitions), the variables
/// no option stands for, and those the command is given.
fn render_environment(cmd: &Command, out: &mut dyn Write) -> io::Result<()> {
    writeln!(out, ".SH ENVIRONMENT")?;
    let mut seen = Vec::new();
    let options = cmd
        .get_arguments()
        .chain(cmd.get_subcommands().flat_map(Command::get_arguments));
    for arg in options {
        let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) else {
            continue;
        };
        let env = env.to_string_lossy().into_owned();
        if seen.contains(&env) {
            continue;
        }
        writeln!(
            out,
            ".TP\n\\fB{}\\fR\nthe same as \\fB\\-\\-{}\\fR",
            roff_text(&env),
            roff_text(long)
        )?;
        seen.push(env);
    }
    let entries = |out: &mut dyn Write, list: &[(&str, &str)]| -> io::Result<()> {
        for (var, meaning) in list {
            writeln!(
                out,
                ".TP\n\\fB{}\\fR\n{}",
                roff_text(var),
                roff_text(meaning)
            )?;
        }
        Ok(())
    };
    entries(out, ENV_ONLY)?;
    writeln!(
        out,
        ".PP\nThe command is started with these set (and without SENTINEL_GUARD_URL and SENTINEL_GUARD_URL_FILE):"
    )?;
    entries(out, APP_ENV)?;
    Ok(())
}

/// Text safe in a roff line: backslashes and hyphens escaped, no line starting with a control
/// character.
fn roff_text(text: &str) -> String {
    let escaped = text.replace('\\', "\\e").replace('-', "\\-");
    match escaped.chars().next() {
        Some('.' | '\'') => format!("\\&{escaped}"),
        _ => escaped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roff_text_escapes_what_roff_would_interpret() {
        assert_eq!(roff_text("--url a\\b"), "\\-\\-url a\\eb");
        assert_eq!(roff_text(".TH x"), "\\&.TH x");
    }
}
