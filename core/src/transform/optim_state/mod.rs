//! Optimizer state dicts as FSDP1 writes them on each rank, built from the full (FQN-keyed) one
//! the way FSDP1's `_optim_utils.py` does with collectives (spec 3.3, 3.4, 3.6, 3.9).
//!
//! - local: what `optim.state_dict()` returns on one rank (integer ids over the wrapped model's
//!   parameters: FlatParameters, or original parameters with 1-D `numel_in_shard` pieces);
//! - full: `FSDP.optim_state_dict` under FULL_STATE_DICT (FQN keys, original shapes).
//!
//! Optimizer ids are positions in the optimizer's parameter list; callers give that list as the
//! wrapped model's parameter names per rank (`Fsdp1Model::wrapped_params` gives the default order,
//! `model.parameters()`).
//!
//! Inside a FlatParameter's flattened local state the state-name order of PyTorch depends on
//! Python's set order (random per process); here it follows the first parameter's dict.
//!
//! - [`to_local`]: [`local_optim_from_full`], a rank's raw state dict (structure-only tensors
//!   allowed, so the runner can write the bytes later);
//! - [`runs`]: [`local_state_runs`], which elements of which full parameter each piece holds;
//! - [`parts`]: where the parts of an optimizer state dict are.
//!
//! The other directions (local → full, sharded → full, id ⇄ FQN rekeying) are in-memory reference
//! implementations: [`crate::transform::reference::optim_state`].

pub(crate) mod parts;
pub mod runs;
pub mod to_local;

pub use runs::{StateRun, local_state_runs};
pub use to_local::local_optim_from_full;
