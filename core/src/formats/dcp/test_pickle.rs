//! Tests only: `.metadata` pickles of any number of chunks, written opcode by opcode as Python's
//! pickler (protocol 4) writes torch's classes: `NEWOBJ` + `BUILD` of a state dict per object,
//! `torch.Size` by `REDUCE`, every value memoized, repeated strings and globals fetched from the
//! memo, `SETITEMS`/`APPENDS` in batches of 1000.

use std::collections::HashMap;

const META: &str = "torch.distributed.checkpoint.metadata";

/// One tensor of the generated checkpoint: `rows` rows split into `chunks` dim-0 chunks, chunk `c`
/// in `__{c % ranks}_0.distcp`.
pub(crate) struct GenTensor {
    pub(crate) fqn: String,
    pub(crate) rows: u64,
    pub(crate) cols: u64,
    pub(crate) chunks: u64,
    /// Its `storage_data` records in the reverse order of its chunk list.
    pub(crate) reversed_records: bool,
    /// Its last chunk has no `storage_data` record.
    pub(crate) drop_last_record: bool,
}

#[derive(Default)]
struct Pickler {
    out: Vec<u8>,
    memo: HashMap<String, u32>,
    next: u32,
}

impl Pickler {
    fn memoize(&mut self) -> u32 {
        self.out.push(0x94);
        self.next += 1;
        self.next - 1
    }

    fn get(&mut self, i: u32) {
        if let Ok(b) = u8::try_from(i) {
            self.out.extend([b'h', b]);
        } else {
            self.out.push(b'j');
            self.out.extend(i.to_le_bytes());
        }
    }

    /// A memoized value the first time, a memo fetch afterwards.
    fn shared(&mut self, key: &str, write: impl FnOnce(&mut Self)) {
        if let Some(&i) = self.memo.get(key) {
            return self.get(i);
        }
        write(self);
        let i = self.memoize();
        self.memo.insert(key.to_owned(), i);
    }

    fn str(&mut self, s: &str) {
        self.shared(&format!("s:{s}"), |p| {
            p.out.push(0x8c);
            p.out.push(u8::try_from(s.len()).unwrap());
            p.out.extend(s.as_bytes());
        });
    }

    fn global(&mut self, module: &str, name: &str) {
        self.shared(&format!("g:{module}:{name}"), |p| {
            p.str(module);
            p.str(name);
            p.out.push(0x93);
        });
    }

    fn int(&mut self, v: u64) {
        if let Ok(b) = u8::try_from(v) {
            self.out.extend([b'K', b]);
        } else if let Ok(w) = u16::try_from(v) {
            self.out.push(b'M');
            self.out.extend(w.to_le_bytes());
        } else {
            self.out.push(b'J');
            self.out.extend(i32::try_from(v).unwrap().to_le_bytes());
        }
    }

    fn tuple_of(&mut self, n: usize) {
        match n {
            0 => self.out.push(b')'),
            1..=3 => self.out.push(0x84 + n as u8),
            _ => unreachable!(),
        }
        if n > 0 {
            self.memoize();
        }
    }

    fn size(&mut self, dims: &[u64]) {
        self.global("torch", "Size");
        for &d in dims {
            self.int(d);
        }
        self.tuple_of(dims.len());
        self.tuple_of(1);
        self.out.push(b'R');
        self.memoize();
    }

    /// `NEWOBJ` of the class, then the start of its state dict.
    fn object(&mut self, module: &str, name: &str) {
        self.global(module, name);
        self.out.extend([b')', 0x81]);
        self.memoize();
        self.out.push(b'}');
        self.memoize();
        self.out.push(b'(');
    }

    fn end_object(&mut self) {
        self.out.extend([b'u', b'b']);
    }

    /// Closes a batch of `SETITEMS`/`APPENDS` every 1000 items.
    fn batch(&mut self, i: usize, close: u8) {
        if i % 1000 == 999 {
            self.out.extend([close, b'(']);
        }
    }

    fn properties(&mut self) {
        self.global(META, "TensorProperties");
        self.out.extend([b')', 0x81]);
        self.memoize();
        self.out.push(b'(');
        self.global("torch", "float32");
        self.shared("layout", |p| {
            p.global("torch.serialization", "_get_layout");
            p.str("torch.strided");
            p.tuple_of(1);
            p.out.push(b'R');
        });
        self.out.push(0x89);
        self.shared("format", |p| {
            p.global(META, "_MEM_FORMAT_ENCODING");
            p.int(0);
            p.tuple_of(1);
            p.out.push(b'R');
        });
        self.out.push(0x89);
        self.out.push(b't');
        self.memoize();
        self.out.push(b'b');
    }
}

