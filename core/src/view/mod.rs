//! Views: a per-rank checkpoint index re-keyed through a layout, without touching bytes, and what a
//! checkpoint says about the layout that wrote it.
//!
//! - [`fsdp1`]: FSDP1 per-rank folders (flat parameters, raw optimizer ids) as original parameters.
//! - [`fsdp2`]: FSDP2 per-rank folders with the raw optimizer's ids named by FQN.
//! - [`hints`]: the FSDP configuration a checkpoint states (world size, API, shard group).
//! - [`overlay`]: stored per-rank chunks laid over a computed layout, differences named.

pub mod fsdp1;
pub mod fsdp2;
pub mod hints;
pub mod overlay;
