//! One read of a checkpoint's files for its manifest.
//!
//! Every file is cut into segments in file order: bytes outside any tensor, then one stored chunk
//! of a slab tensor (its *region*). The segments are put in an order that respects both orders a
//! digest needs: a file's bytes in file order (its digest) and a tensor's chunks in C order (its
//! digest). One thread feeds a segment, 256 KiB piece by piece, to the digests it belongs to (the
//! file's, its chunk's, its tensor's); a segment starts when the segments before it in its file
//! and in its tensor are done, the earliest in the plan's order first. Threads with no segment to
//! start copy pieces ahead for running ones ([`Assist`]). Every wait is on a segment earlier in the
//! plan's order, so the earliest segment not done can always go on: no deadlock.
//!
//! When the two orders conflict (file A holds chunk 2 of `x` before chunk 1 of `y`, file B chunk
//! 1 of `x` after chunk 2 of `y`), the tensor met in a cycle is fed from that chunk on in a second
//! stage, re-reading only those chunks. Tensors not stored as slabs, values, and tensors whose
//! chunks share stored bytes with another are hashed on their own (`super::run_entry`).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Condvar, Mutex, MutexGuard, mpsc};

use shardscope_core::dtype::DType;
use shardscope_core::index::{CheckpointIndex, EntryKind, IndexEntry};
use shardscope_core::manifest::{Algorithm, FileDigest, Hasher, Manifest};
use shardscope_core::source::Source;

use super::assist::{Assist, Help, Piece, Pieces, Spare};
use super::{
    Chunk, Done, HashOptions, PIECE_BYTES, chunk_hasher, resume_slabs, row_bytes, run_entry,
    slab_digest, with_places,
};
use crate::convert::{Reader, SlabPiece, tensor_meta};
use crate::input::Input;

/// A tensor read with its files: its dim-0 slab pieces, sorted by `tensor_start`.
struct Streamed<'a> {
    entry: &'a IndexEntry,
    dtype: DType,
    shape: &'a [u64],
    rows: u64,
    pieces: Vec<SlabPiece>,
}

/// A run of one file's bytes: `start..region` outside any tensor (read for the file's digest
/// only), then `region..end`, piece `chunk.1` of tensor `chunk.0` (`None`: `region == end`).
#[derive(Debug, Clone, Copy)]
struct Segment {
    file: usize,
    start: u64,
    region: u64,
    end: u64,
    chunk: Option<(usize, usize)>,
}

struct Plan<'a> {
    /// `(name, size)` of every file of the checkpoint, in the index's order.
    files: Vec<(&'a str, u64)>,
    tensors: Vec<Streamed<'a>>,
    /// Per tensor: its pieces from this one on are fed to its digest in the second stage.
    feed_until: Vec<usize>,
    /// In the order their pieces are handed out.
    segments: Vec<Segment>,
    /// Hashed on their own.
    separate: Vec<&'a IndexEntry>,
    /// File digests are fed from the segments (else: not hashed, or read on their own).
    fused: bool,
    /// Files whose digest is a read of their own (file digests asked for, not fused).
    file_jobs: Vec<usize>,
}

/// Hashes `entries` and (with `options.files`) every file of `index` into `manifest`.
pub(super) fn run(
    source: &Input,
    index: &CheckpointIndex,
    entries: &[&IndexEntry],
    options: HashOptions,
    manifest: &mut Manifest,
    progress: &mut dyn FnMut(usize, usize, &str),
) {
    let plan = plan(source, index, entries, options);
    let mut total = plan.separate.len() + plan.tensors.len();
    let mut done = 0;
    if options.files {
        total += plan.files.len();
        // An empty file has no segment: its digest is known now.
        for &(name, size) in &plan.files {
            if size == 0 {
                manifest.files.insert(
                    name.to_owned(),
                    FileDigest {
                        size,
                        digest: Hasher::new(options.algorithm).finish(),
                    },
                );
                done += 1;
            }
        }
    }
    let run = Run::new(source, index, &plan, options);
    let threads = options.threads.clamp(1, total.max(1));
    let barrier = Barrier::new(threads);
    let (tx, rx) = mpsc::channel::<Done>();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let tx = tx.clone();
            let (run, barrier) = (&run, &barrier);
            scope.spawn(move || run.worker(barrier, &tx));
        }
        drop(tx);
        progress(done, total, "");
        for result in rx {
            done += 1;
            let name = result.record(manifest);
            progress(done, total, &name);
        }
    });
    progress(total, total, "");
}

