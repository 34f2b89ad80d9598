//! Live layout controls: API, world size, shard-group size, `use_orig_params`, strategy, compute
//! dtype. Any change yields a new [`LayoutConfig`]; the app recomputes the layout at once.

use egui::Ui;
use shardscope_core::DType;
use shardscope_core::layout::{Api, LayoutConfig, Strategy};

/// The controls' values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Controls {
    pub api: Api,
    pub world_size: u64,
    /// Ranks per shard group; used by hybrid strategies only.
    pub shard_group_size: u64,
    pub use_orig_params: bool,
    pub strategy: Strategy,
    /// `None`: the parameters' own dtype.
    pub param_dtype: Option<DType>,
    /// Where the values came from; shown next to them.
    pub origins: Origins,
}

/// Where a control's value came from: `None` is the default; a checkpoint's statement
/// (`from the checkpoint: …`) or `set by hand` otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Origins {
    pub api: Option<String>,
    pub world_size: Option<String>,
    pub shard_group: Option<String>,
}

/// One line, cut to the panel's width (the whole statement on hover): a checkpoint's statement is
/// a sentence, which would otherwise widen the side panel over the whole window.
fn show_origin(ui: &mut Ui, origin: Option<&String>) {
    let text = origin.map_or("default", String::as_str);
    ui.add(egui::Label::new(egui::RichText::new(text).weak()).truncate())
        .on_hover_text(text);
}

impl Default for Controls {
    fn default() -> Self {
        Self {
            api: Api::Fsdp1,
            world_size: 4,
            shard_group_size: 2,
            use_orig_params: true,
            strategy: Strategy::FullShard,
            param_dtype: None,
            origins: Origins::default(),
        }
    }
}

const FSDP1_STRATEGIES: [Strategy; 5] = [
    Strategy::FullShard,
    Strategy::ShardGradOp,
    Strategy::NoShard,
    Strategy::HybridShard,
    Strategy::HybridShardZero2,
];
const FSDP2_STRATEGIES: [Strategy; 3] = [
    Strategy::FullShard,
    Strategy::ShardGradOp,
    Strategy::HybridShard,
];
const DTYPES: [DType; 4] = [
    DType::Float32,
    DType::BFloat16,
    DType::Float16,
    DType::Float64,
];

impl Controls {
    /// Takes the world size, API and HSDP shard group from what a checkpoint states (see
    /// [`shardscope_core::view::hints`]) and records where each came from. Values the checkpoint
    /// does not state, and values set by hand or on the command line, keep their setting.
    pub fn apply_hints(&mut self, hints: &shardscope_core::view::hints::LayoutHints) {
        let from = |why: &str| Some(format!("from the checkpoint: {why}"));
        let open = |origin: &Option<String>| {
            origin
                .as_deref()
                .is_none_or(|o| o.starts_with("from the checkpoint"))
        };
        if let Some(h) = hints.api.as_ref().filter(|_| open(&self.origins.api)) {
            self.api = h.value;
            self.origins.api = from(&h.why);
        }
        if let Some(h) = hints
            .world_size
            .as_ref()
            .filter(|_| open(&self.origins.world_size))
        {
            self.world_size = h.value.max(1);
            self.origins.world_size = from(&h.why);
        }
        if !open(&self.origins.shard_group) {
            // Set by hand or on the command line: kept.
        } else if let Some(h) = &hints.shard_group_size {
            self.strategy = Strategy::HybridShard;
            self.shard_group_size = h.value.clamp(1, self.world_size);
            self.origins.shard_group = from(&h.why);
        } else if hints.world_size.is_some() {
            if self.strategy.is_hybrid() {
                self.strategy = Strategy::FullShard;
            }
            self.origins.shard_group = from("no HSDP mesh: the whole world is one shard group");
        }
        if self.api == Api::Fsdp2 && !FSDP2_STRATEGIES.contains(&self.strategy) {
            self.strategy = Strategy::FullShard;
        }
    }

    /// Ranks per shard group as the layout uses it: the world unless the strategy is hybrid.
    pub fn effective_shard_group_size(&self) -> u64 {
        if self.strategy.is_hybrid() {
            self.shard_group_size
        } else {
            self.world_size
        }
    }

    /// The layout configuration these controls describe.
    pub fn config(&self) -> LayoutConfig {
        LayoutConfig {
            api: self.api,
            world_size: self.world_size,
            shard_group_size: self.strategy.is_hybrid().then_some(self.shard_group_size),
            use_orig_params: self.use_orig_params,
            strategy: self.strategy,
            param_dtype: self.param_dtype,
        }
    }

