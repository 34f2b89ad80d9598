//! What one pickle may make the machine do, and what goes wrong.

/// Limits on what one pickle may make the machine do. Every one has an explicit error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PickleLimits {
    /// Most entries the memo may hold.
    pub max_memo: usize,
    /// Most values on the stack (all mark levels together).
    pub max_stack: usize,
    /// Most nested containers in the result tree (pass 2).
    pub max_depth: usize,
    /// Most nodes pass 2 may produce (shared references count every time they are used).
    pub max_nodes: usize,
    /// Most bytes of strings and byte strings pass 2 may produce.
    pub max_bytes: usize,
}

impl PickleLimits {
    /// Limits proportional to the pickle: pass 2 may expand a pickle of `n` bytes to at most
    /// `4n + 65536` nodes and `16n + 1 MiB` bytes of strings, which no real torch file comes near.
    pub fn for_len(n: usize) -> Self {
        PickleLimits {
            max_memo: n.saturating_add(16),
            max_stack: n.saturating_add(16),
            max_depth: 200,
            max_nodes: n.saturating_mul(4).saturating_add(65_536),
            max_bytes: n.saturating_mul(16).saturating_add(1 << 20),
        }
    }
}

/// What went wrong while reading a pickle. Offsets are byte positions in the pickle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickleError {
    /// The pickle ended in the middle of an opcode or before `STOP`.
    #[error("pickle truncated at byte {offset} (needed {needed} more bytes)")]
    Truncated { offset: usize, needed: u64 },
    /// An opcode this machine does not run (e.g. `EXT1`, `INST`, out-of-band buffers).
    #[error("unsupported pickle opcode 0x{opcode:02x} at byte {offset}")]
    UnsupportedOpcode { opcode: u8, offset: usize },
    /// `PROTO` names a protocol outside 2..=5.
    #[error("unsupported pickle protocol {protocol} (expected 2 to 5)")]
    UnsupportedProtocol { protocol: u8 },
    /// An opcode needed more values on the stack than there were.
    #[error("pickle stack underflow at byte {offset} (opcode 0x{opcode:02x})")]
    StackUnderflow { opcode: u8, offset: usize },
    /// A `MARK`-consuming opcode found no mark.
    #[error("pickle has no MARK for the opcode at byte {offset}")]
    NoMark { offset: usize },
    /// A memo lookup for an index never stored.
    #[error("pickle reads memo entry {index} at byte {offset}, which was never stored")]
    MissingMemo { index: u64, offset: usize },
    /// A value of the wrong type for an opcode (e.g. `SETITEMS` on a tuple).
    #[error("pickle opcode at byte {offset}: {what}")]
    WrongType { offset: usize, what: String },
    /// Text (`GLOBAL`, `INT`, unicode) that is not valid.
    #[error("pickle has invalid text at byte {offset}: {what}")]
    BadText { offset: usize, what: String },
    /// A limit of [`PickleLimits`] was reached.
    #[error(
        "pickle exceeds the limit on {what} ({limit}); the file is malformed or hostile (memo bomb?)"
    )]
    Limit { what: &'static str, limit: usize },
    /// The stack did not hold exactly one value at `STOP`.
    #[error("pickle ended with {len} values on the stack (expected 1)")]
    BadStop { len: usize },
    /// A known torch record had arguments of an unexpected shape.
    #[error("malformed {class} record in pickle: {what}")]
    BadRecord { class: String, what: String },
}
