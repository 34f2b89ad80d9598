//! Suspending reads: where the browser has JavaScript Promise Integration (JSPI), a synchronous
//! step (indexing a checkpoint) reads a range of a picked file *during* the step: the wasm stack
//! is suspended until the browser has read the bytes (`web/js/jspi.js`). A million-chunk
//! `.metadata` (140 MB) is then parsed window by window as it is read, never held whole, and
//! reading overlaps parsing. Where JSPI is missing (or a step is already suspended), steps run
//! as before: what they miss is fetched between rounds ([`crate::lazy::LazySource::run`]).
//!
//! The step runs on a stack of its own (Rust's shadow stack lives in linear memory, and the
//! frame loop runs while the step waits); `jspi.js` switches the stack pointer at each
//! suspension and resumption, which is why the module exports `__stack_pointer` (`build.rs`).

// The one unsafe part of the web crate: a raw import and a raw export across which the wasm
// stack is suspended (the readers stay safe Rust).
#![allow(unsafe_code)]

use std::cell::Cell;

use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::JsFuture;

#[link(wasm_import_module = "./jspi.js")]
unsafe extern "C" {
    /// Copies bytes `offset..offset + len` of registered file `id` to `ptr`, suspending until
    /// they are read: 0 when copied, -1 on an error (its text in `jspi.js`'s `lastError`).
    fn shardscope_read_suspending(id: u32, offset: f64, len: u32, ptr: *mut u8, ahead: u32) -> i32;
    /// The same for `n` ranges at once, described by `4 * n` numbers at `desc` (file id,
    /// offset, length, address), all read before the step resumes.
    fn shardscope_read_many_suspending(desc: *const f64, n: u32) -> i32;
}

#[wasm_bindgen]
extern "C" {
    #[wasm_bindgen(catch, js_namespace = shardscopeJspi, js_name = available)]
    fn js_available(exports: &JsValue) -> Result<bool, JsValue>;
    #[wasm_bindgen(catch, js_namespace = shardscopeJspi, js_name = run)]
    fn js_run(exports: &JsValue, ctx: u32, stack_top: u32) -> Result<js_sys::Promise, JsValue>;
    #[wasm_bindgen(catch, js_namespace = shardscopeJspi, js_name = register)]
    fn js_register(id: u32, blob: &web_sys::Blob) -> Result<(), JsValue>;
    #[wasm_bindgen(catch, js_namespace = shardscopeJspi, js_name = unregister)]
    fn js_unregister(id: u32) -> Result<(), JsValue>;
    #[wasm_bindgen(catch, js_namespace = shardscopeJspi, js_name = readAhead)]
    fn js_read_ahead(id: u32, offset: f64, len: f64) -> Result<(), JsValue>;
    #[wasm_bindgen(catch, js_namespace = shardscopeJspi, js_name = lastError)]
    fn js_last_error() -> Result<String, JsValue>;
}

/// The step's own stack: deeper than the 1 MiB the main one has (the general pickle machine
/// recurses on nested values within its depth limit).
const STACK: usize = 4 << 20;

thread_local! {
    /// A step with suspending reads has started and not returned (one at a time: `jspi.js`
    /// keeps one resting stack pointer).
    static RUNNING: Cell<bool> = const { Cell::new(false) };
    /// Turned off by the page (`WebHandle::set_suspending_reads(false)`), to test the rounds.
    static ENABLED: Cell<bool> = const { Cell::new(true) };
    static NEXT_ID: Cell<u32> = const { Cell::new(1) };
    /// Suspending reads done since the page loaded.
    static READS: Cell<u64> = const { Cell::new(0) };
}

/// Suspending reads done since the page loaded (the browser test checks they happen).
pub fn reads_done() -> u64 {
    READS.with(Cell::get)
}

/// Allows or forbids suspending reads (the browser test runs the same checkpoints both ways).
pub fn set_enabled(on: bool) {
    ENABLED.with(|e| e.set(on));
}

/// Whether steps can run with suspending reads now.
pub fn available() -> bool {
    ENABLED.with(Cell::get)
        && !RUNNING.with(Cell::get)
        && js_available(&wasm_bindgen::exports()).unwrap_or(false)
}

/// A file registered with `jspi.js` for suspending reads; unregistered when dropped.
#[derive(Debug)]
pub struct Registered(u32);

impl Registered {
    pub fn new(blob: &web_sys::Blob) -> Option<Self> {
        let id = NEXT_ID.with(|n| {
            let id = n.get();
            n.set(id.wrapping_add(1).max(1));
            id
        });
        js_register(id, blob).ok().map(|()| Registered(id))
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let _ = js_unregister(self.0);
    }
}

