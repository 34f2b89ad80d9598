//! A [`Source`](shardscope_core::source::Source) over objects behind a URL: `http(s)://`, `s3://`, `gs://`, `az://` (through the
//! `object_store` crate, with a small tokio runtime inside and a blocking API outside).
//!
//! What is read stays lazy: opening a DCP folder fetches its `.metadata` only (it names every data
//! file; HTTP cannot list, object stores list the prefix), sizes come from the listing or from
//! `HEAD` requests, and every other byte is fetched by range when a reader asks for it
//! ([`read_ends`](shardscope_core::source::Source::read_ends): a `torch.save` item's two ends, not its tensor bytes). Large ranges are
//! split into parts fetched in parallel (bounded), each streamed into its place in the caller's
//! buffer; small reads that walk a file forward are served from one read-ahead block, so a reader
//! going through many small adjacent items makes few requests. Transient faults (5xx, 408, 429,
//! resets, bodies cut short, no byte for `--io-timeout`, no connection) are retried with backoff,
//! a cut body resumed from where it stopped (`retry`, `fetch`); faults are told apart by type,
//! never by message text. Files fetched whole are capped, buffers sized by the network allocated
//! fallibly. Every error names the object's URL (never a query).
//!
//! One job per file: `url` parses the URL, `store` builds the client (retries), `open` finds the
//! files (a listing, or the checkpoint's manifest, whose names core's `formats::locate` reads),
//! `source` is the `Source` implementation, `fetch` the parallel ranged GETs (resumed), `retry` the
//! typed faults and the retry budget, `connector` the HTTP client (statuses as types), `readahead`
//! the block that serves small forward reads, `error` the messages.

mod connector;
mod error;
mod fetch;
mod open;
mod readahead;
mod retry;
mod source;
mod store;
mod url;

pub use retry::set_io_timeout;
pub use source::RemoteSource;
pub use url::{is_url, shown};
