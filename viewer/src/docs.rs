//! Opening inputs: classify bytes by content, parse them off the UI thread (a worker thread on
//! native, one file per frame on the web), and hand finished documents to the app.

use std::collections::VecDeque;

use shardscope_core::model::ModelDescription;

use crate::trace::Trace;

/// A parsed input.
#[derive(Debug, Clone)]
pub enum Document {
    /// A model description (`shardscope layout --model`).
    Model {
        name: String,
        model: ModelDescription,
    },
    /// A Chrome trace of the gather runner (or any Chrome trace JSON).
    Trace(Trace),
    /// A `diff`/`verify` report.
    Report(crate::report::Report),
    /// A content manifest (`shardscope hash`): the opened checkpoint is checked against it.
    Manifest(crate::manifest_check::OpenedManifest),
    /// An indexed checkpoint (boxed: it is much larger than the other variants).
    Checkpoint(Box<crate::checkpoint::CheckpointView>),
    /// A Hugging Face model config (`config.json`): the FQN map shows the HF names.
    HfConfig(crate::hf_names::HfConfig),
}

/// Why an input cannot be opened.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpenError {
    /// The model description is invalid.
    #[error("{0}")]
    Model(#[from] shardscope_core::model::DescriptionError),
    /// The trace is invalid.
    #[error("{0}")]
    Trace(#[from] crate::trace::TraceError),
    /// The verification report is invalid.
    #[error("{0}")]
    Report(#[from] crate::report::ReportError),
    /// JSON that is neither a model description nor a trace.
    #[error(
        "{name}: JSON, but not a model description (`params`), a Chrome trace (`traceEvents`), a verification report (`kind: shardscope.verify`), a content manifest (`shardscope hash`) or a Hugging Face config (`architectures`)"
    )]
    UnknownJson { name: String },
    /// A content manifest that does not read (`core::manifest::Manifest::from_json`).
    #[error("{name}: a content manifest (`algorithm`, `tensors`), but {message}")]
    Manifest { name: String, message: String },
    /// A Hugging Face config that is not valid JSON.
    #[error(
        "{name}: a Hugging Face config (`architectures`, `model_type`), but not valid JSON: {message}"
    )]
    HfConfig { name: String, message: String },
    /// Not JSON at all.
    #[error(
        "{name}: unsupported input ({size_bytes} bytes); the viewer opens checkpoints, model descriptions (.json), runner traces (.json) and verification reports (.json)"
    )]
    Unsupported { name: String, size_bytes: usize },
    /// The checkpoint cannot be indexed.
    #[error("{0}")]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// Reading a file failed (native only).
    #[error("cannot read {path}: {message}")]
    Io { path: String, message: String },
}

/// Largest input the viewer parses (model descriptions and traces are metadata, never tensors).
pub const MAX_INPUT_BYTES: usize = 512 << 20;

/// Classifies and parses one input.
pub fn parse(name: &str, bytes: &[u8]) -> Result<Document, OpenError> {
    let head = bytes
        .iter()
        .copied()
        .find(|b| !b.is_ascii_whitespace())
        .unwrap_or(0);
    if bytes.len() > MAX_INPUT_BYTES || !(head == b'{' || head == b'[') {
        return Err(OpenError::Unsupported {
            name: name.to_owned(),
            size_bytes: bytes.len(),
        });
    }
    // Cheap sniffing on the first kilobytes before a full parse.
    let window = &bytes[..bytes.len().min(64 << 10)];
    let has = |needle: &[u8]| window.windows(needle.len()).any(|w| w == needle);
    if head == b'[' || has(b"\"traceEvents\"") {
        return Ok(Document::Trace(Trace::from_json_bytes(bytes, name)?));
    }
    if has(b"\"shardscope.verify\"") {
        return Ok(Document::Report(crate::report::Report::from_json_bytes(
            bytes, name,
        )?));
    }
    // A manifest, or what names a manifest's fields but does not parse (cut short, say): the
    // manifest reader says what is wrong.
    if has(b"\"algorithm\"")
        && has(b"\"tensors\"")
        && (shardscope_core::manifest::Manifest::looks_like(bytes)
            || serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_err())
    {
        let manifest = shardscope_core::manifest::Manifest::from_json(bytes).map_err(|e| {
            OpenError::Manifest {
                name: name.to_owned(),
                message: e.0,
            }
        })?;
        return Ok(Document::Manifest(crate::manifest_check::OpenedManifest {
            name: name.to_owned(),
            manifest,
        }));
    }
    if !has(b"\"params\"") && (has(b"\"architectures\"") || has(b"\"model_type\"")) {
        let config: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| OpenError::HfConfig {
                name: name.to_owned(),
                message: e.to_string(),
            })?;
        if crate::hf_names::is_hf_config(&config) {
            return Ok(Document::HfConfig(crate::hf_names::HfConfig {
                name: name.to_owned(),
                config,
            }));
        }
    }
    if has(b"\"params\"") {
        let model = ModelDescription::from_json_bytes(bytes, name)?;
        return Ok(Document::Model {
            name: name.to_owned(),
            model,
        });
    }
    Err(OpenError::UnknownJson {
        name: name.to_owned(),
    })
}

