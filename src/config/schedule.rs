//! `--every`/`--once-per` and their companions: a scheduled job's windows.

use super::*;

/// `--every`/`--once-per` and their companions, checked against each other and the backend.
pub(super) fn schedule(
    cli: &Cli,
    wait: Wait,
    target: Option<&Target>,
) -> Result<Option<Schedule>, ConfigError> {
    let (option, period, mode) = match (cli.every, cli.once_per) {
        (Some(_), Some(_)) => return Err(invalid(
            "--every and --once-per cannot be used together: --every keeps a scheduler running, \
                 --once-per runs at most once and exits (for a cron line)",
        )),
        (Some(period), None) => ("--every", period, ScheduleMode::Every),
        (None, Some(period)) => ("--once-per", period, ScheduleMode::OncePer),
        (None, None) => {
            if cli.window_offset.is_some() || cli.if_unavailable.is_some() {
                return Err(invalid(
                    "--window-offset and --if-unavailable only apply to --every or --once-per",
                ));
            }
            return Ok(None);
        }
    };
    if wait != Wait::No {
        return Err(invalid(format!(
            "{option} cannot be used with --wait: a window is claimed when it starts, or skipped"
        )));
    }
    at_most(option, period, MAX_WINDOW)?;
    let offset = cli.window_offset.unwrap_or(Duration::ZERO);
    for (what, value) in [(option, period), ("--window-offset", offset)] {
        if value.subsec_nanos() != 0 {
            return Err(invalid(format!(
                "{what} {} must be a whole number of seconds",
                crate::vocab::show_duration(value)
            )));
        }
    }
    if period < Duration::from_secs(1) {
        return Err(invalid(format!("{option} must be at least 1s")));
    }
    if offset >= period {
        return Err(invalid(format!(
            "--window-offset {} must be shorter than the window ({option} {})",
            crate::vocab::show_duration(offset),
            crate::vocab::show_duration(period)
        )));
    }
    if let Some(Target::Etcd(_)) = target {
        return Err(invalid(format!(
            "{option} is not available with etcd: windows are numbered by the backend's clock, so that \
             every replica sees the same ones whatever its own clock says, and etcd has no clock to \
             ask; use a MySQL, PostgreSQL or Redis lock for scheduled runs"
        )));
    }
    if let Some(Target::Mysql(mysql)) = target {
        if mysql.opts.db_name().is_none() {
            return Err(invalid(format!(
                "{option} with MySQL needs a database in the URL (mysql://user:pass@host/db): the table \
                 sentinel_guard_windows that records claimed windows lives there"
            )));
        }
    }
    Ok(Some(Schedule {
        period,
        offset,
        mode,
        if_unavailable: cli.if_unavailable.unwrap_or(IfUnavailable::Skip),
    }))
}
