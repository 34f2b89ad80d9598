//! The `cuda` backend (written below).
