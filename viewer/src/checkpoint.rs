//! Opening checkpoints: gathering files into a [`Source`] (files or a folder on the desktop, read by
//! byte range; dropped files or the members of one `.zip` in the browser), indexing them with
//! `Checkpoint::open` (metadata only) and deriving what the checkpoint panels draw.

#[cfg(not(target_arch = "wasm32"))]
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;

use shardscope_core::checkpoint::{Checkpoint, ReadOptions};
use shardscope_core::index::{CheckpointIndex, EntryKind, IndexEntry, IndexError, PathSeg, Role};
#[cfg(not(target_arch = "wasm32"))]
use shardscope_core::source::SourceError;
use shardscope_core::source::{MemorySource, Source};
use shardscope_core::view::hints::{LayoutHints, layout_hints};

/// Why a checkpoint cannot be opened.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CheckpointError {
    /// The checkpoint could not be opened (`Checkpoint::open`: its files, or its view).
    #[error("{message}")]
    Open { message: String },
    /// The index could not be built.
    #[error("{name}: {source}")]
    Index {
        name: String,
        #[source]
        source: Box<IndexError>,
    },
    /// A `.zip` of a folder could not be read.
    #[error("{name}: not a readable zip: {message}")]
    Zip { name: String, message: String },
    /// The inputs are larger than the viewer accepts.
    #[error("{name}: {what}")]
    TooLarge { name: String, what: String },
}

/// Most bytes a `.zip` may expand to in memory (the browser has no other place for them).
pub const MAX_ZIP_EXPANDED: u64 = 2 << 30;

/// File names the checkpoint readers understand (everything else of a folder is left alone).
pub fn is_checkpoint_name(name: &str) -> bool {
    let base = name.rsplit(['/', '\\']).next().unwrap_or(name);
    // A trainer's state files belong to its checkpoint folder too (torch_checkpointing's
    // `metadata.pkl`, accelerate's `random_states_{rank}.pkl`, the HF Trainer's state).
    if base == ".metadata"
        || base.ends_with(".safetensors.index.json")
        || base == "trainer_state.json"
    {
        return true;
    }
    let ext = base.rsplit_once('.').map_or("", |(_, e)| e);
    matches!(
        ext,
        "pt" | "pth" | "bin" | "ckpt" | "tar" | "safetensors" | "distcp" | "zip" | "pkl"
    )
}

/// True for `*.zip` (any case).
fn is_zip_name(name: &str) -> bool {
    name.rsplit_once('.')
        .is_some_and(|(_, e)| e.eq_ignore_ascii_case("zip"))
}

/// Expands the members of a `.zip` (e.g. a zipped DCP folder) into `out`, named by their path.
pub fn expand_zip(name: &str, bytes: &[u8], out: &mut MemorySource) -> Result<(), CheckpointError> {
    let zip_err = |e: &dyn std::fmt::Display| CheckpointError::Zip {
        name: name.to_owned(),
        message: e.to_string(),
    };
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(bytes)).map_err(|e| zip_err(&e))?;
    let mut total = 0u64;
    for i in 0..archive.len() {
        let mut member = archive.by_index(i).map_err(|e| zip_err(&e))?;
        if member.is_dir() {
            continue;
        }
        let Some(path) = member.enclosed_name() else {
            return Err(zip_err(&format!(
                "member `{}` has an unsafe path",
                member.name().unwrap_or_default()
            )));
        };
        let member_name = path.to_string_lossy().replace('\\', "/");
        let size = member.size();
        total = total.saturating_add(size);
        if total > MAX_ZIP_EXPANDED {
            return Err(CheckpointError::TooLarge {
                name: name.to_owned(),
                what: format!("expands to more than {MAX_ZIP_EXPANDED} bytes"),
            });
        }
        // The declared size bounds the allocation; `take` bounds what is read.
        let cap = usize::try_from(size).map_err(|e| zip_err(&e))?;
        let mut data = Vec::with_capacity(cap.min(bytes.len().saturating_mul(1032)));
        member
            .by_ref()
            .take(size)
            .read_to_end(&mut data)
            .map_err(|e| zip_err(&format!("member `{member_name}`: {e}")))?;
        if data.len() as u64 != size {
            return Err(zip_err(&format!(
                "member `{member_name}` holds {} bytes, its header says {size}",
                data.len()
            )));
        }
        out.insert(member_name, data);
    }
    Ok(())
}