    fn strategy_label(&self, s: Strategy) -> &'static str {
        match (self.api, s) {
            (Api::Fsdp2, Strategy::HybridShard) => "HSDP (replicate x shard)",
            (Api::Fsdp2, Strategy::ShardGradOp) => "shard_grad_op (reshard_after_forward=False)",
            (Api::Fsdp2, Strategy::FullShard) => "full_shard",
            _ => s.name(),
        }
    }

    /// Draws the controls; returns true when a value changed.
    pub fn ui(&mut self, ui: &mut Ui) -> bool {
        let before = self.clone();
        egui::Grid::new("layout_controls")
            .num_columns(2)
            .spacing([8.0, 6.0])
            .show(ui, |ui| {
                ui.label("API");
                ui.horizontal(|ui| {
                    ui.selectable_value(&mut self.api, Api::Fsdp1, "FSDP1");
                    ui.selectable_value(&mut self.api, Api::Fsdp2, "FSDP2");
                    show_origin(ui, self.origins.api.as_ref());
                });
                ui.end_row();

                let label = ui.label("World size");
                ui.horizontal(|ui| {
                    ui.add(
                        egui::DragValue::new(&mut self.world_size)
                            .range(1..=65_536)
                            .speed(0.1),
                    )
                    .labelled_by(label.id);
                    show_origin(ui, self.origins.world_size.as_ref());
                });
                ui.end_row();

                let label = ui.label("Strategy");
                let strategies: &[Strategy] = match self.api {
                    Api::Fsdp1 => &FSDP1_STRATEGIES,
                    Api::Fsdp2 => &FSDP2_STRATEGIES,
                };
                egui::ComboBox::from_id_salt("strategy")
                    .selected_text(self.strategy_label(self.strategy))
                    .show_ui(ui, |ui| {
                        for &s in strategies {
                            let label = self.strategy_label(s);
                            ui.selectable_value(&mut self.strategy, s, label);
                        }
                    })
                    .response
                    .labelled_by(label.id);
                ui.end_row();

                let label = ui.label("Shard group");
                ui.horizontal(|ui| {
                    if self.strategy.is_hybrid() {
                        ui.add(
                            egui::DragValue::new(&mut self.shard_group_size)
                                .range(1..=self.world_size.max(1))
                                .speed(0.1)
                                .suffix(" ranks"),
                        )
                        .labelled_by(label.id);
                    } else {
                        // What the layout uses: the whole world (the hybrid value is kept aside).
                        ui.label(format!("{} ranks (the world)", self.world_size))
                            .labelled_by(label.id)
                            .on_hover_text(
                                "Only hybrid strategies shard over groups smaller than the world",
                            );
                    }
                    show_origin(ui, self.origins.shard_group.as_ref());
                });
                ui.end_row();

                let label = ui.label("use_orig_params");
                ui.add_enabled(
                    self.api == Api::Fsdp1,
                    egui::Checkbox::without_text(&mut self.use_orig_params),
                )
                .labelled_by(label.id)
                .on_hover_text("FSDP1: pad every parameter to 16 bytes of the compute dtype");
                ui.end_row();

                let label = ui.label("Compute dtype");
                egui::ComboBox::from_id_salt("param_dtype")
                    .selected_text(self.param_dtype.map_or("same as params", DType::name))
                    .show_ui(ui, |ui| {
                        ui.selectable_value(&mut self.param_dtype, None, "same as params");
                        for d in DTYPES {
                            ui.selectable_value(&mut self.param_dtype, Some(d), d.name());
                        }
                    })
                    .response
                    .labelled_by(label.id);
                ui.end_row();
            });
        // Keep the values coherent: FSDP2 has no no_shard; a group never exceeds the world.
        if self.api == Api::Fsdp2 && !FSDP2_STRATEGIES.contains(&self.strategy) {
            self.strategy = Strategy::FullShard;
        }
        self.shard_group_size = self.shard_group_size.clamp(1, self.world_size.max(1));
        let by_hand = Some("set by hand".to_owned());
        if self.api != before.api {
            self.origins.api.clone_from(&by_hand);
        }
        if self.world_size != before.world_size {
            self.origins.world_size.clone_from(&by_hand);
        }
        if self.shard_group_size != before.shard_group_size
            || self.strategy.is_hybrid() != before.strategy.is_hybrid()
        {
            self.origins.shard_group = by_hand;
        }
        *self != before
    }
}
