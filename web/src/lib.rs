//! WebAssembly entry of the shardscope viewer: a [`WebHandle`] the page creates, starts on a canvas
//! and feeds with files (`add_blob`... `finish_batch` for picked files that form one checkpoint,
//! read lazily by byte range; `open_url`/`open_urls` for a checkpoint behind HTTP(S), presigned
//! URLs and per-rank URLs included; `open_bytes` for bytes). Everything else is the same
//! `shardscope-viewer` code the desktop binary runs.

pub use shardscope_viewer as viewer;

pub mod urls;

#[cfg(target_arch = "wasm32")]
pub mod lazy;

#[cfg(target_arch = "wasm32")]
pub mod jspi;

#[cfg(target_arch = "wasm32")]
pub mod compare;

#[cfg(target_arch = "wasm32")]
pub mod manifest;

#[cfg(target_arch = "wasm32")]
mod handle {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use shardscope_core::checkpoint::{Checkpoint, CheckpointError, ReadOptions};
    use shardscope_core::verify::Tolerance;
    use shardscope_viewer::checkpoint::CheckpointView;
    use shardscope_viewer::compare::{CompareError, Comparison, Progress};
    use shardscope_viewer::docs::Document;
    use shardscope_viewer::{Tab, Viewer};
    use wasm_bindgen::prelude::*;

    use crate::compare::Side;
    use crate::lazy::{self, LazySource};
    use crate::urls::{self, shown};
    use shardscope_core::source::Source;

    /// Files that are read whole (JSON documents, zips) may be at most this large.
    const MAX_WHOLE: u64 = 1 << 30;
    /// Fetched ranges at least this long are dropped once a checkpoint is indexed.
    const RELEASED_AFTER_INDEXING: u64 = 16 << 20;
    /// Files of unknown kind larger than this are taken for checkpoint files (read lazily).
    const LAZY_UNKNOWN: f64 = 64.0 * 1_048_576.0;
    /// An HF index is at most this large.
    const MAX_HF_INDEX: u64 = 64 << 20;

    /// What the page reads back between frames.
    #[derive(Debug, Default)]
    struct Shared {
        /// The viewer's own part of the status line and the comparison's summary, as of the last
        /// frame (the page's status line adds what the jobs do now: [`compose_status`]).
        frame_status: (String, Option<String>),
        selected: Option<String>,
        /// `Some("")` clears the selection.
        select_request: Option<String>,
        example: bool,
        probe: Option<String>,
        probe_result: Option<(f32, f32)>,
        /// What background opens are doing, by job.
        busy: BTreeMap<u64, String>,
        next_job: u64,
        /// The last failure, shown in the page's status line until the next open.
        error: Option<String>,
        /// Checkpoints opened (or not) in the background, for the viewer's next frame.
        opened: Vec<Result<Box<CheckpointView>, String>>,
        /// How the viewer reads checkpoints (its loaded model description), for background opens.
        read_options: ReadOptions,
        /// `[[key, dtype, shape], ...]` (JSON) of the last checkpoint opened in the background,
        /// for tests (`checkpoint_keys`).
        last_keys: String,
        /// Lazily opened checkpoints that have not reached the viewer yet.
        opens_in_flight: usize,
        /// The last checkpoint opened lazily: A of a comparison (out while one runs).
        a_side: Option<Side>,
        /// B of the last comparison, kept to compare again with another tolerance.
        b_side: Option<Side>,
        /// A comparison runs (the sides are out).
        comparing: bool,
        /// The comparison asked for while one ran (it runs next).
        queued: Option<CompareRequest>,
        /// The running comparison's progress.
        compare_progress: Option<Progress>,
        /// Finished comparisons, for the viewer's next frame.
        compared: Vec<Result<Comparison, CompareError>>,
        /// A comparison was asked for: show the Compare tab.
        show_compare: bool,
        /// The viewer's current tolerance (comparisons started from the page use it).
        tolerance: Option<Tolerance>,
        /// The viewer's cancel flag of comparisons (set by its cancel button).
        compare_cancel: Arc<AtomicBool>,
        /// `diff --json` of the comparison shown (JSON), for tests (`comparison_json`).
        comparison_json: String,
        /// Tolerance controls set by a script, for the viewer's next frame.
        tolerance_request: Option<shardscope_viewer::compare::ToleranceInput>,
        /// Checks of the opened checkpoint against a content manifest.
        checks: crate::manifest::Checks,
    }

    impl crate::manifest::Host for Shared {
        fn checks(&mut self) -> &mut crate::manifest::Checks {
            &mut self.checks
        }
        fn opened_copy(&self) -> Option<Side> {
            let a = self.a_side.as_ref()?;
            Some(Side {
                label: a.label.clone(),
                source: a.source.reopen(),
            })
        }
        fn busy(&self) -> bool {
            self.opens_in_flight > 0 || self.comparing
        }
        fn read_options(&self) -> ReadOptions {
            self.read_options.clone()
        }
    }