/// Files on disk, read by byte range on demand (only metadata is ever read while indexing).
#[cfg(not(target_arch = "wasm32"))]
#[derive(Debug, Clone, Default)]
pub struct FsSource {
    files: BTreeMap<String, std::path::PathBuf>,
}

#[cfg(not(target_arch = "wasm32"))]
impl FsSource {
    /// Adds a file under `name`.
    pub fn insert(&mut self, name: String, path: std::path::PathBuf) {
        self.files.insert(name, path);
    }

    /// Every file under `dir` (subfolders up to 4 levels), named relative to it, but temporaries
    /// (`*.tmp`): what is read, named as not read or refused is `Checkpoint::open`'s to decide, as
    /// for the command line (a trainer's JSON and raw per-rank items may have any name).
    pub fn from_dir(dir: &std::path::Path) -> std::io::Result<Self> {
        fn walk(
            root: &std::path::Path,
            dir: &std::path::Path,
            depth: usize,
            out: &mut FsSource,
        ) -> std::io::Result<()> {
            for entry in std::fs::read_dir(dir)? {
                let path = entry?.path();
                if path.is_dir() {
                    if depth < 4 {
                        walk(root, &path, depth + 1, out)?;
                    }
                    continue;
                }
                let rel = path
                    .strip_prefix(root)
                    .unwrap_or(&path)
                    .to_string_lossy()
                    .replace('\\', "/");
                let temporary = rel
                    .rsplit_once('.')
                    .is_some_and(|(_, e)| e.eq_ignore_ascii_case("tmp"));
                if !temporary {
                    out.insert(rel, path);
                }
            }
            Ok(())
        }
        let mut out = Self::default();
        walk(dir, dir, 0, &mut out)?;
        Ok(out)
    }

    /// True when no file was found.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The `.zip` files among the inputs.
    fn zips(&self) -> Vec<(String, std::path::PathBuf)> {
        self.files
            .iter()
            .filter(|(n, _)| is_zip_name(n))
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect()
    }

    fn path(&self, name: &str) -> Result<&std::path::PathBuf, SourceError> {
        self.files.get(name).ok_or_else(|| SourceError::NotFound {
            name: name.to_owned(),
        })
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl Source for FsSource {
    fn reads_are_local(&self) -> bool {
        true
    }

    fn names(&self) -> Vec<String> {
        self.files.keys().cloned().collect()
    }

    fn size(&self, name: &str) -> Result<u64, SourceError> {
        let path = self.path(name)?;
        std::fs::metadata(path)
            .map(|m| m.len())
            .map_err(|e| SourceError::Io {
                name: name.to_owned(),
                message: e.to_string(),
            })
    }

    /// A positioned read into a new buffer ([`Source::read_range_into`]).
    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Cow<'_, [u8]>, SourceError> {
        let path = self.path(name)?;
        // The range is checked before anything is allocated for it.
        shardscope_core::source::checked_range(name, offset, len, self.size(name)?)?;
        let len = usize::try_from(len).map_err(|_| SourceError::Io {
            name: path.display().to_string(),
            message: format!("cannot hold {len} bytes of it in memory"),
        })?;
        let mut buf = Vec::new();
        buf.try_reserve_exact(len).map_err(|_| SourceError::Io {
            name: path.display().to_string(),
            message: format!("cannot hold {len} bytes of it in memory"),
        })?;
        buf.resize(len, 0);
        self.read_range_into(name, offset, &mut buf)?;
        Ok(Cow::Owned(buf))
    }

    /// A positioned read (never a memory map: a file truncated while it is read is an error
    /// naming it, not a `SIGBUS`).
    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        use std::os::unix::fs::FileExt;
        let path = self.path(name)?;
        let io = |what: &str, e: std::io::Error| SourceError::Io {
            name: path.display().to_string(),
            message: format!("{what}: {e}"),
        };
        let len = out.len() as u64;
        let file = std::fs::File::open(path).map_err(|e| io("cannot open", e))?;
        let size = file.metadata().map_err(|e| io("cannot stat", e))?.len();
        shardscope_core::source::checked_range(name, offset, len, size)?;
        match file.read_exact_at(out, offset) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                let now = file.metadata().map_or(0, |m| m.len());
                Err(SourceError::Io {
                    name: path.display().to_string(),
                    message: format!(
                        "the file changed while it was read (it was {size} bytes, now {now} bytes); \
                         was it being written or replaced?"
                    ),
                })
            }
            Err(e) => Err(io(
                &format!("cannot read {len} bytes at offset {offset}"),
                e,
            )),
        }
    }
}

