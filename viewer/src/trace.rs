//! Chrome trace JSON (the `traceEvents` format the gather runner, PyTorch's profiler and Perfetto
//! share): complete spans (`ph: "X"`) with `pid` = rank, become one lane per rank.

use std::collections::BTreeMap;

use serde_json::Value;

/// Why a trace cannot be shown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// The bytes are not JSON.
    #[error("{name}: not JSON: {message}")]
    Json { name: String, message: String },
    /// JSON, but neither an event array nor an object with `traceEvents`.
    #[error(
        "{name}: not a Chrome trace (expected an array of events or an object with `traceEvents`)"
    )]
    NotATrace { name: String },
    /// A trace without a single complete (`ph: "X"`) span.
    #[error(
        "{name}: no complete spans (`ph: \"X\"` events with `ts` and `dur`) in {events} events"
    )]
    NoSpans { name: String, events: usize },
}

/// One complete span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// Lane index (into [`Trace::lanes`]).
    pub lane: usize,
    pub name: String,
    /// `cat`, the phase (`all_gather`, `read`, `copy`...); empty when absent.
    pub category: String,
    pub start_us: f64,
    pub duration_us: f64,
    /// `args.bytes` when present.
    pub bytes: Option<u64>,
    /// The other args, `key=value` sorted by key.
    pub args: Vec<(String, String)>,
    /// The phase it belongs to (its colour): its category, or its name when every span of the
    /// trace has the same category (the gather runner puts the phase in the name).
    pub phase: String,
}

impl Span {
    pub fn end_us(&self) -> f64 {
        self.start_us + self.duration_us
    }

    /// Bytes per second over the span, when it carries bytes and lasts.
    pub fn bandwidth_bytes_per_sec(&self) -> Option<f64> {
        let bytes = self.bytes?;
        (self.duration_us > 0.0).then(|| bytes as f64 / (self.duration_us * 1e-6))
    }
}

/// A lane: one process (`pid`, a rank), or one thread of it when a rank has several (host and
/// device clocks). Named `rank N` unless `process_name`/`thread_name` metadata events name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lane {
    pub pid: i64,
    pub tid: i64,
    pub label: String,
}

/// A parsed trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub name: String,
    pub lanes: Vec<Lane>,
    /// Spans sorted by lane, then start.
    pub spans: Vec<Span>,
    /// Categories in first-seen order (they pick colours).
    pub categories: Vec<String>,
    pub start_us: f64,
    pub end_us: f64,
}

