//! A [`Source`](shardscope_core::source::Source) over objects behind a URL: `http(s)://`, `s3://`, `gs://`, `az://` (through the
//! `object_store` crate, with a small tokio runtime inside and a blocking API outside).
//!
//! What is read stays lazy: opening a DCP folder fetches its `.metadata` only (it names every data
//! file; HTTP cannot list, object stores list the prefix), sizes come from the listing or from
//! `HEAD` requests, and every other byte is fetched by range when a reader asks for it
//! ([`read_ends`](shardscope_core::source::Source::read_ends): a `torch.save` item's two ends, not its tensor bytes). Large ranges are
//! split into parts fetched in parallel (bounded), each streamed into its place in the caller's
//! buffer; small reads that walk a file forward are served from one read-ahead block, so a reader
//! going through many small adjacent items makes few requests. Transient failures (5xx, resets, timeouts) are retried with backoff by
//! `object_store`'s `RetryConfig`; a body shorter than the range asked for is an error. Every error
//! names the object's URL.
//!
//! One job per file: `url` parses the URL, `store` builds the client (retries), `open` finds the
//! files (a listing, or the checkpoint's manifest, whose names core's `formats::locate` reads),
//! `source` is the `Source` implementation, `fetch` the parallel ranged GETs, `readahead` the block
//! that serves small forward reads, `error` the messages.

mod error;
mod fetch;
mod open;
mod readahead;
mod source;
mod store;
mod url;

pub use source::RemoteSource;
pub use url::is_url;