/// Work waiting to be parsed.
#[derive(Debug)]
enum Job {
    Bytes {
        name: String,
        bytes: Vec<u8>,
    },
    /// Files of one checkpoint, in memory (opened together: one batch, or one frame).
    Checkpoint {
        files: Vec<(String, Vec<u8>)>,
        /// The batch is complete: later files start another checkpoint.
        closed: bool,
    },
    #[cfg(not(target_arch = "wasm32"))]
    Path(std::path::PathBuf),
    /// Checkpoint files on disk (a folder, or files opened together).
    #[cfg(not(target_arch = "wasm32"))]
    Files {
        name: String,
        source: crate::checkpoint::FsSource,
    },
}

/// True when bytes opened under `name` are (part of) a checkpoint rather than a JSON document.
pub fn is_checkpoint_part(name: &str, bytes: &[u8]) -> bool {
    if crate::checkpoint::is_checkpoint_name(name) {
        return true;
    }
    if name
        .rsplit_once('.')
        .is_some_and(|(_, e)| e.eq_ignore_ascii_case("json"))
    {
        return false;
    }
    let head = bytes.iter().copied().find(|b| !b.is_ascii_whitespace());
    !matches!(head, Some(b'{' | b'['))
}

/// A name for a set of checkpoint files: their common folder, or the single file.
pub fn group_name(names: &[&str]) -> String {
    match names {
        [] => "checkpoint".to_owned(),
        [one] => (*one).to_owned(),
        [first, rest @ ..] => {
            let mut prefix: &str = first.rsplit_once('/').map_or("", |(d, _)| d);
            for n in rest {
                while !prefix.is_empty() && !n.starts_with(&format!("{prefix}/")) {
                    prefix = prefix.rsplit_once('/').map_or("", |(d, _)| d);
                }
            }
            if prefix.is_empty() {
                format!("{} files ({first}, ...)", names.len())
            } else {
                prefix.to_owned()
            }
        }
    }
}

type Finished = Result<Document, OpenError>;

/// Parses inputs without blocking the UI.
#[derive(Debug, Default)]
pub struct Loader {
    queue: VecDeque<Job>,
    /// How checkpoints are read (`Checkpoint::open`): the loaded model description, so that
    /// FSDP1 per-rank files read as their original parameters, as `shardscope inspect --model`
    /// reads them.
    pub read_options: shardscope_core::checkpoint::ReadOptions,
    #[cfg(not(target_arch = "wasm32"))]
    worker: Option<std::sync::mpsc::Receiver<Finished>>,
    /// Parse synchronously (tests and benchmarks).
    pub synchronous: bool,
    /// The front job was shown in the status line for a frame (browser).
    #[cfg(target_arch = "wasm32")]
    announced: bool,
}

impl Loader {
    /// Queues bytes. Checkpoint files queued one after the other (one drop, one picker choice,
    /// before the next frame) are opened together as one checkpoint.
    pub fn open_bytes(&mut self, name: String, bytes: Vec<u8>) {
        if is_checkpoint_part(&name, &bytes) {
            if let Some(Job::Checkpoint {
                files,
                closed: false,
            }) = self.queue.back_mut()
            {
                files.push((name, bytes));
            } else {
                self.queue.push_back(Job::Checkpoint {
                    files: vec![(name, bytes)],
                    closed: false,
                });
            }
        } else {
            self.queue.push_back(Job::Bytes { name, bytes });
        }
    }