/// Opens files on disk as one checkpoint (`.zip` files are expanded into memory).
#[cfg(not(target_arch = "wasm32"))]
pub fn open_files(
    name: &str,
    source: &FsSource,
    options: &ReadOptions,
) -> Result<CheckpointView, CheckpointError> {
    let zips = source.zips();
    if zips.is_empty() {
        let mut view = CheckpointView::build(name, source, options)?;
        view.origin = Some(Origin::Files(source.clone()));
        return Ok(view);
    }
    let mut mem = MemorySource::new();
    for (zname, path) in zips {
        let bytes = std::fs::read(&path).map_err(|e| CheckpointError::Zip {
            name: zname.clone(),
            message: e.to_string(),
        })?;
        expand_zip(&zname, &bytes, &mut mem)?;
    }
    let mut view = CheckpointView::build(name, &mem, options)?;
    view.origin = Some(Origin::Files(source.clone()));
    Ok(view)
}

/// Opens in-memory files (browser drops, tests) as one checkpoint; `.zip` files are expanded.
pub fn open_memory(
    name: &str,
    files: Vec<(String, Vec<u8>)>,
    options: &ReadOptions,
) -> Result<CheckpointView, CheckpointError> {
    let mut mem = MemorySource::new();
    for (fname, bytes) in files {
        if is_zip_name(&fname) {
            expand_zip(&fname, &bytes, &mut mem)?;
        } else {
            mem.insert(fname, bytes);
        }
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let mem = std::sync::Arc::new(mem);
        let mut view = CheckpointView::build(name, &*mem, options)?;
        view.origin = Some(Origin::Memory(mem));
        Ok(view)
    }
    // The browser keeps no second copy of dropped files.
    #[cfg(target_arch = "wasm32")]
    CheckpointView::build(name, &mem, options)
}

/// Where an opened checkpoint's files are, so that it can be read again (the A/B compare reads
/// its tensors, which opening it never does).
#[derive(Debug, Clone)]
pub enum Origin {
    /// Files on disk, read by byte range.
    #[cfg(not(target_arch = "wasm32"))]
    Files(FsSource),
    /// Files held in memory (opened as bytes; `.zip` members expanded).
    Memory(std::sync::Arc<MemorySource>),
}

impl Origin {
    /// The files on disk at `path` (a folder's checkpoint files, or one file), as the loader
    /// reads them.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_path(path: &std::path::Path) -> Result<Self, CheckpointError> {
        let io = |message: String| CheckpointError::Open {
            message: format!("{message}: {}", path.display()),
        };
        if path.is_dir() {
            let source = FsSource::from_dir(path).map_err(|e| io(format!("cannot list ({e})")))?;
            if source.is_empty() {
                return Err(io("no checkpoint files in the folder".to_owned()));
            }
            return Ok(Self::Files(source));
        }
        if !path.is_file() {
            return Err(io("no such file or folder".to_owned()));
        }
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let mut source = FsSource::default();
        source.insert(name, path.to_path_buf());
        Ok(Self::Files(source))
    }

    /// A source reading these files (`.zip` files are expanded into memory first, as
    /// [`open_files`] does).
    pub fn source(&self) -> Result<Box<dyn Source + Send + Sync>, CheckpointError> {
        match self {
            #[cfg(not(target_arch = "wasm32"))]
            Self::Files(fs) => {
                let zips = fs.zips();
                if zips.is_empty() {
                    return Ok(Box::new(fs.clone()));
                }
                let mut mem = MemorySource::new();
                for (zname, path) in zips {
                    let bytes = std::fs::read(&path).map_err(|e| CheckpointError::Zip {
                        name: zname.clone(),
                        message: e.to_string(),
                    })?;
                    expand_zip(&zname, &bytes, &mut mem)?;
                }
                Ok(Box::new(mem))
            }
            Self::Memory(mem) => Ok(Box::new(SharedMemory(mem.clone()))),
        }
    }
}

