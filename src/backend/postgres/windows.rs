//! PostgreSQL's words for the windows of scheduled jobs (`window_table.rs`).

use super::*;

/// PostgreSQL's words for the windows of scheduled jobs (`window_table.rs`), and where they are
/// kept: the URL's database (its default schema), on a connection of their own, named
/// `app_name` in `pg_stat_activity`.
pub struct PostgresWindows {
    pub(super) target: Box<PostgresTarget>,
    pub(super) app_name: String,
}

#[async_trait]
impl WindowDialect for PostgresWindows {
    type Session = Client;

    const CREATE: &'static str = "CREATE TABLE IF NOT EXISTS sentinel_guard_windows (\
name varchar(64) NOT NULL, \
window_start timestamptz NOT NULL, \
holder varchar(64) NOT NULL, \
host varchar(255) NOT NULL, \
claimed_at timestamptz NOT NULL, \
finished_at timestamptz NULL, \
exit_code smallint NULL, \
PRIMARY KEY (name, window_start))";
    const NOW: &'static str = "clock_timestamp()";
    /// A standby refuses every write by itself.
    const WRITABLE: &'static str = "TRUE";

    fn timestamp(unix_secs: i64) -> String {
        format!("to_timestamp({unix_secs})")
    }

    /// Exactly: `extract` is numeric.
    fn micros(timestamp: &str) -> String {
        format!("(extract(epoch FROM {timestamp}) * 1000000)::bigint")
    }

    /// The lock's backend holds the key and is this guard's, by its `application_name` (pids are
    /// reused).
    fn claim_sql(&self, request: &ClaimRequest<'_>, session_id: i64) -> String {
        let (start, end) = (
            request.window.start / 1_000_000,
            request.window.end / 1_000_000,
        );
        format!(
            "INSERT INTO sentinel_guard_windows (name, window_start, holder, host, claimed_at) \
             SELECT '{name}', to_timestamp({start}), '{holder}', '{host}', clock_timestamp() \
             WHERE EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE {lock} AND l.pid = {session_id} AND a.application_name = '{app}') \
             AND clock_timestamp() >= to_timestamp({start}) AND clock_timestamp() < to_timestamp({end}) \
             ON CONFLICT DO NOTHING",
            name = request.name.as_str(),
            holder = request.holder.id,
            host = request.holder.host,
            lock = lock_row(lock_key(request.name)),
            app = application_name(&request.holder.id),
        )
    }

    fn grant(&self) -> String {
        let user = self.target.config.get_user().unwrap_or("<user>");
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON sentinel_guard_windows TO \"{user}\";")
    }

    async fn open(&self, connect_limit: Duration, _answer: Duration) -> Result<Client, LockError> {
        connect(&self.target, &self.app_name, connect_limit).await
    }

    async fn run(
        &self,
        client: &mut Client,
        what: &str,
        sql: &str,
        limit: Duration,
    ) -> Result<(Rows, u64), TableError> {
        match statement(client, sql, limit).await {
            Ok(answer) => Ok(answer),
            Err(Failure::Db(e)) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => {
                Err(TableError::Missing)
            }
            Err(Failure::Db(e)) if e.as_db_error().is_some() && !session_ended(&e) => {
                Err(TableError::Refused(self.target.explain(e)))
            }
            Err(failure) => Err(TableError::Failed(self.target.failed(what, failure, limit))),
        }
    }

    async fn close(&self, client: Client, _limit: Duration) {
        drop(client);
    }
}

/// The server's clock, in microseconds since the epoch.
pub async fn server_clock(
    target: &PostgresTarget,
    timings: &Timings,
) -> Result<UnixMicros, LockError> {
    let windows = PostgresWindows {
        target: Box::new(target.clone()),
        app_name: "sentinel-guard clock".to_owned(),
    };
    window_table::server_clock(&windows, timings).await
}

/// The newest claimed window of `name`, for `status` and the scheduler.
pub async fn last_claim(
    target: &PostgresTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<Claim>, LockError> {
    let windows = PostgresWindows {
        target: Box::new(target.clone()),
        app_name: "sentinel-guard status".to_owned(),
    };
    window_table::last_claim(&windows, name.as_str(), connect_limit, answer).await
}