    /// Ends a batch: checkpoint files queued after this form another checkpoint.
    pub fn end_batch(&mut self) {
        if let Some(Job::Checkpoint { closed, .. }) = self.queue.back_mut() {
            *closed = true;
        }
    }

    /// What the next queued input is, for the status line (`indexing checkpoint: 3 files, 1.2 MiB`).
    pub fn pending_text(&self) -> Option<String> {
        let text = match self.queue.front()? {
            Job::Bytes { name, bytes } => {
                format!(
                    "parsing {name} ({})",
                    crate::format::bytes(bytes.len() as u64)
                )
            }
            Job::Checkpoint { files, .. } => {
                let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
                format!(
                    "indexing checkpoint: {} files, {}",
                    files.len(),
                    crate::format::bytes(total)
                )
            }
            #[cfg(not(target_arch = "wasm32"))]
            Job::Path(p) => format!("reading {}", p.display()),
            #[cfg(not(target_arch = "wasm32"))]
            Job::Files { name, .. } => format!("indexing checkpoint {name}"),
        };
        let more = self.queue.len() - 1;
        Some(if more > 0 {
            format!("{text} (+{more} queued)")
        } else {
            text
        })
    }

    /// Opens a file or a folder (native only). A folder holding checkpoint files opens as one
    /// checkpoint (plus any JSON documents in it); checkpoint files opened one after the other
    /// form one checkpoint (per-rank files).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open_path(&mut self, path: std::path::PathBuf) {
        if path.is_dir() {
            if let Ok(source) = crate::checkpoint::FsSource::from_dir(&path)
                && !source.is_empty()
            {
                self.queue.push_back(Job::Files {
                    name: path.display().to_string(),
                    source,
                });
            }
        } else if crate::checkpoint::is_checkpoint_name(&path.to_string_lossy()) {
            let file_name = path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            if let Some(Job::Files { source, name }) = self.queue.back_mut() {
                source.insert(file_name, path.clone());
                if let Some(parent) = path.parent() {
                    *name = parent.display().to_string();
                }
            } else {
                let mut source = crate::checkpoint::FsSource::default();
                source.insert(file_name, path.clone());
                self.queue.push_back(Job::Files {
                    name: path.display().to_string(),
                    source,
                });
            }
            return;
        }
        self.queue.push_back(Job::Path(path));
    }

    /// Inputs queued or being parsed.
    pub fn pending(&self) -> usize {
        #[cfg(not(target_arch = "wasm32"))]
        {
            self.queue.len() + usize::from(self.worker.is_some())
        }
        #[cfg(target_arch = "wasm32")]
        {
            self.queue.len()
        }
    }

    /// Advances the work; returns what finished. Call once per frame.
    pub fn poll(&mut self) -> Vec<Finished> {
        let mut done = Vec::new();
        if self.synchronous {
            while let Some(job) = self.queue.pop_front() {
                done.extend(run_job(job, &self.read_options));
            }
            return done;
        }
        #[cfg(not(target_arch = "wasm32"))]
        {
            if let Some(rx) = &self.worker {
                loop {
                    match rx.try_recv() {
                        Ok(result) => done.push(result),
                        Err(std::sync::mpsc::TryRecvError::Empty) => break,
                        Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                            self.worker = None;
                            break;
                        }
                    }
                }
            }
            if !self.queue.is_empty() && self.worker.is_none() {
                let jobs: Vec<Job> = self.queue.drain(..).collect();
                let options = self.read_options.clone();
                let (tx, rx) = std::sync::mpsc::channel();
                let spawned = std::thread::Builder::new()
                    .name("shardscope-loader".to_owned())
                    .spawn(move || {
                        for job in jobs {
                            for result in run_job(job, &options) {
                                if tx.send(result).is_err() {
                                    return;
                                }
                            }
                        }
                    });
                match spawned {
                    Ok(_) => self.worker = Some(rx),
                    Err(e) => done.push(Err(OpenError::Io {
                        path: "(loader thread)".to_owned(),
                        message: e.to_string(),
                    })),
                }
            }
        }
        #[cfg(target_arch = "wasm32")]
        {
            // One input per frame keeps the page responsive while a batch of files is parsed;
            // each input is announced one frame before it is parsed, so the status line says
            // what the page is busy with while the (synchronous) parse runs.
            if !self.queue.is_empty() {
                if self.announced {
                    self.announced = false;
                    if let Some(job) = self.queue.pop_front() {
                        done.extend(run_job(job, &self.read_options));
                    }
                } else {
                    self.announced = true;
                }
            }
        }
        done
    }
}

