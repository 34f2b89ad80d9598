//! Which files a checkpoint is made of, as its own manifest names them: a DCP `.metadata` names
//! every data file (`storage_data`'s `relative_path`s), an HF `*.index.json` its shard files
//! (`weight_map`'s values). A reader that cannot list a folder (HTTP) finds the files this way.
//!
//! The manifests are parsed by [`dcp::read_metadata`] and [`safetensors::read_index`]; this module
//! only collects the names and checks that each stays inside the checkpoint's folder.

use std::collections::BTreeSet;

use crate::formats::dcp::{self, DcpError};
use crate::formats::safetensors::{self, SafetensorsError};

/// The DCP manifest's name inside a checkpoint folder.
pub const DCP_METADATA: &str = ".metadata";
/// The HF manifest of a folder of sharded safetensors files.
pub const HF_INDEX: &str = "model.safetensors.index.json";

/// A file that names the other files of its checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Manifest {
    /// A DCP `.metadata`.
    Dcp,
    /// An HF `*.index.json` (`model.safetensors.index.json`).
    HfIndex,
}

/// What went wrong while reading the file names out of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocateError {
    /// The `.metadata` is not one DCP wrote.
    #[error(transparent)]
    Dcp(#[from] DcpError),
    /// The index is not one HF wrote.
    #[error(transparent)]
    Index(#[from] SafetensorsError),
    /// A name in the manifest would leave the checkpoint's folder (absolute, `..`, `.`, an empty
    /// segment, a backslash).
    #[error("names the file {name:?}, which is not inside its folder")]
    OutsideFolder { name: String },
}

impl Manifest {
    /// The manifest a file is, by its name: exactly `.metadata`, or any `*.index.json`.
    pub fn of_file(name: &str) -> Option<Manifest> {
        if name == DCP_METADATA {
            Some(Manifest::Dcp)
        } else if name.ends_with(".index.json") {
            Some(Manifest::HfIndex)
        } else {
            None
        }
    }

    /// The files the manifest's bytes name, each once, sorted; every name is checked to stay
    /// inside the folder (the first one met that does not is the error).
    pub fn files(self, bytes: &[u8]) -> Result<Vec<String>, LocateError> {
        let mut files = BTreeSet::new();
        match self {
            Manifest::Dcp => {
                let meta = dcp::read_metadata(bytes)?;
                for (_, info) in meta.storage {
                    check_member_name(&info.relative_path)?;
                    files.insert(info.relative_path.to_string());
                }
            }
            Manifest::HfIndex => {
                let index = safetensors::read_index(bytes)?;
                for file in index.weight_map.into_values() {
                    check_member_name(&file)?;
                    files.insert(file);
                }
            }
        }
        Ok(files.into_iter().collect())
    }
}

/// A name read from a checkpoint's own files must be a relative `/`-separated path inside the
/// folder: not empty, not absolute, no backslash, no empty, `.` or `..` segment.
fn check_member_name(name: &str) -> Result<(), LocateError> {
    if name.is_empty()
        || name.starts_with('/')
        || name.contains('\\')
        || name
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err(LocateError::OutsideFolder {
            name: name.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::formats::write::dcp::{
        BytesValue, DcpEntry, DcpFileWriter, DcpMetadataOptions, DcpPlan, DcpValue, PathKey,
        metadata_pickle,
    };
    use crate::formats::write::pickle::PyValue;

    #[test]
    fn manifests_are_known_by_name() {
        assert_eq!(Manifest::of_file(".metadata"), Some(Manifest::Dcp));
        assert_eq!(Manifest::of_file(HF_INDEX), Some(Manifest::HfIndex));
        assert_eq!(
            Manifest::of_file("pytorch_model.bin.index.json"),
            Some(Manifest::HfIndex)
        );
        assert_eq!(Manifest::of_file("x.metadata"), None);
        assert_eq!(Manifest::of_file("model.safetensors"), None);
    }

    #[test]
    fn member_names_stay_inside_the_folder() {
        for bad in ["../x", "/etc/passwd", "a//b", "a/./b", "", "a\\b"] {
            assert!(
                matches!(
                    check_member_name(bad),
                    Err(LocateError::OutsideFolder { .. })
                ),
                "{bad}"
            );
        }
        check_member_name("__0_0.distcp").unwrap();
        check_member_name("sub/__1_0.distcp").unwrap();
    }

    #[test]
    fn a_dcp_metadata_names_every_rank_file() {
        let entry = |fqn: &str, rank| DcpEntry {
            fqn: fqn.to_owned(),
            path: vec![PathKey::Key(fqn.to_owned())],
            value: DcpValue::Bytes {
                rank,
                value: BytesValue::Value(PyValue::Int(3)),
            },
        };
        let plan = DcpPlan::new(2, vec![entry("a", 0), entry("b", 1), entry("c", 1)]).unwrap();
        let records: Vec<_> = (0..2)
            .map(|rank| {
                DcpFileWriter::new(&plan, rank, Vec::new())
                    .unwrap()
                    .finish()
                    .unwrap()
                    .1
            })
            .collect();
        let meta = metadata_pickle(&plan, &records, &DcpMetadataOptions::default()).unwrap();
        assert_eq!(
            Manifest::Dcp.files(&meta).unwrap(),
            [DcpPlan::file_name(0), DcpPlan::file_name(1)]
        );
        assert!(matches!(
            Manifest::Dcp.files(b"not a pickle"),
            Err(LocateError::Dcp(_))
        ));
    }

    #[test]
    fn an_hf_index_names_its_shards_once() {
        let index = br#"{"metadata": {}, "weight_map": {
            "a": "model-00002-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00001-of-00002.safetensors"}}"#;
        assert_eq!(
            Manifest::HfIndex.files(index).unwrap(),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        assert!(matches!(
            Manifest::HfIndex.files(b"{}"),
            Err(LocateError::Index(_))
        ));
        let outside = br#"{"weight_map": {"a": "sub//x.safetensors"}}"#;
        assert_eq!(
            Manifest::HfIndex.files(outside),
            Err(LocateError::OutsideFolder {
                name: "sub//x.safetensors".to_owned()
            })
        );
    }
}
