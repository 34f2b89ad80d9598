//! State-dict and optimizer-state transforms for FSDP checkpoints, computed offline (spec section
//! 3.9): every collective of PyTorch's FSDP code has a closed form once all ranks' data and the
//! layout are known.
//!
//! What the tools use (streaming writers build structure here and read the bytes themselves):
//!
//! - [`model_state`]: FSDP1 flat parameters as a LOCAL state dict stores them (padding fill,
//!   stored lengths, the `_flat_param` ShardedTensor entry).
//! - [`mapping`]: name mappings between model families (torchtitan, Megatron-core → Hugging Face
//!   and back) as data files, planned into renames and tensor operations.
//! - [`optim_state`]: a rank's raw optimizer state dict from the full one, and the element runs
//!   its tensors are made of.
//!
//! [`reference`] holds the in-memory transforms the integration tests compare the streaming
//! executor against (FSDP1 flat shards, whole model and optimizer state dicts, FSDP2 gathers,
//! resharding). Everything here is a pure function over [`crate::model::tree`] values.

pub mod mapping;
pub mod model_state;
pub mod optim_state;
pub mod reference;

mod pyrepr;

use crate::dtype::DType;

/// Why a transform cannot be applied. Where PyTorch rejects the same input, the message contains
/// PyTorch's own text.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransformError {
    /// A value has the wrong kind (e.g. a list where a dict is expected).
    #[error("{path}: expected {expected}, found {found}")]
    WrongKind {
        path: String,
        expected: &'static str,
        found: &'static str,
    },
    /// A required key is absent.
    #[error("{path}: missing key `{key}`")]
    MissingKey { path: String, key: String },
    /// torch: '`optim_state_dict` must have the keys "state"to be a valid optimizer state dict'.
    #[error("`optim_state_dict` must have the keys \"state\"to be a valid optimizer state dict")]
    NoStateKey,
    /// An optimizer id or a wrapped parameter name is not known.
    #[error("{path}: {what} `{name}` is not a parameter of the model")]
    UnknownParam {
        path: String,
        what: &'static str,
        name: String,
    },
    /// The number of ranks given does not match the layout.
    #[error("expected {expected} ranks, got {found}")]
    RankCount { expected: usize, found: usize },
    /// A tensor has an unexpected length, shape or dtype.
    #[error("{path}: {reason}")]
    BadTensor { path: String, reason: String },
    /// torch (`_check_missing_keys_on_rank`): "FSDP currently requires each rank to have at least
    /// the optimizer states needed by rank 0's optimizer but some ranks are missing some of those
    /// states" followed by one line per rank.
    #[error(
        "FSDP currently requires each rank to have at least the optimizer states needed by rank 0's optimizer but some ranks are missing some of those states{details}"
    )]
    MissingRank0Keys { details: String },
    /// torch (`_flatten_optim_state`): "Differing optimizer state names for the unflattened
    /// parameters: [...]".
    #[error("Differing optimizer state names for the unflattened parameters: {names}")]
    DifferingStateNames { names: String },
    /// torch: "Differing optimizer state types for state ..., values ..., and unflattened parameter
    /// names [...]".
    #[error(
        "Differing optimizer state types for state {state}, values {values}, and unflattened parameter names {names}"
    )]
    DifferingStateTypes {
        state: String,
        values: String,
        names: String,
    },
    /// torch: "All unflattened parameters comprising a single flat parameter must have
    /// positive-dimension tensor state with the same dtype ...".
    #[error(
        "All unflattened parameters comprising a single flat parameter must have positive-dimension tensor state with the same dtype but got dtypes {dtypes} for state {state} and unflattened parameter names {names}"
    )]
    DifferingDTypes {
        dtypes: String,
        state: String,
        names: String,
    },
    /// torch: "Tensor optimizer state does not have same shape as its parameter: ...".
    #[error(
        "Tensor optimizer state does not have same shape as its parameter: torch.Size({found}) torch.Size({expected})"
    )]
    ShapeMismatch { found: String, expected: String },
    /// torch: "Flattening a zero-dimension parameter is not supported".
    #[error("Flattening a zero-dimension parameter is not supported")]
    ZeroDimParam,
    /// torch: "All unflattened parameters comprising a single flat parameter must have scalar
    /// state with the same value and dtype ..." (0-dim tensors).
    #[error(
        "All unflattened parameters comprising a single flat parameter must have scalar state with the same value and dtype but got values {values} and dtypes {dtypes} for state {state} and unflattened parameter names {names}"
    )]
    DifferingScalars {
        values: String,
        dtypes: String,
        state: String,
        names: String,
    },
    /// Same torch message, non-tensor states (torch prints two spaces before "unflattened").
    #[error(
        "All unflattened parameters comprising a single flat parameter must have scalar state with the same value and dtype but got values {values} for state {state} and  unflattened parameter names {names}"
    )]
    DifferingNonTensors {
        values: String,
        state: String,
        names: String,
    },
    /// torch (`_convert_state_with_orig_params`): "<fqn> is not in the optimizer state. ...".
    #[error(
        "{fqn} is not in the optimizer state. The FSDPParamInfo has the param keys {unit_keys} while the optimizer has the param keys {optim_keys}."
    )]
    NotInOptimizerState {
        fqn: String,
        unit_keys: String,
        optim_keys: String,
    },
    /// Ranks disagree on a 0-dim or non-tensor state of one parameter (torch asserts).
    #[error(
        "Rank {rank} has different values for {state}: {value}. Other ranks: {other} (parameter {fqn})"
    )]
    RankValuesDiffer {
        rank: usize,
        state: String,
        value: String,
        other: String,
        fqn: String,
    },
    /// A rank lacks the state of a parameter piece it holds, so the flat shard cannot be rebuilt
    /// (torch: "Manually calculated _sharded_numel_padded is incorrect").
    #[error(
        "Manually calculated _sharded_numel_padded is incorrect: rank {rank} holds part of `{fqn}` but has no `{state}` for it"
    )]
    MissingPiece {
        rank: usize,
        fqn: String,
        state: String,
    },
    /// torch (`rekey_optim_state_dict`): "Invalid parameter keys".
    #[error("Invalid parameter keys: {keys}")]
    InvalidParameterKeys { keys: String },
    /// torch: "The state of ... is empty. This should happen when use_orig_params=True."
    #[error("The state of {key} is empty. This should happen when use_orig_params=True.")]
    EmptyFlatState { key: String },
    /// A dtype cannot hold the padding fill value.
    #[error("cannot fill padding of dtype {dtype}")]
    FillDType { dtype: DType },
}

/// Appends `/key` to a path used in messages.
pub(crate) fn sub(path: &str, key: impl std::fmt::Display) -> String {
    format!("{path}/{key}")
}