    /// A comparison to run: with a new B (else the last one's B) and a tolerance.
    #[derive(Debug)]
    struct CompareRequest {
        b: Option<BSource>,
        tolerance: Option<Tolerance>,
    }

    /// Where B comes from.
    #[derive(Debug)]
    enum BSource {
        /// Picked files (one checkpoint).
        Files(Side),
        /// URLs (as `open_urls` takes them) and the rank count of `{r}` patterns.
        Urls(Vec<String>, String),
    }

    /// The app the runner drives: the viewer plus the shared state.
    struct WebApp {
        viewer: Viewer,
        shared: Arc<Mutex<Shared>>,
        ctx: Arc<Mutex<Option<egui::Context>>>,
        /// Viewer messages already looked at for errors.
        seen_messages: usize,
    }

    /// Hands the viewer what the page's comparisons did (results, progress, requests).
    fn take_compare_updates(viewer: &mut Viewer, s: &mut Shared) {
        for result in std::mem::take(&mut s.compared) {
            if let Ok(c) = &result {
                s.comparison_json =
                    urls::hide_queries(&serde_json::to_string(&c.report).unwrap_or_default());
            }
            viewer.take_comparison(result);
        }
        viewer.comparer.external.enabled = true;
        if let Some(input) = s.tolerance_request.take() {
            // As if typed into the Compare tab's controls.
            let t = input.tolerance();
            viewer.comparer.tolerance_input = input;
            match t {
                Ok(t) => viewer.comparer.set_tolerance(t),
                Err(e) => s.error = Some(e),
            }
        }
        if std::mem::take(&mut s.show_compare) {
            viewer.tab = Tab::Compare;
        }
        viewer.comparer.external.cancel = s.compare_cancel.clone();
        viewer
            .comparer
            .external
            .progress
            .clone_from(&s.compare_progress);
    }