fn as_f64(v: Option<&Value>) -> Option<f64> {
    match v? {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

fn as_i64(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

impl Trace {
    /// Parses Chrome trace JSON bytes.
    #[allow(
        clippy::too_many_lines,
        reason = "reads every Chrome-trace event field with its own error, in one pass over the events"
    )]
    pub fn from_json_bytes(bytes: &[u8], name: &str) -> Result<Self, TraceError> {
        let value: Value = serde_json::from_slice(bytes).map_err(|e| TraceError::Json {
            name: name.to_owned(),
            message: e.to_string(),
        })?;
        let events = match &value {
            Value::Array(a) => a,
            Value::Object(o) => match o.get("traceEvents") {
                Some(Value::Array(a)) => a,
                _ => {
                    return Err(TraceError::NotATrace {
                        name: name.to_owned(),
                    });
                }
            },
            _ => {
                return Err(TraceError::NotATrace {
                    name: name.to_owned(),
                });
            }
        };
        let mut names: BTreeMap<i64, String> = BTreeMap::new();
        let mut thread_names: BTreeMap<(i64, i64), String> = BTreeMap::new();
        let mut raw = Vec::new();
        for ev in events {
            let Value::Object(ev) = ev else { continue };
            let ph = ev.get("ph").and_then(Value::as_str).unwrap_or("");
            let pid = as_i64(ev.get("pid")).unwrap_or(0);
            let tid = as_i64(ev.get("tid")).unwrap_or(0);
            if ph == "M" {
                let meta_name = ev
                    .get("args")
                    .and_then(|a| a.get("name"))
                    .and_then(Value::as_str);
                match (ev.get("name").and_then(Value::as_str), meta_name) {
                    (Some("process_name"), Some(n)) => {
                        names.insert(pid, n.to_owned());
                    }
                    (Some("thread_name"), Some(n)) => {
                        thread_names.insert((pid, tid), n.to_owned());
                    }
                    _ => {}
                }
                continue;
            }
            if ph != "X" {
                continue;
            }
            let (Some(ts), Some(dur)) = (as_f64(ev.get("ts")), as_f64(ev.get("dur"))) else {
                continue;
            };
            if !ts.is_finite() || !dur.is_finite() || dur < 0.0 {
                continue;
            }
            let mut bytes = None;
            let mut args = Vec::new();
            if let Some(Value::Object(a)) = ev.get("args") {
                for (k, v) in a {
                    if bytes.is_none() && matches!(k.as_str(), "bytes" | "nbytes" | "size_bytes") {
                        bytes = as_f64(Some(v)).filter(|b| *b >= 0.0).map(|b| b as u64);
                        continue;
                    }
                    let shown = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    args.push((k.clone(), shown));
                }
            }
            args.sort();
            raw.push((
                (pid, tid),
                Span {
                    lane: 0,
                    name: ev
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                        .to_owned(),
                    category: ev
                        .get("cat")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned(),
                    start_us: ts,
                    duration_us: dur,
                    bytes,
                    args,
                    phase: String::new(),
                },
            ));
        }
        if raw.is_empty() {
            return Err(TraceError::NoSpans {
                name: name.to_owned(),
                events: events.len(),
            });
        }
        let mut keys: Vec<(i64, i64)> = raw.iter().map(|(k, _)| *k).collect();
        keys.sort_unstable();
        keys.dedup();
        let threads_of = |pid: i64| keys.iter().filter(|(p, _)| *p == pid).count();
        let lanes: Vec<Lane> = keys
            .iter()
            .map(|&(pid, tid)| {
                let process = names
                    .get(&pid)
                    .cloned()
                    .unwrap_or_else(|| format!("rank {pid}"));
                let label = if threads_of(pid) > 1 {
                    let thread = thread_names
                        .get(&(pid, tid))
                        .cloned()
                        .unwrap_or_else(|| format!("tid {tid}"));
                    format!("{process} {thread}")
                } else {
                    process
                };
                Lane { pid, tid, label }
            })
            .collect();
        let one_category = raw.iter().all(|(_, s)| s.category == raw[0].1.category);
        let mut categories: Vec<String> = Vec::new();
        let mut spans: Vec<Span> = raw
            .into_iter()
            .map(|(key, mut s)| {
                s.lane = keys.binary_search(&key).unwrap_or(0);
                s.phase = if one_category || s.category.is_empty() {
                    s.name.clone()
                } else {
                    s.category.clone()
                };
                if !categories.contains(&s.phase) {
                    categories.push(s.phase.clone());
                }
                s
            })
            .collect();
        spans.sort_by(|a, b| a.lane.cmp(&b.lane).then(a.start_us.total_cmp(&b.start_us)));
        let start_us = spans
            .iter()
            .map(|s| s.start_us)
            .fold(f64::INFINITY, f64::min);
        let end_us = spans
            .iter()
            .map(Span::end_us)
            .fold(f64::NEG_INFINITY, f64::max);
        Ok(Self {
            name: name.to_owned(),
            lanes,
            spans,
            categories,
            start_us,
            end_us,
        })
    }

    /// The category index of a span (its colour).
    pub fn category_index(&self, span: &Span) -> usize {
        self.categories
            .iter()
            .position(|c| c == span.phase())
            .unwrap_or(0)
    }

    /// Total bytes moved per second over time, in `bins` equal bins from the first span start to
    /// the last span end: `(bin centre in µs since start, bytes/s)`. A span's bytes are spread
    /// evenly over its duration.
    pub fn bandwidth_series(&self, bins: usize) -> Vec<(f64, f64)> {
        let bins = bins.max(1);
        let width = ((self.end_us - self.start_us) / bins as f64).max(f64::MIN_POSITIVE);
        let mut bytes = vec![0.0f64; bins];
        for s in &self.spans {
            let (Some(b), true) = (s.bytes, s.duration_us > 0.0) else {
                continue;
            };
            let rate = b as f64 / s.duration_us; // bytes per µs
            let first =
                (((s.start_us - self.start_us) / width).floor().max(0.0) as usize).min(bins - 1);
            let last =
                (((s.end_us() - self.start_us) / width).floor().max(0.0) as usize).min(bins - 1);
            for (i, slot) in bytes.iter_mut().enumerate().take(last + 1).skip(first) {
                let lo = self.start_us + i as f64 * width;
                let hi = lo + width;
                let overlap = s.end_us().min(hi) - s.start_us.max(lo);
                if overlap > 0.0 {
                    *slot += rate * overlap;
                }
            }
        }
        bytes
            .into_iter()
            .enumerate()
            .map(|(i, b)| ((i as f64 + 0.5) * width, b / (width * 1e-6)))
            .collect()
    }
}

impl Span {
    /// The phase a span belongs to (see [`Span::phase`] the field).
    pub fn phase(&self) -> &str {
        &self.phase
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_spans_lanes_and_bandwidth() {
        let json = br#"{"traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rank 1 (gpu1)"}},
            {"ph": "X", "name": "gather", "cat": "all_gather", "pid": 1, "tid": 0, "ts": 10, "dur": 10, "args": {"bytes": 1000, "unit": "block1"}},
            {"ph": "X", "name": "read", "cat": "read", "pid": 0, "tid": 0, "ts": 0, "dur": 20, "args": {"bytes": 4000}},
            {"ph": "B", "name": "ignored", "pid": 0, "ts": 0}
        ]}"#;
        let t = Trace::from_json_bytes(json, "t.json").unwrap();
        assert_eq!(t.lanes.len(), 2);
        assert_eq!(t.lanes[1].label, "rank 1 (gpu1)");
        assert_eq!(t.lanes[0].label, "rank 0");
        assert_eq!(t.spans.len(), 2);
        assert_eq!(t.spans[0].name, "read");
        assert_eq!(
            t.spans[1].args,
            vec![("unit".to_owned(), "block1".to_owned())]
        );
        // 1000 bytes in 10 µs = 1e8 B/s.
        assert!((t.spans[1].bandwidth_bytes_per_sec().unwrap() - 1e8).abs() < 1.0);
        // Two bins of 10 µs: bin 0 holds 2000 B of `read`; bin 1 holds 2000 + 1000 B.
        let series = t.bandwidth_series(2);
        assert!((series[0].1 - 2000.0 / 10e-6).abs() < 1.0);
        assert!((series[1].1 - 3000.0 / 10e-6).abs() < 1.0);
    }

    #[test]
    fn runner_traces_colour_by_name_and_split_host_and_device_lanes() {
        // The shape `shardscope gather --trace` writes: one category, phase in the name, host
        // (tid 0) and device (tid 1) clocks on the same rank.
        let json = br#"{"traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "host"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "device (CUDA events)"}},
            {"ph": "X", "name": "read", "cat": "gather", "pid": 0, "tid": 0, "ts": 0, "dur": 5, "args": {"bytes": 10}},
            {"ph": "X", "name": "all_gather", "cat": "gather", "pid": 0, "tid": 1, "ts": 5, "dur": 5, "args": {"bytes": 40}},
            {"ph": "X", "name": "read", "cat": "gather", "pid": 1, "tid": 0, "ts": 0, "dur": 5, "args": {"bytes": 10}}
        ]}"#;
        let t = Trace::from_json_bytes(json, "g.json").unwrap();
        assert_eq!(
            t.categories,
            vec!["read".to_owned(), "all_gather".to_owned()]
        );
        let labels: Vec<&str> = t.lanes.iter().map(|l| l.label.as_str()).collect();
        assert_eq!(
            labels,
            ["rank 0 host", "rank 0 device (CUDA events)", "rank 1"]
        );
    }

    #[test]
    fn rejects_non_traces() {
        assert!(matches!(
            Trace::from_json_bytes(b"{\"a\": 1}", "x.json"),
            Err(TraceError::NotATrace { .. })
        ));
        assert!(matches!(
            Trace::from_json_bytes(b"[]", "x.json"),
            Err(TraceError::NoSpans { .. })
        ));
        assert!(matches!(
            Trace::from_json_bytes(b"{", "x.json"),
            Err(TraceError::Json { .. })
        ));
    }
}
