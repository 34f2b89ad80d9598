//! What the Python module (`import shardscope`) reads checkpoints with: the command's own way to
//! open a checkpoint (files, a folder or a URL, through `Checkpoint::open`) and to read a tensor
//! from its chunks straight into a buffer the caller allocated. Nothing here decides how a
//! checkpoint is read; it only hands the CLI's reading to another front end.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use shardscope_core::DType;
use shardscope_core::checkpoint::{Checkpoint, Fsdp1Flags, ReadOptions};
use shardscope_core::index::{EntryKind, IndexEntry, Problem};
use shardscope_core::model::ModelDescription;
use shardscope_core::shape::numel;

pub use crate::errors::error_text;
use crate::input::Input;

/// The model description a checkpoint is read with.
#[derive(Debug, Clone)]
pub enum Model {
    /// A description file (`--model MODEL.json`).
    Path(PathBuf),
    /// A description's JSON text, and the name messages show it by.
    Json { text: String, name: String },
}

/// How to open a checkpoint: what `--model`, the FSDP1 flags, `--model-files`, `--optim-files`
/// and `--model-only` say on the command line.
#[derive(Debug, Clone, Default)]
pub struct OpenArgs {
    pub model: Option<Model>,
    pub fsdp1: Fsdp1Flags,
    pub model_files: Option<String>,
    pub optim_files: Option<String>,
    pub model_only: bool,
    /// `--ranks N`: an input holding `{r}` is the files of ranks 0 to N-1.
    pub ranks: Option<u64>,
}

/// An opened checkpoint: its source and how `Checkpoint::open` read it.
#[derive(Debug)]
pub struct Opened {
    input: Input,
    checkpoint: Checkpoint,
    /// What it was opened from and with (a mapped view reopens its model part).
    paths: Vec<PathBuf>,
    args: OpenArgs,
    /// The recipes of tensors a mapping derives (a view in another naming: [`Opened::mapped`]).
    derived: Option<crate::convert::mapped::Derivations>,
    /// The first problem of each entry whose chunks do not tile it (read refuses those).
    problems: BTreeMap<String, Problem>,
}

/// What reading one tensor gives: its dtype and shape after the cast and row slice, and the bytes
/// the caller must allocate (the cast happens in place: the larger of the two dtype sizes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPlan {
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Bytes of the result.
    pub nbytes: u64,
    /// Bytes the buffer passed to [`Opened::read_into`] must have.
    pub buffer: u64,
}

impl Opened {
    /// Opens `paths` (one file, a folder, several per-rank files, one URL or several, a `{r}`
    /// pattern with `args.ranks`) as every command does.
    pub fn open(paths: &[PathBuf], args: &OpenArgs) -> Result<Self> {
        let description = match &args.model {
            None => None,
            Some(Model::Path(path)) => Some((
                crate::fsdp1_local::read_description(path)?,
                path.display().to_string(),
            )),
            Some(Model::Json { text, name }) => Some((
                ModelDescription::from_json_bytes(text.as_bytes(), name)?,
                name.clone(),
            )),
        };
        let options = ReadOptions {
            description,
            fsdp1: args.fsdp1,
            model_files: args.model_files.clone(),
            optim_files: args.optim_files.clone(),
            model_only: args.model_only,
        };
        let expanded = crate::cli::read::expand_ranks(paths, args.ranks)?;
        let (input, checkpoint) = crate::cli::read::open(&expanded, false, &options)?;
        let mut problems = BTreeMap::new();
        for p in checkpoint.index.check() {
            problems.entry(p.key.clone()).or_insert(p);
        }
        Ok(Self {
            input,
            checkpoint,
            paths: paths.to_vec(),
            args: args.clone(),
            derived: None,
            problems,
        })
    }

