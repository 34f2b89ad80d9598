//! shardscope viewer: panels over `shardscope-core` types (filled by the viewer issue).

pub use shardscope_core as core;
