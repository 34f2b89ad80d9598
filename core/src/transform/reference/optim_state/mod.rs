//! Optimizer state dicts from the per-rank shapes to the full one, in memory, the way FSDP1's
//! `_optim_utils.py` converts them with collectives (spec 3.3, 3.4, 3.6, 3.9).
//!
//! - [`from_local`]: [`full_optim_from_local`], `FSDP.optim_state_dict` (FULL, or SHARDED with
//!   positive-dim states chunked on dim 0) from every rank's raw `optim.state_dict()`;
//! - [`gather`]: [`full_from_sharded_tree`], ShardedTensors/DTensors replaced by full tensors;
//! - [`rekey`]: [`rekey_ids_to_fqns`] and [`rekey_fqns_to_ids`].
//!
//! Key order follows PyTorch: with `use_orig_params=False` the full state follows rank 0's ids;
//! with `True` non-FSDP keys come first, then FSDP keys sorted per flat parameter.

pub mod from_local;
pub mod gather;
pub mod rekey;

pub use from_local::full_optim_from_local;
pub use gather::full_from_sharded_tree;
pub use rekey::{rekey_fqns_to_ids, rekey_ids_to_fqns};
