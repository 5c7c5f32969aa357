//! The Lua scripts the Redis lock runs: each reads and writes a lock's keys in one step on the
//! server, which is what makes them safe against another guard's.

/// The server's `INFO replication` as `replication` (`''` where an ACL refuses `INFO`), and the
/// role it names as `role` (`master`, `slave`; nil where it names none), read once per script.
macro_rules! replication_lua {
    () => {
        r"
local ok, replication = pcall(redis.call, 'INFO', 'replication')
if not ok then
  replication = ''
end
local role = string.match(replication, 'role:(%w+)')
"
    };
}

/// The dataset a script runs on, as a Lua function `dataset(replication)` of the text
/// `replication_lua!` read: the server process and its replication history (`ACQUIRE`), or `''`
/// where `INFO` is refused or says neither.
macro_rules! dataset_lua {
    () => {
        r"
local function dataset(replication)
  local ok, server = pcall(redis.call, 'INFO', 'server')
  local run = ok and string.match(server, 'run_id:(%x+)')
  local replid = string.match(replication, 'master_replid:(%x+)')
  if run and replid then
    return run .. '/' .. replid
  end
  return ''
end
"
    };
}

/// KEYS: lock, fence counter, clean marker, lease record. ARGV: token, holder, ttl (ms), this
/// holder's "app dead by" bound (ms).
///
/// The value is `<token> fence=<n> found=<previous>/<bound>/<dataset> <holder>`; the token is its
/// first word.
/// Returns `{fence, previous, bound, role_read}`: fence 0 when held by another token; `role_read` 0
/// when `INFO` named no role (refused by an ACL), which the guard then asks with `ROLE` before it
/// counts a grant. `previous` is 1 when the
/// previous lease was released by its owner (its fence is the one recorded in the clean key), 2 when
/// it ran out: the lease record (`<fence> <expiry µs> <bound ms>`, written at every grant and
/// renewal) says its expiry has passed on the server's clock; else 0, as after a `DEL` of a live
/// lease. With 2 and 0, the bound that holder recorded (0: none). A key that already holds this
/// token (a retry finding its own grant, whose record replaced the previous holder's) is answered
/// as that grant was, from its `found=`, with the bound it found; a release (1) only if the dataset
/// is still the one that grant ran on (a failover or a split history in between may have let
/// another holder come and go; a dataset `INFO` does not show proves nothing), else as 0.
/// Defensively, a value without `found=` answers 0 with no bound. A missing counter means a first acquisition or a server
/// that lost its data: nobody can tell which, so it counts as 0. The clean marker names the dataset
/// that wrote it: the server process (`run_id`, new at every start) and its replication history
/// (`master_replid`, new at every promotion and full resynchronisation). A marker restored from a
/// snapshot, written before a restart, or carried through a failover and back may miss newer
/// leases, and proves nothing; so does one written where `INFO` is not allowed (an ACL without
/// `+info`): the hand-over then waits.
/// Fence -1 is a counter set back below a token its records hold (`{-1, counter, recorded}`):
/// nothing is written then; nor with fence `NOT_PRIMARY` (-2), from a server whose `INFO` says it is
/// a replica (one with `replica-read-only no` would grant the lock that its primary may hold too). A counter that is missing while its records remain (evicted under an
/// `allkeys-*` policy) is not set back: it resumes above them, and the hand-over waits.
///
/// Fencing tokens never go backwards, even when the server loses its data or a failover loses the
/// newest increments: each token is the counter + 1 or the server's clock in microseconds (`TIME`),
/// whichever is larger, so a counter that lost writes (or all of them) resumes above any token it
/// gave out, unless it was incremented more than a million times a second or the new server's clock
/// is behind the old one's by more than the time the failover took.
pub(super) const ACQUIRE: &str = concat!(
    dataset_lua!(),
    replication_lua!(),
    r"
if role and role ~= 'master' then
  return {-2, 0, 0, 1}
end
local known = role and 1 or 0
local now = redis.call('TIME')
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
local function record(fence)
  redis.call('SET', KEYS[4], fence .. ' ' .. string.format('%.0f', micros + tonumber(ARGV[3]) * 1000) .. ' ' .. ARGV[4])
end
local current = redis.call('GET', KEYS[1])
if current then
  if string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    local fence = string.match(current, ' fence=(%d+)')
    local found, found_bound, found_in = string.match(current, ' found=(%d+)/(%d+)/?(%S*)')
    record(fence)
    -- A release proves something only on the dataset it was seen on; the bound always stands.
    if found == '1' and (found_in == '' or found_in ~= dataset(replication)) then
      found = '0'
    end
    return {tonumber(fence), tonumber(found or '0'), tonumber(found_bound or '0'), known}
  end
  return {0, 0, 0, known}
end
local previous = redis.call('GET', KEYS[2])
local counter = tonumber(previous or '0')
local clean, clean_set = string.match(redis.call('GET', KEYS[3]) or '', '^(%d+) ?(%S*)$')
local f, expiry, b = string.match(redis.call('GET', KEYS[4]) or '', '^(%d+) (%d+) (%d+)')
local recorded = math.max(tonumber(clean or '0'), tonumber(f or '0'))
if previous and recorded > counter then
  return {-1, counter, recorded, known}
end
local status, bound = 0, 0
local here = dataset(replication)
if previous and previous == clean and clean_set == here and here ~= '' then
  status = 1
elseif previous and f == previous then
  bound = tonumber(b)
  if tonumber(expiry) <= micros then
    status = 2
  end
end
-- A counter that is gone while its records are not (evicted, deleted) resumes above them.
local fence = math.max(math.max(counter, recorded) + 1, micros)
-- Lua would print a number this large as 1.79e+15: the records keep every digit.
local fenced = string.format('%.0f', fence)
redis.call('SET', KEYS[2], fenced)
local found = ' found=' .. status .. '/' .. string.format('%.0f', bound) .. '/' .. here
redis.call('SET', KEYS[1], ARGV[1] .. ' fence=' .. fenced .. found .. ' ' .. ARGV[2], 'NX', 'PX', ARGV[3])
record(fenced)
return {fence, status, bound, known}
"
);

