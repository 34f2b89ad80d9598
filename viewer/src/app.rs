//! The whole viewer as one `ui` function over its state; the native binary and the web entry wrap
//! it in an `eframe::App`.

use egui::{RichText, Ui};
use shardscope_core::checkpoint::app_state_prefix;
use shardscope_core::layout::{self, LayoutConfig};
use shardscope_core::model::ModelDescription;

use crate::Selection;
use crate::docs::{Document, Loader};
use crate::format::{bytes as fmt_bytes, count, ranks as fmt_ranks, shape as fmt_shape};
use crate::panels::{
    chunk_map, controls::Controls, fqn_map, ranks, shard_map, tensor_tree, timeline,
};
use crate::theme::Theme;
use crate::trace::Trace;
use crate::view::LayoutView;

/// The bundled example model (also what the web page shows before a file is opened).
pub const EXAMPLE_MODEL: &[u8] = include_bytes!("../../examples/tiny_model.json");
/// The name the bundled example model is shown under.
pub const EXAMPLE_MODEL_NAME: &str = "examples/tiny_model.json";
/// The name the bundled example trace is shown under.
pub const EXAMPLE_TRACE_NAME: &str = "examples/viewer/gather_trace.json";
/// The bundled example trace.
pub const EXAMPLE_TRACE: &[u8] = include_bytes!("../../examples/viewer/gather_trace.json");

/// Inputs handed over from outside the frame loop (browser drops, `WebHandle::open_bytes`).
pub type Inbox = std::sync::Arc<std::sync::Mutex<Vec<(String, Result<Vec<u8>, String>)>>>;

/// The bundled example verification report (schema in `docs/viewer.md`).
pub const EXAMPLE_REPORT: &[u8] = include_bytes!("../../examples/viewer/verify_report.json");

/// The central tabs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tab {
    #[default]
    ShardMap,
    FqnMap,
    Ranks,
    Trace,
    Verify,
    /// The opened checkpoint's keys (clean ⇄ raw, FSDP facts, chunks, ranks).
    Checkpoint,
    /// The chunk map of the selected checkpoint entry.
    Chunks,
    /// Optimizer state per parameter.
    Optimizer,
    /// A/B compare of two checkpoints (`shardscope diff`).
    Compare,
    /// Per-tensor value statistics of the opened checkpoint as a heatmap over layers.
    Values,
}

/// The loaded model description.
#[derive(Debug, Clone)]
pub struct LoadedModel {
    pub name: String,
    pub model: ModelDescription,
    /// Derived from the opened checkpoint (not opened as a description): its units follow
    /// `unit_patterns`, which the user edits.
    pub derived: Option<DerivedUnits>,
    /// The bundled example (what the viewer shows before anything is opened): a checkpoint
    /// opened later replaces it, as it replaces a derived model; a description the user opened
    /// is kept.
    pub example: bool,
}

/// The units of a model derived from a checkpoint, as the user edits them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DerivedUnits {
    /// Comma-separated module patterns, `N` for a block number (`model.layers.N`).
    pub patterns: String,
    /// The root module is a unit too.
    pub root: bool,
}

/// All viewer state.
#[derive(Debug, Default)]
pub struct Viewer {
    pub theme: Theme,
    applied_theme: Option<Theme>,
    pub controls: Controls,
    pub model: Option<LoadedModel>,
    /// The view of the current layout, `None` when no model is loaded or the layout is invalid.
    pub view: Option<LayoutView>,
    /// Why the current controls give no layout.
    pub layout_error: Option<String>,
    /// The configuration `view` was computed for.
    pub applied_config: Option<LayoutConfig>,
    /// The opened checkpoint's stored chunks laid over the current layout (`view::overlay`).
    pub overlay: Option<shardscope_core::view::overlay::Overlay>,
    /// The overlay's differences placed on the shard map's bars.
    pub map_marks: Option<crate::map_marks::MapMarks>,
    pub trace: Option<Trace>,
    /// The opened checkpoint.
    pub checkpoint: Option<crate::checkpoint::CheckpointView>,
    /// A Hugging Face config opened beside it, and the HF names of the layout's parameters.
    pub hf_config: Option<crate::hf_names::HfConfig>,
    pub hf_names: Option<crate::hf_names::HfNames>,
    pub ckpt: crate::panels::checkpoint::CheckpointState,
    pub report: Option<crate::report::Report>,
    pub verify: crate::panels::verify::VerifyState,
    /// The last finished A/B comparison.
    pub comparison: Option<crate::compare::Comparison>,
    pub compare_view: crate::panels::compare::CompareState,
    /// Runs comparisons off the UI thread.
    pub comparer: crate::compare::Comparer,
    /// Value statistics of the opened checkpoint (computed on request: it reads every tensor).
    pub values: Option<crate::values::ValueMap>,
    pub values_view: crate::panels::values::ValuesState,
    pub value_job: crate::values::ValueJob,
    pub selection: Selection,
    pub tab: Tab,
    pub shard_map: shard_map::ShardMapState,
    pub fqn_map: fqn_map::FqnMapState,
    pub tree: tensor_tree::TreeState,
    pub timeline: timeline::TimelineState,
    pub loader: Loader,
    /// Counts layout rebuilds (see [`LayoutView::generation`]).
    pub(crate) generation: u64,
    /// Keep the current tab when a trace opens (the example opens both).
    pub stay_on_tab: bool,
    /// The next model opened under [`EXAMPLE_MODEL_NAME`] is the bundled example
    /// ([`Viewer::open_example`]).
    example_pending: bool,
    /// The desktop window's fit to its screen (`shardscope-viewer` turns it on).
    pub window_fit: crate::window_fit::WindowFit,
    /// A content manifest opened to check the checkpoint against (`manifest_check`).
    pub manifest: Option<crate::manifest_check::OpenedManifest>,
    pub manifest_job: crate::manifest_check::ManifestJob,
    /// Errors and notices, newest last.
    pub messages: Vec<String>,
    inbox: Inbox,
    #[cfg(not(target_arch = "wasm32"))]
    dialog: Option<std::sync::mpsc::Receiver<Vec<std::path::PathBuf>>>,
    /// The "Compare with..." dialog: B for the opened checkpoint.
    #[cfg(not(target_arch = "wasm32"))]
    compare_dialog: Option<std::sync::mpsc::Receiver<Vec<std::path::PathBuf>>>,
}

