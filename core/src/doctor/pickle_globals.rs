//! Which globals of a pickle `torch.load(weights_only=True)` refuses, and the `unsafe-pickle`
//! finding that names them.

use crate::formats::pickle::Global;

use super::report::{Finding, Severity};
use super::text::{list, quote};

/// Which globals of a pickle `torch.load(weights_only=True)` refuses and that are not torch's own
/// classes: what `weights_only=False` would import and could run.
pub fn unsafe_globals(globals: &[Global]) -> Vec<String> {
    // ShardedTensor pickles (FSDP1 LOCAL/SHARDED) look up a memory format with `getattr` on
    // torch's own `MEM_FORMAT_ENCODING` enum.
    let sharded_tensor = globals.iter().any(|g| {
        g.module == "torch.distributed._shard.sharded_tensor.metadata"
            && g.name == "MEM_FORMAT_ENCODING"
    });
    let getattr = |g: &Global| {
        sharded_tensor
            && matches!(g.module.as_str(), "builtins" | "__builtin__")
            && g.name == "getattr"
    };
    globals
        .iter()
        .filter(|g| !weights_only_allows(g) && !torch_own(g) && !getattr(g))
        .map(ToString::to_string)
        .collect()
}

/// torch's `_get_allowed_globals()` (torch 2.15, `torch/_weights_only_unpickler.py`), after its
/// Python 2 name mapping (`__builtin__` is `builtins`).
pub fn weights_only_allows(g: &Global) -> bool {
    const EXACT: [(&str, &str); 12] = [
        ("collections", "OrderedDict"),
        ("collections", "Counter"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("torch", "Tensor"),
        ("torch", "device"),
        ("_codecs", "encode"),
        ("builtins", "bytearray"),
        ("builtins", "set"),
        ("builtins", "complex"),
        ("torch._tensor", "_rebuild_from_type_v2"),
    ];
    const REBUILD: [&str; 11] = [
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
        "_rebuild_qtensor",
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_sparse_tensor",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_wrapper_subclass",
        "_rebuild_device_tensor_from_numpy",
        "_rebuild_device_tensor_from_cpu_tensor",
    ];
    const QSCHEMES: [&str; 5] = [
        "per_tensor_affine",
        "per_tensor_symmetric",
        "per_channel_affine",
        "per_channel_symmetric",
        "per_channel_affine_float_qparams",
    ];
    const DTYPES: [&str; 24] = [
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "complex32",
        "complex64",
        "complex128",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "bool",
        "qint8",
        "quint8",
        "qint32",
        "quint4x2",
        "quint2x4",
        "uint16",
        "uint32",
        "uint64",
        "bits8",
        "bits16",
        "float4_e2m1fn_x2",
    ];
    let module = if g.module == "__builtin__" {
        "builtins"
    } else {
        g.module.as_str()
    };
    let name = g.name.as_str();
    if EXACT.contains(&(module, name)) {
        return true;
    }
    match module {
        "torch._utils" => REBUILD.contains(&name),
        "torch.storage" => matches!(name, "TypedStorage" | "UntypedStorage"),
        "torch" => {
            QSCHEMES.contains(&name)
                || DTYPES.contains(&name)
                || name.starts_with("float8_")
                || name.starts_with("bits")
                || sub_byte_int(name)
                || name.ends_with("Tensor")
                || name.ends_with("Storage")
        }
        "torch.cuda" | "torch.cuda.sparse" | "torch.sparse" => {
            name.ends_with("Tensor") || name.ends_with("Storage")
        }
        _ => false,
    }
}

/// `torch.uint1` … `torch.uint7`, `torch.int1` … `torch.int7`.
fn sub_byte_int(name: &str) -> bool {
    let digits = name
        .strip_prefix("uint")
        .or_else(|| name.strip_prefix("int"));
    matches!(digits, Some("1" | "2" | "3" | "4" | "5" | "6" | "7"))
}

/// torch's own distributed records (DTensor, DeviceMesh, placements, ShardedTensor and its
/// metadata, DCP metadata): torch registers them as safe when `torch.distributed` is imported, and
/// shardscope reads them as data.
pub(super) fn torch_own(g: &Global) -> bool {
    g.module.starts_with("torch.distributed.")
        && !g.module.contains(".elastic")
        && !g.module.contains(".rpc")
        && !g.module.contains(".launcher")
        && g.name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_uppercase() || c == '_')
        && !g.name.starts_with("__")
}

