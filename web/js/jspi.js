// shardscope: synchronous reads for the viewer's synchronous readers, where the browser has
// JavaScript Promise Integration (JSPI: `WebAssembly.Suspending` / `WebAssembly.promising`,
// Chromium 137 and later).
//
// The wasm module imports `shardscope_read_suspending` from this file (a raw import, see
// web/src/jspi.rs). A step run through `run` (indexing a checkpoint) calls it to read a range of
// a picked file: the wasm stack is suspended until the bytes are copied into wasm memory, so a
// large `.metadata` is read window by window as it is parsed instead of whole before. Where JSPI
// is missing, `available` says so and the viewer reads by rounds as before.
//
// Rust keeps its shadow stack in linear memory (the `__stack_pointer` global). A suspended step
// must not share it with the code that runs while it waits (the frame loop, other tasks), so the
// step runs on a stack of its own (`stackTop`, allocated by Rust), and the global is switched at
// each suspension and resumption: the waiting step's value is kept aside and the resting value is
// put back.

const SUPPORTED =
  typeof WebAssembly === "object" &&
  typeof WebAssembly.Suspending === "function" &&
  typeof WebAssembly.promising === "function";

// A file read front to back (a `.metadata`) is streamed (`Blob.stream()`, read into buffers of
// BLOCK bytes that are used again, so that reading 140 MB leaves no garbage for the collector to
// find late); the block after the one being parsed is read ahead, so that reading overlaps
// parsing.
const BLOCK = 4 << 20;

// The most bytes read ahead (`readAhead`) and held for one step.
const AHEAD_MAX = 256 << 20;

const files = new Map(); // id -> Blob
const streams = new Map(); // id -> Streamed
const aheads = new Map(); // id -> [{ offset, len, promise }]: ranges being read or read
let aheadBytes = 0;
let exportsObj = null;
let promisingStep = null;
// The resting value of `__stack_pointer` (what the code outside the step runs with).
let restingSp = 0;
let suspended = false;
let lastError = "";
let running = false;

class Streamed {
  constructor(blob) {
    this.blob = blob;
    this.reader = null;
    this.streamPos = 0; // the file offset the stream reads next
    this.expect = 0; // the file offset handed out next
    this.cur = null; // { buf, off, len }: bytes read and not all handed out yet
    this.ahead = null; // Promise of the next block
    this.free = []; // buffers to read into
  }

  restart(offset) {
    if (this.reader) this.reader.cancel().catch(() => {});
    if (this.ahead) this.ahead.catch(() => {});
    this.reader = this.blob.slice(offset).stream().getReader({ mode: "byob" });
    this.streamPos = offset;
    this.expect = offset;
    this.cur = null;
    this.ahead = null;
  }

  // Reads the next block (fewer bytes at the end of the file) into a free buffer.
  async block() {
    let buf = this.free.pop() ?? new ArrayBuffer(BLOCK);
    let got = 0;
    while (got < BLOCK) {
      const { value, done } = await this.reader.read(new Uint8Array(buf, got, BLOCK - got));
      // The same memory handed back (an empty view of it at the end of the stream).
      if (value !== undefined) buf = value.buffer;
      if (done) break;
      got += value.byteLength;
    }
    this.streamPos += got;
    return { buf, off: 0, len: got };
  }

  async read(offset, len, ptr) {
    if (this.reader === null || offset !== this.expect) this.restart(offset);
    let done = 0;
    while (done < len) {
      if (this.cur === null || this.cur.off === this.cur.len) {
        const next = this.ahead ?? this.block();
        this.ahead = null;
        if (this.cur) this.free.push(this.cur.buf);
        this.cur = await next;
        if (this.cur.len === 0) throw new Error(`the file ended at byte ${this.expect}`);
      }
      const n = Math.min(this.cur.len - this.cur.off, len - done);
      // wasm memory may have grown while waiting: a fresh view each time.
      new Uint8Array(exportsObj.memory.buffer, ptr + done, n)
        .set(new Uint8Array(this.cur.buf, this.cur.off, n));
      this.cur.off += n;
      this.expect += n;
      done += n;
    }
    if (this.ahead === null && this.streamPos < this.blob.size) {
      this.ahead = this.block();
      this.ahead.catch(() => {}); // read ahead and never used: not an unhandled error
    }
  }

  close() {
    if (this.reader) this.reader.cancel().catch(() => {});
    if (this.ahead) this.ahead.catch(() => {});
  }
}

