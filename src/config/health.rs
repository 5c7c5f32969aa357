//! `--health-cmd` and its companions: the app's health check, as Docker's HEALTHCHECK runs one.

use super::*;

/// `--health-cmd`: the app's health check, as Docker's HEALTHCHECK runs one.
#[derive(Debug, Clone)]
pub struct HealthCheck {
    /// Run by `/bin/sh -c`.
    pub command: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub retries: u32,
    pub start_period: Duration,
}

const MIN_HEALTH_INTERVAL: Duration = Duration::from_millis(100);
const MIN_HEALTH_TIMEOUT: Duration = Duration::from_millis(100);

/// `--health-cmd` and its companions, which mean nothing without it.
pub(super) fn health_check(cli: &Cli) -> Result<Option<HealthCheck>, ConfigError> {
    let Some(command) = cli.health_cmd.clone() else {
        if cli.health_interval.is_some()
            || cli.health_timeout.is_some()
            || cli.health_retries.is_some()
            || cli.health_start_period.is_some()
        {
            return Err(invalid(
                "--health-interval, --health-timeout, --health-retries and --health-start-period need --health-cmd",
            ));
        }
        return Ok(None);
    };
    if command.trim().is_empty() {
        return Err(invalid("--health-cmd is empty; give a command such as 'curl -fsS http://localhost:8080/health'"));
    }
    let check = HealthCheck {
        command,
        interval: cli.health_interval.unwrap_or(Duration::from_secs(10)),
        timeout: cli.health_timeout.unwrap_or(Duration::from_secs(5)),
        retries: cli.health_retries.unwrap_or(3),
        start_period: cli.health_start_period.unwrap_or(Duration::ZERO),
    };
    at_most("--health-interval", check.interval, DAY)?;
    at_most("--health-timeout", check.timeout, HOUR)?;
    at_most("--health-start-period", check.start_period, DAY)?;
    at_least("--health-interval", check.interval, MIN_HEALTH_INTERVAL)?;
    at_least("--health-timeout", check.timeout, MIN_HEALTH_TIMEOUT)?;
    Ok(Some(check))
}
