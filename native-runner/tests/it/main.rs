//! The integration tests of the runner and of the `shardscope` binary: one test binary (one link,
//! one process start), a module per area, as uv does (`crates/uv/tests/it/main.rs`).
//!
//! Every test that runs the `shardscope` binary lives here, in the package that owns the binary:
//! only there does Cargo build the binary before the tests and pass its path in
//! `CARGO_BIN_EXE_shardscope` (see [`common::shardscope_bin`]), so no test runs a nested
//! `cargo build` and none can run a stale binary. Fixture paths and the torch helpers come from the
//! `shardscope-tests` crate (a dev-dependency).

/// Helpers shared by the modules: the binary, torch.
mod common;

mod cli_layout;
mod cli_vocab;
mod conversion_hashes;
mod convert_atomic;
mod convert_fsdp2_optim;
mod convert_interop;
mod convert_parallel;
mod deepspeed;
mod deepspeed_checks;
mod deepspeed_universal;
mod diff_verify;
mod docs;
mod doctor;
mod dtypes;
mod export_interop;
mod formats_read;
mod front_ends;
mod fsdp1_view;
mod fsdp2_order_ties;
mod fsdp2_view;
mod gather_ckpt;
mod gather_cli;
mod gather_fixtures;
mod gather_roundtrip;
mod hash_manifest;
mod hf_mapping;
mod hsdp_replicas;
mod interop_ranks;
mod layout_fixtures;
mod layout_from;
mod local_faults;
mod rank_names;
mod remote;
mod remote_faults;
mod remote_tls;
mod remote_urls;
mod reshard_cli;
mod reshard_fsdp2;
mod select_sides;
mod trainer_sets;
