//! What wrote a checkpoint, when its files say: a trainer's folder layout (Megatron-core's
//! `metadata.json`, accelerate's `pytorch_model_fsdp_0/`, Lightning's `meta.pt`, torch_checkpointing's
//! `metadata.pkl`, verl's file names, torchtitan's items). Shown by `inspect`; a DCP conversion of a
//! Megatron-core checkpoint carries its `metadata.json` and `common.pt` ([`megatron_companions`]).

use crate::index::{CheckpointIndex, CheckpointKind, PathSeg};
use crate::source::Source;

/// The most bytes of `metadata.json` read (Megatron-core writes about 120).
const MAX_METADATA_JSON: u64 = 64 << 10;

/// The `sharded_backend` Megatron-core's `metadata.json` names (`torch_dist`, `zarr`), when the
/// folder holds one at its top.
pub fn megatron_backend(source: &dyn Source) -> Option<String> {
    let size = source.size("metadata.json").ok()?;
    if size > MAX_METADATA_JSON {
        return None;
    }
    let bytes = source.read_range("metadata.json", 0, size).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    value
        .get("sharded_backend")
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
}

/// What wrote the checkpoint, in words (`Megatron-core dist_checkpointing (torch_dist)`), when
/// its files or items say.
pub fn written_by(
    source: &dyn Source,
    names: &[String],
    index: &CheckpointIndex,
) -> Option<String> {
    let has = |n: &str| names.iter().any(|x| x == n);
    if index.kind.is_deepspeed() {
        let version = index
            .entry("extra.ds_version")
            .and_then(|e| e.value.as_ref())
            .and_then(serde_json::Value::as_str)
            .map_or_else(String::new, |v| format!(" {v}"));
        return Some(
            if matches!(index.kind, CheckpointKind::DeepSpeedUniversal { .. }) {
                format!("DeepSpeed{version} (ds_to_universal of an engine.save_checkpoint)")
            } else if has("trainer_state.json") {
                format!("Hugging Face Trainer checkpoint (DeepSpeed{version} engine state)")
            } else {
                format!("DeepSpeed{version} (engine.save_checkpoint)")
            },
        );
    }
    if has("common.pt")
        && let Some(backend) = megatron_backend(source)
    {
        return Some(format!(
            "Megatron-core dist_checkpointing ({backend}; common.pt merged at the top, as dist_checkpointing.load does)"
        ));
    }
    if names.iter().any(|n| n.starts_with("pytorch_model_fsdp_0/")) {
        return Some(if has("trainer_state.json") {
            "Hugging Face Trainer checkpoint (accelerate FSDP state)".to_owned()
        } else {
            "accelerate save_state".to_owned()
        });
    }
    if has("meta.pt") && names.iter().any(|n| n.ends_with(".metadata")) {
        return Some("Lightning (sharded: DCP + meta.pt)".to_owned());
    }
    if has("metadata.pkl") {
        return Some("torch_checkpointing".to_owned());
    }
    if names
        .iter()
        .any(|n| n.contains("_world_size_") && n.contains("_rank_"))
    {
        return Some("verl (model/optim/extra_state per rank)".to_owned());
    }
    let top = |k: &str| {
        index
            .entries
            .iter()
            .any(|e| matches!(e.path.first(), Some(PathSeg::Key(s)) if s == k))
    };
    if top("train_state") && top("lr_scheduler") {
        return Some("torchtitan".to_owned());
    }
    None
}

/// The files a DCP conversion of a Megatron-core checkpoint must carry for `dist_checkpointing.load`
/// to accept it: `metadata.json` and `common.pt`, as stored (`(name, bytes)`); none for other
/// checkpoints. `common.pt` holds the state that is not sharded (iteration, args, small tensors),
/// the same whatever the world size.
pub fn megatron_companions(
    source: &dyn Source,
    max_bytes: u64,
) -> Result<Vec<(String, Vec<u8>)>, crate::source::SourceError> {
    let names = source.names();
    if !names.iter().any(|n| n == "common.pt") || megatron_backend(source).is_none() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for name in ["metadata.json", "common.pt"] {
        let size = source.size(name)?;
        if size > max_bytes {
            return Err(crate::source::SourceError::Io {
                name: name.to_owned(),
                message: format!(
                    "{size} bytes: more than the {max_bytes} a companion file may have"
                ),
            });
        }
        out.push((
            name.to_owned(),
            source.read_range(name, 0, size)?.into_owned(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::MemorySource;

    fn index() -> CheckpointIndex {
        CheckpointIndex {
            format: crate::index::Format::Dcp,
            kind: crate::index::CheckpointKind::Plain,
            has_optimizer_state: false,
            entries: Vec::new(),
            files: std::collections::BTreeMap::new(),
            dcp: None,
        }
    }

    fn by(files: &[(&str, &[u8])]) -> Option<String> {
        let source = files
            .iter()
            .fold(MemorySource::new(), |s, (n, b)| s.with(*n, b.to_vec()));
        written_by(&source, &source.names(), &index())
    }

    #[test]
    fn trainers_are_named_by_their_files() {
        let meta = br#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1}"#;
        let megatron = by(&[
            (".metadata", b""),
            ("common.pt", b""),
            ("metadata.json", meta),
        ]);
        assert!(
            megatron.is_some_and(|w| w.starts_with("Megatron-core dist_checkpointing (torch_dist"))
        );
        // A metadata.json that is not Megatron's says nothing.
        assert_eq!(
            by(&[("common.pt", b""), ("metadata.json", b"{\"x\": 1}")]),
            None
        );
        assert_eq!(
            by(&[("common.pt", b""), ("metadata.json", b"not json")]),
            None
        );
        assert_eq!(
            by(&[
                ("pytorch_model_fsdp_0/.metadata", b""),
                ("trainer_state.json", b"{}")
            ])
            .as_deref(),
            Some("Hugging Face Trainer checkpoint (accelerate FSDP state)")
        );
        assert_eq!(
            by(&[("pytorch_model_fsdp_0/.metadata", b"")]).as_deref(),
            Some("accelerate save_state")
        );
        assert!(
            by(&[(".metadata", b""), ("meta.pt", b"")]).is_some_and(|w| w.starts_with("Lightning"))
        );
        assert!(
            by(&[("model_world_size_2_rank_0.pt", b"")]).is_some_and(|w| w.starts_with("verl"))
        );
        assert_eq!(by(&[("model.safetensors", b"")]), None);
    }
}
