//! The watchdog's farewell on MySQL: ending a dead guard's session, and only while that session
//! is still the dead guard's.

use super::*;

/// `KILL CONNECTION` of the dead guard's session, from a new session, if that session still holds
/// the lock and runs the dead guard's check (see `SessionFarewell`). Run in the watchdog.
pub fn end_session(farewell: &SessionFarewell) -> Result<String, String> {
    let target = match farewell.target()? {
        Target::Mysql(target) => target,
        _ => return Err("not a mysql:// URL".to_owned()),
    };
    farewell.on_runtime(async {
        let mut conn = connect(&target, farewell.timeout)
            .await
            .map_err(|e| e.to_string())?;
        let result = end_on(farewell, &mut conn, &target).await;
        let _ = timeout(farewell.timeout, conn.disconnect()).await;
        result
    })
}

async fn end_on(
    farewell: &SessionFarewell,
    conn: &mut Conn,
    target: &MysqlTarget,
) -> Result<String, String> {
    // The tree is gone (the watchdog says farewell only then): a record still held by the dead
    // guard says so, whether or not its session still holds the lock. One the next holder wrote
    // is not the dead guard's, and is left as it is. Marked before the proof, which the KILL then
    // follows at once: an UPDATE in between (it can wait for a row lock) would age the proof.
    let marked = timeout(
        farewell.timeout,
        conn.query_drop(record_table::mark_sql(
            &farewell.name,
            &farewell.holder_id,
            RecordState::TreeGone,
        )),
    )
    .await;
    match marked {
        Ok(Ok(())) => {}
        Ok(Err(_)) => debug!("the dead guard's lock record could not be marked tree_gone"),
        // Its answer is still unread on this session, where the KILL would read it as its own.
        Err(_) => {
            return Err(format!(
                "no answer within {} while marking the lock record tree_gone",
                crate::vocab::show_duration(farewell.timeout)
            ))
        }
    }
    let ours = runs_our_check(
        conn,
        &farewell.name,
        farewell.session_id,
        &farewell.holder_id,
        farewell.timeout,
    )
    .await
    .map_err(|e| match e {
        Some(e) => target.url.scrub(e),
        None => "no answer to the session's proof".to_owned(),
    })?;
    if !ours {
        return Ok(format!(
            "left connection {}: it no longer holds the lock while running the dead guard's check",
            farewell.session_id
        ));
    }
    let kill = format!("KILL CONNECTION {}", farewell.session_id);
    match timeout(farewell.timeout, conn.query_drop(kill)).await {
        Err(_) => Err(format!(
            "no answer within {}",
            crate::vocab::show_duration(farewell.timeout)
        )),
        Ok(Err(mysql_async::Error::Server(e))) if e.code == ER_NO_SUCH_THREAD => Ok(format!(
            "connection {} had already ended",
            farewell.session_id
        )),
        Ok(Err(e)) => Err(target.url.scrub(e)),
        Ok(Ok(())) => Ok(format!("ended connection {}", farewell.session_id)),
    }
}

/// Whether connection `id` of the server `conn` reaches holds `name` and is running the check of
/// the guard `holder_id` (its comment names the holder): the proof that the number is the lock's
/// session, and not a stranger's that got the same id after a restart, or on another server behind
/// a proxy or a moved address. Only then may it be interrupted or ended. `Err(None)` is a timeout.
pub(super) async fn runs_our_check(
    conn: &mut Conn,
    name: &str,
    id: u64,
    holder_id: &str,
    limit: Duration,
) -> Result<bool, Option<mysql_async::Error>> {
    // A text query: a prepared one costs a round trip more on the side connection, which is new at
    // every release. Lock names and holder ids are characters that need no quoting.
    let proof = conn.query_first::<Option<i64>, _>(format!(
        "SELECT IS_USED_LOCK('{name}') = {id} AND EXISTS (SELECT 1 FROM \
         information_schema.PROCESSLIST WHERE ID = {id} AND INSTR(INFO, 'holder_id={holder_id} ') > 0)"
    ));
    match timeout(limit, proof).await {
        Err(_) => Err(None),
        Ok(Err(e)) => Err(Some(e)),
        Ok(Ok(answer)) => Ok(answer.flatten() == Some(1)),
    }
}

/// MariaDB's "Unknown thread id": the session had already ended.
const ER_NO_SUCH_THREAD: u16 = 1094;
