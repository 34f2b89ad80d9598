//! What opening a checkpoint or a content manifest does to the viewer's state (the other inputs
//! are applied in `app`): the checkpoint's panels, its own layout or none, the overlay, and the
//! check of the checkpoint against an opened manifest (`manifest_check`).

use crate::Tab;
use crate::app::{DerivedUnits, LoadedModel, Viewer};
use crate::compare::{CompareError, CompareInput};
use crate::manifest_check::{ExternalRequest, OpenedManifest};

impl Viewer {
    /// Applies an opened checkpoint: its panels, its own layout (or none, said why), the overlay,
    /// and the check against an opened manifest.
    pub(crate) fn open_checkpoint(&mut self, mut ckpt: Box<crate::checkpoint::CheckpointView>) {
        self.generation += 1;
        ckpt.generation = self.generation;
        self.messages.push(format!(
            "opened checkpoint {}: {}",
            ckpt.name,
            ckpt.summary()
        ));
        self.ckpt = crate::panels::checkpoint::CheckpointState::default();
        self.values = None;
        // The layout panel follows what was opened: the checkpoint's own configuration.
        self.controls.apply_hints(&ckpt.hints);
        for note in &ckpt.notes {
            self.messages.push(format!("note: {note}"));
        }
        // The shard map of what was opened, from the checkpoint alone, unless a model
        // description was opened by hand.
        let replaceable = self
            .model
            .as_ref()
            .is_none_or(|m| m.derived.is_some() || m.example);
        if replaceable && ckpt.derived.is_none() && self.model.take().is_some() {
            // Never the example's (or another checkpoint's) layout over this one.
            self.messages.push(format!(
                "no layout for {}: it could not be derived from the checkpoint alone (see \
                 the note above); open the model's description JSON (Python: `shardscope.describe(model)`) \
                 to draw its shard map",
                ckpt.name
            ));
        }
        if replaceable && let Some(d) = &ckpt.derived {
            self.messages.push(format!(
                "layout derived from {}: {}",
                ckpt.name,
                d.notes.join("; ")
            ));
            self.model = Some(LoadedModel {
                name: format!("derived from {}", ckpt.name),
                model: d.model.clone(),
                derived: Some(DerivedUnits {
                    patterns: d.unit_patterns.clone(),
                    root: true,
                }),
                example: false,
            });
            self.applied_config = None;
        }
        self.checkpoint = Some(*ckpt);
        self.check_against_manifest();
        // Always recompute: the overlay of the new checkpoint needs the layout.
        self.applied_config = None;
        self.recompute();
        if !self.stay_on_tab {
            self.tab = Tab::Checkpoint;
        }
    }

    /// The shard map of an opened DeepSpeed ZeRO checkpoint is its flat partitions as saved
    /// (unless a model description was opened by hand): true when that view was set.
    pub(crate) fn show_stored_partitions(&mut self) -> bool {
        let by_hand = self
            .model
            .as_ref()
            .is_some_and(|m| m.derived.is_none() && !m.example);
        let Some(p) = self.checkpoint.as_ref().and_then(|c| c.partitions.as_ref()) else {
            return false;
        };
        if by_hand {
            return false;
        }
        self.generation += 1;
        let mut view = crate::view::LayoutView::from_deepspeed(p);
        view.generation = self.generation;
        self.view = Some(view);
        self.layout_error = None;
        self.refresh_hf_names();
        true
    }

    /// Keeps `m` and checks the opened checkpoint against it (when one is open).
    pub(crate) fn open_manifest(&mut self, m: OpenedManifest) {
        self.messages.push(format!(
            "opened content manifest {} ({} tensors, {} values, {}): the opened checkpoint is checked against it",
            m.name,
            m.manifest.tensors.len(),
            m.manifest.values.len(),
            m.manifest.algorithm.name()
        ));
        self.manifest = Some(m);
        self.check_against_manifest();
    }

    /// Starts the check of the opened checkpoint against the opened manifest, when both are there.
    pub(crate) fn check_against_manifest(&mut self) {
        let (Some(m), Some(c)) = (&self.manifest, &self.checkpoint) else {
            return;
        };
        let Some(origin) = c.origin.clone() else {
            if self.manifest_job.external.enabled {
                // The front end reads the checkpoint's files itself (the browser).
                self.messages.push(format!(
                    "checking {} against {}: every tensor and value is read and hashed",
                    c.name, m.name
                ));
                self.manifest_job.external.request = Some(ExternalRequest {
                    checkpoint: c.name.clone(),
                    manifest: m.clone(),
                });
            } else {
                self.messages.push(format!(
                    "note: {}: checking against a manifest reads every tensor; this viewer reads \
                     only a checkpoint's metadata here (the desktop viewer and `shardscope verify \
                     --manifest` check it)",
                    c.name
                ));
            }
            return;
        };
        let input = CompareInput {
            label: c.name.clone(),
            origin,
        };
        self.manifest_job.synchronous = self.loader.synchronous;
        self.manifest_job
            .start(input, self.loader.read_options.clone(), m.clone());
        self.poll_manifest_job();
    }

    /// Takes a finished check (shown in the Verify tab); true while one runs.
    pub fn poll_manifest_job(&mut self) -> bool {
        if let Some(result) = self.manifest_job.poll() {
            self.take_manifest_check(result);
        }
        self.manifest_job.running()
    }

    /// Shows a finished check (the worker's, or the front end's: [`ExternalRequest`]) in the
    /// Verify tab, or its error in the messages.
    pub fn take_manifest_check(&mut self, result: Result<crate::report::Report, CompareError>) {
        match result {
            Ok(report) => {
                self.messages
                    .push(format!("checked {}: {}", report.name, report.summary()));
                self.verify.only_problems = report.entries.iter().any(|e| e.status.is_problem());
                self.report = Some(report);
                if !self.stay_on_tab {
                    self.tab = Tab::Verify;
                }
            }
            Err(e) if e != CompareError::Cancelled => {
                self.messages.push(format!("error: manifest check: {e}"));
            }
            Err(_) => {}
        }
    }
}
