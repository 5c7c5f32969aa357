//! MySQL's words for the windows of scheduled jobs (`window_table.rs`).

use super::*;

/// MySQL's words for the windows of scheduled jobs (`window_table.rs`), and where they are kept:
/// the URL's database, on a connection of their own.
pub struct MysqlWindows(pub(super) Box<MysqlTarget>);

pub(super) const ER_NO_SUCH_TABLE: u16 = 1146;

#[async_trait]
impl WindowDialect for MysqlWindows {
    type Session = Conn;

    const CREATE: &'static str = "CREATE TABLE IF NOT EXISTS sentinel_guard_windows (\
name VARCHAR(64) NOT NULL, \
window_start DATETIME(6) NOT NULL, \
holder VARCHAR(64) NOT NULL, \
host VARCHAR(255) NOT NULL, \
claimed_at DATETIME(6) NOT NULL, \
finished_at DATETIME(6) NULL, \
exit_code SMALLINT NULL, \
PRIMARY KEY (name, window_start))";
    const NOW: &'static str = "NOW(6)";
    /// `read_only` read as `GET_LOCK`'s statement reads it.
    const WRITABLE: &'static str = "CAST(@@global.read_only AS CHAR) IN ('0', 'OFF')";

    fn timestamp(unix_secs: i64) -> String {
        format!("FROM_UNIXTIME({unix_secs})")
    }

    fn micros(timestamp: &str) -> String {
        format!("CAST(UNIX_TIMESTAMP({timestamp}) * 1000000 AS SIGNED)")
    }

    /// The lock's session holds the lock (`IS_USED_LOCK`) and still runs this guard's check (after
    /// a server restart its id could be a stranger's), on a server that is still a writable
    /// primary: a user allowed to write on a demoted one would claim a window its replicas never
    /// see (`read_only` read as `GET_LOCK`'s statement reads it).
    fn claim_sql(&self, request: &ClaimRequest<'_>, session_id: i64) -> String {
        let (start, end) = (
            request.window.start / 1_000_000,
            request.window.end / 1_000_000,
        );
        format!(
            "INSERT IGNORE INTO sentinel_guard_windows (name, window_start, holder, host, claimed_at) \
             SELECT '{name}', FROM_UNIXTIME({start}), '{holder}', '{host}', NOW(6) FROM DUAL \
             WHERE IS_USED_LOCK('{name}') = {session_id} \
             AND (SELECT INFO FROM information_schema.PROCESSLIST WHERE ID = {session_id}) \
             LIKE '%holder_id={holder} %' \
             AND {writable} \
             AND UNIX_TIMESTAMP(NOW(6)) >= {start} AND UNIX_TIMESTAMP(NOW(6)) < {end}",
            name = request.name.as_str(),
            holder = request.holder.id,
            host = request.holder.host,
            writable = Self::WRITABLE,
        )
    }

    fn grant(&self) -> String {
        let db = self.0.opts.db_name().unwrap_or("<database>");
        let user = self.0.opts.user().unwrap_or("<user>");
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON `{db}`.`sentinel_guard_windows` TO '{user}'@'%';")
    }

    /// In UTC, so `FROM_UNIXTIME` and `UNIX_TIMESTAMP` are exact, and with autocommit on whatever
    /// the server's default, so a claim is stored the moment it is made.
    async fn open(&self, connect_limit: Duration, answer: Duration) -> Result<Conn, LockError> {
        let target: &MysqlTarget = &self.0;
        let mut conn = connect(target, connect_limit).await?;
        let set = "SET time_zone = '+00:00', autocommit = 1";
        set_up((target, set, answer), conn.query_drop(set)).await?;
        Ok(conn)
    }

    async fn run(
        &self,
        conn: &mut Conn,
        what: &str,
        sql: &str,
        limit: Duration,
    ) -> Result<(Rows, u64), TableError> {
        let target: &MysqlTarget = &self.0;
        let ran = timeout(limit, async {
            let answer = conn.query_iter(sql).await?;
            let changed = answer.affected_rows();
            let rows = answer.collect_and_drop::<mysql_async::Row>().await?;
            Ok::<_, mysql_async::Error>((rows, changed))
        })
        .await;
        match ran {
            Err(_) => Err(TableError::Failed(no_answer(target, what, limit))),
            Ok(Ok((rows, changed))) => Ok((rows.into_iter().map(text_row).collect(), changed)),
            Ok(Err(mysql_async::Error::Server(e))) if e.code == ER_NO_SUCH_TABLE => {
                Err(TableError::Missing)
            }
            // A server shutting down or a killed session: unreachable, not a refusal.
            Ok(Err(e)) if session_ended(&e) => Err(TableError::Failed(setup_error(target, e))),
            Ok(Err(mysql_async::Error::Server(e))) => Err(TableError::Refused(format!(
                "{}: {}",
                target.url,
                target.url.scrub(e)
            ))),
            Ok(Err(e)) => Err(TableError::Failed(setup_error(target, e))),
        }
    }

    async fn close(&self, conn: Conn, limit: Duration) {
        let _ = timeout(limit, conn.disconnect()).await;
    }
}

/// A row of the text protocol, whose values are bytes or NULL.
fn text_row(row: mysql_async::Row) -> Vec<Option<String>> {
    row.unwrap()
        .into_iter()
        .map(|value| match value {
            mysql_async::Value::NULL => None,
            mysql_async::Value::Bytes(bytes) => Some(String::from_utf8_lossy(&bytes).into_owned()),
            other => Some(other.as_sql(true)),
        })
        .collect()
}

/// The server's clock, in microseconds since the epoch.
pub async fn server_clock(
    target: &MysqlTarget,
    timings: &Timings,
) -> Result<UnixMicros, LockError> {
    window_table::server_clock(&MysqlWindows(Box::new(target.clone())), timings).await
}

/// The newest claimed window of `name`, for `status` and the scheduler; none without a database
/// in the URL, where no window can have been claimed.
pub async fn last_claim(
    target: &MysqlTarget,
    name: &LockName,
    connect_limit: Duration,
    answer: Duration,
) -> Result<Option<Claim>, LockError> {
    if target.opts.db_name().is_none() {
        return Ok(None);
    }
    let windows = MysqlWindows(Box::new(target.clone()));
    window_table::last_claim(&windows, name.as_str(), connect_limit, answer).await
}
