//! Log output on stderr: tracing's text format, or one JSON object per line whose top level always
//! carries the same keys, so a log pipeline can index them without knowing each event.

use std::fmt;
use std::io::IsTerminal;
use std::sync::OnceLock;
use std::time::SystemTime;

use serde_json::{Map, Value};
use tracing::{Event, Subscriber};
use tracing_appender::non_blocking::{NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::field::VisitOutput;
use tracing_subscriber::fmt::format::{JsonFields, JsonVisitor, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// Present on every JSON line, `null` where an event has no value for them. `name`, `backend` and
/// `holder_id` come from the guard's span, `app_pid` once the app runs, `event` and `reason` from
/// the event itself.
const ALWAYS_PRESENT: [&str; 6] = ["name", "backend", "holder_id", "event", "reason", "app_pid"];

/// How the guard tells its watchdog process which format to log in.
pub const FORMAT_VAR: &str = "SENTINEL_GUARD_LOG_FORMAT";

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// The format this process logs in, as `--log-format` spells it.
pub fn format_name() -> &'static str {
    match FORMAT.get() {
        Some(LogFormat::Json) => "json",
        _ => "text",
    }
}

/// The format the guard passed down to this helper process.
pub fn inherited_format() -> LogFormat {
    match std::env::var(FORMAT_VAR).as_deref() {
        Ok("json") => LogFormat::Json,
        _ => LogFormat::Text,
    }
}

/// Whether `raw` is a filter that means what it says. tracing's syntax reads a bare word as a target
/// name, so a mistyped level (`bogus`, `verbose`) would be a filter that logs nothing at all.
pub fn check_filter(raw: &str) -> Result<(), String> {
    EnvFilter::try_new(raw).map_err(|e| e.to_string())?;
    for directive in raw.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let bare = !directive.contains(['=', '[']);
        let level = ["trace", "debug", "info", "warn", "error", "off"]
            .contains(&directive.to_ascii_lowercase().as_str());
        let ours = directive == "sentinel_guard" || directive.starts_with("sentinel_guard::");
        if bare && !level && !ours {
            return Err(format!(
                "{directive:?} is neither a level (error, warn, info, debug, trace, off) nor target=level"
            ));
        }
    }
    Ok(())
}

/// One error line in the JSON format, for what comes before logging is set up (a refused
/// configuration): written straight to stderr, so no filter can silence it.
pub fn json_error_line(event: &str, message: &str, error: &str) -> String {
    let mut line = line_head("error");
    line.insert("event".into(), event.into());
    line.insert("message".into(), message.into());
    line.insert("error".into(), error.into());
    Value::Object(line).to_string()
}

/// Lines a full stderr may hold back before new ones are dropped.
const BUFFERED_LINES: usize = 1024;

/// Sets up logging; the returned guard flushes what is buffered when dropped (waiting a bounded time
/// for a stderr nobody reads).
///
/// Lines go through a buffer and a writer thread, and are dropped when that buffer is full: a log
/// driver that stops reading stderr must never hold up the guard, whose next step may be a kill.
pub fn init(format: LogFormat) -> WorkerGuard {
    let _ = FORMAT.set(format);
    let filter = EnvFilter::try_from_env(crate::cli::LOG_FILTER_VAR)
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let (writer, flush) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(BUFFERED_LINES)
        .thread_name("sentinel-guard-log")
        .finish(std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder
            .with_ansi(false)
            .fmt_fields(JsonFields::new())
            .event_format(JsonLines)
            .init(),
    }
    flush
}

struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = line_head(&event.metadata().level().as_str().to_lowercase());
        // Span fields are kept as JSON text by `JsonFields`; inner spans override outer ones.
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<FormattedFields<N>>() {
                    line.extend(parse_object(fields.as_str()));
                }
            }
        }
        let mut own = String::new();
        let mut visitor = JsonVisitor::new(&mut own);
        event.record(&mut visitor);
        visitor.finish()?;
        line.extend(parse_object(&own));
        // The holder is `key=value` words in a text line, and an object in a JSON one.
        if let Some(Value::String(holder)) = line.get("holder") {
            let fields = key_values(holder);
            if !fields.is_empty() {
                line.insert("holder".into(), Value::Object(fields));
            }
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// `key=value key="a value"` words (the holder's `Display`: a value with a space is quoted with
/// Rust's escapes) as an object; empty if the text is not made of such words.
fn key_values(text: &str) -> Map<String, Value> {
    let mut fields = Map::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else {
            return Map::new();
        };
        if key.is_empty() || key.contains([' ', '"']) {
            return Map::new();
        }
        let (value, after) = match after.strip_prefix('"') {
            Some(quoted) => {
                let mut value = String::new();
                let mut chars = quoted.char_indices();
                let mut end = None;
                while let Some((at, c)) = chars.next() {
                    match c {
                        '\\' => value.extend(chars.next().map(|(_, c)| c)),
                        '"' => {
                            end = Some(at + 1);
                            break;
                        }
                        c => value.push(c),
                    }
                }
                let Some(end) = end else {
                    return Map::new();
                };
                (value, &quoted[end..])
            }
            None => {
                let end = after.find(' ').unwrap_or(after.len());
                (after[..end].to_owned(), &after[end..])
            }
        };
        fields.insert(key.to_owned(), Value::String(value));
        rest = after.trim_start();
    }
    fields
}

/// What every JSON line starts with: the time, the level, and the keys always present, `null`.
fn line_head(level: &str) -> Map<String, Value> {
    let mut line = Map::new();
    line.insert(
        "timestamp".into(),
        humantime::format_rfc3339_millis(SystemTime::now())
            .to_string()
            .into(),
    );
    line.insert("level".into(), level.into());
    for key in ALWAYS_PRESENT {
        line.insert(key.into(), Value::Null);
    }
    line
}

fn parse_object(text: &str) -> Map<String, Value> {
    match serde_json::from_str(text) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_reads_as_an_object() {
        let fields =
            key_values(r#"connection_id=19 holder="unknown (the lookup failed)" note="a \"q\"""#);
        assert_eq!(fields["connection_id"], "19");
        assert_eq!(fields["holder"], "unknown (the lookup failed)");
        assert_eq!(fields["note"], "a \"q\"");
        assert!(key_values("not key value words").is_empty());
        assert!(key_values(r#"a="unterminated"#).is_empty());
    }

    #[test]
    fn a_filter_that_would_log_nothing_by_mistake_is_refused() {
        for good in [
            "debug",
            "INFO",
            "warn,sentinel_guard=debug",
            "sentinel_guard::backend=trace",
            "off",
        ] {
            assert!(check_filter(good).is_ok(), "{good}");
        }
        for bad in ["bogus", "verbose", "info,loud", "=debug"] {
            assert!(check_filter(bad).is_err(), "{bad}");
        }
    }
}
