//! The process's log: a `tracing` subscriber that writes each event on
//! stderr in one write, as its message alone (`--log-format text`, the
//! default) or as one JSON object (`--log-format json`):
//! `{"ts":"2026-12-05T07:37:16.123Z","level":"info","role":"server","pid":42,"msg":"...",...}`
//! with the event's fields (`event`, and its ids: `shard`, `from`, `to`, ...).
//! A process that installs none (a library's host) gets `eps_proto::say!`'s
//! plain lines.

use std::io::Write;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// How logs are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Plain lines (the default).
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    /// Its name, as `--log-format` and `EPS_LOG_FORMAT` take it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Json => "json",
        }
    }
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            _ => Err(format!("log format {s:?}: give text or json")),
        }
    }
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// The format this process logs in (`Text` until [`init`]).
pub fn format() -> LogFormat {
    *FORMAT.get().unwrap_or(&LogFormat::Text)
}

/// Sets how this process logs, once; `role` names it in every JSON line.
pub fn init(format: LogFormat, role: &str) {
    if FORMAT.set(format).is_err() {
        return;
    }
    let sub = Lines {
        format,
        role: role.to_string(),
        pid: std::process::id(),
        clock: SystemTime::now,
        out: Box::new(|line: String| {
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
        }),
    };
    // (Only fails if another subscriber came first: its choice stands.)
    let _ = tracing::subscriber::set_global_default(sub);
}

/// The subscriber.
struct Lines {
    format: LogFormat,
    role: String,
    pid: u32,
    clock: fn() -> SystemTime,
    /// Where each line goes (stderr, in one write).
    out: Box<dyn Fn(String) + Send + Sync>,
}

/// Collects an event's fields; its message goes to `msg`.
struct Fields(Map<String, Value>);

impl Visit for Fields {
    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        self.put(f, Value::String(format!("{v:?}")));
    }
    fn record_str(&mut self, f: &Field, v: &str) {
        self.put(f, Value::String(v.to_string()));
    }
    fn record_u64(&mut self, f: &Field, v: u64) {
        self.put(f, v.into());
    }
    fn record_i64(&mut self, f: &Field, v: i64) {
        self.put(f, v.into());
    }
    fn record_f64(&mut self, f: &Field, v: f64) {
        self.put(f, serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number));
    }
    fn record_bool(&mut self, f: &Field, v: bool) {
        self.put(f, v.into());
    }
}

impl Fields {
    fn put(&mut self, f: &Field, v: Value) {
        let name = if f.name() == "message" { "msg" } else { f.name() };
        self.0.insert(name.to_string(), v);
    }
}

impl Lines {
    /// The line of one event: `ts`, `level`, `role`, `pid`, `msg`, `event`
    /// first, in that order, then the event's other fields.
    fn line(&self, level: &tracing::Level, mut fields: Map<String, Value>, now: SystemTime) -> String {
        if self.format == LogFormat::Text {
            let mut msg = match fields.remove("msg") {
                Some(Value::String(m)) => m,
                Some(v) => v.to_string(),
                None => String::new(),
            };
            msg.push('\n');
            return msg;
        }
        let head = [
            ("ts", Value::String(rfc3339(now))),
            ("level", Value::String(level.as_str().to_ascii_lowercase())),
            ("role", Value::String(self.role.clone())),
            ("pid", self.pid.into()),
        ];
        let firsts: Vec<(&str, Value)> = ["msg", "event"].into_iter().filter_map(|k| Some((k, fields.remove(k)?))).collect();
        let all: Vec<String> = head
            .into_iter()
            .chain(firsts)
            .map(|(k, v)| (k.to_string(), v))
            .chain(fields)
            .map(|(k, v)| format!("{}:{v}", Value::String(k)))
            .collect();
        format!("{{{}}}\n", all.join(","))
    }
}

impl Subscriber for Lines {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        // No spans are made; any that are share one id and are not written.
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, e: &Event<'_>) {
        let mut f = Fields(Map::new());
        e.record(&mut f);
        (self.out)(self.line(e.metadata().level(), f.0, (self.clock)()));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// `t` as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC).
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let (days, secs) = ((d.as_secs() / 86_400) as i64, d.as_secs() % 86_400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z", secs / 3600, secs / 60 % 60, secs % 60, d.subsec_millis())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates_are_utc_rfc3339() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_millis(951_782_400_123)), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_secs(1_796_456_236)), "2026-12-05T07:37:16.000Z");
    }

    /// An event becomes one JSON object with its fields; the message is `msg`.
    #[test]
    fn an_event_is_one_json_line_with_its_fields() {
        use std::sync::{Arc, Mutex};
        let lines = Arc::new(Mutex::new(Vec::new()));
        let into = lines.clone();
        let out = Box::new(move |l: String| into.lock().unwrap().push(l));
        let sub = Lines { format: LogFormat::Json, role: "server".into(), pid: 7, clock: || UNIX_EPOCH, out };
        tracing::subscriber::with_default(sub, || {
            tracing::info!(target: "eps", event = "migration", shard = 3u32, to = 2u32, secs = 0.5, "eps server 0: moved \"it\"");
            tracing::warn!("plain");
        });
        let lines = lines.lock().unwrap();
        assert_eq!(lines.len(), 2);
        assert!(lines.iter().all(|l| l.ends_with('\n') && l.matches('\n').count() == 1));
        assert!(
            lines[0].starts_with(r#"{"ts":"1970-01-01T00:00:00.000Z","level":"info","role":"server","pid":7,"msg":"#),
            "{}",
            lines[0]
        );
        let v: Value = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!(v["msg"], "eps server 0: moved \"it\"");
        assert_eq!((v["event"].as_str(), v["shard"].as_u64(), v["to"].as_u64()), (Some("migration"), Some(3), Some(2)));
        assert_eq!((v["role"].as_str(), v["pid"].as_u64(), v["level"].as_str()), (Some("server"), Some(7), Some("info")));
        assert_eq!((v["ts"].as_str(), v["secs"].as_f64()), (Some("1970-01-01T00:00:00.000Z"), Some(0.5)));
        let v: Value = serde_json::from_str(&lines[1]).unwrap();
        assert_eq!((v["level"].as_str(), v["msg"].as_str()), (Some("warn"), Some("plain")));
        // As text: the message alone.
        let text = Lines { format: LogFormat::Text, role: "server".into(), pid: 7, clock: || UNIX_EPOCH, out: Box::new(|_| {}) };
        let mut f = Map::new();
        f.insert("msg".into(), Value::String("eps server 0: moved".into()));
        f.insert("shard".into(), 3.into());
        assert_eq!(text.line(&tracing::Level::INFO, f, UNIX_EPOCH), "eps server 0: moved\n");
    }
}