fn plan<'a>(
    source: &'a Input,
    index: &'a CheckpointIndex,
    entries: &[&'a IndexEntry],
    options: HashOptions,
) -> Plan<'a> {
    let reader = Reader::new(source, index);
    let all_files: Vec<(&str, u64)> = index
        .files
        .iter()
        .map(|(n, f)| (n.as_str(), f.size))
        .collect();
    let mut tensors = Vec::new();
    let mut separate = Vec::new();
    for &e in entries {
        match streamable(&reader, e) {
            Some(t) => tensors.push(t),
            None => separate.push(e),
        }
    }
    let (regions, alone) = regions_by_file(&tensors, &all_files);
    let mut kept = Vec::new();
    let mut renumber = vec![usize::MAX; tensors.len()];
    for (t, s) in tensors.into_iter().enumerate() {
        if alone[t] {
            separate.push(s.entry);
        } else {
            renumber[t] = kept.len();
            kept.push(s);
        }
    }
    // A file's digest takes its bytes in order: the files' digests are as many streams as there
    // are files holding tensors. With fewer than the threads, the other threads copy pieces ahead
    // for them ([`Assist`]), which pays while the copy is most of the work (xxh3); where the
    // digest is (sha256), one stream's digests would leave the other cores idle, and the file
    // digests are read on their own instead, beside the tensors.
    let streams = regions
        .iter()
        .filter(|list| list.iter().any(|r| !alone[r.2]))
        .count();
    let with_files = options.files
        && (streams >= options.threads.max(1) || options.algorithm == Algorithm::Xxh3);
    let file_jobs = if options.files && !with_files {
        (0..all_files.len())
            .filter(|&f| all_files[f].1 > 0)
            .collect()
    } else {
        Vec::new()
    };
    let per_file: Vec<Vec<Segment>> = regions
        .iter()
        .enumerate()
        .map(|(f, list)| {
            let mut segments = Vec::new();
            let mut at = 0;
            for &(a, b, t, k) in list.iter().filter(|r| !alone[r.2]) {
                segments.push(Segment {
                    file: f,
                    start: if with_files { at } else { a },
                    region: a,
                    end: b,
                    chunk: Some((renumber[t], k)),
                });
                at = b;
            }
            let size = all_files[f].1;
            if with_files && at < size {
                segments.push(Segment {
                    file: f,
                    start: at,
                    region: size,
                    end: size,
                    chunk: None,
                });
            }
            segments
        })
        .collect();
    let counts: Vec<usize> = kept.iter().map(|t| t.pieces.len()).collect();
    let (segments, feed_until) = order(&per_file, &counts, with_files);
    Plan {
        files: all_files,
        tensors: kept,
        feed_until,
        segments,
        separate,
        fused: with_files,
        file_jobs,
    }
}

