//! WebAssembly entry of the shardscope viewer (filled by the viewer issue).

pub use shardscope_viewer as viewer;