/// KEYS: lock, lease record. ARGV: token, ttl (ms), fence, this holder's bound (ms). The lease
/// record follows the lease's expiry, so the next holder can tell a lease that ran out from one
/// taken away. Returns 1 when renewed on a primary, 0 when the key is gone or holds another token,
/// and `NOT_PRIMARY` when the server is a replica: a replica with `replica-read-only no` would take
/// the renewal, and the role is read in the same step, so no answer about it can be older than the
/// renewal it vouches for. Where `INFO` is refused (an ACL without `+info`) or names no role, the
/// renewal answers `RENEWED_ROLE_UNASKED`, and the guard asks `ROLE` after it.
pub(super) const RENEW: &str = concat!(
    replication_lua!(),
    r"
if role and role ~= 'master' then
  return -2
end
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  local now = redis.call('TIME')
  local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
  redis.call('SET', KEYS[2], ARGV[3] .. ' ' .. string.format('%.0f', micros + tonumber(ARGV[2]) * 1000) .. ' ' .. ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if role then
    return 1
  end
  return 3
end
return 0
"
);

/// `RENEW`'s answer from a replica (`ACQUIRE`'s fence too).
pub(super) const NOT_PRIMARY: i64 = -2;
/// `RENEW`'s answer when it renewed on a server whose role it could not read.
pub(super) const RENEWED_ROLE_UNASKED: i64 = 3;

/// KEYS: lock, clean marker, release channel (a channel, listed for cluster routing). The marker
/// names the dataset that wrote it (`ACQUIRE`).
pub(super) const RELEASE: &str = concat!(
    dataset_lua!(),
    replication_lua!(),
    r"
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], string.match(current, ' fence=(%d+)') .. ' ' .. dataset(replication))
  redis.call('PUBLISH', KEYS[3], ARGV[1])
  return 1
end
return 0
"
);

/// Claims a window for a scheduled run. KEYS: lock, window claim. ARGV: token, window start (µs),
/// window end (µs), claim record without its time. The claim has no expiry, like the fencing
/// counter: one small key per lock name, which no eviction policy for expiring keys can take and no
/// run, however long, can outlive. Returns 1 when claimed, or when the claim already is this very
/// one, unended (a re-send whose first answer was lost, as a Cluster client makes by itself): then it
/// is written again, so that a `WAIT` after it covers the first write too; 0 and the
/// last claim when it blocks the window (it is this window or a later one, or its run ended after this
/// window started: `Claim::blocks`); -1 when the lease is not ours; -2 when the server's clock is
/// outside the window. The claim only ever moves forward.
pub(super) const CLAIM: &str = r"
local current = redis.call('GET', KEYS[1])
if not current or string.sub(current, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then
  return {-1, ''}
end
local now = redis.call('TIME')
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
if micros < tonumber(ARGV[2]) or micros >= tonumber(ARGV[3]) then
  return {-2, ''}
end
local last = redis.call('GET', KEYS[2])
if last and string.sub(last, 1, #ARGV[4] + 12) == ARGV[4] .. ' claimed_at='
    and not string.find(last, ' finished_at=', 1, true) then
  redis.call('SET', KEYS[2], last)
  return {1, ''}
end
if last then
  local start = tonumber(string.match(last, 'window_start=(%-?%d+)'))
  local finished = tonumber(string.match(last, 'finished_at=(%-?%d+)'))
  -- A claim whose command never started holds its own window no more, but still keeps every
  -- earlier one from being claimed (`Claim::blocks`).
  if string.find(last, ' not_started=1', 1, true) then
    if start and start > tonumber(ARGV[2]) then
      return {0, last}
    end
  elseif (start and start >= tonumber(ARGV[2])) or (finished and finished >= tonumber(ARGV[2])) then
    return {0, last}
  end
end
redis.call('SET', KEYS[2], ARGV[4] .. ' claimed_at=' .. string.format('%.0f', micros))
return {1, ''}
";

/// Adds a run's end to its claim, if the claim is still that run's. KEYS: window claim. ARGV: window
/// start (µs), holder id, exit code, the mark of a command that never started (`RunExit::text_mark`).
pub(super) const RECORD_END: &str = r"
local last = redis.call('GET', KEYS[1])
if last and string.match(last, 'window_start=(%-?%d+)') == ARGV[1]
    and string.match(last, 'claimed_by=(%S+)') == ARGV[2] then
  -- Already recorded: a re-send after a lost answer (a Cluster client's own) adds nothing.
  if string.find(last, ' finished_at=', 1, true) then
    return 1
  end
  local now = redis.call('TIME')
  local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
  redis.call('SET', KEYS[1], last .. ' exit_code=' .. ARGV[3] .. ' finished_at=' .. string.format('%.0f', micros) .. ARGV[4])
  return 1
end
return 0
";