    impl eframe::App for WebApp {
        fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
            if let Ok(mut s) = self.shared.lock() {
                for result in std::mem::take(&mut s.opened) {
                    match result {
                        Ok(view) => self.viewer.open_document(Ok(Document::Checkpoint(view))),
                        Err(e) => self.viewer.messages.push(format!("error: {e}")),
                    }
                    ui.ctx().request_repaint();
                }
                if let Some(fqn) = s.select_request.take() {
                    if fqn.is_empty() {
                        self.viewer.selection.fqn = None;
                    } else {
                        self.viewer.selection.select(fqn);
                    }
                }
                take_compare_updates(&mut self.viewer, &mut s);
                s.checks.take_results(&mut self.viewer);
                if std::mem::take(&mut s.example) {
                    self.viewer.stay_on_tab = true;
                    self.viewer.open_example();
                    self.viewer.open_bytes(
                        "examples/viewer/verify_report.json",
                        shardscope_viewer::app::EXAMPLE_REPORT.to_vec(),
                    );
                }
            }
            self.viewer.ui(ui);
            if let Some(request) = self.viewer.manifest_job.external.request.take() {
                crate::manifest::request(&self.shared, &self.ctx, request);
            }
            // A new tolerance in the Compare tab: compare the same two checkpoints again.
            if let Some(tolerance) = self.viewer.comparer.external.request.take() {
                request_compare(
                    &self.shared,
                    &self.ctx,
                    CompareRequest { b: None, tolerance },
                );
            }
            // Progress four times a second: frames take the page's one thread from the work.
            if s_compare_running(&self.shared) {
                ui.ctx()
                    .request_repaint_after(std::time::Duration::from_millis(250));
            }
            if let Ok(mut s) = self.shared.lock() {
                // Errors of the viewer's own loader (documents, zips) reach the page too.
                for m in self.viewer.messages.iter().skip(self.seen_messages) {
                    if let Some(e) = m.strip_prefix("error: ") {
                        s.error = Some(e.to_owned());
                    }
                }
                self.seen_messages = self.viewer.messages.len();
                s.frame_status = (
                    self.viewer.status_line(),
                    self.viewer
                        .comparison
                        .as_ref()
                        .map(shardscope_viewer::compare::Comparison::summary),
                );
                s.selected.clone_from(&self.viewer.selection.fqn);
                s.read_options.clone_from(&self.viewer.loader.read_options);
                s.tolerance = self.viewer.comparer.tolerance;
                s.probe_result = s
                    .probe
                    .as_deref()
                    .and_then(|f| self.viewer.slice_center(f))
                    .map(|p| (p.x, p.y));
            }
        }
    }

    /// A file of a batch.
    enum BatchFile {
        /// Its name and its bytes (or why it could not be read).
        Bytes(String, Result<Vec<u8>, String>),
        /// A picked file, read when needed.
        Blob(String, web_sys::Blob),
    }

    /// True for files read by byte range: checkpoint files but zips, and large files of unknown
    /// kind. JSON documents and zips are read whole.
    fn reads_lazily(name: &str, size: f64) -> bool {
        let ext = name
            .rsplit_once('.')
            .map(|(_, e)| e.to_ascii_lowercase())
            .unwrap_or_default();
        if name.ends_with(".safetensors.index.json") {
            return true;
        }
        if ext == "zip" || ext == "json" {
            return false;
        }
        shardscope_viewer::checkpoint::is_checkpoint_name(name) || size > LAZY_UNKNOWN
    }

    fn mib(bytes: u64) -> String {
        shardscope_viewer::format::bytes(bytes)
    }

    /// Starts a background job: its status text is shown until it ends.
    fn begin(shared: &Mutex<Shared>, text: String) -> u64 {
        let Ok(mut s) = shared.lock() else { return 0 };
        s.error = None;
        s.next_job += 1;
        let job = s.next_job;
        s.busy.insert(job, text);
        job
    }

    fn set_busy(shared: &Mutex<Shared>, job: u64, text: String) {
        if let Ok(mut s) = shared.lock() {
            s.busy.insert(job, text);
        }
    }

    /// What an open that indexes a lazily read checkpoint is doing.
    fn indexing_line(name: &str, files: usize, total: u64, read: u64, reads: u64) -> String {
        format!(
            "indexing checkpoint {name}: {files} files, {}; read {} in {reads} requests",
            mib(total),
            mib(read)
        )
    }

    /// The page's status line: the viewer's, what the jobs are doing, the comparison, the last
    /// failure; never a URL's query (a presigned URL's signature).
    fn compose_status(s: &Shared) -> String {
        let (viewer, compared) = &s.frame_status;
        let mut status = viewer.clone();
        for b in s.busy.values() {
            status.push_str(" · ");
            status.push_str(b);
            status.push_str("...");
        }
        if let Some(p) = &s.compare_progress {
            status.push_str(" · ");
            status.push_str(&p.text());
            status.push_str("...");
        } else if let Some(c) = compared {
            status.push_str(" · compared: ");
            status.push_str(c);
        }
        if let Some((text, running)) = s.checks.status() {
            status.push_str(" · ");
            status.push_str(text);
            status.push_str(if running { "..." } else { "" });
        }
        if let Some(e) = &s.error {
            status.push_str(" · error: ");
            status.push_str(e);
        }
        urls::hide_queries(&status)
    }

    fn repaint_ctx(ctx: &Mutex<Option<egui::Context>>) {
        if let Ok(slot) = ctx.lock()
            && let Some(ctx) = slot.as_ref()
        {
            ctx.request_repaint();
        }
    }

    /// Ends a job with its result.
    fn finish(
        shared: &Mutex<Shared>,
        ctx: &Mutex<Option<egui::Context>>,
        job: u64,
        result: Result<Box<CheckpointView>, String>,
    ) {
        let result = result.map_err(|e| urls::hide_queries(&e));
        if let Ok(mut s) = shared.lock() {
            s.busy.remove(&job);
            s.opens_in_flight = s.opens_in_flight.saturating_sub(1);
            match &result {
                Err(e) => {
                    log::error!("{e}");
                    s.error = Some(e.clone());
                }
                Ok(view) => s.last_keys = keys_json(view),
            }
            s.opened.push(result);
        }
        repaint_ctx(ctx);
    }

    /// `[[key, dtype, shape], ...]` of a checkpoint (`null` for what has no dtype or shape), as
    /// `shardscope inspect --json` writes them.
    fn keys_json(view: &CheckpointView) -> String {
        let keys: Vec<serde_json::Value> = view
            .index
            .entries
            .iter()
            .map(|e| serde_json::json!([e.key, e.dtype.map(|d| d.to_string()), e.shape]))
            .collect();
        serde_json::Value::Array(keys).to_string()
    }

    /// Indexes a lazily read checkpoint, then reads the few values the panels show.
    async fn index_lazily(
        name: &str,
        src: &mut LazySource,
        shared: &Arc<Mutex<Shared>>,
        ctx: &Mutex<Option<egui::Context>>,
        job: u64,
    ) -> Result<Box<CheckpointView>, String> {
        let total = src.total_size();
        let files = src.file_count();
        let mut progress = |s: &LazySource| {
            let read = s.cached_bytes().saturating_add(s.streamed_bytes());
            set_busy(
                shared,
                job,
                indexing_line(name, files, total, read, s.reads()),
            );
            repaint_ctx(ctx);
        };
        if crate::jspi::available() {
            // Read during the step: the status line follows the `.metadata` as it is streamed.
            // No frame is asked for: the page's status line is composed when it is read
            // (`WebHandle::status`), and drawing a frame (0.1 s in software) would delay the
            // waiting step.
            let (shared, name) = (Arc::clone(shared), name.to_owned());
            src.on_step_reads(Box::new(move |reads, bytes| {
                set_busy(
                    &shared,
                    job,
                    indexing_line(&name, files, total, bytes, reads),
                );
            }));
            src.begin_first_reads().await?;
        } else {
            src.prefetch_first().await?;
        }
        progress(src);
        let options = shared
            .lock()
            .map(|s| s.read_options.clone())
            .unwrap_or_default();
        // The view takes the index (a million chunks are not copied): what it reads is fetched
        // before (the values the panels show, the model description's probes), so that it runs
        // once; should it still miss a range, the checkpoint is opened again with it fetched.
        for _ in 0..3 {
            let checkpoint = src
                .run(
                    |s| {
                        Checkpoint::open(s, name, &options).map_err(|e| match e {
                            CheckpointError::Index { source, .. } => format!("{name}: {source}"),
                            other => other.to_string(),
                        })
                    },
                    &mut progress,
                )
                .await?;
            // What indexing read whole (a million-chunk `.metadata` is 140 MB) is not read again.
            src.release_large(RELEASED_AFTER_INDEXING);
            src.prefetch(CheckpointView::value_ranges(&checkpoint.index))
                .await?;
            let derived = src
                .run(
                    |s| Ok::<_, String>(CheckpointView::derive_model(&checkpoint, s)),
                    &mut progress,
                )
                .await?;
            let view = src
                .run_once(|s| CheckpointView::from_checkpoint_derived(checkpoint, derived, s))
                .await?;
            if let Some(view) = view {
                return Ok(Box::new(view.map_err(|e| e.to_string())?));
            }
        }
        Err(format!(
            "{name}: reading the values to show took more than 3 rounds of reads"
        ))
    }

    /// Opens picked files as one checkpoint, read by byte range.
    async fn open_blobs(
        files: Vec<(String, web_sys::Blob)>,
        shared: Arc<Mutex<Shared>>,
        ctx: Arc<Mutex<Option<egui::Context>>>,
    ) {
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        let name = shardscope_viewer::docs::group_name(&names);
        let job = begin(
            &shared,
            format!("indexing checkpoint {name}: {} files", files.len()),
        );
        if let Ok(mut s) = shared.lock() {
            s.opens_in_flight += 1;
        }
        repaint_ctx(&ctx);
        let mut src = LazySource::new();
        let mut result = Ok(());
        for (n, b) in files {
            if let Err(e) = src.add_blob(n, b) {
                result = Err(e);
            }
        }
        let result = match result {
            Ok(()) => open_as_a(name, src, &shared, &ctx, job).await,
            Err(e) => Err(e),
        };
        finish(&shared, &ctx, job, result);
    }

    /// Indexes a lazily read checkpoint for the viewer and keeps its files as A of the next
    /// comparison.
    async fn open_as_a(
        name: String,
        mut src: LazySource,
        shared: &Arc<Mutex<Shared>>,
        ctx: &Mutex<Option<egui::Context>>,
        job: u64,
    ) -> Result<Box<CheckpointView>, String> {
        let view = index_lazily(&name, &mut src, shared, ctx, job).await?;
        if let Ok(mut s) = shared.lock() {
            s.a_side = Some(Side {
                label: name,
                source: src,
            });
        }
        Ok(view)
    }

    /// Resolves `url` against the page into an http(s) URL without query and fragment, and its
    /// query as written.
    fn resolve(url: &str) -> Result<(String, Option<String>), String> {
        let (head, query) = urls::split_query(url);
        let page = web_sys::window()
            .and_then(|w| w.location().href().ok())
            .unwrap_or_default();
        let abs = web_sys::Url::new_with_base(head, &page)
            .map_err(|_| format!("`{}` is not a URL", shown(url)))?;
        if !matches!(abs.protocol().as_str(), "http:" | "https:") {
            return Err(format!(
                "{}: only http and https URLs can be opened in the browser",
                shown(url)
            ));
        }
        abs.set_hash("");
        abs.set_search("");
        Ok((abs.href(), query.map(str::to_owned)))
    }

    /// Opens a checkpoint behind HTTP(S). One URL without a query: a DCP folder (URL ending with
    /// `/`), a safetensors file, an HF `*.safetensors.index.json` (files looked up next to it) or
    /// any one file. Otherwise (several URLs, `{r}` patterns expanded, or a URL with a query, which
    /// names one file: a signature covers one object) every URL is one file of the checkpoint,
    /// named by its file name, each read with its own query.
    async fn open_urls_lazily(
        inputs: &[String],
        ranks: &str,
        shared: &Arc<Mutex<Shared>>,
        ctx: &Mutex<Option<egui::Context>>,
        job: u64,
    ) -> Result<Box<CheckpointView>, String> {
        let (name, src) = url_sources(inputs, ranks, shared, ctx, job).await?;
        open_as_a(name, src, shared, ctx, job).await
    }

    /// The files of a checkpoint behind HTTP(S) (see [`open_urls_lazily`]) and its name.
    async fn url_sources(
        inputs: &[String],
        ranks: &str,
        shared: &Mutex<Shared>,
        ctx: &Mutex<Option<egui::Context>>,
        job: u64,
    ) -> Result<(String, LazySource), String> {
        let inputs = urls::expand_ranks(inputs, ranks)?;
        let mut resolved = Vec::new();
        for u in &inputs {
            resolved.push((u.as_str(), resolve(u)?));
        }
        match resolved.as_slice() {
            [] => Err("no URL given".to_owned()),
            [(_, (href, None))] => open_plain_url(href, shared, job).await,
            _ => open_url_files(&resolved, shared, ctx, job).await,
        }
    }

    /// Opens one URL without a query (see [`open_urls_lazily`]).
    async fn open_plain_url(
        href: &str,
        shared: &Mutex<Shared>,
        job: u64,
    ) -> Result<(String, LazySource), String> {
        let (base, file) = href
            .rsplit_once('/')
            .map(|(b, f)| (format!("{b}/"), f.to_owned()))
            .ok_or_else(|| format!("`{href}` is not a URL"))?;
        let mut src = LazySource::new();
        src.set_base_url(base);
        if file.is_empty() {
            // A DCP folder: its `.metadata` names every data file (looked up as it is read).
            src.add_url_file(".metadata").await?;
        } else if file.ends_with(".safetensors.index.json") {
            let bytes = lazy::get_small(href, MAX_HF_INDEX).await?;
            let index = shardscope_core::formats::safetensors::read_index(&bytes)
                .map_err(|e| format!("{href}: {e}"))?;
            src.add_url_file(&file).await?;
            let shards: std::collections::BTreeSet<&String> = index.weight_map.values().collect();
            for (i, shard) in shards.iter().enumerate() {
                set_busy(
                    shared,
                    job,
                    format!("opening {href}: {}/{} files", i + 1, shards.len()),
                );
                src.add_url_file(shard).await?;
            }
        } else {
            src.add_url_file(&file).await?;
        }
        Ok((href.to_owned(), src))
    }

    /// Opens URLs that each name one file (see [`open_urls_lazily`]): one server, distinct file
    /// names, each file read with its own query.
    async fn open_url_files(
        resolved: &[(&str, (String, Option<String>))],
        shared: &Mutex<Shared>,
        ctx: &Mutex<Option<egui::Context>>,
        job: u64,
    ) -> Result<(String, LazySource), String> {
        let mut src = LazySource::new();
        let mut origin: Option<String> = None;
        let mut shown_urls = Vec::new();
        for (i, (input, (href, query))) in resolved.iter().enumerate() {
            let shown_input = shown(input);
            let file = href.rsplit_once('/').map_or("", |(_, f)| f);
            if file.is_empty() {
                return Err(if query.is_some() {
                    format!(
                        "{shown_input}: a URL with a query (a presigned URL, an Azure SAS) names \
                         one file, not a folder: a signature covers one object; give the URL of \
                         each file (`.metadata` and every `.distcp`, each per-rank `.pt`), each \
                         with its own query"
                    )
                } else {
                    format!(
                        "{shown_input}: a folder URL opens on its own; with several URLs, each \
                         names one file"
                    )
                });
            }
            let this_origin = web_sys::Url::new(href)
                .map(|u| u.origin())
                .unwrap_or_default();
            match &origin {
                None => origin = Some(this_origin),
                Some(o) if *o != this_origin => {
                    return Err(format!(
                        "{shown_input}: the URLs of one checkpoint must be on one server ({o})"
                    ));
                }
                Some(_) => {}
            }
            let name = js_sys::decode_uri_component(file)
                .ok()
                .and_then(|n| n.as_string())
                .unwrap_or_else(|| file.to_owned());
            if src.names().contains(&name) {
                return Err(format!(
                    "{shown_input}: two URLs name the file `{name}` (files are told apart by name)"
                ));
            }
            set_busy(
                shared,
                job,
                format!("opening {shown_input}: {}/{} files", i + 1, resolved.len()),
            );
            repaint_ctx(ctx);
            let url = match query {
                Some(q) => format!("{href}?{q}"),
                None => href.clone(),
            };
            shown_urls.push(shown(&url));
            src.add_url(name, url).await?;
        }
        let names: Vec<&str> = shown_urls.iter().map(String::as_str).collect();
        Ok((shardscope_viewer::docs::group_name(&names), src))
    }

    fn s_compare_running(shared: &Mutex<Shared>) -> bool {
        shared.lock().is_ok_and(|s| s.comparing)
    }

    /// Runs a comparison, after the running one (which is cancelled) if any.
    fn request_compare(
        shared: &Arc<Mutex<Shared>>,
        ctx: &Arc<Mutex<Option<egui::Context>>>,
        request: CompareRequest,
    ) {
        let Ok(mut s) = shared.lock() else { return };
        s.show_compare = true;
        s.error = None;
        if s.comparing {
            s.queued = Some(request);
            s.compare_cancel.store(true, Ordering::Relaxed);
            return;
        }
        s.comparing = true;
        s.compare_progress = Some(Progress {
            what: "comparing".to_owned(),
            ..Progress::default()
        });
        drop(s);
        wasm_bindgen_futures::spawn_local(compare_loop(shared.clone(), ctx.clone(), request));
        repaint_ctx(ctx);
    }

    /// Waits `ms` milliseconds.
    async fn sleep(ms: i32) {
        let promise = js_sys::Promise::new(&mut |resolve, _| {
            if let Some(w) = web_sys::window() {
                let _ = w.set_timeout_with_callback_and_timeout_and_arguments_0(&resolve, ms);
            }
        });
        let _ = wasm_bindgen_futures::JsFuture::from(promise).await;
    }

    /// Runs comparisons until none is queued: A is the checkpoint opened last (waited for while
    /// it opens), B the request's or the last comparison's.
    async fn compare_loop(
        shared: Arc<Mutex<Shared>>,
        ctx: Arc<Mutex<Option<egui::Context>>>,
        mut request: CompareRequest,
    ) {
        loop {
            let result = compare_once(&shared, &ctx, &mut request).await;
            let Ok(mut s) = shared.lock() else { return };
            if let Err(e) = &result
                && *e != CompareError::Cancelled
            {
                s.error = Some(urls::hide_queries(&format!("compare: {e}")));
            }
            s.compared.push(result);
            if let Some(next) = s.queued.take() {
                request = next;
            } else {
                s.comparing = false;
                s.compare_progress = None;
                drop(s);
                repaint_ctx(&ctx);
                return;
            }
        }
    }

    async fn compare_once(
        shared: &Mutex<Shared>,
        ctx: &Mutex<Option<egui::Context>>,
        request: &mut CompareRequest,
    ) -> Result<Comparison, CompareError> {
        let fail = |side, message: String| CompareError::Open {
            side,
            source: shardscope_viewer::checkpoint::CheckpointError::Open { message },
        };
        let (cancel, options) = {
            let Ok(s) = shared.lock() else {
                return Err(CompareError::Cancelled);
            };
            s.compare_cancel.store(false, Ordering::Relaxed);
            (s.compare_cancel.clone(), s.read_options.clone())
        };
        // Shown by the next periodic frame (see `WebApp::ui`).
        let mut progress = |p: Progress| {
            if let Ok(mut s) = shared.lock() {
                s.compare_progress = Some(p);
            }
        };
        // B first (A may still be opening).
        let b = match request.b.take() {
            Some(BSource::Files(side)) => Some(side),
            Some(BSource::Urls(inputs, ranks)) => {
                progress(Progress {
                    what: format!(
                        "opening B: {}",
                        inputs
                            .iter()
                            .map(|u| shown(u))
                            .collect::<Vec<_>>()
                            .join(" ")
                    ),
                    ..Progress::default()
                });
                let opened = url_sources(&inputs, &ranks, shared, ctx, 0).await;
                if let Ok(mut s) = shared.lock() {
                    s.busy.remove(&0);
                }
                let (label, source) = opened.map_err(|e| fail("B", e))?;
                Some(Side { label, source })
            }
            None => shared.lock().ok().and_then(|mut s| s.b_side.take()),
        };
        let mut b = b.ok_or_else(|| fail("B", "no checkpoint to compare with".to_owned()))?;
        let mut a = loop {
            let (a, opening) = match shared.lock() {
                Ok(mut s) => (s.a_side.take(), s.opens_in_flight > 0),
                Err(_) => (None, false),
            };
            match a {
                Some(a) => break a,
                None if opening && !cancel.load(Ordering::Relaxed) => sleep(100).await,
                None => {
                    if let Ok(mut s) = shared.lock() {
                        s.b_side = Some(b);
                    }
                    return Err(fail(
                        "A",
                        "open a checkpoint first, from files or URLs (a .zip opened whole is not \
                         compared in the browser): it is A of the comparison"
                            .to_owned(),
                    ));
                }
            }
        };
        let tolerance = request.tolerance;
        let result =
            crate::compare::compare(&mut a, &mut b, &options, tolerance, &mut progress, &cancel)
                .await;
        if let Ok(mut s) = shared.lock() {
            // A checkpoint opened meanwhile is the next A.
            if s.a_side.is_none() {
                s.a_side = Some(a);
            }
            s.b_side = Some(b);
        }
        result
    }

    /// The handle the page holds.
    #[wasm_bindgen]
    pub struct WebHandle {
        runner: eframe::WebRunner,
        inbox: shardscope_viewer::app::Inbox,
        shared: Arc<Mutex<Shared>>,
        ctx: Arc<Mutex<Option<egui::Context>>>,
        /// Files added with `add_file` or `add_blob`, handed over together by `finish_batch`.
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
            // Checks against a content manifest run here (`manifest`), over the lazily read files.
            viewer.manifest_job.external.enabled = true;
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
                        Ok(Box::new(WebApp {
                            viewer,
                            shared,
                            ctx: ctx_slot,
                            seen_messages: 0,
                        }))
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

        /// Adds a file's bytes to the current batch; nothing is opened before `finish_batch`.
        pub fn add_file(&self, name: String, bytes: Vec<u8>) {
            if let Ok(mut b) = self.batch.lock() {
                b.push(BatchFile::Bytes(name, Ok(bytes)));
            }
        }

        /// Fetched ranges longer than `bytes` stay in the JS arrays the browser read them into,
        /// copied into wasm as they are read (default 16 MiB: a large `.metadata`); the browser
        /// test sets 0 to read every range of a checkpoint that way.
        pub fn set_held_in_js_over(&self, bytes: u32) {
            lazy::set_held_in_js_over(u64::from(bytes));
        }

        /// Allows (the default) or forbids reading picked files during a step where the browser
        /// can suspend wasm (JSPI) instead of between rounds; the browser test opens its
        /// checkpoints both ways.
        pub fn set_suspending_reads(&self, on: bool) {
            crate::jspi::set_enabled(on);
        }

        /// Whether steps read with suspending reads in this browser (JSPI).
        pub fn suspending_reads(&self) -> bool {
            crate::jspi::available()
        }

        /// Suspending reads done since the page loaded.
        pub fn suspending_reads_done(&self) -> f64 {
            crate::jspi::reads_done() as f64
        }

        /// Adds a picked `File` (any `Blob`) to the current batch. Checkpoint files are read by
        /// byte range when opened (only their metadata), so files of any size open; JSON
        /// documents and zips are read whole.
        pub fn add_blob(&self, name: String, blob: web_sys::Blob) {
            if let Ok(mut b) = self.batch.lock() {
                b.push(BatchFile::Blob(name, blob));
            }
        }

        /// Opens a checkpoint behind HTTP(S), read with `Range` requests: a DCP folder (URL
        /// ending with `/`; its `.metadata` names the data files), a `.safetensors` file, an
        /// HF `model.safetensors.index.json`, or one file by a URL with a query (a presigned
        /// URL, an Azure SAS: sent with every request, shown as `?…`).
        pub fn open_url(&self, url: String) {
            self.open_urls(vec![url], String::new());
        }

        /// Opens several URLs as one checkpoint, as picked files are (per-rank `.pt` files, a
        /// DCP's `.metadata` and every `.distcp`), each URL with its own query; `{r}` in a URL
        /// stands for the rank, 0 to `ranks` - 1 (`ranks` empty: no pattern). One URL without a
        /// query opens as `open_url` describes.
        pub fn open_urls(&self, urls: Vec<String>, ranks: String) {
            let shared = self.shared.clone();
            let ctx = self.ctx.clone();
            let what = match urls.as_slice() {
                [one] => shown(one),
                _ => format!("{} URLs", urls.len()),
            };
            let job = begin(&shared, format!("opening {what}"));
            if let Ok(mut s) = shared.lock() {
                s.opens_in_flight += 1;
            }
            self.repaint();
            wasm_bindgen_futures::spawn_local(async move {
                let result = open_urls_lazily(&urls, &ranks, &shared, &ctx, job).await;
                finish(&shared, &ctx, job, result);
            });
        }

        /// `[[key, dtype, shape], ...]` (JSON) of the last checkpoint opened by URL or from
        /// picked files (`null` where an entry has no dtype or shape), for tests.
        pub fn checkpoint_keys(&self) -> String {
            self.shared
                .lock()
                .map(|s| s.last_keys.clone())
                .unwrap_or_default()
        }

        /// Compares the checkpoint opened last (A) with the picked files added since the last
        /// batch (`add_blob`; B, one checkpoint, read lazily as A is), as `shardscope diff A B`
        /// with the Compare tab's tolerance; the result shows in the Compare tab.
        pub fn finish_compare_batch(&self) {
            let files = self
                .batch
                .lock()
                .map(|mut b| std::mem::take(&mut *b))
                .unwrap_or_default();
            let mut source = LazySource::new();
            let mut names = Vec::new();
            for f in files {
                let added = match f {
                    BatchFile::Blob(name, blob) => {
                        names.push(name.clone());
                        source.add_blob(name, blob)
                    }
                    BatchFile::Bytes(name, bytes) => bytes.map(|bytes| {
                        let size = bytes.len() as u64;
                        let blob = js_sys::Uint8Array::from(bytes.as_slice());
                        let parts = js_sys::Array::of1(&blob);
                        names.push(name.clone());
                        match web_sys::Blob::new_with_u8_array_sequence(&parts) {
                            Ok(b) => source.add(name, lazy::Origin::Blob(b), size),
                            Err(_) => log::error!("{name}: cannot make a Blob"),
                        }
                    }),
                };
                if let Err(e) = added
                    && let Ok(mut s) = self.shared.lock()
                {
                    s.error = Some(e);
                    return;
                }
            }
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let label = shardscope_viewer::docs::group_name(&refs);
            let tolerance = self.shared.lock().ok().and_then(|s| s.tolerance);
            request_compare(
                &self.shared,
                &self.ctx,
                CompareRequest {
                    b: Some(BSource::Files(Side { label, source })),
                    tolerance,
                },
            );
        }

        /// Compares the checkpoint opened last (A) with the checkpoint behind `urls` (B, as
        /// `open_urls` takes them), as `shardscope diff A B`; waits for A while it opens.
        pub fn compare_urls(&self, urls: Vec<String>, ranks: String) {
            let tolerance = self.shared.lock().ok().and_then(|s| s.tolerance);
            request_compare(
                &self.shared,
                &self.ctx,
                CompareRequest {
                    b: Some(BSource::Urls(urls, ranks)),
                    tolerance,
                },
            );
        }

        /// Sets the Compare tab's tolerance controls (`on` false: bitwise; else `rtol`, `atol`
        /// and `equal_nan` as `diff --rtol --atol --equal-nan`) and compares again, as typing
        /// them into the tab does.
        pub fn set_compare_tolerance(&self, on: bool, rtol: String, atol: String, equal_nan: bool) {
            if let Ok(mut s) = self.shared.lock() {
                s.tolerance_request = Some(shardscope_viewer::compare::ToleranceInput {
                    on,
                    rtol,
                    atol,
                    equal_nan,
                });
            }
            self.repaint();
        }

        /// `shardscope diff --json` of the comparison shown (empty before the first), queries
        /// hidden, for tests.
        pub fn comparison_json(&self) -> String {
            self.shared
                .lock()
                .map(|s| s.comparison_json.clone())
                .unwrap_or_default()
        }

        /// `shardscope verify --manifest --json` of the last check of the opened checkpoint against
        /// an opened content manifest (empty before the first), queries hidden, for tests.
        pub fn manifest_report_json(&self) -> String {
            self.shared
                .lock()
                .map(|s| s.checks.report_json().to_owned())
                .unwrap_or_default()
        }

        /// Files added so far and not yet handed over.
        pub fn batch_len(&self) -> usize {
            self.batch.lock().map(|b| b.len()).unwrap_or_default()
        }

        /// Hands every file added since the last batch to the viewer at once: the checkpoint
        /// files among them form one checkpoint (per-rank files, a DCP folder), the other inputs
        /// (models, traces, reports) open on their own. The viewer announces the work in the
        /// status line while it reads and indexes. Picked checkpoint files (`add_blob`) are
        /// indexed in the background from byte ranges; the rest goes to the viewer's loader.
        pub fn finish_batch(&self) {
            let files = self
                .batch
                .lock()
                .map(|mut b| std::mem::take(&mut *b))
                .unwrap_or_default();
            if let Ok(mut s) = self.shared.lock() {
                s.error = None;
            }
            let mut ready = Vec::new();
            let mut whole = Vec::new();
            let mut lazy_files = Vec::new();
            for f in files {
                match f {
                    BatchFile::Bytes(name, bytes) => ready.push((name, bytes)),
                    BatchFile::Blob(name, blob) if reads_lazily(&name, blob.size()) => {
                        lazy_files.push((name, blob));
                    }
                    BatchFile::Blob(name, blob) => whole.push((name, blob)),
                }
            }
            if whole.is_empty() {
                if let Ok(mut q) = self.inbox.lock() {
                    q.extend(ready);
                }
            } else {
                let inbox = self.inbox.clone();
                let shared = self.shared.clone();
                let ctx = self.ctx.clone();
                let job = begin(&shared, format!("reading {} files", whole.len()));
                wasm_bindgen_futures::spawn_local(async move {
                    for (name, blob) in whole {
                        let bytes = lazy::read_whole(&name, &blob, MAX_WHOLE).await;
                        ready.push((name, bytes));
                    }
                    if let Ok(mut q) = inbox.lock() {
                        q.extend(ready);
                    }
                    if let Ok(mut s) = shared.lock() {
                        s.busy.remove(&job);
                    }
                    repaint_ctx(&ctx);
                });
            }
            if !lazy_files.is_empty() {
                wasm_bindgen_futures::spawn_local(open_blobs(
                    lazy_files,
                    self.shared.clone(),
                    self.ctx.clone(),
                ));
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
            // Composed now: what the jobs do is current even before the next frame.
            self.shared
                .lock()
                .map(|s| compose_status(&s))
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
            repaint_ctx(&self.ctx);
        }
    }
}

#[cfg(target_arch = "wasm32")]
pub use handle::WebHandle;