    /// Its model part (found as `--model-only` finds it) in another naming, as `convert --to`
    /// writes it: `to` is `hf` or `torchtitan`, `config_json` a Hugging Face config's text, and
    /// `mapping` a mapping file's `(text, name)` (default: the built-in files, chosen by the
    /// config and the stored names). Tensors a mapping derives (RoPE rows, one expert of a
    /// grouped tensor) are made when read.
    pub fn mapped(
        &self,
        to: &str,
        config_json: &str,
        mapping: Option<(&str, &str)>,
    ) -> Result<Self> {
        if self.derived.is_some() {
            bail!("{}: already in another naming", self.checkpoint.label);
        }
        let config: serde_json::Value =
            serde_json::from_str(config_json).context("the config is not JSON")?;
        if !config.is_object() {
            bail!("the config is a JSON object (a Hugging Face config.json)");
        }
        let files = match mapping {
            None => shardscope_core::transform::mapping::builtin(),
            Some((text, name)) => vec![crate::cli::convert_mapped::parse_mapping(text, name)?],
        };
        // Reopened as `--model-only` (the model part; the view owns its own source).
        let base = Self::open(
            &self.paths,
            &OpenArgs {
                model_only: true,
                ..self.args.clone()
            },
        )?;
        let m = crate::cli::convert_mapped::map_model(
            &base.input,
            &base.checkpoint.index,
            &base.checkpoint.label,
            to,
            &config,
            &files,
        )?;
        let mut notes = base.checkpoint.notes.clone();
        notes.push(format!(
            "mapping `{}` ({}): {} stored tensors -> {} tensors{}",
            m.file.name,
            m.file.origin,
            m.plan.stored,
            m.plan.plan.outputs.len(),
            if m.plan.plan.dropped.is_empty() {
                String::new()
            } else {
                format!(
                    "; left out by the mapping: {}",
                    m.plan.plan.dropped.join(", ")
                )
            }
        ));
        if let Some(w) = m.lost_warning() {
            notes.push(w);
        }
        if let Some((kept, dropped)) = &m.tied {
            notes.push(format!(
                "`{dropped}` equals `{kept}` (the config ties them): held once, as `{kept}`"
            ));
        }
        Ok(Self {
            checkpoint: Checkpoint {
                label: base.checkpoint.label.clone(),
                index: m.index,
                view: base.checkpoint.view,
                hints: base.checkpoint.hints.clone(),
                sets: Vec::new(),
                ambiguous: None,
                notes,
                written_by: base.checkpoint.written_by.clone(),
            },
            input: base.input,
            paths: self.paths.clone(),
            args: self.args.clone(),
            derived: Some(m.derived),
            problems: BTreeMap::new(),
        })
    }