/// Reads `out.len()` bytes at `offset` of `file` into `out`, suspending the running step until
/// they are read; `ahead`: the file is read from start to end (a `.metadata`), so its next bytes
/// are read ahead in blocks. Only from within the step [`run`] runs (the caller's source knows
/// whether it is in one): elsewhere the browser refuses to suspend and the module traps.
pub fn read_into(
    file: &Registered,
    offset: u64,
    out: &mut [u8],
    ahead: bool,
) -> Result<(), String> {
    let len = u32::try_from(out.len()).map_err(|_| format!("{} bytes in one read", out.len()))?;
    // Offsets of files the browser can hold are below 2^53: exact as f64.
    if offset > (1u64 << 53) {
        return Err(format!(
            "offset {offset} is past what the browser addresses"
        ));
    }
    // SAFETY: `out` is a live, writable buffer of `len` bytes in this module's memory; the
    // import writes exactly `len` bytes there before the step resumes, and nothing else touches
    // `out` meanwhile (the step, which holds it, is suspended).
    let rc = unsafe {
        shardscope_read_suspending(
            file.0,
            offset as f64,
            len,
            out.as_mut_ptr(),
            u32::from(ahead),
        )
    };
    if rc == 0 {
        READS.with(|r| r.set(r.get().saturating_add(1)));
        Ok(())
    } else {
        Err(js_last_error().unwrap_or_else(|_| "the read failed".into()))
    }
}

/// Reads several ranges at once into their buffers, suspending the running step once until all
/// are read (the data files' heads a DCP index reads one after another). Only from within the
/// step [`run`] runs.
pub fn read_many(reads: &mut [(&Registered, u64, &mut [u8])]) -> Result<(), String> {
    let mut desc = Vec::with_capacity(reads.len() * 4);
    for (file, offset, out) in reads.iter_mut() {
        if *offset > (1u64 << 53) {
            return Err(format!(
                "offset {offset} is past what the browser addresses"
            ));
        }
        desc.extend([
            f64::from(file.0),
            *offset as f64,
            out.len() as f64,
            out.as_mut_ptr() as usize as f64,
        ]);
    }
    let n = u32::try_from(reads.len()).map_err(|_| "too many reads at once".to_owned())?;
    // SAFETY: `desc` names live, writable buffers (`reads` holds them, and nothing touches them
    // while the step is suspended); the import writes exactly each one's length there.
    let rc = unsafe { shardscope_read_many_suspending(desc.as_ptr(), n) };
    if rc == 0 {
        READS.with(|r| r.set(r.get().saturating_add(reads.len() as u64)));
        Ok(())
    } else {
        Err(js_last_error().unwrap_or_else(|_| "the reads failed".into()))
    }
}

/// Starts reading `offset..offset + len` of `file` without waiting: a suspending read of a range
/// within it (until the running step returns) takes its bytes from this read. Within a step or
/// just before one ([`crate::lazy::LazySource::begin_first_reads`]).
pub fn read_ahead(file: &Registered, offset: u64, len: u64) {
    // Sizes of files the browser holds are below 2^53: exact as f64.
    let _ = js_read_ahead(file.0, offset as f64, len as f64);
}

/// The step entry `jspi.js` wraps with `WebAssembly.promising`: `ctx` points to the
/// `&mut dyn FnMut()` that [`run`] keeps alive until the step has returned.
#[unsafe(no_mangle)]
pub extern "C" fn shardscope_jspi_step(ctx: u32) {
    // SAFETY: `run` passes the address of its `&mut dyn FnMut()` and awaits this call's
    // completion before that reference ends (and aborts rather than end it earlier).
    let step = unsafe { &mut *(ctx as usize as *mut &mut dyn FnMut()) };
    step();
}

/// Aborts when [`run`]'s future is dropped while its step is suspended: the step would resume
/// into freed memory.
struct MustFinish(bool);

impl Drop for MustFinish {
    fn drop(&mut self) {
        if !self.0 {
            std::process::abort();
        }
    }
}

/// Runs `step` with suspending reads ([`available`] must be true); its result once it has
/// returned.
pub async fn run<T>(step: impl FnOnce() -> T) -> Result<T, String> {
    let mut out: Option<T> = None;
    let mut step = Some(step);
    let mut call = || {
        if let Some(step) = step.take() {
            out = Some(step());
        }
    };
    let mut entry: &mut dyn FnMut() = &mut call;
    let stack: Vec<u8> = Vec::with_capacity(STACK);
    // The stack grows down from its 16-byte aligned end.
    let top = (stack.as_ptr() as usize + STACK) & !15;
    let ctx = (&raw mut entry) as usize;
    let (Ok(ctx), Ok(top)) = (u32::try_from(ctx), u32::try_from(top)) else {
        return Err("wasm addresses are 32-bit".into());
    };
    RUNNING.with(|s| s.set(true));
    let mut guard = MustFinish(false);
    let done = match js_run(&wasm_bindgen::exports(), ctx, top) {
        Ok(promise) => JsFuture::from(promise).await.map(|_| ()),
        Err(e) => Err(e),
    };
    guard.0 = true;
    RUNNING.with(|s| s.set(false));
    drop(stack);
    done.map_err(|e| format!("the step failed: {e:?}"))?;
    out.ok_or_else(|| "the step did not run".into())
}
