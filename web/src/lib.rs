//! WebAssembly entry of the shardscope viewer: a [`WebHandle`] the page creates, starts on a canvas
//! and feeds with files (`open_bytes`, or `add_file`... `finish_batch` for files that form one
//! checkpoint). Everything else is the same `shardscope-viewer` code the
//! desktop binary runs.

pub use shardscope_viewer as viewer;

#[cfg(target_arch = "wasm32")]
mod handle {
    use std::sync::{Arc, Mutex};

    use shardscope_viewer::Viewer;
    use wasm_bindgen::prelude::*;

    /// What the page reads back between frames.
    #[derive(Debug, Default)]
    struct Shared {
        status: String,
        selected: Option<String>,
        /// `Some("")` clears the selection.
        select_request: Option<String>,
        example: bool,
        probe: Option<String>,
        probe_result: Option<(f32, f32)>,
    }

    /// The app the runner drives: the viewer plus the shared state.
    struct WebApp {
        viewer: Viewer,
        shared: Arc<Mutex<Shared>>,
    }

    impl eframe::App for WebApp {
        fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
            if let Ok(mut s) = self.shared.lock() {
                if let Some(fqn) = s.select_request.take() {
                    if fqn.is_empty() {
                        self.viewer.selection.fqn = None;
                    } else {
                        self.viewer.selection.select(fqn);
                    }
                }
                if std::mem::take(&mut s.example) {
                    self.viewer.stay_on_tab = true;
                    self.viewer.open_bytes(
                        "examples/tiny_model.json",
                        shardscope_viewer::app::EXAMPLE_MODEL.to_vec(),
                    );
                    self.viewer.open_bytes(
                        "examples/viewer/gather_trace.json",
                        shardscope_viewer::app::EXAMPLE_TRACE.to_vec(),
                    );
                    self.viewer.open_bytes(
                        "examples/viewer/verify_report.json",
                        shardscope_viewer::app::EXAMPLE_REPORT.to_vec(),
                    );
                }
            }
            self.viewer.ui(ui);
            if let Ok(mut s) = self.shared.lock() {
                s.status = self.viewer.status_line();
                s.selected.clone_from(&self.viewer.selection.fqn);
                s.probe_result = s
                    .probe
                    .as_deref()
                    .and_then(|f| self.viewer.slice_center(f))
                    .map(|p| (p.x, p.y));
            }
        }
    }

    /// A file of a batch: its name and its bytes (or why it could not be read).
    type BatchFile = (String, Result<Vec<u8>, String>);

    /// The handle the page holds.
    #[wasm_bindgen]
    pub struct WebHandle {
        runner: eframe::WebRunner,
        inbox: shardscope_viewer::app::Inbox,
        shared: Arc<Mutex<Shared>>,
        ctx: Arc<Mutex<Option<egui::Context>>>,
        /// Files added with `add_file`, handed over together by `finish_batch`.
        batch: Mutex<Vec<BatchFile>>,
    }

    impl std::fmt::Debug for WebHandle {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("WebHandle").finish_non_exhaustive()
        }
    }

    #[wasm_bindgen]
    impl WebHandle {
        #[wasm_bindgen(constructor)]
        #[allow(clippy::new_without_default)]
        pub fn new() -> Self {
            eframe::WebLogger::init(log::LevelFilter::Warn).ok();
            let viewer = Viewer::new();
            let inbox = viewer.inbox();
            Self {
                runner: eframe::WebRunner::new(),
                inbox,
                shared: Arc::new(Mutex::new(Shared::default())),
                ctx: Arc::new(Mutex::new(None)),
                batch: Mutex::new(Vec::new()),
            }
        }

        /// Starts the viewer on `canvas`. With `example` it opens the bundled example.
        pub async fn start(
            &self,
            canvas: web_sys::HtmlCanvasElement,
            example: bool,
        ) -> Result<(), JsValue> {
            let mut viewer = Viewer::new();
            // Share the inbox created in `new`, so files opened before `start` are kept.
            viewer.set_inbox(self.inbox.clone());
            if let Ok(mut s) = self.shared.lock() {
                s.example = example;
            }
            let shared = self.shared.clone();
            let ctx_slot = self.ctx.clone();
            self.runner
                .start(
                    canvas,
                    eframe::WebOptions::default(),
                    Box::new(move |cc| {
                        if let Ok(mut slot) = ctx_slot.lock() {
                            *slot = Some(cc.egui_ctx.clone());
                        }
                        Ok(Box::new(WebApp { viewer, shared }))
                    }),
                )
                .await
        }

        /// Opens a file's bytes (the page's file picker, scripts). Parsing happens on the
        /// following frames, one file per frame.
        pub fn open_bytes(&self, name: String, bytes: Vec<u8>) {
            if let Ok(mut q) = self.inbox.lock() {
                q.push((name, Ok(bytes)));
            }
            self.repaint();
        }

        /// Adds a file to the current batch; nothing is opened before `finish_batch`.
        pub fn add_file(&self, name: String, bytes: Vec<u8>) {
            if let Ok(mut b) = self.batch.lock() {
                b.push((name, Ok(bytes)));
            }
        }

        /// Files added so far and not yet handed over.
        pub fn batch_len(&self) -> usize {
            self.batch.lock().map(|b| b.len()).unwrap_or_default()
        }

        /// Hands every file added since the last batch to the viewer at once: the checkpoint
        /// files among them form one checkpoint (per-rank files, a DCP folder), the other inputs
        /// (models, traces, reports) open on their own. The viewer announces the work in the
        /// status line for a frame, then indexes the checkpoint in the next frame.
        pub fn finish_batch(&self) {
            let files = self
                .batch
                .lock()
                .map(|mut b| std::mem::take(&mut *b))
                .unwrap_or_default();
            if let Ok(mut q) = self.inbox.lock() {
                q.extend(files);
            }
            self.repaint();
        }

        /// Selects a parameter by clean FQN (an empty string clears the selection).
        pub fn select(&self, fqn: String) {
            if let Ok(mut s) = self.shared.lock() {
                s.select_request = Some(fqn);
            }
            self.repaint();
        }

        /// One line describing what is shown (model, layout, selection).
        pub fn status(&self) -> String {
            self.shared
                .lock()
                .map(|s| s.status.clone())
                .unwrap_or_default()
        }

        /// The selected parameter's clean FQN, or an empty string.
        pub fn selected_fqn(&self) -> String {
            self.shared
                .lock()
                .ok()
                .and_then(|s| s.selected.clone())
                .unwrap_or_default()
        }

        /// Asks where `fqn`'s first slice is drawn in the shard map (or, for a checkpoint key,
        /// its row in the **Checkpoint** table); read it with `probe_result` after the next
        /// frame.
        pub fn probe(&self, fqn: String) {
            if let Ok(mut s) = self.shared.lock() {
                s.probe = Some(fqn);
            }
            self.repaint();
        }

        /// `[x, y]` in CSS pixels relative to the canvas, or an empty array when not on screen.
        pub fn probe_result(&self) -> Vec<f32> {
            self.shared
                .lock()
                .ok()
                .and_then(|s| s.probe_result)
                .map(|(x, y)| vec![x, y])
                .unwrap_or_default()
        }

        pub fn has_panicked(&self) -> bool {
            self.runner.has_panicked()
        }

        pub fn destroy(&self) {
            self.runner.destroy();
        }

        fn repaint(&self) {
            if let Ok(slot) = self.ctx.lock()
                && let Some(ctx) = slot.as_ref()
            {
                ctx.request_repaint();
            }
        }
    }
}

#[cfg(target_arch = "wasm32")]
pub use handle::WebHandle;