/// Each tensor's chunks, by file: `(start, end, tensor, piece)` sorted; and per tensor, whether it
/// is hashed on its own: a chunk outside the files, or sharing stored bytes with another chunk (tied
/// weights in a torch.save file).
#[allow(clippy::type_complexity)] // a plan's intermediate, used once
fn regions_by_file(
    tensors: &[Streamed<'_>],
    all_files: &[(&str, u64)],
) -> (Vec<Vec<(u64, u64, usize, usize)>>, Vec<bool>) {
    let file_of: BTreeMap<&str, usize> = all_files
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (*n, i))
        .collect();
    let mut regions: Vec<Vec<(u64, u64, usize, usize)>> = vec![Vec::new(); all_files.len()];
    let mut alone = vec![false; tensors.len()];
    for (t, s) in tensors.iter().enumerate() {
        for (k, p) in s.pieces.iter().enumerate() {
            let end = p.file_start.checked_add(p.len);
            match (file_of.get(p.file.as_str()), end) {
                (Some(&f), Some(end)) if end <= all_files[f].1 => {
                    regions[f].push((p.file_start, end, t, k));
                }
                _ => alone[t] = true,
            }
        }
    }
    for list in &mut regions {
        list.sort_unstable();
        let mut end = 0;
        for &(a, b, t, _) in list.iter() {
            if a < end {
                alone[t] = true;
            } else {
                end = b;
            }
        }
    }
    (regions, alone)
}

fn streamable<'a>(reader: &Reader<'_>, e: &'a IndexEntry) -> Option<Streamed<'a>> {
    if e.kind != EntryKind::Tensor {
        return None;
    }
    let (dtype, shape) = tensor_meta(e).ok()?;
    let mut pieces = reader.slab_pieces(e, dtype)?;
    if pieces.is_empty() {
        return None;
    }
    pieces.sort_by_key(|p| p.tensor_start);
    let rows = row_bytes(e, dtype.size_bytes() as u64, shape).ok()?;
    Some(Streamed {
        entry: e,
        dtype,
        shape,
        rows,
        pieces,
    })
}

/// The segments of all files in one order that keeps each file's (when files are hashed) and each
/// tensor's chunks in order (Kahn's algorithm; among the segments ready, the earliest in its file
/// first, so that the files advance together). A cycle between the two orders is broken by feeding
/// the tensor met from that chunk on in the second stage. Returns the order and, per tensor, the
/// first piece fed in the second stage (its piece count: none).
fn order(
    per_file: &[Vec<Segment>],
    pieces: &[usize],
    with_files: bool,
) -> (Vec<Segment>, Vec<usize>) {
    let mut feed_until: Vec<usize> = pieces.to_vec();
    let mut place: Vec<Vec<(usize, usize)>> = pieces
        .iter()
        .map(|&n| vec![(usize::MAX, usize::MAX); n])
        .collect();
    let mut waits: Vec<Vec<u8>> = Vec::with_capacity(per_file.len());
    for (f, segments) in per_file.iter().enumerate() {
        let mut w = Vec::with_capacity(segments.len());
        for (i, s) in segments.iter().enumerate() {
            let mut n = u8::from(with_files && i > 0);
            if let Some((t, k)) = s.chunk {
                place[t][k] = (f, i);
                n += u8::from(k > 0);
            }
            w.push(n);
        }
        waits.push(w);
    }
    let total: usize = per_file.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(total);
    let mut scheduled: Vec<Vec<bool>> = per_file.iter().map(|s| vec![false; s.len()]).collect();
    // With file order kept, the segments scheduled are a prefix of each file's.
    let mut heads = vec![0usize; per_file.len()];
    let mut ready: BinaryHeap<Reverse<(usize, usize)>> = BinaryHeap::new();
    for (f, w) in waits.iter().enumerate() {
        for (i, &n) in w.iter().enumerate() {
            if n == 0 {
                ready.push(Reverse((i, f)));
            }
        }
    }
    let release = |waits: &mut Vec<Vec<u8>>, ready: &mut BinaryHeap<_>, (f, i): (usize, usize)| {
        let w: &mut u8 = &mut waits[f][i];
        *w -= 1;
        if *w == 0 {
            ready.push(Reverse((i, f)));
        }
    };
    while out.len() < total {
        while let Some(Reverse((i, f))) = ready.pop() {
            let s = per_file[f][i];
            out.push(s);
            scheduled[f][i] = true;
            heads[f] = heads[f].max(i + 1);
            if with_files && i + 1 < per_file[f].len() {
                release(&mut waits, &mut ready, (f, i + 1));
            }
            if let Some((t, k)) = s.chunk
                && k + 1 < feed_until[t]
            {
                release(&mut waits, &mut ready, place[t][k + 1]);
            }
        }
        if out.len() == total {
            break;
        }
        // A cycle: the first segment not scheduled of some file waits on its tensor only (its
        // file's previous one is scheduled). Feed that tensor from there on in the second stage.
        let Some((t, k)) = (0..per_file.len()).find_map(|f| {
            let i = heads[f];
            let s = per_file[f].get(i)?;
            s.chunk
                .filter(|_| with_files && !scheduled[f][i] && waits[f][i] > 0)
        }) else {
            // Cannot happen (every wait is on a file's previous segment or a tensor's previous
            // chunk); hand the rest out in file order with no tensor fed, rather than loop.
            for (f, segments) in per_file.iter().enumerate() {
                for (i, s) in segments.iter().enumerate() {
                    if !scheduled[f][i] {
                        out.push(*s);
                        if let Some((t, _)) = s.chunk {
                            feed_until[t] = 0;
                        }
                    }
                }
            }
            break;
        };
        for k2 in k.max(1)..feed_until[t] {
            let (g, j) = place[t][k2 - 1];
            if !scheduled[g][j] {
                release(&mut waits, &mut ready, place[t][k2]);
            }
        }
        feed_until[t] = k;
    }
    (out, feed_until)
}