    fn reader(&self) -> crate::convert::Reader<'_> {
        match &self.derived {
            Some(d) => crate::convert::Reader::with_derived(&self.input, &self.checkpoint.index, d),
            None => crate::convert::Reader::new(&self.input, &self.checkpoint.index),
        }
    }

    fn is_derived(&self, key: &str) -> bool {
        self.derived.as_ref().is_some_and(|d| d.contains_key(key))
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// The entry of `key`, or an error naming the checkpoint, the key and the closest keys.
    pub fn entry(&self, key: &str) -> Result<&IndexEntry> {
        if let Some(e) = self.checkpoint.index.entry(key) {
            return Ok(e);
        }
        let near: Vec<&str> = self
            .checkpoint
            .index
            .entries
            .iter()
            .map(|e| e.key.as_str())
            .filter(|k| shares_tail(k, key))
            .take(3)
            .collect();
        if near.is_empty() {
            bail!("{}: no key `{key}`", self.checkpoint.label);
        }
        bail!(
            "{}: no key `{key}`\nhint: keys that end the same: {}",
            self.checkpoint.label,
            near.join(", ")
        )
    }

    /// What reading `key` cast to `to` (floating tensors only; `None`: as stored), rows `rows` of
    /// dim 0 (`None`: all), gives.
    pub fn plan(&self, key: &str, to: Option<DType>, rows: Option<(u64, u64)>) -> Result<ReadPlan> {
        let entry = self.readable(key)?;
        let (dtype, shape) = crate::convert::tensor_meta(entry)?;
        let out = match to {
            None => dtype,
            Some(to) if to == dtype => dtype,
            Some(to) => {
                if !(shardscope_core::cast::is_castable(dtype)
                    && shardscope_core::cast::is_castable(to))
                {
                    bail!(
                        "{}: {key} is {dtype}: only float16, bfloat16, float32 and float64 tensors are cast (asked for {to})",
                        self.checkpoint.label
                    );
                }
                to
            }
        };
        let mut out_shape = shape.to_vec();
        if let Some((start, end)) = rows {
            let Some(dim0) = out_shape.first_mut() else {
                bail!("{}: {key} is 0-dim: it has no rows", self.checkpoint.label);
            };
            if start > end || end > *dim0 {
                bail!(
                    "{}: {key}: rows {start}..{end} are not inside its {dim0} rows",
                    self.checkpoint.label
                );
            }
            *dim0 = end - start;
        }
        let n = numel(&out_shape)
            .with_context(|| format!("{}: {key}: size overflows", self.checkpoint.label))?;
        let nbytes = n
            .checked_mul(out.size_bytes() as u64)
            .with_context(|| format!("{}: {key}: size overflows", self.checkpoint.label))?;
        let buffer = n
            .checked_mul(out.size_bytes().max(dtype.size_bytes()) as u64)
            .with_context(|| format!("{}: {key}: size overflows", self.checkpoint.label))?;
        // Never ask for more memory than the files holding the chunks can fill (a derived
        // tensor's reads are checked as they are made).
        let available = self.checkpoint.index.max_decoded_bytes(entry);
        let stored = n.saturating_mul(dtype.size_bytes() as u64);
        if stored > available && !self.is_derived(key) {
            bail!(
                "{}: {key}: the tensor ({stored} bytes) is larger than the chunks holding it can decode to ({available} bytes)",
                self.checkpoint.label
            );
        }
        Ok(ReadPlan {
            dtype: out,
            shape: out_shape,
            nbytes,
            buffer,
        })
    }

    /// Reads `key` as [`Self::plan`] describes into `out` (at least `plan.buffer` bytes) and
    /// returns the result's length at the start of `out`.
    pub fn read_into(
        &self,
        key: &str,
        to: Option<DType>,
        rows: Option<(u64, u64)>,
        out: &mut [u8],
    ) -> Result<usize> {
        let plan = self.plan(key, to, rows)?;
        let entry = self.readable(key)?;
        let mut reader = self.reader();
        let label = &self.checkpoint.label;
        let n = match rows {
            None => reader.tensor_as_into(entry, plan.dtype, out),
            Some((a, b)) => reader.rows_as_into(entry, plan.dtype, a..b, out),
        }
        .with_context(|| format!("{label}: cannot read {key}"))?;
        if n as u64 != plan.nbytes {
            bail!(
                "{label}: {key}: read {n} bytes, the tensor has {}",
                plan.nbytes
            );
        }
        Ok(n)
    }

    /// Where the bytes of `key` (rows `rows` of dim 0, or all) lie as one contiguous range of one
    /// local file, as stored (no cast): `(path, byte offset, byte length)`, checked to lie inside the
    /// file's size when it was opened. `None` for a remote source, a tensor split over several
    /// chunks or files, a compressed or strided chunk: it must be read.
    pub fn locate(
        &self,
        key: &str,
        rows: Option<(u64, u64)>,
    ) -> Result<Option<(PathBuf, u64, u64)>> {
        let Input::Local(local) = &self.input else {
            return Ok(None);
        };
        if self.is_derived(key) {
            return Ok(None);
        }
        let entry = self.readable(key)?;
        let plan = self.plan(key, None, rows)?;
        let (dtype, shape) = crate::convert::tensor_meta(entry)?;
        let reader = self.reader();
        let Some(pieces) = reader.slab_pieces(entry, dtype) else {
            return Ok(None);
        };
        let row_bytes = shape
            .iter()
            .skip(1)
            .try_fold(dtype.size_bytes() as u64, |n, &d| n.checked_mul(d));
        let start = match (rows, row_bytes) {
            (None, _) => 0,
            (Some((a, _)), Some(rb)) => a.saturating_mul(rb),
            (Some(_), None) => return Ok(None),
        };
        let end = start.saturating_add(plan.nbytes);
        let Some(piece) = pieces
            .iter()
            .find(|p| p.tensor_start <= start && end <= p.tensor_start.saturating_add(p.len))
        else {
            return Ok(None);
        };
        let Some((path, size)) = local.path_of(&piece.file) else {
            return Ok(None);
        };
        let at = piece.file_start + (start - piece.tensor_start);
        if at.checked_add(plan.nbytes).is_none_or(|e| e > size) {
            bail!(
                "{}: {key}: bytes {at}..+{} lie past the end of {} ({size} bytes)",
                self.checkpoint.label,
                plan.nbytes,
                path.display()
            );
        }
        Ok(Some((path.to_path_buf(), at, plan.nbytes)))
    }

    /// The value of a non-tensor entry (a scalar of a `torch.save` file, a DCP bytes item) as
    /// JSON.
    pub fn value(&self, key: &str) -> Result<serde_json::Value> {
        let entry = self.entry(key)?;
        match entry.kind {
            EntryKind::Tensor => bail!("{}: {key} is a tensor", self.checkpoint.label),
            EntryKind::Scalar => Ok(entry.value.clone().unwrap_or(serde_json::Value::Null)),
            EntryKind::Bytes => self
                .checkpoint
                .index
                .read_bytes_value(&self.input, entry)
                .with_context(|| format!("{}: cannot read {key}", self.checkpoint.label)),
        }
    }

    /// Tie groups among `keys` found from shared storage (`torch.save` files): for each group,
    /// the key that comes first in `keys` and the keys that alias it. Reads nothing.
    pub fn storage_ties(&self, keys: &[String]) -> Vec<(String, Vec<String>)> {
        // A derived tensor (a mapped view's) is made when read: it shares no storage.
        let stored: Vec<String> = keys
            .iter()
            .filter(|k| !self.is_derived(k))
            .cloned()
            .collect();
        let candidates = self.positions(&stored);
        shardscope_core::index::ties::find_storage_ties(&self.checkpoint.index, &candidates)
            .into_iter()
            .map(|g| {
                (
                    self.key_at(g.keep),
                    g.aliases.iter().map(|&a| self.key_at(a)).collect(),
                )
            })
            .collect()
    }

    /// The aliases of tied weights among `keys`, as `shardscope convert` drops them (shared
    /// storage in `torch.save`, equal bytes elsewhere): `(kept, dropped)` pairs, the kept key
    /// the one that comes first in the checkpoint.
    pub fn tied_aliases(&self, keys: &[String]) -> Result<Vec<(String, String)>> {
        if self.derived.as_ref().is_some_and(|d| !d.is_empty()) {
            // A mapped view with derived tensors: its mapping's tie is already applied (as
            // `convert --to` does).
            return Ok(Vec::new());
        }
        let wanted: BTreeSet<&str> = keys.iter().map(String::as_str).collect();
        let mut sel = crate::convert::select(&self.checkpoint.index, None)?;
        sel.tensors
            .retain(|(name, _)| wanted.contains(name.as_str()));
        crate::convert::drop_tied(&self.input, &self.checkpoint.index, &mut sel)
    }

    /// `verify --manifest` of this checkpoint as it was opened: its content manifest, computed
    /// with the algorithm of the manifest at `manifest` (file digests too when that one has
    /// them), compared key by key; the report `verify --manifest --json` prints.
    pub fn verify_manifest(
        &self,
        manifest: &std::path::Path,
        threads: Option<usize>,
    ) -> Result<shardscope_core::verify::Report> {
        if self.derived.is_some() {
            bail!(
                "{}: a view in another naming has no stored manifest to check\nhint: verify the checkpoint itself, or `convert --manifest` the view and verify its output",
                self.checkpoint.label
            );
        }
        let expected = crate::cli::hash::read_manifest(manifest)?;
        let options = crate::hash::HashOptions {
            algorithm: expected.algorithm,
            threads: threads.unwrap_or_else(crate::hash::default_threads).max(1),
            files: !expected.files.is_empty(),
        };
        let actual = crate::hash::manifest_of(
            &self.input,
            &self.checkpoint.index,
            options,
            &mut |_, _, _| {},
        );
        Ok(shardscope_core::verify::compare_manifests(
            (&expected, &manifest.display().to_string()),
            (&actual, &self.checkpoint.label),
            "verify",
        ))
    }

    /// The keys in the order the checkpoint stores them (registration order for a state dict;
    /// `.metadata` order for DCP); keys the order does not list follow, sorted.
    pub fn stored_order(&self) -> Vec<String> {
        let index = &self.checkpoint.index;
        if self.derived.is_some() {
            // A mapped view: the mapping's output order.
            let mut entries: Vec<&IndexEntry> = index.entries.iter().collect();
            entries.sort_by_key(|e| (e.position.is_none(), e.position));
            return entries.into_iter().map(|e| e.key.clone()).collect();
        }
        let mut keys = Vec::with_capacity(index.entries.len());
        let mut seen = BTreeSet::new();
        if let Ok(order) = shardscope_core::index::from_index::stored_key_order(&self.input, index)
        {
            for k in order.keys {
                if index.entry(&k).is_some() && seen.insert(k.clone()) {
                    keys.push(k);
                }
            }
        }
        for e in &index.entries {
            if !seen.contains(&e.key) {
                keys.push(e.key.clone());
            }
        }
        keys
    }

    fn readable(&self, key: &str) -> Result<&IndexEntry> {
        let entry = self.entry(key)?;
        if let Some(p) = self.problems.get(key) {
            bail!(
                "{}: {p}\nhint: `shardscope inspect {}` lists the checkpoint's problems",
                self.checkpoint.label,
                self.checkpoint.label
            );
        }
        Ok(entry)
    }

    fn positions(&self, keys: &[String]) -> Vec<usize> {
        let at: BTreeMap<&str, usize> = self
            .checkpoint
            .index
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.key.as_str(), i))
            .collect();
        keys.iter()
            .filter_map(|k| at.get(k.as_str()).copied())
            .collect()
    }

    fn key_at(&self, i: usize) -> String {
        self.checkpoint.index.entries[i].key.clone()
    }
}

