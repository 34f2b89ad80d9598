//! The viewer's integration tests: one test binary (one link, one process start), a module per
//! area, as uv does (`crates/uv/tests/it/main.rs`).

mod checkpoints;
mod compare;
mod compare_tolerance;
mod deepspeed_map;
mod derived_layout;
mod doctor;
mod follows;
mod front_ends;
mod hf_names;
mod manifest_check;
mod map_marks;
mod open_reads;
mod overlay;
mod panels;
mod torch_layouts;
mod trainer_layouts;
