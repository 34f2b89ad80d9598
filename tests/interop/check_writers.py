"""Loads files written by shardscope's writers with torch's own loaders and checks them bit for bit.

Usage: python check_writers.py FORMAT DIR
  FORMAT: torch_save | safetensors | safetensors_sharded | dcp
  DIR holds the files and manifest.json: {"tensors": [{"key", "k", "dtype", "shape"}, ...], ...}.

Expected tensor values are computed here from the same formula the Rust test uses, independently:
  floats:   ((k * 1000 + i) * 0.25) rounded to float32, then to the dtype (round to nearest even)
  complex:  real = that float32 value, imag = -real
  ints:     (k * 1000 + i) wrapped to the dtype's width (two's complement)
  bool:     (k * 1000 + i) % 3 == 0
  float8:   raw byte (k * 1000 + i) % 256
Prints "ok: ..." and exits 0, or prints what differs and exits 1.
"""

import collections
import json
import os
import struct
import sys

import torch

FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
FLOAT8 = {
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

failures = []


def fail(msg):
    failures.append(msg)


def dtype_of(name):
    return getattr(torch, name)


def expected_tensor(k, dtype_name, shape):
    dtype = dtype_of(dtype_name)
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.int64) + k * 1000
    if dtype in FLOATS:
        t = (base.to(torch.float64) * 0.25).to(torch.float32).to(dtype)
    elif dtype in (torch.complex64, torch.complex128):
        re = (base.to(torch.float64) * 0.25).to(torch.float32)
        if dtype == torch.complex128:
            re = re.to(torch.float64)
        t = torch.complex(re, -re)
    elif dtype == torch.bool:
        t = (base % 3) == 0
    elif dtype in FLOAT8:
        t = (base % 256).to(torch.uint8).view(dtype)
    else:
        # Wrap to the width first so that every conversion below is exact.
        bits = torch.iinfo(dtype).bits
        wrapped = base % (1 << bits) if bits < 64 else base
        if bits < 64 and torch.iinfo(dtype).min < 0:
            wrapped = torch.where(wrapped >= (1 << (bits - 1)), wrapped - (1 << bits), wrapped)
        t = wrapped.to(dtype)
    return t.reshape(shape)


