//! A restricted pickle machine (protocols 2 to 5) that never imports or executes anything.
//!
//! Pass 1 ([`Machine`]) runs the opcodes and builds an arena of nodes: globals become names,
//! `REDUCE`/`NEWOBJ` on anything become generic object nodes, `BUILD`/`SETITEMS`/`APPENDS` on
//! objects are recorded on the node. Shared references (`BINGET`) point at the same node, so a
//! memo bomb costs nothing in pass 1. Pass 2 ([`to_value`]) walks the arena into an owned
//! [`PyValue`] tree with a node budget and a depth limit, turning the torch classes it knows
//! (`_rebuild_tensor_v2`, `_rebuild_from_type_v2`, typed storages, `torch.Size`, dtypes,
//! `OrderedDict`, `ShardedTensor`, `DTensor`) into typed records. Anything else stays an
//! [`PyObject`] with its class name, arguments and state, to be read (or ignored) by the caller.

mod arena;
mod convert;
mod limits;
mod machine;
#[cfg(test)]
mod tests;
mod torch_classes;
mod value;
mod view;

use arena::Node;
use convert::Converter;
pub use limits::{PickleError, PickleLimits};
use machine::Machine;
pub use torch_classes::dtype_of_storage_class;
pub use value::{
    DTensorRecord, Global, LocalShard, Placement, PyObject, PyValue, ShardMeta,
    ShardedTensorRecord, StorageRef, TensorRef, dict_get,
};
pub use view::{AttrCache, ObjRef, PickleArena, PyRef};

/// Parses a pickle into a value tree with limits derived from its length.
pub fn parse(data: &[u8]) -> Result<PyValue, PickleError> {
    parse_with_limits(data, PickleLimits::for_len(data.len()))
}

/// Parses a pickle into a value tree with explicit limits.
pub fn parse_with_limits(data: &[u8], limits: PickleLimits) -> Result<PyValue, PickleError> {
    let (arena, root) = Machine::new(data, limits).run()?;
    let mut conv = Converter {
        arena: &arena,
        limits,
        nodes: 0,
        bytes: 0,
    };
    conv.value(root, 0)
}

/// Runs pass 1 only.
pub fn parse_arena(data: &[u8]) -> Result<PickleArena, PickleError> {
    let limits = PickleLimits::for_len(data.len());
    let (nodes, root) = Machine::new(data, limits).run()?;
    Ok(PickleArena {
        nodes,
        root,
        limits,
    })
}

/// Every global the pickle names (`GLOBAL`, `STACK_GLOBAL`), once each, in first-seen order.
/// Pass 1 only: nothing is imported, called or built.
pub fn globals(data: &[u8]) -> Result<Vec<Global>, PickleError> {
    Ok(parse_arena(data)?.globals())
}

impl PickleArena {
    /// Every global the pickle names, once each, in first-seen order.
    pub fn globals(&self) -> Vec<Global> {
        let mut out: Vec<Global> = Vec::new();
        for node in &self.nodes.nodes {
            if let Node::Global(g) = node
                && !out.contains(g)
            {
                out.push((**g).clone());
            }
        }
        out
    }
}

/// The globals a pickle names before it stops or fails to parse, and the error if it failed:
/// what an unpickler that imports would already have imported (and may have called) when it
/// reached that point. Pass 1 only: nothing is imported, called or built.
pub fn globals_until_error(data: &[u8]) -> (Vec<Global>, Option<PickleError>) {
    let limits = PickleLimits::for_len(data.len());
    if u32::try_from(data.len()).is_err() {
        return (
            Vec::new(),
            Some(PickleError::Limit {
                what: "bytes of one pickle",
                limit: u32::MAX as usize,
            }),
        );
    }
    Machine::new(data, limits).globals_until_error()
}