impl Viewer {
    pub fn new() -> Self {
        Self::default()
    }

    /// A viewer showing the bundled example model and trace.
    pub fn with_example() -> Self {
        let mut v = Self::new();
        v.open_document(crate::docs::parse(
            "examples/tiny_model.json",
            EXAMPLE_MODEL,
        ));
        v.open_document(crate::docs::parse(
            "examples/viewer/gather_trace.json",
            EXAMPLE_TRACE,
        ));
        v.tab = Tab::ShardMap;
        v.stay_on_tab = true;
        v
    }

    /// Queues bytes for parsing (browser drops, the file picker, tests).
    pub fn open_bytes(&mut self, name: impl Into<String>, bytes: Vec<u8>) {
        self.loader.open_bytes(name.into(), bytes);
    }

    /// Opens the bundled example model and trace (what the viewer shows before a file is opened).
    /// The example model is marked as such: a checkpoint opened later draws its own layout, or
    /// none, never the example's.
    pub fn open_example(&mut self) {
        self.example_pending = true;
        self.open_bytes(EXAMPLE_MODEL_NAME, EXAMPLE_MODEL.to_vec());
        self.open_bytes(EXAMPLE_TRACE_NAME, EXAMPLE_TRACE.to_vec());
    }

    /// Queues a file or folder for parsing.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open_path(&mut self, path: std::path::PathBuf) {
        self.loader.open_path(path);
    }

    /// Compares checkpoint `a` with `b` (files or folders on disk), as `shardscope diff A B`; the
    /// result shows in the **Compare** tab. Runs on a worker thread unless the loader is
    /// synchronous (tests).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn compare_paths(&mut self, a: &std::path::Path, b: &std::path::Path) {
        use crate::compare::CompareInput;
        match (CompareInput::from_path(a), CompareInput::from_path(b)) {
            (Ok(a), Ok(b)) => self.start_compare(a, b),
            (Err(e), _) => self.messages.push(format!("error: A: {e}")),
            (_, Err(e)) => self.messages.push(format!("error: B: {e}")),
        }
    }

    /// Compares the opened checkpoint (A) with `b` (a file or folder on disk).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn compare_with_path(&mut self, b: &std::path::Path) {
        let b = match crate::compare::CompareInput::from_path(b) {
            Ok(b) => b,
            Err(e) => {
                self.messages.push(format!("error: B: {e}"));
                return;
            }
        };
        self.compare_with(b);
    }

    /// Compares the opened checkpoint (A) with `b`.
    pub fn compare_with(&mut self, b: crate::compare::CompareInput) {
        let a = self.checkpoint.as_ref().and_then(|c| {
            c.origin.clone().map(|origin| crate::compare::CompareInput {
                label: c.name.clone(),
                origin,
            })
        });
        match a {
            Some(a) => self.start_compare(a, b),
            None => self
                .messages
                .push("error: open a checkpoint first: it is A of the comparison".to_owned()),
        }
    }

    /// Starts comparing `a` with `b` (any running comparison is cancelled).
    pub fn start_compare(
        &mut self,
        a: crate::compare::CompareInput,
        b: crate::compare::CompareInput,
    ) {
        self.messages
            .push(format!("comparing {} with {}", a.label, b.label));
        self.comparer.synchronous = self.loader.synchronous;
        self.comparer.start(a, b, self.loader.read_options.clone());
        self.tab = Tab::Compare;
        // A worker's result shows from the next frame on (never before the call returns, however
        // fast the worker); a synchronous one at once.
        if self.comparer.synchronous {
            self.poll_comparer();
        }
    }

    /// Computes the value statistics of the opened checkpoint (every tensor is read, one at a
    /// time); the result shows in the **Values** tab.
    pub fn compute_values(&mut self) {
        let input = self.checkpoint.as_ref().and_then(|c| {
            c.origin.clone().map(|origin| crate::compare::CompareInput {
                label: c.name.clone(),
                origin,
            })
        });
        let Some(input) = input else {
            self.messages
                .push("error: open a checkpoint first to read its values".to_owned());
            return;
        };
        self.value_job.synchronous = self.loader.synchronous;
        self.value_job
            .start(input, self.loader.read_options.clone());
        self.tab = Tab::Values;
        self.poll_value_job();
    }

    /// Takes finished value statistics; true while they are still computed.
    pub fn poll_value_job(&mut self) -> bool {
        match self.value_job.poll() {
            Some(Ok(map)) => {
                self.values_view = crate::panels::values::ValuesState::default();
                self.values = Some(map);
            }
            Some(Err(e)) if e != crate::compare::CompareError::Cancelled => {
                self.messages.push(format!("error: values: {e}"));
            }
            Some(Err(_)) | None => {}
        }
        self.value_job.running()
    }

    /// Takes a finished comparison; true while one still runs.
    pub fn poll_comparer(&mut self) -> bool {
        if let Some(result) = self.comparer.poll() {
            self.take_comparison(result);
        }
        self.comparer.running()
    }

    /// Shows a finished comparison (the worker's, or the browser front end's). A comparison of
    /// the same two checkpoints (another tolerance) keeps the view's filter.
    pub fn take_comparison(
        &mut self,
        result: Result<crate::compare::Comparison, crate::compare::CompareError>,
    ) {
        match result {
            Ok(c) => {
                self.messages.push(format!(
                    "compared {} with {}: {}",
                    c.left,
                    c.right,
                    c.summary()
                ));
                let same = self
                    .comparison
                    .as_ref()
                    .is_some_and(|old| old.left == c.left && old.right == c.right);
                if !same {
                    self.compare_view = crate::panels::compare::CompareState::default();
                }
                self.comparison = Some(c);
            }
            Err(e) if e != crate::compare::CompareError::Cancelled => {
                self.messages.push(format!("error: compare: {e}"));
            }
            // Cancelled: a newer comparison replaces it.
            Err(_) => {}
        }
    }

    /// Applies a parsed document.
    pub fn open_document(&mut self, doc: Result<Document, crate::docs::OpenError>) {
        match doc {
            Ok(Document::Model { name, model }) => {
                self.messages.push(format!(
                    "opened model {name} ({} parameters)",
                    model.params.len()
                ));
                let example =
                    name == EXAMPLE_MODEL_NAME && std::mem::take(&mut self.example_pending);
                // Checkpoints opened from now on read FSDP1 per-rank files through it; never
                // through the example's (it describes no checkpoint the user opens).
                self.loader.read_options.description =
                    (!example).then(|| (model.clone(), name.clone()));
                self.model = Some(LoadedModel {
                    name,
                    model,
                    derived: None,
                    example,
                });
                self.applied_config = None;
                self.recompute();
                if self.tab == Tab::Trace {
                    self.tab = Tab::ShardMap;
                }
            }
            Ok(Document::Trace(trace)) => {
                self.messages.push(format!(
                    "opened trace {} ({} spans on {} lanes)",
                    trace.name,
                    trace.spans.len(),
                    trace.lanes.len()
                ));
                self.trace = Some(trace);
                self.timeline = timeline::TimelineState::default();
                if !self.stay_on_tab {
                    self.tab = Tab::Trace;
                }
            }
            Ok(Document::Report(report)) => {
                self.messages.push(format!(
                    "opened report {}: {}",
                    report.name,
                    report.summary()
                ));
                self.verify.only_problems = report.entries.iter().any(|e| e.status.is_problem());
                self.report = Some(report);
                if !self.stay_on_tab {
                    self.tab = Tab::Verify;
                }
            }
            Ok(Document::Checkpoint(ckpt)) => self.open_checkpoint(ckpt),
            Ok(Document::HfConfig(config)) => self.open_hf_config(config),
            Ok(Document::Manifest(m)) => self.open_manifest(m),
            Err(e) => self.messages.push(format!("error: {e}")),
        }
    }

    /// Applies a Hugging Face config: the FQN map shows the HF names.
    fn open_hf_config(&mut self, config: crate::hf_names::HfConfig) {
        self.messages.push(format!(
            "opened Hugging Face config {}: the FQN map shows the HF names",
            config.name
        ));
        self.hf_config = Some(config);
        self.refresh_hf_names();
        if let Some(names) = &self.hf_names {
            match (&names.mapping, &names.error) {
                (_, Some(e)) => self.messages.push(format!("note: HF names: {e}")),
                (Some(m), None) => {
                    self.messages.push(format!("HF names by the mapping `{m}`"));
                }
                (None, None) => {}
            }
        }
        if !self.stay_on_tab {
            self.tab = Tab::FqnMap;
        }
    }

    /// Recomputes the HF names of the current layout (after a layout or a config change).
    pub(crate) fn refresh_hf_names(&mut self) {
        self.hf_names = self
            .hf_config
            .as_ref()
            .zip(self.view.as_ref())
            .map(|(config, view)| {
                let index = self.checkpoint.as_ref().map(|c| &c.index);
                crate::hf_names::of_layout(config, view, index)
            });
    }

    /// Recomputes the layout if the controls or the model changed.
    pub fn recompute(&mut self) {
        let config = self.controls.config();
        if self.applied_config.as_ref() == Some(&config) {
            return;
        }
        self.applied_config = Some(config.clone());
        self.overlay = None;
        self.map_marks = None;
        if self.show_stored_partitions() {
            return;
        }
        let Some(loaded) = &self.model else {
            self.view = None;
            return;
        };
        match layout::compute(&loaded.model, &config) {
            Ok(l) => {
                self.overlay = self.checkpoint.as_ref().map(|c| {
                    shardscope_core::view::overlay::compare(
                        &c.index,
                        &c.hints,
                        &l,
                        shardscope_core::checkpoint::app_state_prefix(&c.index),
                    )
                });
                self.generation += 1;
                let mut view = LayoutView::new(&loaded.model, &l);
                view.generation = self.generation;
                self.map_marks = self
                    .overlay
                    .as_ref()
                    .filter(|o| o.applicable)
                    .map(|o| crate::map_marks::place(&view, o));
                self.view = Some(view);
                self.layout_error = None;
                self.refresh_hf_names();
            }
            Err(e) => {
                self.view = None;
                self.layout_error = Some(e.to_string());
            }
        }
    }

    /// Finishes pending loads (tests: call until it returns 0).
    pub fn poll_loader(&mut self) -> usize {
        let docs = self.loader.poll();
        let opened = !docs.is_empty();
        for doc in docs {
            self.open_document(doc);
        }
        let pending = self.loader.pending();
        if opened && pending == 0 {
            // A batch (e.g. the example's model and trace) is done: later traces switch tabs.
            self.stay_on_tab = false;
        }
        pending
    }

    /// Screen position (points) of the centre of `fqn`'s first slice in the shard map as last
    /// drawn, if it is on screen. Browser tests aim real mouse clicks with it.
    pub fn slice_center(&self, fqn: &str) -> Option<egui::Pos2> {
        self.layout_slice_center(fqn)
            .or_else(|| self.checkpoint_row_center(fqn))
    }

    /// Centre of `key`'s row in the checkpoint key table as last drawn (the **Checkpoint** tab).
    pub fn checkpoint_row_center(&self, key: &str) -> Option<egui::Pos2> {
        let c = self.checkpoint.as_ref()?;
        let &i = c.by_key.get(key)?;
        self.ckpt
            .row_rects
            .iter()
            .find(|(e, _)| *e == i)
            .map(|(_, r)| r.center())
    }

    fn layout_slice_center(&self, fqn: &str) -> Option<egui::Pos2> {
        let view = self.view.as_ref()?;
        let canvas = self.shard_map.last_canvas?;
        let &param = view.by_fqn.get(fqn)?;
        let (_, _, rect) = shard_map::slice_rect(view, &self.shard_map, canvas, param)?;
        let rect = rect.intersect(shard_map::bar_area(canvas));
        (rect.is_positive() && canvas.contains(rect.center())).then(|| rect.center())
    }

    /// One line describing the state, mirrored into the web page for scripts and screen readers.
    pub fn status_line(&self) -> String {
        let model = self
            .model
            .as_ref()
            .map_or("no model".to_owned(), |m| m.name.clone());
        let layout = match (&self.view, &self.layout_error) {
            (Some(v), _) => format!(
                "{} {} x{} · {} units · {} chunks",
                v.api_label,
                v.strategy_label,
                v.world_size,
                v.units.len(),
                v.chunk_count()
            ),
            // A model derived from the checkpoint that FSDP could not wrap is no error of the
            // user's: say why there is no layout.
            (None, Some(e)) if self.model.as_ref().is_some_and(|m| m.derived.is_some()) => {
                format!("no layout for the derived model ({e})")
            }
            (None, Some(e)) => format!("layout error: {e}"),
            (None, None) => "no layout".to_owned(),
        };
        let selected = self.selection.fqn.as_deref().unwrap_or("none");
        let busy = self
            .loader
            .pending_text()
            .map_or(String::new(), |t| format!(" · {t}..."));
        match &self.checkpoint {
            Some(c) => {
                // A selected checkpoint entry names its chunk count (scripts check it).
                let chunks = self
                    .selection
                    .fqn
                    .as_deref()
                    .and_then(|f| c.by_key.get(f))
                    .map_or(String::new(), |&i| {
                        format!(" ({} chunks)", c.index.entries[i].chunks.len())
                    });
                let overlay = self
                    .overlay
                    .as_ref()
                    .filter(|o| o.applicable)
                    .map_or(String::new(), |o| format!(" · {}", o.summary()));
                format!(
                    "{model} · {layout} · checkpoint {}: {}{overlay} · selected: {selected}{chunks}{busy}",
                    c.name,
                    c.summary()
                )
            }
            None => format!("{model} · {layout} · selected: {selected}{busy}"),
        }
    }

    /// Draws the whole viewer.
    pub fn ui(&mut self, ui: &mut Ui) {
        let ctx = ui.ctx().clone();
        if self.applied_theme != Some(self.theme) {
            ctx.set_visuals(self.theme.visuals());
            self.applied_theme = Some(self.theme);
        }
        if self.poll_loader() > 0 {
            ctx.request_repaint();
        }
        if self.poll_comparer() | self.poll_value_job() | self.poll_manifest_job() {
            // Progress is shown as it goes (4 times a second: in the browser, frames share the
            // one thread with the work); the worker never blocks on the UI.
            ctx.request_repaint_after(std::time::Duration::from_millis(250));
        }
        self.take_dropped_files(&ctx);
        // Refilled by the key table if it is drawn this frame.
        self.ckpt.row_rects.clear();
        // Controls changed by any means (widgets, scripts, tests) take effect this frame.
        self.recompute();
        #[cfg(not(target_arch = "wasm32"))]
        self.poll_dialog();

        egui::Panel::top("menu").show(ui, |ui| self.menu_bar(ui));
        egui::Panel::bottom("status").show(ui, |ui| self.status_bar(ui));
        // At most 40% of the window, whatever a row holds: the central map keeps its room.
        let max_side = (ctx.content_rect().width() * 0.4).max(240.0);
        egui::Panel::left("controls")
            .resizable(true)
            .default_size(310.0)
            .max_size(max_side)
            .show(ui, |ui| self.left_panel(ui));
        // A floor too: a size remembered from a first frame narrower than the window's real size
        // (the window is sized after it opens) kept the inspector at ~95 px.
        egui::Panel::right("inspector")
            .resizable(true)
            .default_size(340.0)
            .min_size(240.0)
            .show(ui, |ui| self.inspector(ui));
        egui::CentralPanel::default().show(ui, |ui| self.central(ui));

        if self.selection.changed {
            self.selection.changed = false;
            self.shard_map.reveal_selection = true;
            self.fqn_map.reveal_selection = true;
            self.ckpt.reveal_selection = true;
            ctx.request_repaint();
        }
    }

    fn take_dropped_files(&mut self, ctx: &egui::Context) {
        let dropped = ctx.input_mut(|i| std::mem::take(&mut i.raw.dropped_files));
        #[cfg(not(target_arch = "wasm32"))]
        for file in dropped {
            self.open_path(file.path().to_path_buf());
        }
        #[cfg(target_arch = "wasm32")]
        if !dropped.is_empty() {
            // Browsers read files asynchronously: every file of one drop is read first, then
            // they reach the inbox together, so they are opened as one checkpoint.
            let inbox = self.inbox.clone();
            let ctx = ctx.clone();
            wasm_bindgen_futures::spawn_local(async move {
                let mut batch = Vec::with_capacity(dropped.len());
                for file in dropped {
                    let name = file.path().display().to_string();
                    batch.push((name, file.bytes_async().await));
                }
                if let Ok(mut q) = inbox.lock() {
                    q.extend(batch);
                }
                ctx.request_repaint();
            });
        }
        let arrived = self
            .inbox
            .lock()
            .map(|mut q| std::mem::take(&mut *q))
            .unwrap_or_default();
        for (name, result) in arrived {
            match result {
                Ok(bytes) => self.open_bytes(name, bytes),
                Err(e) => self
                    .messages
                    .push(format!("error: cannot read {name}: {e}")),
            }
        }
        // What arrived together is one batch; the next arrival starts another checkpoint.
        self.loader.end_batch();
    }

    /// Replaces the inbox (the web handle creates it before the viewer exists).
    pub fn set_inbox(&mut self, inbox: Inbox) {
        self.inbox = inbox;
    }

    /// A queue other threads or JavaScript can push `(name, bytes)` into; the viewer opens them on
    /// its next frame.
    pub fn inbox(&self) -> Inbox {
        self.inbox.clone()
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn poll_dialog(&mut self) {
        if let Some(rx) = &self.dialog
            && let Ok(paths) = rx.try_recv()
        {
            self.dialog = None;
            for p in paths {
                self.open_path(p);
            }
        }
        if let Some(rx) = &self.compare_dialog
            && let Ok(paths) = rx.try_recv()
        {
            self.compare_dialog = None;
            if let Some(b) = paths.first() {
                self.compare_with_path(b);
            }
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn open_dialog(&mut self, folder: bool) {
        if let Some(rx) = self.file_dialog(folder) {
            self.dialog = Some(rx);
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn file_dialog(
        &mut self,
        folder: bool,
    ) -> Option<std::sync::mpsc::Receiver<Vec<std::path::PathBuf>>> {
        let (tx, rx) = std::sync::mpsc::channel();
        // The dialog runs on its own thread so the UI keeps drawing while it is open.
        let spawned = std::thread::Builder::new()
            .name("file-dialog".to_owned())
            .spawn(move || {
                let dialog = rfd::FileDialog::new();
                let picked = if folder {
                    dialog.pick_folder().map(|p| vec![p])
                } else {
                    dialog
                        .add_filter(
                            "Checkpoints and JSON",
                            &[
                                "json",
                                "pt",
                                "pth",
                                "bin",
                                "safetensors",
                                "distcp",
                                "metadata",
                                "zip",
                            ],
                        )
                        .add_filter("All files", &["*"])
                        .pick_files()
                };
                if let Some(paths) = picked {
                    let _ = tx.send(paths);
                }
            });
        match spawned {
            Ok(_) => Some(rx),
            Err(e) => {
                self.messages
                    .push(format!("error: cannot open a file dialog: {e}"));
                None
            }
        }
    }

    fn menu_bar(&mut self, ui: &mut Ui) {
        ui.horizontal(|ui| {
            ui.heading("shardscope");
            ui.separator();
            #[cfg(not(target_arch = "wasm32"))]
            {
                if ui.button("Open files...").clicked() {
                    self.open_dialog(false);
                }
                if ui.button("Open folder...").clicked() {
                    self.open_dialog(true);
                }
                let can_compare = self.checkpoint.as_ref().is_some_and(|c| c.origin.is_some());
                ui.add_enabled_ui(can_compare, |ui| {
                    ui.menu_button("Compare with...", |ui| {
                        for (folder, text) in [(false, "a file..."), (true, "a folder...")] {
                            if ui.button(text).clicked() {
                                self.compare_dialog = self.file_dialog(folder);
                                ui.close();
                            }
                        }
                    })
                    .response
                    .on_hover_text("A/B compare: the opened checkpoint (A) with another (B)");
                });
            }
            if ui
                .button("Example")
                .on_hover_text("The bundled tiny model and gather trace")
                .clicked()
            {
                self.open_bytes("examples/tiny_model.json", EXAMPLE_MODEL.to_vec());
                self.open_bytes("examples/viewer/gather_trace.json", EXAMPLE_TRACE.to_vec());
                self.open_bytes(
                    "examples/viewer/verify_report.json",
                    EXAMPLE_REPORT.to_vec(),
                );
                self.stay_on_tab = true;
            }
            ui.separator();
            let dark = self.theme.is_dark();
            if ui
                .button(if dark { "Light theme" } else { "Dark theme" })
                .on_hover_text("Switch theme")
                .clicked()
            {
                self.theme = if dark { Theme::Light } else { Theme::Dark };
            }
            if self.comparer.running() {
                ui.spinner();
                ui.label(self.comparer.progress().text());
                if ui.small_button("cancel").clicked() {
                    self.comparer.cancel();
                }
            }
            if self.loader.pending() > 0 {
                ui.spinner();
                ui.label(
                    self.loader.pending_text().unwrap_or_else(|| {
                        format!("parsing {} input(s)...", self.loader.pending())
                    }),
                );
            }
            ui.with_layout(egui::Layout::right_to_left(egui::Align::Center), |ui| {
                ui.weak("drop checkpoints (files, folders, a .zip), models or traces anywhere");
            });
        });
    }

    fn status_bar(&mut self, ui: &mut Ui) {
        ui.horizontal(|ui| {
            match self.selection.fqn.clone() {
                Some(f) => {
                    ui.label("Selected:");
                    ui.strong(&f);
                    if ui
                        .small_button("x")
                        .on_hover_text("Clear selection")
                        .clicked()
                    {
                        self.selection.fqn = None;
                    }
                }
                None => {
                    ui.weak("Nothing selected: click a slice, a row or a tree leaf");
                }
            }
            if let Some(m) = self.messages.last() {
                ui.separator();
                if m.starts_with("error") {
                    ui.colored_label(ui.visuals().error_fg_color, m);
                } else {
                    ui.weak(m);
                }
            }
        });
    }

    fn left_panel(&mut self, ui: &mut Ui) {
        ui.add_space(4.0);
        if let Some(c) = &self.checkpoint {
            ui.strong("Checkpoint");
            ui.weak(&c.name);
            ui.weak(c.index.kind.describe());
            egui::Frame::NONE.show(ui, |ui| {
                ui.set_max_height((ui.available_height() * 0.5).max(120.0));
                crate::panels::checkpoint::tree_ui(ui, c, &mut self.ckpt, &mut self.selection);
            });
            ui.separator();
        }
        ui.strong("Layout");
        if let Some(m) = &self.model {
            ui.weak(format!("model: {}", m.name));
        } else {
            ui.weak("no model loaded");
        }
        if self.units_ui(ui) {
            self.applied_config = None;
            self.recompute();
        }
        if self.controls.ui(ui) {
            self.recompute();
        }
        if let Some(e) = &self.layout_error {
            ui.colored_label(ui.visuals().error_fg_color, e);
        }
        if let Some(v) = &self.view {
            for note in &v.notes {
                ui.colored_label(ui.visuals().warn_fg_color, note);
            }
        }
        ui.separator();
        ui.strong("Tensors");
        if let Some(view) = &self.view {
            tensor_tree::ui(ui, view, &mut self.tree, &mut self.selection, self.theme);
        }
    }

    /// The units of a model derived from the checkpoint: a field of module patterns and the root,
    /// applied as they are edited. True when the units changed.
    fn units_ui(&mut self, ui: &mut Ui) -> bool {
        let Some(m) = &mut self.model else {
            return false;
        };
        let Some(d) = &mut m.derived else {
            return false;
        };
        let before = d.clone();
        ui.horizontal(|ui| {
            let label = ui.label("units").on_hover_text(
                "FSDP units: module patterns, comma-separated; N is a block number (model.layers.N)",
            );
            ui.add(egui::TextEdit::singleline(&mut d.patterns).id_salt("unit-patterns"))
                .labelled_by(label.id);
        });
        ui.checkbox(&mut d.root, "root module is a unit");
        if *d == before {
            return false;
        }
        set_units(m);
        true
    }

    fn inspector(&mut self, ui: &mut Ui) {
        ui.add_space(4.0);
        ui.strong("Selection");
        if self.checkpoint_inspector(ui) {
            return;
        }
        let Some(view) = &self.view else {
            return;
        };
        let Some(p) = self.selection.fqn.as_deref().and_then(|f| view.param(f)) else {
            ui.weak("Select a parameter to see where it lives.");
            return;
        };
        egui::ScrollArea::vertical()
            .id_salt("inspector_scroll")
            .show(ui, |ui| {
                ui.label(RichText::new(&p.fqn).monospace().strong());
                egui::Grid::new("inspector_grid")
                    .num_columns(2)
                    .striped(true)
                    .show(ui, |ui| {
                        let mut row = |k: &str, v: String| {
                            ui.weak(k);
                            ui.add(egui::Label::new(v).truncate());
                            ui.end_row();
                        };
                        row("raw name", p.raw_name.clone());
                        row("status", p.status.label().to_owned());
                        if let Some(prim) = &p.shared_with {
                            row("tied to", prim.clone());
                        }
                        row(
                            "unit",
                            p.unit.as_deref().map_or("(none)".to_owned(), |u| {
                                if u.is_empty() {
                                    "(root)".to_owned()
                                } else {
                                    u.to_owned()
                                }
                            }),
                        );
                        if let Some(f) = &p.flat_param {
                            row("flat parameter", f.clone());
                        }
                        if let Some((a, b)) = p.flat_range {
                            row("flat range", format!("[{a}, {b})"));
                        }
                        row("shape", fmt_shape(&p.shape));
                        row("dtype", p.dtype.name().to_owned());
                        row("numel", count(p.numel));
                        row("bytes", fmt_bytes(p.bytes()));
                        row("ranks", fmt_ranks(&p.ranks));
                    });
                ui.separator();
                ui.strong("Chunk map");
                chunk_map::ui(ui, p, self.theme);
            });
    }

    /// Details of the selected checkpoint entry; false when the selection is not one.
    fn checkpoint_inspector(&mut self, ui: &mut Ui) -> bool {
        use crate::panels::checkpoint::{chunk_table_ui, entry_facts, fsdp_text};
        let Some(c) = &self.checkpoint else {
            return false;
        };
        let Some((i, e)) = self.selection.fqn.as_deref().and_then(|k| c.entry(k)) else {
            return false;
        };
        ui.label(RichText::new(&e.key).monospace().strong());
        egui::Grid::new("ckpt_inspector_grid")
            .num_columns(2)
            .striped(true)
            .show(ui, |ui| {
                let mut row = |k: &str, v: String| {
                    ui.weak(k);
                    ui.add(egui::Label::new(v).truncate());
                    ui.end_row();
                };
                if let Some(raw) = &e.raw_key {
                    row("raw key", raw.clone());
                }
                row("kind", format!("{:?}", e.kind).to_lowercase());
                row("facts", entry_facts(e));
                let fsdp = fsdp_text(e);
                if !fsdp.is_empty() {
                    row("fsdp", fsdp);
                }
                row("chunks", e.chunks.len().to_string());
                row("ranks", fmt_ranks(&c.ranks[i]));
            });
        if !e.chunks.is_empty() {
            ui.separator();
            ui.strong("Chunks");
            chunk_table_ui(ui, e);
        }
        true
    }

    #[allow(
        clippy::too_many_lines,
        reason = "immediate-mode UI: the central panel's widgets laid out in drawing order"
    )]
    fn central(&mut self, ui: &mut Ui) {
        ui.horizontal(|ui| {
            if self.checkpoint.is_some() {
                ui.selectable_value(&mut self.tab, Tab::Checkpoint, "Checkpoint");
                ui.selectable_value(&mut self.tab, Tab::Chunks, "Chunks");
                ui.selectable_value(&mut self.tab, Tab::Optimizer, "Optimizer");
                ui.separator();
            }
            ui.selectable_value(&mut self.tab, Tab::ShardMap, "Shard map");
            ui.selectable_value(&mut self.tab, Tab::FqnMap, "FQN map");
            ui.selectable_value(&mut self.tab, Tab::Ranks, "Ranks");
            ui.add_enabled_ui(self.trace.is_some(), |ui| {
                ui.selectable_value(&mut self.tab, Tab::Trace, "Trace");
            });
            ui.add_enabled_ui(self.report.is_some(), |ui| {
                ui.selectable_value(&mut self.tab, Tab::Verify, "Verify");
            });
            if self.checkpoint.is_some() {
                ui.selectable_value(&mut self.tab, Tab::Values, "Values");
            }
            ui.add_enabled_ui(self.comparison.is_some() || self.comparer.running(), |ui| {
                ui.selectable_value(&mut self.tab, Tab::Compare, "Compare");
            });
            if let Some(v) = &self.view {
                ui.separator();
                // Cut to the row: a longer line would widen the central panel, and the map
                // drawn below it would run under the inspector.
                let text = format!(
                    "{} · {} · world {} · {} parameters",
                    v.api_label,
                    v.strategy_label,
                    v.world_size,
                    v.params.len()
                );
                ui.add(egui::Label::new(RichText::new(&text).weak()).truncate())
                    .on_hover_text(text);
            }
        });
        ui.separator();
        match self.tab {
            Tab::Checkpoint | Tab::Chunks | Tab::Optimizer => {
                let Some(c) = &self.checkpoint else {
                    ui.label("Open a checkpoint to see its keys.");
                    return;
                };
                match self.tab {
                    Tab::Checkpoint => crate::panels::checkpoint::table_ui(
                        ui,
                        c,
                        &mut self.ckpt,
                        &mut self.selection,
                    ),
                    Tab::Chunks => {
                        let entry = self.selection.fqn.as_deref().and_then(|k| c.entry(k));
                        match entry {
                            Some((i, _)) => {
                                self.ckpt.last_canvas = crate::panels::checkpoint::chunk_map_ui(
                                    ui,
                                    c,
                                    i,
                                    &mut self.ckpt,
                                    self.theme,
                                );
                            }
                            None => {
                                ui.label("Select a key of the checkpoint to see its chunks.");
                            }
                        }
                    }
                    _ => crate::panels::checkpoint::optimizer_ui(ui, c, &mut self.selection),
                }
            }
            Tab::Values => {
                let can_read = self.checkpoint.as_ref().is_some_and(|c| c.origin.is_some());
                ui.horizontal(|ui| {
                    if self.value_job.running() {
                        ui.spinner();
                        ui.label(self.value_job.progress().text().replace("comparing", "reading"));
                        if ui.small_button("cancel").clicked() {
                            self.value_job.cancel();
                        }
                    } else if ui
                        .add_enabled(can_read, egui::Button::new("Read values"))
                        .on_hover_text("Reads every tensor once (min/max/mean, NaN/inf counts, as inspect --values)")
                        .clicked()
                    {
                        self.compute_values();
                    }
                });
                ui.separator();
                match &self.values {
                    Some(map) => crate::panels::values::ui(
                        ui,
                        map,
                        &mut self.values_view,
                        &mut self.selection,
                    ),
                    None => {
                        ui.label("Read values to see per-tensor statistics laid out by layer.");
                    }
                }
            }
            Tab::Compare => crate::panels::compare::tab_ui(
                ui,
                self.comparison.as_ref(),
                &mut self.comparer,
                &mut self.compare_view,
                &mut self.selection,
            ),
            Tab::Trace => match &self.trace {
                Some(t) => timeline::ui(ui, t, &mut self.timeline, &mut self.selection, self.theme),
                None => {
                    ui.label("Open a runner trace (Chrome trace JSON) to see the timeline.");
                }
            },
            Tab::Verify => {
                if let Some(c) = &self.checkpoint
                    && !c.findings.is_empty()
                {
                    crate::panels::verify::doctor_ui(ui, &c.findings, &mut self.selection);
                    ui.separator();
                }
                match &self.report {
                    Some(r) => {
                        let (view, c) = (self.view.as_ref(), self.checkpoint.as_ref());
                        let wrapper = c.and_then(|c| app_state_prefix(&c.index));
                        let known = |k: &str| crate::panels::verify::in_layout(view, wrapper, k);
                        crate::panels::verify::ui(
                            ui,
                            r,
                            &mut self.verify,
                            &mut self.selection,
                            &known,
                        );
                    }
                    None => {
                        ui.label(
                            "Open a verification report (shardscope verify --json) to list mismatches.",
                        );
                    }
                }
            }
            tab => {
                let Some(view) = &self.view else {
                    empty_state(ui, self.layout_error.as_deref());
                    return;
                };
                match tab {
                    Tab::ShardMap => shard_map::ui(
                        ui,
                        view,
                        self.map_marks.as_ref(),
                        &mut self.shard_map,
                        &mut self.selection,
                        self.theme,
                    ),
                    Tab::FqnMap => fqn_map::ui(
                        ui,
                        view,
                        self.hf_names.as_ref(),
                        &mut self.fqn_map,
                        &mut self.selection,
                    ),
                    _ => {
                        if let Some(o) = &self.overlay {
                            let line = crate::panels::overlay::origins_line(
                                &self.controls.origins,
                                view.world_size,
                                view.api_label,
                            );
                            crate::panels::overlay::ui(ui, o, &line);
                        }
                        ranks::ui(ui, view, self.theme);
                    }
                }
            }
        }
    }
}

fn empty_state(ui: &mut Ui, error: Option<&str>) {
    ui.vertical_centered(|ui| {
        ui.add_space(40.0);
        if let Some(e) = error {
            ui.colored_label(ui.visuals().error_fg_color, e);
        } else {
            ui.heading("Open a model description or a runner trace");
            ui.label("Drop a .json file here, or press Example.");
        }
    });
}

impl eframe::App for Viewer {
    fn ui(&mut self, ui: &mut Ui, _frame: &mut eframe::Frame) {
        #[cfg(not(target_arch = "wasm32"))]
        self.window_fit.step(ui.ctx());
        Viewer::ui(self, ui);
    }
}

/// Recomputes the units of a derived model from its patterns.
pub fn set_units(m: &mut LoadedModel) {
    let Some(d) = &m.derived else { return };
    let patterns = d.patterns.clone();
    let is_unit = |prefix: &str| crate::checkpoint::matches_unit_patterns(&patterns, prefix);
    m.model.units =
        shardscope_core::index::from_index::module_units(&m.model.params, &is_unit, d.root);
}
