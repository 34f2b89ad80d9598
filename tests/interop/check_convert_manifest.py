"""`convert --write-manifest` against torch: for a `.pt`, a safetensors file, a DCP (`--world-size 3`,
FSDP2 and FSDP1 chunking) and a `--to hf` folder, the manifest written beside (or inside) the
output
- lets `verify DST --manifest M` exit 0,
- equals `shardscope hash DST` (tensors, values, files), and
- holds, key by key, the SHA-256 digests this script computes (check_hash.py's framing) from what
  torch loads from DST: `torch.load` of the `.pt`, `dcp_to_torch_save` of the DCP (each chunk's
  digest from the slice of torch's tensor), safetensors' `load_file` of the others; and the digest
  of each non-tensor value torch loads.

Usage: python check_convert_manifest.py SHARDSCOPE_BIN WORK_DIR. Prints `ok` last.
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from check_hash import check_tensors, paths, tensor_digest, value_digest

BIN, WORK = sys.argv[1], Path(sys.argv[2])
ROOT = Path(__file__).resolve().parents[2]


def run(*args, code=0):
    out = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True)
    assert out.returncode == code, (args, out.returncode, out.stdout, out.stderr)
    return out.stdout


def convert(src, dst, *flags):
    run("convert", src, "-o", dst, "--write-manifest", "--manifest-algorithm", "sha256", "--quiet", *flags)
    folder = dst.is_dir()
    manifest = dst / "shardscope.manifest.json" if folder else dst.with_name(dst.name + ".manifest.json")
    assert manifest.is_file(), manifest
    m = json.loads(manifest.read_text())
    assert m["version"] == 1 and m["algorithm"] == "sha256", m
    # The output proves intact against it, and `hash` of the output says the same.
    run("verify", dst, "--manifest", manifest)
    hashed = json.loads(run("hash", dst, "--algorithm", "sha256", "--json", "--quiet"))
    assert hashed["tensors"] == m["tensors"], f"{dst}: tensors differ from `hash`"
    assert hashed == m, f"{dst}: {[k for k in m if m[k] != hashed.get(k)]} differ from `hash`"
    assert m["files"], f"{dst}: no file digests"
    return m


def check(name, m, tensors, values=None):
    check_tensors(name, m["tensors"], tensors)
    for k, t in tensors.items():
        for c in m["tensors"][k].get("chunks", []):
            part = t[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"]))]
            assert c["digest"] == tensor_digest(part), f"{name}: {k}: chunk {c['offsets']}"
    if values is not None:
        # Each value of the manifest is what torch loads at its path (a list of numbers, like
        # `betas`, is one value); every non-tensor leaf torch loads is under one of them.
        for k, v in m["values"].items():
            assert k in values, f"{name}: {k} is not a value torch loads"
            assert v["digest"] == value_digest(values[k]), f"{name}: {k}: {values[k]!r}"
        for k, v in values.items():
            if not isinstance(v, (dict, list, tuple)):
                covered = any(k == p or k.startswith(p + ".") for p in m["values"])
                assert covered, f"{name}: {k} = {v!r} has no digest"


def split(loaded):
    flat = paths(loaded)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    return tensors, values


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    src = ROOT / "examples" / "fsdp2_dcp"

    pt = WORK / "full.pt"
    m = convert(src, pt)
    tensors, values = split(torch.load(pt, weights_only=True))
    assert len(tensors) > 10 and values, (len(tensors), values)
    check("pt", m, tensors, values)

    for api in ["fsdp2", "fsdp1"]:
        d = WORK / f"dcp_{api}"
        m = convert(src, d, "--world-size", "3", "--api", api)
        back = WORK / f"dcp_{api}.pt"
        dcp_to_torch_save(str(d), str(back))
        tensors, values = split(torch.load(back, weights_only=False))
        check(f"dcp {api}", m, tensors, values)
        assert any(len(t.get("chunks", [])) > 1 for t in m["tensors"].values()), "no chunked tensor"

    st = WORK / "model.safetensors"
    m = convert(src, st, "--select", "model", "--dtype", "bf16")
    check("safetensors", m, load_file(st), {})

    hf_src = ROOT / "tests" / "fixtures" / "hf_mapping" / "llama3"
    hf = WORK / "hf"
    m = convert(hf_src / "step-1", hf, "--to", "hf", "--config", hf_src / "config.json", "--max-shard-size", "20000")
    shards = sorted(hf.glob("*.safetensors"))
    assert len(shards) > 1, shards
    hf_tensors = {}
    for f in shards:
        hf_tensors.update(load_file(f))
    check("hf", m, hf_tensors, {})
    assert sorted(m["files"]) == [f.name for f in shards], m["files"]
    print(f"{len(tensors)} tensors in .pt and DCP, {len(hf_tensors)} in {len(shards)} HF shards")
    print("ok")


if __name__ == "__main__":
    main()