enum Work {
    Segment(usize, Arc<Assist>),
    Help(Arc<Assist>),
    Nothing,
}

struct FileState {
    hasher: Option<Hasher>,
    error: Option<String>,
}

struct TensorState {
    hasher: Option<Hasher>,
    /// A read failed while feeding it: hashed again on its own in the second stage.
    broken: bool,
    chunks: Vec<Chunk>,
    finished: bool,
}

/// What the threads share: the digests not being fed, and which segments can start.
struct State {
    files: Vec<FileState>,
    tensors: Vec<TensorState>,
    /// Per segment (in the plan's order): the segments it still waits for.
    waits: Vec<u8>,
    /// Segments whose wait is over, not yet taken: the earliest in the plan's order goes first.
    ready: BTreeSet<usize>,
    /// The running segments, for threads with nothing to start to copy ahead for.
    assists: Vec<Arc<Assist>>,
    running: usize,
    left: usize,
}

/// A file's digest once its bytes are all fed, or why it has none.
fn file_done(name: &str, size: u64, error: Option<String>, hasher: Option<Hasher>) -> Done {
    match (error, hasher) {
        (None, Some(h)) => Done::File(
            name.to_owned(),
            FileDigest {
                size,
                digest: h.finish(),
            },
        ),
        (error, _) => Done::Failed(
            format!("file {name}"),
            error.unwrap_or_else(|| format!("{name}: not read")),
        ),
    }
}

struct Run<'a> {
    source: &'a Input,
    index: &'a CheckpointIndex,
    plan: &'a Plan<'a>,
    options: HashOptions,
    /// Per segment: the segments that wait for it (its file's next, its tensor's next chunk).
    next: Vec<[Option<usize>; 2]>,
    next_file: AtomicUsize,
    /// `state.ready.len()`, read without the lock by threads copying ahead.
    ready_len: AtomicUsize,
    next_separate: AtomicUsize,
    next_resume: AtomicUsize,
    state: Mutex<State>,
    changed: Condvar,
    /// Slot buffers of finished segments' copiers.
    spare: Spare,
}