async function readInto(id, offset, len, ptr, ahead) {
  const blob = files.get(id);
  if (blob === undefined) throw new Error(`file ${id} is not registered`);
  if (offset + len > blob.size) throw new Error(`bytes ${offset}..${offset + len} are past the end (${blob.size})`);
  if (ahead) {
    let s = streams.get(id);
    if (s === undefined) streams.set(id, (s = new Streamed(blob)));
    return s.read(offset, len, ptr);
  }
  // A range read ahead holding this one, else a read of exactly its bytes.
  const held = (aheads.get(id) ?? []).find((a) => a.offset <= offset && offset + len <= a.offset + a.len);
  const start = held ? held.offset : offset;
  const buf = await (held ? held.promise : blob.slice(offset, offset + len).arrayBuffer());
  if (buf.byteLength < offset - start + len) throw new Error(`read ${buf.byteLength} bytes of ${offset - start + len}`);
  new Uint8Array(exportsObj.memory.buffer, ptr, len).set(new Uint8Array(buf, offset - start, len));
}

function readAhead(id, offset, len) {
  const blob = files.get(id);
  if (blob === undefined || len <= 0 || offset + len > blob.size || aheadBytes + len > AHEAD_MAX) return;
  const promise = blob.slice(offset, offset + len).arrayBuffer();
  promise.catch(() => {}); // read ahead and never used: not an unhandled error
  let list = aheads.get(id);
  if (list === undefined) aheads.set(id, (list = []));
  list.push({ offset, len, promise });
  aheadBytes += len;
}

function closeStreams() {
  for (const s of streams.values()) s.close();
  streams.clear();
  aheads.clear();
  aheadBytes = 0;
}

// Runs `work` while the step is suspended: the step's stack pointer is kept aside and the resting
// value put back until the step resumes. 0 when done, -1 on an error (its text in `lastError`).
async function suspending(work) {
  const sp = exportsObj.__stack_pointer;
  const inner = sp.value;
  sp.value = restingSp;
  suspended = true;
  let rc = 0;
  try {
    // Always awaited (a synchronous throw of `work` rejects), so that the lines below run only
    // once the step is about to resume.
    await new Promise((resolve) => resolve(work()));
  } catch (e) {
    lastError = e && e.message ? `${e.name}: ${e.message}` : String(e);
    rc = -1;
  }
  restingSp = sp.value;
  sp.value = inner;
  return rc;
}

function readSuspending(id, offset, len, ptr, ahead) {
  return suspending(() => readInto(id, offset, len, ptr, ahead !== 0));
}

// `n` ranges described by `4 * n` numbers at `desc`: file id, offset, length, address.
function readManySuspending(desc, n) {
  return suspending(() => {
    const d = new Float64Array(exportsObj.memory.buffer, desc, 4 * n).slice();
    const reads = [];
    for (let i = 0; i < n; i++) reads.push(readInto(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3], false));
    return Promise.all(reads);
  });
}

// The raw imports. Where JSPI is missing they are never called (`available` is false).
export const shardscope_read_suspending = SUPPORTED
  ? new WebAssembly.Suspending(readSuspending)
  : () => -1;
export const shardscope_read_many_suspending = SUPPORTED
  ? new WebAssembly.Suspending(readManySuspending)
  : () => -1;

globalThis.shardscopeJspi = {
  // Whether steps can be run with suspending reads (JSPI, and a module that exports its stack
  // pointer and the step entry).
  available(exports) {
    return (
      SUPPORTED &&
      !running &&
      exports.__stack_pointer instanceof WebAssembly.Global &&
      typeof exports.shardscope_jspi_step === "function"
    );
  },
  register(id, blob) {
    files.set(id, blob);
  },
  readAhead,
  unregister(id) {
    files.delete(id);
    aheads.delete(id);
    streams.get(id)?.close();
    streams.delete(id);
  },
  lastError() {
    return lastError;
  },
  // Runs the step `ctx` on the stack ending at `stackTop`; resolves when it has returned.
  run(exports, ctx, stackTop) {
    exportsObj = exports;
    if (promisingStep === null) promisingStep = WebAssembly.promising(exports.shardscope_jspi_step);
    const sp = exports.__stack_pointer;
    const saved = sp.value;
    restingSp = saved;
    suspended = false;
    running = true;
    sp.value = stackTop;
    let p;
    try {
      p = promisingStep(ctx);
    } finally {
      // Returned or suspended: the caller goes on with its own stack.
      sp.value = saved;
    }
    const done = () => {
      // A step that suspended returned on its own stack: put the resting value back.
      if (suspended) sp.value = restingSp;
      suspended = false;
      running = false;
      closeStreams();
    };
    return p.then(
      (v) => { done(); return v; },
      (e) => { done(); throw e; },
    );
  },
};
