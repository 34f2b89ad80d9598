//! Helpers shared by the integration tests: fixture paths and the `shardscope` binary.

use std::path::PathBuf;

/// The `tests/fixtures` folder.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}