/// True when `a` and `b` end with the same two dotted segments (`layers.0.attn.weight` and
/// `model.layers.0.attn.weight`) or one ends with the other.
fn shares_tail(a: &str, b: &str) -> bool {
    fn tail(s: &str) -> Vec<&str> {
        s.rsplit('.').take(2).collect()
    }
    if a.ends_with(b) || b.ends_with(a) {
        return true;
    }
    let (ta, tb) = (tail(a), tail(b));
    ta.len() == 2 && ta == tb
}

/// The description of the `--model` JSON in `text` (named `name` in messages), as the CLI
/// validates it.
pub fn parse_description(text: &str, name: &str) -> Result<ModelDescription> {
    Ok(ModelDescription::from_json_bytes(text.as_bytes(), name)?)
}

/// The FSDP units `layout --from` chooses for a model of these parameters: the root and every
/// block of a repeated module list (`layers.0`, `layers.1`, …: the transformer-block auto-wrap
/// policies of HF, accelerate and torchtitan), in the order the parameters reach them.
pub fn auto_units(description: &ModelDescription) -> Vec<String> {
    let blocks = shardscope_core::checkpoint::repeated_blocks(
        description.params.iter().map(|p| p.fqn.as_str()),
    );
    let is_unit = |prefix: &str| shardscope_core::checkpoint::is_block(&blocks, prefix);
    shardscope_core::index::from_index::module_units(&description.params, &is_unit, true)
}
