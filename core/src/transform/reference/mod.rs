//! The in-memory reference transforms: whole state dicts (every rank's, as [`crate::model::tree`]
//! values) converted between FSDP's shapes exactly as PyTorch's collectives would. Nothing in the
//! tools calls them; the integration tests (`tests/`, `native-runner/tests/`) compare the streaming
//! executor's outputs (`shardscope convert` / `reshard`, read through `core::view`) against them,
//! and against what PyTorch itself wrote.
//!
//! - [`chunk`]: dim-0 `torch.chunk` sharding (ShardedTensor and DTensor conventions) and its inverse.
//! - [`flat_shards`]: full parameters ⇄ FSDP1 flat-parameter shards, one at a time.
//! - [`model_state`]: whole model state dicts (FULL / LOCAL / SHARDED, FSDP2 DTensors).
//! - [`optim_state`]: optimizer state dicts from local or sharded to full, and id ⇄ FQN rekeying.
//! - [`fsdp2_optim`]: FSDP2 per-rank model and raw optimizer state dicts (DTensors, integer ids)
//!   to the full FQN-keyed ones DSD returns with `full_state_dict=True`.
//! - [`reshard`]: FSDP1 LOCAL model state and raw optimizer state from one layout (world size,
//!   wrapping, `use_orig_params`) to another.

pub mod chunk;
pub mod flat_shards;
pub mod fsdp2_optim;
pub mod model_state;
pub mod optim_state;
pub mod reshard;