def same_bits(a, b):
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    view = BITS[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def check_tensor(where, got, spec):
    if not isinstance(got, torch.Tensor):
        fail(f"{where}: expected a tensor, got {type(got).__name__}")
        return
    want = expected_tensor(spec["k"], spec["dtype"], spec["shape"])
    if not same_bits(got, want):
        fail(f"{where}: got {got.dtype} {tuple(got.shape)} {got.flatten()[:6].tolist()}, "
             f"want {want.dtype} {tuple(want.shape)} {want.flatten()[:6].tolist()}")


def nbytes(spec):
    n = 1
    for d in spec["shape"]:
        n *= d
    return n * dtype_of(spec["dtype"]).itemsize


# Python values stored next to the tensors; the Rust test builds the same values.
EXTRA = {
    "lr": 0.5,
    "betas": (0.9, 0.999),
    "names": ["a.weight", "b.bias"],
    "step": 7,
    "nothing": None,
    "flag": True,
    "big": 2**40,
    "negative": -3,
    "nested": {"x": [1, (2, "three")]},
}


def check_plain(where, got, want):
    if type(got) is not type(want):
        fail(f"{where}: type {type(got).__name__}, want {type(want).__name__} ({got!r})")
        return
    if isinstance(want, dict):
        if list(got.keys()) != list(want.keys()):
            fail(f"{where}: keys {list(got.keys())}, want {list(want.keys())}")
            return
        for key in want:
            check_plain(f"{where}.{key}", got[key], want[key])
    elif isinstance(want, (list, tuple)):
        if len(got) != len(want):
            fail(f"{where}: length {len(got)}, want {len(want)}")
            return
        for i, (g, w) in enumerate(zip(got, want)):
            check_plain(f"{where}[{i}]", g, w)
    elif got != want:
        fail(f"{where}: {got!r}, want {want!r}")


def check_torch_save(d, manifest):
    obj = torch.load(os.path.join(d, "model.pt"), weights_only=True)
    if type(obj) is not collections.OrderedDict:
        fail(f"top level is {type(obj).__name__}, want OrderedDict")
        return
    if list(obj.keys()) != ["model", "extra", "view"]:
        fail(f"top-level keys {list(obj.keys())}")
        return
    model = obj["model"]
    if type(model) is not collections.OrderedDict:
        fail(f"model is {type(model).__name__}, want OrderedDict")
    keys = [t["key"] for t in manifest["tensors"]]
    if list(model.keys()) != keys:
        fail(f"model keys {list(model.keys())}, want {keys}")
    for spec in manifest["tensors"]:
        check_tensor(f"model[{spec['key']}]", model.get(spec["key"]), spec)
    check_plain("extra", obj["extra"], EXTRA)
    # "view" is elements [2, 4) of the first tensor, sharing its storage.
    first = model[keys[0]]
    view = obj["view"]
    if not torch.equal(view, first.flatten()[2:4]):
        fail(f"view {view.tolist()} != {first.flatten()[2:4].tolist()}")
    if view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        fail("view does not share the storage of its base tensor")
    if view.storage_offset() != 2:
        fail(f"view storage offset {view.storage_offset()}")


def check_safetensors(d, manifest):
    from safetensors.torch import load_file, save

    path = os.path.join(d, "model.safetensors")
    loaded = load_file(path)
    keys = sorted(t["key"] for t in manifest["tensors"])
    if sorted(loaded.keys()) != keys:
        fail(f"keys {sorted(loaded.keys())}, want {keys}")
    for spec in manifest["tensors"]:
        check_tensor(spec["key"], loaded.get(spec["key"]), spec)
    # The reference implementation writes the same bytes for the same tensors and metadata.
    with open(path, "rb") as f:
        ours = f.read()
    ref = save({s["key"]: expected_tensor(s["k"], s["dtype"], s["shape"]) for s in manifest["tensors"]},
               metadata=manifest.get("metadata"))
    if ours != ref:
        n = struct.unpack("<Q", ours[:8])[0]
        m = struct.unpack("<Q", ref[:8])[0]
        fail(f"bytes differ from safetensors.torch.save:\n ours {ours[8:8 + n]!r}\n ref  {ref[8:8 + m]!r}")


def hf_split(specs, max_size):
    """huggingface_hub's split rule, written out from its documentation."""
    shards, current, current_size = [], [], 0
    for spec in specs:
        size = nbytes(spec)
        if size > max_size:
            shards.append([spec["key"]])
            continue
        if current_size + size > max_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(spec["key"])
        current_size += size
    if current:
        shards.append(current)
    return shards


def check_safetensors_sharded(d, manifest):
    from safetensors.torch import load_file

    specs = manifest["tensors"]
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        text = f.read()
    index = json.loads(text)
    if list(index.keys()) != ["metadata", "weight_map"]:
        fail(f"index keys {list(index.keys())}")
    total = sum(nbytes(s) for s in specs)
    if index["metadata"] != {"total_size": total}:
        fail(f"index metadata {index['metadata']}, want total_size {total}")
    shards = hf_split(specs, manifest["max_shard_size"])
    n = len(shards)
    want_map = {}
    for i, keys in enumerate(shards):
        for key in keys:
            want_map[key] = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    if index["weight_map"] != want_map:
        fail(f"weight_map {index['weight_map']}, want {want_map}")
    if text != json.dumps(index, indent=2, sort_keys=True) + "\n":
        fail("index text is not json.dumps(indent=2, sort_keys=True) + newline")
    by_key = {s["key"]: s for s in specs}
    files = sorted(set(want_map.values()))
    on_disk = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    if on_disk != files:
        fail(f"files {on_disk}, want {files}")
    for file in files:
        loaded = load_file(os.path.join(d, file))
        want_keys = sorted(k for k, v in want_map.items() if v == file)
        if sorted(loaded.keys()) != want_keys:
            fail(f"{file}: keys {sorted(loaded.keys())}, want {want_keys}")
        for key, tensor in loaded.items():
            check_tensor(f"{file}:{key}", tensor, by_key[key])


def check_dcp(d, manifest):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    warnings.filterwarnings("ignore")
    files = sorted(f for f in os.listdir(d) if f.endswith(".distcp"))
    want_files = [f"__{r}_0.distcp" for r in range(manifest["world_size"])]
    if files != sorted(want_files):
        fail(f"files {files}, want {want_files}")

    # 1. dcp.load into a state dict of empty tensors of the right shapes (single process, no group).
    model = {s["key"]: torch.empty(s["shape"], dtype=dtype_of(s["dtype"])) for s in manifest["tensors"]}
    state = {
        "model": model,
        "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]},
        "step": 0,
    }
    dcp.load(state, checkpoint_id=d)
    for spec in manifest["tensors"]:
        check_tensor(f"dcp.load model.{spec['key']}", state["model"][spec["key"]], spec)
    check_plain("dcp.load optim", state["optim"],
                {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.999), "params": ["a.weight", "b.bias"]}]})
    check_plain("dcp.load step", state["step"], 7)

    # 2. format_utils.dcp_to_torch_save rebuilds the nesting from planner_data.
    out = os.path.join(os.path.dirname(d.rstrip("/")), "from_dcp.pt")
    dcp_to_torch_save(d, out)
    full = torch.load(out, weights_only=True)
    if sorted(full.keys()) != ["model", "optim", "step"]:
        fail(f"dcp_to_torch_save keys {sorted(full.keys())}")
        return
    for spec in manifest["tensors"]:
        check_tensor(f"dcp_to_torch_save model.{spec['key']}", full["model"].get(spec["key"]), spec)
    check_plain("dcp_to_torch_save optim", full["optim"],
                {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.999), "params": ["a.weight", "b.bias"]}]})
    check_plain("dcp_to_torch_save step", full["step"], 7)


def main():
    fmt, d = sys.argv[1], sys.argv[2]
    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    {
        "torch_save": check_torch_save,
        "safetensors": check_safetensors,
        "safetensors_sharded": check_safetensors_sharded,
        "dcp": check_dcp,
    }[fmt](d, manifest)
    if failures:
        print("\n".join(failures))
        sys.exit(1)
    print(f"ok: {fmt} ({len(manifest['tensors'])} tensors, torch {torch.__version__})")


if __name__ == "__main__":
    main()
