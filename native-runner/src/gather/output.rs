//! Writing the consolidated parameters (`-o FULL.safetensors`).
//!
//! The bytes come from the `safetensors` crate's serializer; the CLI writes them atomically
//! (`atomic::write_file`: temporary file, fsync, rename).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::gather::GatheredParam;
use crate::gather::source::dtype_to_safetensors;

/// Why the output cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// A parameter's dtype has no safetensors equivalent.
    #[error("parameter `{fqn}` has dtype {dtype}, which safetensors cannot store")]
    UnsupportedDType { fqn: String, dtype: String },
    /// The serializer rejected the tensors.
    #[error("cannot serialize safetensors for {}: {message}", path.display())]
    Serialize { path: PathBuf, message: String },
}

struct View<'a> {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: &'a [u8],
}

impl safetensors::View for View<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Serializes `params` (sorted by name; safetensors orders the data itself) to bytes.
pub fn safetensors_bytes(
    params: &BTreeMap<String, GatheredParam>,
    path: &Path,
) -> Result<Vec<u8>, OutputError> {
    let mut views = Vec::with_capacity(params.len());
    for (fqn, p) in params {
        let dtype = dtype_to_safetensors(p.dtype).ok_or_else(|| OutputError::UnsupportedDType {
            fqn: fqn.clone(),
            dtype: p.dtype.to_string(),
        })?;
        views.push((
            fqn.as_str(),
            View {
                dtype,
                shape: p.shape.iter().map(|&d| d as usize).collect(),
                data: &p.bytes,
            },
        ));
    }
    safetensors::serialize(views, None).map_err(|e| OutputError::Serialize {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// Formats a byte count for people (`1.5 MiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