/// An in-memory source shared with the opened checkpoint.
#[derive(Debug)]
struct SharedMemory(std::sync::Arc<MemorySource>);

impl Source for SharedMemory {
    fn names(&self) -> Vec<String> {
        self.0.names()
    }
    fn size(&self, name: &str) -> Result<u64, shardscope_core::source::SourceError> {
        self.0.size(name)
    }
    fn read_range(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<std::borrow::Cow<'_, [u8]>, shardscope_core::source::SourceError> {
        self.0.read_range(name, offset, len)
    }
    fn whole_reads_are_cheap(&self) -> bool {
        self.0.whole_reads_are_cheap()
    }
    fn lends_ranges(&self) -> bool {
        self.0.lends_ranges()
    }
    fn reads_are_local(&self) -> bool {
        self.0.reads_are_local()
    }
}

/// One optimizer state of one parameter (`state[param][name]`).
#[derive(Debug, Clone)]
pub struct StateRow {
    pub name: String,
    /// Index into [`CheckpointView::index`]`.entries`.
    pub entry: usize,
    pub ranks: Vec<u64>,
    /// The value when it is a scalar (`step`).
    pub value: Option<String>,
}

/// Everything the checkpoint panels draw, derived once from the index.
#[derive(Debug, Clone)]
pub struct CheckpointView {
    pub name: String,
    pub index: CheckpointIndex,
    /// Position of each key in `index.entries`.
    pub by_key: BTreeMap<String, usize>,
    /// Ranks holding each entry (parallel to `index.entries`).
    pub ranks: Vec<Vec<u64>>,
    /// Every rank holding anything.
    pub all_ranks: Vec<u64>,
    pub chunk_count: usize,
    /// Optimizer state per parameter (the param id or FQN as written), states sorted by name.
    pub optimizer: BTreeMap<String, Vec<StateRow>>,
    /// `param_groups[i]` leaves: group → (key, value text).
    pub param_groups: BTreeMap<i64, Vec<(String, String)>>,
    /// Counts rebuilds of cached panel state.
    pub generation: u64,
    /// `shardscope doctor` findings on the checkpoint alone (no target model), shown in the
    /// Verify tab next to the keys they name.
    pub findings: Vec<shardscope_core::doctor::Finding>,
    /// What the checkpoint states about its FSDP configuration (`Checkpoint::hints`).
    pub hints: LayoutHints,
    /// How the checkpoint was read, for people (`Checkpoint::notes`).
    pub notes: Vec<String>,
    /// The model description the checkpoint implies on its own (`Checkpoint::describe_auto`: the
    /// model part, its repeated blocks and the root as units), for the layout panels; `None` when
    /// none can be derived (why: in `notes`).
    pub derived: Option<DerivedModel>,
    /// Where its files are, to read them again (A/B compare); `None` in the browser.
    pub origin: Option<Origin>,
    /// A DeepSpeed ZeRO checkpoint's flat partitions as saved, which the shard map draws
    /// ([`crate::view::LayoutView::from_deepspeed`]).
    pub partitions: Option<shardscope_core::index::deepspeed_partitions::Partitions>,
}

/// A model description derived from an opened checkpoint, with the unit patterns chosen.
#[derive(Debug, Clone)]
pub struct DerivedModel {
    pub model: shardscope_core::model::ModelDescription,
    /// The unit patterns, as the user edits them: module lists with `N` for the block number
    /// (`model.layers.N`), comma-separated.
    pub unit_patterns: String,
    /// What was derived, for people (the model part, units, tied weights).
    pub notes: Vec<String>,
}