/// The `.metadata` bytes of `tensors` over `ranks` files, with a bytes item `extra` when given.
#[allow(
    clippy::too_many_lines,
    reason = "the opcodes of a whole `.metadata`, in the order Python's pickler writes them"
)]
pub(crate) fn metadata(tensors: &[GenTensor], ranks: u64, extra: Option<&str>) -> Vec<u8> {
    let mut p = Pickler::default();
    p.out.extend([0x80, 4]);
    p.object(META, "Metadata");
    p.str("state_dict_metadata");
    p.out.push(b'}');
    p.memoize();
    p.out.push(b'(');
    let rows_of = |t: &GenTensor, c: u64| -> (u64, u64) {
        let per = t.rows.div_ceil(t.chunks);
        let start = (c * per).min(t.rows);
        (start, per.min(t.rows - start))
    };
    for (i, t) in tensors.iter().enumerate() {
        p.str(&t.fqn);
        p.object(META, "TensorStorageMetadata");
        p.str("properties");
        p.properties();
        p.str("size");
        p.size(&[t.rows, t.cols]);
        p.str("chunks");
        p.out.push(b']');
        p.memoize();
        p.out.push(b'(');
        for c in 0..t.chunks {
            let (start, n) = rows_of(t, c);
            p.object(META, "ChunkStorageMetadata");
            p.str("offsets");
            p.size(&[start, 0]);
            p.str("sizes");
            p.size(&[n, t.cols]);
            p.end_object();
            p.batch(c as usize, b'e');
        }
        p.out.push(b'e');
        p.end_object();
        p.batch(i, b'u');
    }
    if let Some(key) = extra {
        p.str(key);
        p.global(META, "BytesStorageMetadata");
        p.out.extend([b')', 0x81]);
        p.memoize();
    }
    p.out.push(b'u');
    p.str("planner_data");
    p.out.push(b'}');
    p.memoize();
    p.out.push(b'(');
    for t in tensors {
        p.str(&t.fqn);
        let parts: Vec<&str> = t.fqn.split('.').collect();
        for part in &parts[..2] {
            p.str(part);
        }
        p.tuple_of(2);
    }
    p.out.push(b'u');
    p.str("storage_data");
    p.out.push(b'}');
    p.memoize();
    p.out.push(b'(');
    let mut n = 0usize;
    let mut offsets = vec![0u64; usize::try_from(ranks).unwrap()];
    let mut record =
        |p: &mut Pickler, fqn: &str, offset: Option<(u64, u64)>, rank: u64, len: u64| {
            p.object(META, "MetadataIndex");
            p.str("fqn");
            p.str(fqn);
            p.str("offset");
            match offset {
                Some((r, c)) => p.size(&[r, c]),
                None => p.out.push(b'N'),
            }
            p.str("index");
            p.out.push(b'N');
            p.end_object();
            p.object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
            p.str("relative_path");
            p.str(&format!("__{rank}_0.distcp"));
            p.str("offset");
            let at = &mut offsets[usize::try_from(rank).unwrap()];
            p.int(*at);
            *at += len;
            p.str("length");
            p.int(len);
            p.str("transform_descriptors");
            p.out.push(b'N');
            p.end_object();
            p.batch(n, b'u');
            n += 1;
        };
    for t in tensors {
        let mut order: Vec<u64> = (0..t.chunks).collect();
        if t.drop_last_record {
            order.pop();
        }
        if t.reversed_records {
            order.reverse();
        }
        for c in order {
            let (start, rows) = rows_of(t, c);
            record(
                &mut p,
                &t.fqn,
                Some((start, 0)),
                c % ranks,
                600 + rows * t.cols * 4,
            );
        }
    }
    if let Some(key) = extra {
        record(&mut p, key, None, 0, 300);
    }
    p.out.push(b'u');
    p.str("storage_meta");
    p.out.push(b'N');
    p.str("version");
    p.str("1.0.0");
    p.end_object();
    p.out.push(b'.');
    p.out
}