/// A finding for a pickle that names globals outside torch's `weights_only=True` allowlist.
/// DeepSpeed's own record classes, in the files `DeepSpeedEngine.save_checkpoint` writes
/// (DeepSpeed 0.19.8, ZeRO-1/2/3): the ZeRO stage (`ZeroStageEnum(1)`, an `enum.IntEnum`), the loss
/// scaler's settings (`LossScaler`, `DynamicLossScaler`: plain attributes set by `BUILD`) and the
/// `param_slice_mappings` records (`fragment_address(numel, start)`, a dataclass). DeepSpeed itself
/// loads these files with `torch.load(weights_only=False)`; nothing else is DeepSpeed's known
/// content, and another global in such a file is an `unsafe-pickle` like anywhere else.
pub fn deepspeed_own(g: &Global) -> bool {
    matches!(
        (g.module.as_str(), g.name.as_str()),
        ("deepspeed.runtime.zero.config", "ZeroStageEnum")
            | (
                "deepspeed.runtime.fp16.loss_scaler",
                "LossScaler" | "DynamicLossScaler"
            )
            | ("deepspeed.utils.tensor_fragment", "fragment_address")
    )
}

/// The finding for the globals of a `torch.save` file outside torch's `weights_only` allowlist,
/// or `None` when there are none. In a DeepSpeed checkpoint (`deepspeed`), a file naming only
/// DeepSpeed's own record classes ([`deepspeed_own`]) besides torch's is a warning
/// (`deepspeed-pickle`): `torch.load(weights_only=True)` refuses it, as it refuses every DeepSpeed
/// optimizer file, and DeepSpeed loads it with `weights_only=False`. Any other global is an
/// `unsafe-pickle` error naming every global outside the allowlist.
pub fn torch_save_pickle_finding(
    file: &str,
    globals: &[Global],
    deepspeed: bool,
) -> Option<Finding> {
    let bad = unsafe_globals(globals);
    if bad.is_empty() {
        return None;
    }
    let foreign = globals
        .iter()
        .any(|g| !deepspeed_own(g) && bad.contains(&g.to_string()));
    if !deepspeed || foreign {
        return Some(unsafe_pickle(file, &bad));
    }
    Some(Finding {
        code: "deepspeed-pickle",
        severity: Severity::Warning,
        keys: vec![file.to_owned()],
        message: format!(
            "{file} names DeepSpeed's own record classes ({}), outside torch's weights_only allowlist: torch.load(weights_only=True, the default) refuses it; DeepSpeed loads it with torch.load(weights_only=False), which imports DeepSpeed. It names nothing else (shardscope reads it without importing or running anything)",
            list(&bad)
        ),
        fix: "load it with DeepSpeed, or let shardscope read it (`shardscope convert CKPT -o model.safetensors`, or `--world-size N` for FSDP)".to_owned(),
    })
}

pub fn unsafe_pickle(file: &str, globals: &[String]) -> Finding {
    Finding {
        code: "unsafe-pickle",
        severity: Severity::Error,
        keys: vec![file.to_owned()],
        message: format!(
            "{file} names {} global(s) outside torch's weights_only allowlist: {}. torch.load (weights_only=True, the default) refuses it; torch.load(weights_only=False) would import and may call them (run code). shardscope never executes them",
            globals.len(),
            list(globals)
        ),
        fix: format!(
            "shardscope convert {} -o {}.safetensors  # keeps the tensors, drops the code, without running it",
            quote(file),
            file.rsplit_once('.').map_or(file, |(s, _)| s)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(module: &str, name: &str) -> Global {
        Global {
            module: module.into(),
            name: name.into(),
        }
    }

    #[test]
    fn allowlist_follows_torch() {
        for (m, n) in [
            ("collections", "OrderedDict"),
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch", "FloatStorage"),
            ("torch", "bfloat16"),
            ("torch", "float8_e4m3fn"),
            ("torch", "uint3"),
            ("torch", "int7"),
            ("__builtin__", "set"),
            ("torch.nn.parameter", "Parameter"),
        ] {
            assert!(weights_only_allows(&g(m, n)), "{m}.{n}");
        }
        for (m, n) in [
            ("posix", "system"),
            ("os", "system"),
            ("builtins", "eval"),
            ("torch", "load"),
            ("torch", "int8x"),
            ("__main__", "Net"),
            ("numpy.core.multiarray", "_reconstruct"),
        ] {
            assert!(!weights_only_allows(&g(m, n)), "{m}.{n}");
        }
        assert_eq!(
            unsafe_globals(&[
                g("posix", "system"),
                g("torch.distributed.tensor", "DTensor"),
                g("torch._utils", "_rebuild_tensor_v2"),
            ]),
            vec!["posix.system".to_owned()]
        );
    }
}