/// Whether the module prefix `prefix` matches one of `patterns` (comma-separated dotted patterns;
/// a segment `N` matches a block number, `*` any one segment).
pub fn matches_unit_patterns(patterns: &str, prefix: &str) -> bool {
    patterns
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .any(|p| {
            let want: Vec<&str> = p.split('.').collect();
            let got: Vec<&str> = prefix.split('.').collect();
            want.len() == got.len()
                && want.iter().zip(&got).all(|(w, g)| match *w {
                    "N" => !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()),
                    "*" => !g.is_empty(),
                    w => w == *g,
                })
        })
}

fn derive_model(checkpoint: &Checkpoint, source: &dyn Source) -> Result<DerivedModel, String> {
    let auto = checkpoint
        .describe_auto(source)
        .map_err(|e| e.to_string())?;
    let unit_patterns = auto
        .blocks
        .iter()
        .map(|(l, _)| format!("{l}.N"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut notes = Vec::new();
    if let Some(p) = auto.select {
        notes.push(format!("the model is under `{p}` (an app-state key)"));
    }
    notes.push(if auto.blocks.is_empty() {
        "units: no repeated blocks found; the root only".to_owned()
    } else {
        format!(
            "units: {} and the root, as transformer-block auto-wrap policies wrap them",
            auto.blocks
                .iter()
                .map(|(l, n)| format!("{l}.N ({n} blocks)"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    });
    notes.extend(
        auto.described
            .notes
            .iter()
            .map(|n| n.trim_start_matches("note: ").to_owned()),
    );
    let mut model = auto.described.derived.model;
    let mut unit_patterns = unit_patterns;
    // Several dtypes: FSDP1 flattens one dtype per unit, so each module holding parameters is a
    // unit (when no module mixes dtypes itself).
    if let Ok((uniform, shardscope_core::index::from_index::UnitChoice::PerModule { dtypes, .. })) =
        shardscope_core::index::from_index::uniform_dtype_units(&model)
    {
        notes.push(format!(
            "parameters of several dtypes ({}): each module holding parameters is a unit",
            dtypes.join(", ")
        ));
        unit_patterns = uniform
            .units
            .iter()
            .filter(|u| !u.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(", ");
        model = uniform;
    }
    Ok(DerivedModel {
        model,
        unit_patterns,
        notes,
    })
}

/// Scalar tensors no larger than this are read to show their value (`step`).
const MAX_SCALAR_BYTES: u64 = 16;
/// Most stored copies of a scalar that are read (one per rank).
const MAX_SCALAR_CHUNKS: usize = 4096;

/// A scalar `step` tensor (optimizer step counters), whose value the panels show.
fn is_step_scalar(e: &IndexEntry) -> bool {
    let is_step = matches!(e.path.last(), Some(PathSeg::Key(k)) if k == "step");
    let scalar_chunks = e.chunks.len() <= MAX_SCALAR_CHUNKS
        && e.chunks
            .iter()
            .all(|c| c.numel() == Some(1) && c.byte_length <= MAX_SCALAR_BYTES);
    is_step && e.kind == EntryKind::Tensor && scalar_chunks
}

impl CheckpointView {
    /// Indexes `source` and reads the few values the panels show (bytes items, scalar `step`
    /// tensors); no other tensor bytes are read.
    pub fn build(
        name: &str,
        source: &dyn Source,
        options: &ReadOptions,
    ) -> Result<Self, CheckpointError> {
        let checkpoint = Checkpoint::open(source, name, options).map_err(|e| match e {
            shardscope_core::checkpoint::CheckpointError::Index { source, .. } => {
                CheckpointError::Index {
                    name: name.to_owned(),
                    source,
                }
            }
            other => CheckpointError::Open {
                message: other.to_string(),
            },
        })?;
        Self::from_checkpoint(checkpoint, source)
    }

    /// The view of a checkpoint opened by `Checkpoint::open` from `source` (the browser opens it
    /// itself, fetching the ranges it reads as it goes).
    pub fn from_checkpoint(
        checkpoint: Checkpoint,
        source: &dyn Source,
    ) -> Result<Self, CheckpointError> {
        let derived = derive_model(&checkpoint, source);
        Self::from_checkpoint_derived(checkpoint, derived, source)
    }

    /// The model description [`CheckpointView::from_checkpoint`] derives from the checkpoint
    /// alone (it reads a few bytes of `source`: tied-weight probes), or why there is none. The
    /// browser derives it first, fetching what it reads, so that building the view takes one
    /// round and never a copy of the index.
    pub fn derive_model(
        checkpoint: &Checkpoint,
        source: &dyn Source,
    ) -> Result<DerivedModel, String> {
        derive_model(checkpoint, source)
    }

    /// [`CheckpointView::from_checkpoint`] with the model description derived before
    /// ([`CheckpointView::derive_model`]).
    pub fn from_checkpoint_derived(
        checkpoint: Checkpoint,
        derived: Result<DerivedModel, String>,
        source: &dyn Source,
    ) -> Result<Self, CheckpointError> {
        let mut view = Self::from_source_index(&checkpoint.label, checkpoint.index, source)?;
        view.notes = checkpoint.notes;
        view.hints = checkpoint.hints;
        match derived {
            Ok(d) => view.derived = Some(d),
            Err(e) => view
                .notes
                .push(format!("no layout can be derived from it alone: {e}")),
        }
        if matches!(
            view.index.kind,
            shardscope_core::index::CheckpointKind::DeepSpeedZero { .. }
        ) {
            let names = source.names();
            match shardscope_core::index::deepspeed_partitions::partitions(source, &names) {
                Ok(p) => view.partitions = Some(p),
                Err(e) => view
                    .notes
                    .push(format!("no map of its DeepSpeed partitions: {e}")),
            }
        }
        Ok(view)
    }

    /// The part of [`CheckpointView::build`] after indexing: reads the few values the panels
    /// show (bytes items, scalar `step` tensors) from `source` for an index built from it. The
    /// browser indexes first, then fetches exactly these ranges ([`CheckpointView::value_ranges`]).
    pub fn from_source_index(
        name: &str,
        mut index: CheckpointIndex,
        source: &dyn Source,
    ) -> Result<Self, CheckpointError> {
        let index_err = |source| CheckpointError::Index {
            name: name.to_owned(),
            source: Box::new(source),
        };
        // Bytes items hold small pickled Python values (step counters, hyper-parameters).
        index.decode_bytes_values(source).map_err(index_err)?;
        let mut scalar_values = BTreeMap::new();
        for (i, e) in index.entries.iter().enumerate() {
            if !is_step_scalar(e) {
                continue;
            }
            // Global scalars and replicated rank-local scalars alike: read each stored copy.
            let values: Vec<f64> = e
                .chunks
                .iter()
                .filter_map(|c| {
                    index
                        .read_chunk(source, e, c)
                        .ok()?
                        .to_f64()?
                        .first()
                        .copied()
                })
                .collect();
            if values.len() == e.chunks.len()
                && let Some(&first) = values.first()
            {
                let text = if values.iter().all(|v| v.to_bits() == first.to_bits()) {
                    format_number(first)
                } else {
                    values
                        .iter()
                        .map(|v| format_number(*v))
                        .collect::<Vec<_>>()
                        .join(" / ")
                };
                scalar_values.insert(i, text);
            }
        }
        let mut view = Self::from_index(name, index, &scalar_values);
        let options = shardscope_core::doctor::Options {
            label: name.to_owned(),
            ..shardscope_core::doctor::Options::default()
        };
        view.findings =
            shardscope_core::doctor::diagnose(&view.index, source, &view.index.check(), &options);
        view.findings = shardscope_core::doctor::Report::new(view.findings).findings;
        Ok(view)
    }

    /// The byte ranges `(file, offset, length)` that [`CheckpointView::from_source_index`] reads:
    /// every bytes item and every stored copy of a scalar `step` tensor. Nothing else of the
    /// data files is read to show a checkpoint.
    pub fn value_ranges(index: &CheckpointIndex) -> Vec<(String, u64, u64)> {
        let mut out = Vec::new();
        for e in &index.entries {
            if e.kind == EntryKind::Bytes {
                out.extend(
                    e.chunks
                        .first()
                        .map(|c| (c.file.to_string(), c.byte_offset, c.byte_length)),
                );
            } else if is_step_scalar(e) {
                out.extend(
                    e.chunks
                        .iter()
                        .map(|c| (c.file.to_string(), c.byte_offset, c.byte_length)),
                );
            }
        }
        out
    }

    /// Derives the panel data; `scalars` holds values read for scalar tensors (by entry).
    pub fn from_index(
        name: &str,
        index: CheckpointIndex,
        scalars: &BTreeMap<usize, String>,
    ) -> Self {
        let mut by_key = BTreeMap::new();
        let mut ranks = Vec::with_capacity(index.entries.len());
        let mut all = BTreeSet::new();
        let mut chunk_count = 0;
        let mut optimizer: BTreeMap<String, Vec<StateRow>> = BTreeMap::new();
        let mut param_groups: BTreeMap<i64, Vec<(String, String)>> = BTreeMap::new();
        for (i, e) in index.entries.iter().enumerate() {
            by_key.insert(e.key.clone(), i);
            let r: Vec<u64> = e.ranks().into_iter().map(u64::from).collect();
            all.extend(r.iter().copied());
            chunk_count += e.chunks.len();
            let value = scalars
                .get(&i)
                .cloned()
                .or_else(|| e.value.as_ref().map(value_text));
            match &e.role {
                Some(Role::OptimizerState { param, state }) => {
                    optimizer
                        .entry(param.to_string())
                        .or_default()
                        .push(StateRow {
                            name: state.clone(),
                            entry: i,
                            ranks: r.clone(),
                            value,
                        });
                }
                Some(Role::ParamGroup { group }) => {
                    let leaf = e
                        .path
                        .iter()
                        .skip(2)
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(".");
                    param_groups
                        .entry(*group)
                        .or_default()
                        .push((leaf, value.unwrap_or_default()));
                }
                None => {}
            }
            ranks.push(r);
        }
        for rows in optimizer.values_mut() {
            rows.sort_by(|a, b| a.name.cmp(&b.name));
        }
        let hints = layout_hints(&index);
        Self {
            name: name.to_owned(),
            index,
            by_key,
            ranks,
            all_ranks: all.into_iter().collect(),
            chunk_count,
            optimizer,
            param_groups,
            generation: 0,
            findings: Vec::new(),
            hints,
            notes: Vec::new(),
            derived: None,
            origin: None,
            partitions: None,
        }
    }

    /// The entry of `key`.
    pub fn entry(&self, key: &str) -> Option<(usize, &IndexEntry)> {
        let &i = self.by_key.get(key)?;
        Some((i, self.index.entries.get(i)?))
    }

    /// One line for the status bar.
    pub fn summary(&self) -> String {
        format!(
            "{} · {} entries · {} chunks · {} ranks",
            self.index.kind.describe(),
            self.index.entries.len(),
            self.chunk_count,
            self.all_ranks.len()
        )
    }
}

/// A JSON value as a short text (`2`, `[0.9, 0.999]`, `"tiny"`).
pub fn value_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Number(n) => n
            .as_f64()
            .filter(|_| !n.is_i64() && !n.is_u64())
            .map_or_else(|| n.to_string(), format_number),
        other => other.to_string(),
    }
}

/// A number as Python prints it for integral floats (`1.0`), otherwise the shortest form.
pub fn format_number(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod conformance {
    #![allow(clippy::unwrap_used)]
    use shardscope_core::source::conformance::{sample_files, violations};

    use super::FsSource;

    #[test]
    fn the_desktop_files_keep_the_source_contract() {
        let files = sample_files();
        let dir = std::env::temp_dir().join(format!("shardscope-fs-{}", std::process::id()));
        let mut source = FsSource::default();
        for (name, bytes) in &files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, bytes).unwrap();
            source.insert(name.clone(), path);
        }
        let found = violations(&source, &files);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found, Vec::<String>::new());
    }
}
