//! Chrome trace event JSON (the format Perfetto and `chrome://tracing` open).
//!
//! One process lane per rank (`pid` = rank), a `host` thread (spans timed with the host clock) and, for
//! GPU runs, a `device` thread (spans timed with CUDA events). Every span is a complete event
//! (`"ph": "X"`) in microseconds with `args` `unit`, `bytes` and `dtype`.

use std::io::Write;
use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};

/// The steps of the gather path, as span names.
pub mod names {
    pub const READ: &str = "read";
    pub const HOST_TO_DEVICE: &str = "host-to-device";
    pub const COPY_IN: &str = "copy-in";
    pub const ALL_GATHER: &str = "all-gather";
    pub const COPY_OUT: &str = "copy-out";
    pub const DEVICE_TO_HOST: &str = "device-to-host";
    pub const VERIFY: &str = "verify";
    pub const WRITE: &str = "write";
}

/// Which clock measured a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Clock {
    /// `std::time::Instant` on the host thread of the rank.
    Host,
    /// CUDA events on the rank's stream, placed on the host timeline at a common origin.
    Device,
}

impl Clock {
    fn tid(self) -> u64 {
        match self {
            Clock::Host => 0,
            Clock::Device => 1,
        }
    }
}

/// One timed step of one rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Span {
    pub rank: u64,
    pub name: &'static str,
    pub clock: Clock,
    /// Start in microseconds since the run's origin.
    pub start_us: f64,
    pub dur_us: f64,
    /// Unit prefix (`(root)` for the root), or a label such as the output file for `write`.
    pub unit: String,
    pub bytes: u64,
    pub dtype: String,
}

/// The spans of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Trace {
    pub world_size: u64,
    pub spans: Vec<Span>,
    /// Shown as `otherData` (backend, layout, source...).
    pub metadata: Vec<(String, String)>,
}

/// Why a trace cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Creating, writing or renaming the output failed.
    #[error("cannot write trace {}", path.display())]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Trace {
    /// Sorts spans by rank, then start, then name (the output is deterministic up to the times).
    pub(crate) fn sort(&mut self) {
        self.spans.sort_by(|a, b| {
            (a.rank, a.clock.tid())
                .cmp(&(b.rank, b.clock.tid()))
                .then(a.start_us.total_cmp(&b.start_us))
                .then(a.name.cmp(b.name))
        });
    }

    /// The trace as Chrome trace event JSON (object form with `traceEvents`).
    pub fn to_chrome_json(&self) -> Value {
        let mut events = Vec::with_capacity(self.spans.len() + 3 * self.world_size as usize);
        let device_ranks: std::collections::BTreeSet<u64> = self
            .spans
            .iter()
            .filter(|s| s.clock == Clock::Device)
            .map(|s| s.rank)
            .collect();
        for rank in 0..self.world_size {
            events.push(
                json!({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                               "args": {"name": format!("rank {rank}")}}),
            );
            events.push(
                json!({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                               "args": {"sort_index": rank}}),
            );
            events.push(
                json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0,
                               "args": {"name": "host"}}),
            );
            if device_ranks.contains(&rank) {
                events.push(
                    json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": 1,
                                   "args": {"name": "device (CUDA events)"}}),
                );
            }
        }
        for s in &self.spans {
            events.push(json!({
                "ph": "X",
                "name": s.name,
                "cat": "gather",
                "pid": s.rank,
                "tid": s.clock.tid(),
                "ts": round3(s.start_us),
                "dur": round3(s.dur_us),
                "args": {"unit": s.unit, "bytes": s.bytes, "dtype": s.dtype, "clock": s.clock},
            }));
        }
        let other: serde_json::Map<String, Value> = self
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        json!({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other})
    }

    /// Writes the Chrome JSON to `path` atomically (temporary file in the same folder, then rename).
    pub fn write_chrome_json(&self, path: &Path) -> Result<(), TraceError> {
        let io = |source| TraceError::Io {
            path: path.to_owned(),
            source,
        };
        let mut text = serde_json::to_vec(&self.to_chrome_json()).map_err(|e| io(e.into()))?;
        text.push(b'\n');
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
        tmp.write_all(&text).map_err(io)?;
        tmp.as_file().sync_all().map_err(io)?;
        tmp.persist(path).map_err(|e| io(e.error))?;
        Ok(())
    }
}

fn round3(us: f64) -> f64 {
    (us * 1000.0).round() / 1000.0
}