impl<'a> Run<'a> {
    fn new(
        source: &'a Input,
        index: &'a CheckpointIndex,
        plan: &'a Plan<'a>,
        options: HashOptions,
    ) -> Run<'a> {
        let algorithm = options.algorithm;
        let n = plan.segments.len();
        // Who waits for whom: a file's segments follow each other (with file digests), and a
        // tensor's chunks fed with their files follow each other.
        let mut by_file: Vec<Vec<usize>> = vec![Vec::new(); plan.files.len()];
        let mut by_piece: Vec<Vec<usize>> = plan
            .tensors
            .iter()
            .map(|t| vec![usize::MAX; t.pieces.len()])
            .collect();
        for (i, s) in plan.segments.iter().enumerate() {
            by_file[s.file].push(i);
            if let Some((t, k)) = s.chunk {
                by_piece[t][k] = i;
            }
        }
        let mut next = vec![[None, None]; n];
        let mut waits = vec![0u8; n];
        if plan.fused {
            for list in &mut by_file {
                list.sort_by_key(|&i| plan.segments[i].start);
                for w in list.windows(2) {
                    next[w[0]][0] = Some(w[1]);
                    waits[w[1]] += 1;
                }
            }
        }
        for (t, list) in by_piece.iter().enumerate() {
            for k in 1..plan.feed_until[t].min(list.len()) {
                next[list[k - 1]][1] = Some(list[k]);
                waits[list[k]] += 1;
            }
        }
        let ready: BTreeSet<usize> = (0..n).filter(|&i| waits[i] == 0).collect();
        let ready_len = ready.len();
        let state = State {
            files: plan
                .files
                .iter()
                .map(|_| FileState {
                    hasher: Some(Hasher::new(algorithm)),
                    error: None,
                })
                .collect(),
            tensors: plan
                .tensors
                .iter()
                .map(|t| TensorState {
                    hasher: Some(Hasher::tensor(algorithm, t.dtype, t.shape)),
                    broken: false,
                    chunks: vec![Chunk::NotYet; t.pieces.len()],
                    finished: false,
                })
                .collect(),
            waits,
            ready,
            assists: Vec::new(),
            running: 0,
            left: n,
        };
        Run {
            source,
            index,
            plan,
            options,
            next,
            next_file: AtomicUsize::new(0),
            ready_len: AtomicUsize::new(ready_len),
            next_separate: AtomicUsize::new(0),
            next_resume: AtomicUsize::new(0),
            state: Mutex::new(state),
            changed: Condvar::new(),
            spare: Spare::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A thread that panicked holding the lock left no half-made digest that matters: the
        // manifest is not written when a worker panics (the scope re-raises it).
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn worker(&self, barrier: &Barrier, tx: &mpsc::Sender<Done>) {
        let mut buf = Vec::new();
        let mut reader = Reader::new(self.source, self.index);
        // Files read on their own first: each is one long stream.
        loop {
            let i = self.next_file.fetch_add(1, Ordering::Relaxed);
            let Some(&f) = self.plan.file_jobs.get(i) else {
                break;
            };
            let _ = tx.send(self.hash_file(f, &mut buf));
        }
        loop {
            match self.take_work() {
                Work::Segment(seg, assist) => {
                    for done in self.hash_segment(seg, &assist, &mut buf) {
                        let _ = tx.send(done);
                    }
                }
                Work::Help(assist) => self.help(&assist),
                Work::Nothing => break,
            }
        }
        loop {
            let i = self.next_separate.fetch_add(1, Ordering::Relaxed);
            let Some(e) = self.plan.separate.get(i) else {
                break;
            };
            let _ = tx.send(run_entry(&mut reader, e, self.options.algorithm, &mut buf));
        }
        // Every segment is hashed before any tensor is taken over.
        barrier.wait();
        loop {
            let t = self.next_resume.fetch_add(1, Ordering::Relaxed);
            if t >= self.plan.tensors.len() {
                break;
            }
            if let Some(done) = self.resume(&mut reader, t, &mut buf) {
                let _ = tx.send(done);
            }
        }
    }

    /// The earliest segment that can start; else a running segment to copy ahead for; waits
    /// while neither is there and segments are left.
    fn take_work(&self) -> Work {
        let mut st = self.lock();
        loop {
            if let Some(i) = st.ready.pop_first() {
                self.ready_len.store(st.ready.len(), Ordering::Release);
                st.running += 1;
                st.left -= 1;
                let s = self.plan.segments[i];
                let assist = Arc::new(Assist::new(
                    Pieces {
                        start: s.start,
                        region: s.region,
                        end: s.end,
                    },
                    self.plan.files[s.file].0,
                    2 * self.options.threads.clamp(1, 8),
                    &self.spare,
                ));
                st.assists.push(Arc::clone(&assist));
                drop(st);
                self.changed.notify_all();
                return Work::Segment(i, assist);
            }
            // The running segment with the most pieces nobody has claimed, if worth a copier.
            if let Some(a) = st
                .assists
                .iter()
                .max_by_key(|a| a.unclaimed())
                .filter(|a| a.unclaimed() >= 2)
            {
                return Work::Help(Arc::clone(a));
            }
            if st.left == 0 || st.running == 0 {
                // `running == 0` with segments left cannot happen (the plan's order has every
                // wait before its segment); stop rather than wait for ever.
                return Work::Nothing;
            }
            st = self
                .changed
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Copies pieces ahead for `assist`'s thread until they are all claimed or a segment can start.
    fn help(&self, assist: &Assist) {
        loop {
            match assist.help(self.source) {
                Help::Done => return,
                Help::Copied => {}
                Help::Full => std::thread::yield_now(),
            }
            if self.ready_len.load(Ordering::Acquire) > 0 {
                return;
            }
        }
    }

    /// Reads segment `seg` piece by piece, each piece feeding its file's digest, its chunk's and
    /// its tensor's (whose earlier bytes are all fed: the segments it waited for are done).
    /// Returns the files and tensors it finished.
    fn hash_segment(&self, seg: usize, assist: &Arc<Assist>, buf: &mut Vec<u8>) -> Vec<Done> {
        let s = self.plan.segments[seg];
        let with_files = self.plan.fused;
        let (name, size) = self.plan.files[s.file];
        let tensor = s
            .chunk
            .and_then(|(t, k)| Some((t, k, self.plan.tensors.get(t)?)));
        let feed = tensor.is_some_and(|(t, k, _)| k < self.plan.feed_until[t]);
        let (mut file_h, mut tensor_h) = {
            let mut st = self.lock();
            let file_h = if with_files {
                st.files[s.file].hasher.take()
            } else {
                None
            };
            let tensor_h = match tensor {
                Some((t, _, _)) if feed => st.tensors[t].hasher.take(),
                _ => None,
            };
            (file_h, tensor_h)
        };
        let mut chunk_h = tensor.and_then(|(_, k, x)| {
            chunk_hasher(
                self.options.algorithm,
                x.entry,
                x.pieces.len(),
                x.rows,
                &x.pieces[k],
            )
        });
        let error = self.read_segment(s, assist, buf, [&mut file_h, &mut chunk_h, &mut tensor_h]);
        // Copiers stop: the pieces left (after an error) are not wanted.
        assist.close();

        let mut out = Vec::new();
        let mut finished = None;
        let mut st = self.lock();
        if with_files {
            let f = &mut st.files[s.file];
            match &error {
                None => f.hasher = file_h,
                Some(e) => {
                    f.error.get_or_insert_with(|| e.clone());
                }
            }
            if s.end == size {
                out.push(file_done(name, size, f.error.take(), f.hasher.take()));
            }
        }
        if let Some((t, k, x)) = tensor {
            // A read failed: the chunk is not hashed (the second stage reads it again and names
            // the failure), and a tensor fed here is hashed again on its own.
            let ts = &mut st.tensors[t];
            if error.is_none() {
                ts.chunks[k] = Chunk::of(chunk_h);
            }
            if feed {
                if error.is_some() {
                    ts.broken = true;
                } else if !ts.broken {
                    ts.hasher = tensor_h;
                    if k + 1 == x.pieces.len() {
                        ts.finished = true;
                        finished = ts
                            .hasher
                            .take()
                            .map(|h| (h, std::mem::take(&mut ts.chunks)));
                    }
                }
            }
        }
        st.running -= 1;
        st.assists.retain(|a| !Arc::ptr_eq(a, assist));
        for j in self.next[seg].into_iter().flatten() {
            st.waits[j] -= 1;
            if st.waits[j] == 0 {
                st.ready.insert(j);
            }
        }
        self.ready_len.store(st.ready.len(), Ordering::Release);
        drop(st);
        self.changed.notify_all();
        if let (Some((_, _, x)), Some((h, chunks))) = (tensor, finished) {
            out.push(finish(x, h.finish(), chunks));
        }
        out
    }

    /// Feeds segment `s`'s pieces, in order, to `hashers` (the file's, then the chunk's and the
    /// tensor's, which take the region's bytes only); the error of a piece that cannot be read.
    fn read_segment(
        &self,
        s: Segment,
        assist: &Assist,
        buf: &mut Vec<u8>,
        hashers: [&mut Option<Hasher>; 3],
    ) -> Option<String> {
        let [file_h, chunk_h, tensor_h] = hashers;
        let name = self.plan.files[s.file].0;
        let mut error: Option<String> = None;
        let mut update = |bytes: &[u8], at: u64| {
            if let Some(h) = file_h.as_mut() {
                h.update(bytes);
            }
            if at >= s.region {
                for h in [&mut *chunk_h, &mut *tensor_h].into_iter().flatten() {
                    h.update(bytes);
                }
            }
        };
        for i in 0..assist.pieces.count() {
            let (a, b) = assist.pieces.range(i);
            match assist.take(i, self.source) {
                Piece::Own => {
                    let n = usize::try_from(b - a).unwrap_or(PIECE_BYTES);
                    if buf.len() < n {
                        buf.resize(n, 0);
                    }
                    if let Err(e) = self.source.read_range_into(name, a, &mut buf[..n]) {
                        error = Some(format!("{name}: bytes {a}..{b}: {e}"));
                        break;
                    }
                    update(&buf[..n], a);
                }
                Piece::Copied(taken) => match taken.bytes() {
                    Ok(bytes) => update(bytes, a),
                    Err(e) => {
                        error = Some(e.to_owned());
                        break;
                    }
                },
            }
        }
        error
    }

    /// The digest of file `f`, read on its own.
    fn hash_file(&self, f: usize, buf: &mut Vec<u8>) -> Done {
        let (name, size) = self.plan.files[f];
        // The whole file as one segment outside any tensor, read by this thread alone.
        let all = Pieces {
            start: 0,
            region: size,
            end: size,
        };
        let segment = Segment {
            file: f,
            start: 0,
            region: size,
            end: size,
            chunk: None,
        };
        let alone = Assist::new(all, name, 1, &self.spare);
        let mut h = Some(Hasher::new(self.options.algorithm));
        let error = self.read_segment(segment, &alone, buf, [&mut h, &mut None, &mut None]);
        file_done(name, size, error, h)
    }

    /// The second stage for tensor `t`: feeds the pieces not fed with their files (re-reading
    /// them), or hashes it again on its own after a read failed. `None` when it is done.
    fn resume(&self, reader: &mut Reader<'_>, t: usize, buf: &mut Vec<u8>) -> Option<Done> {
        let x = &self.plan.tensors[t];
        let (hasher, chunks, broken) = {
            let mut st = self.lock();
            let ts = &mut st.tensors[t];
            if ts.finished {
                return None;
            }
            (ts.hasher.take(), std::mem::take(&mut ts.chunks), ts.broken)
        };
        let algorithm = self.options.algorithm;
        let Some(hasher) = hasher.filter(|_| !broken) else {
            return Some(run_entry(reader, x.entry, algorithm, buf));
        };
        let from = self.plan.feed_until[t];
        Some(
            match resume_slabs(
                reader, x.entry, algorithm, x.rows, &x.pieces, from, hasher, chunks, buf,
            ) {
                Ok(d) => Done::Tensor(x.entry.key.clone(), d),
                Err(err) => Done::Failed(x.entry.key.clone(), with_places(x.entry, &err)),
            },
        )
    }
}

fn finish(x: &Streamed<'_>, digest: String, chunks: Vec<Chunk>) -> Done {
    let key = x.entry.key.clone();
    match slab_digest(x.entry, x.rows, &x.pieces, digest, chunks) {
        Ok(d) => Done::Tensor(key, d),
        Err(err) => Done::Failed(key, with_places(x.entry, &err)),
    }
}

#[cfg(test)]
mod tests {
    use super::{Segment, order};

    /// Files as lists of `(tensor, piece)` chunks, each 10 bytes, laid out back to back.
    fn files(layout: &[&[(usize, usize)]]) -> Vec<Vec<Segment>> {
        layout
            .iter()
            .enumerate()
            .map(|(f, chunks)| {
                (0u64..)
                    .zip(chunks.iter())
                    .map(|(i, &c)| Segment {
                        file: f,
                        start: 10 * i,
                        region: 10 * i,
                        end: 10 * i + 10,
                        chunk: Some(c),
                    })
                    .collect()
            })
            .collect()
    }

    /// Every segment once; each file's in file order (with files); each tensor's fed pieces in
    /// order, and a tensor's pieces fed with the files are a prefix of them.
    fn check(per_file: &[Vec<Segment>], pieces: &[usize], with_files: bool) -> Vec<usize> {
        let (out, feed_until) = order(per_file, pieces, with_files);
        assert_eq!(out.len(), per_file.iter().map(Vec::len).sum::<usize>());
        let pos = |s: &Segment| {
            out.iter()
                .position(|o| o.file == s.file && o.start == s.start)
                .unwrap()
        };
        for segments in per_file {
            let at: Vec<usize> = segments.iter().map(pos).collect();
            if with_files {
                assert!(at.windows(2).all(|w| w[0] < w[1]), "file order: {at:?}");
            }
        }
        for (t, &n) in pieces.iter().enumerate() {
            assert!(feed_until[t] <= n);
            let at: Vec<usize> = (0..feed_until[t])
                .map(|k| {
                    let s = per_file
                        .iter()
                        .flatten()
                        .find(|s| s.chunk == Some((t, k)))
                        .unwrap();
                    pos(s)
                })
                .collect();
            assert!(at.windows(2).all(|w| w[0] < w[1]), "tensor {t}: {at:?}");
        }
        feed_until
    }

    #[test]
    fn fsdp_files_are_fed_in_one_pass() {
        // Rank r's file holds chunk r of every tensor, in the same key order.
        let layout = files(&[
            &[(0, 0), (1, 0), (2, 0)],
            &[(0, 1), (1, 1), (2, 1)],
            &[(0, 2), (1, 2), (2, 2)],
        ]);
        assert_eq!(check(&layout, &[3, 3, 3], true), [3, 3, 3]);
        // The files take turns: chunk 0 of x, then chunk 1 of x, ...
        let (out, _) = order(&layout, &[3, 3, 3], true);
        assert_eq!(out[1].chunk, Some((0, 1)));
    }

    #[test]
    fn a_crossing_is_fed_after_from_where_it_crosses() {
        // File 0 holds x's chunk 1 before y's chunk 0; file 1 y's chunk 1 before x's chunk 0.
        let layout = files(&[&[(0, 1), (1, 0)], &[(1, 1), (0, 0)]]);
        let feed = check(&layout, &[2, 2], true);
        assert_eq!(feed.iter().filter(|&&f| f < 2).count(), 1, "{feed:?}");
        // Without file digests nothing crosses.
        assert_eq!(check(&layout, &[2, 2], false), [2, 2]);
        // Longer cycles over three files, and a tensor crossing twice.
        let layout = files(&[
            &[(2, 1), (0, 0), (1, 2)],
            &[(0, 1), (1, 1), (2, 0)],
            &[(1, 0), (2, 2), (0, 2)],
        ]);
        check(&layout, &[3, 3, 3], true);
        check(&layout, &[3, 3, 3], false);
        let layout = files(&[&[(0, 3), (0, 1)], &[(0, 2), (0, 0)]]);
        let feed = check(&layout, &[4], true);
        assert!(feed[0] < 4);
    }
}
