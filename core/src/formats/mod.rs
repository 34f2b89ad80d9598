//! File formats: bytes in, raw records out (readers), and raw records in, bytes out (writers).

pub mod write;
