//! [`Job`]: work that reads checkpoints off the UI thread (the A/B comparison, the Values tab's
//! statistics): on a worker thread on the desktop, in the calling thread in the browser and when
//! `synchronous` (tests). The UI polls it every frame, shows its progress and can cancel it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::checkpoint::CheckpointError;

/// What a job runs: it reports progress and stops early once the flag is set.
pub type Work<T> =
    Box<dyn FnOnce(&mut dyn FnMut(Progress), &AtomicBool) -> Result<T, CompareError> + Send>;

/// A job run off the UI thread, its progress and its result.
pub struct Job<T> {
    /// Run in the calling thread (tests).
    pub synchronous: bool,
    progress: Arc<Mutex<Progress>>,
    cancel: Arc<AtomicBool>,
    #[cfg(not(target_arch = "wasm32"))]
    worker: Option<std::sync::mpsc::Receiver<Result<T, CompareError>>>,
    finished: Option<Result<T, CompareError>>,
}

impl<T> Default for Job<T> {
    fn default() -> Self {
        Self {
            synchronous: false,
            progress: Arc::default(),
            cancel: Arc::default(),
            #[cfg(not(target_arch = "wasm32"))]
            worker: None,
            finished: None,
        }
    }
}

impl<T> std::fmt::Debug for Job<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("synchronous", &self.synchronous)
            .field("running", &self.running())
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> Job<T> {
    /// Starts `work` (a running job is cancelled); `name` names its thread (`compare`).
    pub fn start(&mut self, name: &str, work: Work<T>) {
        self.cancel.store(true, Ordering::Relaxed);
        self.cancel = Arc::new(AtomicBool::new(false));
        self.progress = Arc::new(Mutex::new(Progress::default()));
        self.finished = None;
        let (cancel, progress) = (self.cancel.clone(), self.progress.clone());
        let run = move || {
            work(
                &mut |p| {
                    if let Ok(mut slot) = progress.lock() {
                        *slot = p;
                    }
                },
                &cancel,
            )
        };
        // The browser has no threads: the job runs here.
        #[cfg(target_arch = "wasm32")]
        let _ = name;
        #[cfg(not(target_arch = "wasm32"))]
        if !self.synchronous {
            let (tx, rx) = std::sync::mpsc::channel();
            match std::thread::Builder::new()
                .name(format!("shardscope-{name}"))
                .spawn(move || {
                    let _ = tx.send(run());
                }) {
                Ok(_) => self.worker = Some(rx),
                Err(e) => {
                    self.finished = Some(Err(CompareError::Open {
                        side: "A",
                        source: CheckpointError::Open {
                            message: format!("cannot start the {name} thread: {e}"),
                        },
                    }));
                }
            }
            return;
        }
        self.finished = Some(run());
    }
}

impl<T> Job<T> {
    /// Asks a running job to stop.
    pub fn cancel(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// True while a job runs.
    pub fn running(&self) -> bool {
        #[cfg(not(target_arch = "wasm32"))]
        {
            self.worker.is_some()
        }
        #[cfg(target_arch = "wasm32")]
        {
            false
        }
    }

    /// The progress of the running job.
    pub fn progress(&self) -> Progress {
        self.progress.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// The finished job's result, once (call every frame).
    pub fn poll(&mut self) -> Option<Result<T, CompareError>> {
        #[cfg(not(target_arch = "wasm32"))]
        if let Some(rx) = &self.worker {
            match rx.try_recv() {
                Ok(result) => {
                    self.worker = None;
                    return Some(result);
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => return None,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    self.worker = None;
                    return Some(Err(CompareError::Cancelled));
                }
            }
        }
        self.finished.take()
    }
}

/// How far a comparison is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// Entries compared so far, of `total`.
    pub done: usize,
    pub total: usize,
    /// What is being done (`opening A`, or the key being compared).
    pub what: String,
}

impl Progress {
    pub fn text(&self) -> String {
        if self.total == 0 {
            self.what.clone()
        } else {
            format!("comparing {}/{}: {}", self.done, self.total, self.what)
        }
    }
}

/// Why a comparison gave no result.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CompareError {
    /// One side could not be opened.
    #[error("{side}: {source}")]
    Open {
        side: &'static str,
        #[source]
        source: CheckpointError,
    },
    /// A newer comparison was started, or the viewer asked it to stop.
    #[error("the comparison was cancelled")]
    Cancelled,
}