fn run_job(job: Job, options: &shardscope_core::checkpoint::ReadOptions) -> Vec<Finished> {
    match job {
        Job::Bytes { name, bytes } => vec![parse(&name, &bytes)],
        Job::Checkpoint { files, .. } => {
            let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
            let name = group_name(&names);
            vec![
                crate::checkpoint::open_memory(&name, files, options)
                    .map(|c| Document::Checkpoint(Box::new(c)))
                    .map_err(OpenError::from),
            ]
        }
        #[cfg(not(target_arch = "wasm32"))]
        Job::Path(path) => read_path(&path),
        #[cfg(not(target_arch = "wasm32"))]
        Job::Files { name, source } => vec![
            crate::checkpoint::open_files(&name, &source, options)
                .map(|c| Document::Checkpoint(Box::new(c)))
                .map_err(OpenError::from),
        ],
    }
}

#[cfg(not(target_arch = "wasm32"))]
fn read_path(path: &std::path::Path) -> Vec<Finished> {
    let io = |e: std::io::Error| OpenError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    if path.is_dir() {
        let mut entries: Vec<std::path::PathBuf> = match std::fs::read_dir(path) {
            Ok(rd) => rd.filter_map(Result::ok).map(|e| e.path()).collect(),
            Err(e) => return vec![Err(io(e))],
        };
        entries.sort();
        return entries
            .into_iter()
            .filter(|p| {
                p.extension().is_some_and(|e| e == "json")
                    && !crate::checkpoint::is_checkpoint_name(&p.to_string_lossy())
            })
            .flat_map(|p| read_path(&p))
            .collect();
    }
    let name = path.display().to_string();
    match std::fs::metadata(path) {
        Ok(m) if m.len() > MAX_INPUT_BYTES as u64 => {
            return vec![Err(OpenError::Unsupported {
                name,
                size_bytes: usize::try_from(m.len()).unwrap_or(usize::MAX),
            })];
        }
        Ok(_) => {}
        Err(e) => return vec![Err(io(e))],
    }
    match std::fs::read(path) {
        Ok(bytes) => vec![parse(&name, &bytes)],
        Err(e) => vec![Err(io(e))],
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sniffs_models_and_traces() {
        let model = parse(
            "m.json",
            br#"{"params": [{"fqn": "w", "shape": [2], "dtype": "float32"}]}"#,
        )
        .unwrap();
        assert!(matches!(model, Document::Model { .. }));
        let trace = parse(
            "t.json",
            br#"[{"ph": "X", "name": "a", "pid": 0, "ts": 0, "dur": 1}]"#,
        )
        .unwrap();
        assert!(matches!(trace, Document::Trace(_)));
        assert!(matches!(
            parse("x.bin", b"PK\x03\x04"),
            Err(OpenError::Unsupported { .. })
        ));
        assert!(matches!(
            parse("x.json", b"{\"a\": 1}"),
            Err(OpenError::UnknownJson { .. })
        ));
    }

    #[test]
    fn batches_split_checkpoints() {
        let mut loader = Loader::default();
        loader.open_bytes("a/__0_0.distcp".to_owned(), vec![1]);
        loader.open_bytes("a/__1_0.distcp".to_owned(), vec![2]);
        loader.open_bytes("a/.metadata".to_owned(), vec![3]);
        assert_eq!(loader.queue.len(), 1, "one batch is one checkpoint");
        assert_eq!(
            loader.pending_text().as_deref(),
            Some("indexing checkpoint: 3 files, 3 B")
        );
        loader.end_batch();
        loader.open_bytes("b/model.pt".to_owned(), vec![4]);
        assert_eq!(loader.queue.len(), 2, "a later batch is another checkpoint");
        loader.open_bytes("m.json".to_owned(), b"{}".to_vec());
        assert_eq!(loader.queue.len(), 3);
    }
}
