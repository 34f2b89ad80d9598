"""Content manifests against torch: `shardscope hash` gives, key by key, the digests this script
computes itself (docs/hash.md's framing, SHA-256 from hashlib) from what torch loads, for one
checkpoint in every serialization torch writes: a DCP (examples/fsdp2_dcp), torch's consolidated
`.pt` of it (`dcp_to_torch_save`), the same tensors as safetensors, and FSDP2 per-rank files
(tests/fixtures/formats/fsdp2, the full tensor assembled here from each rank's local shard).
Default manifests (with file digests, read in one pass with the tensors) give the same tensors and
each file's hashlib SHA-256; among them a DCP written here whose file order crosses its tensors' C
order (rank 0 holds `x`'s second half before `y`'s first, rank 1 `y`'s second before `x`'s first),
which the one pass cannot follow for both, hashed with 1, 2 and 3 threads; and one 24 MiB
safetensors file with 1, 2 and 4 threads.

Usage: python check_hash.py SHARDSCOPE_BIN WORK_DIR. Prints `ok` last.
"""
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

BIN, WORK = sys.argv[1], Path(sys.argv[2])
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import finish, spawn  # noqa: E402


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    header = b"tensor\0" + str(t.dtype).removeprefix("torch.").encode() + b"\0"
    header += ",".join(str(d) for d in t.shape).encode() + b"\0"
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(header + data).hexdigest()


def canonical(v) -> bytes:
    if v is None:
        return b"N"
    if v is True:
        return b"T"
    if v is False:
        return b"F"
    if isinstance(v, int):
        return b"I%d;" % v
    if isinstance(v, float):
        return b"D" + struct.pack(">d", v).hex().encode() + b";"
    if isinstance(v, str):
        b = v.encode()
        return b"S%d:" % len(b) + b
    if isinstance(v, (list, tuple)):
        return b"L%d:" % len(v) + b"".join(canonical(x) for x in v)
    if isinstance(v, dict):
        items = sorted(((str(k).encode(), x) for k, x in v.items()), key=lambda p: p[0])
        return b"M%d:" % len(items) + b"".join(b"S%d:" % len(k) + k + canonical(x) for k, x in items)
    raise TypeError(type(v))


def value_digest(v) -> str:
    return hashlib.sha256(b"value\0" + canonical(v)).hexdigest()


def paths(obj, prefix="", out=None) -> dict:
    """Every container and leaf by its dotted path (dict keys, list indices)."""
    out = {} if out is None else out
    if prefix:
        out[prefix] = obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    for k, v in items:
        paths(v, f"{prefix}.{k}" if prefix else str(k), out)
    return out


def shardscope_hash(*inputs, files=False, threads=None) -> dict:
    flags = [] if files else ["--no-files"]
    flags += [] if threads is None else ["--threads", str(threads)]
    out = subprocess.run(
        [BIN, "hash", "--algorithm", "sha256", "--json", "--quiet", *flags, *map(str, inputs)],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    assert m["version"] == 1 and m["algorithm"] == "sha256", m
    return m


def check_tensors(name: str, got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected), f"{name}: keys {sorted(set(got) ^ set(expected))}"
    for k, t in expected.items():
        g = got[k]
        assert g["dtype"] == str(t.dtype).removeprefix("torch."), (name, k, g)
        assert g["shape"] == list(t.shape), (name, k, g)
        assert g["digest"] == tensor_digest(t), f"{name}: {k}: {g['digest']} != {tensor_digest(t)}"


def check_files(name: str, root: Path, no_files: dict, threads=None) -> None:
    """The default manifest of `root` (a folder or a file): the same tensors and values as
    without file digests, and each file's SHA-256 as hashlib computes it."""
    m = shardscope_hash(root, files=True, threads=threads)
    assert m["tensors"] == no_files["tensors"], f"{name}: tensors differ with file digests"
    assert m.get("values") == no_files.get("values"), f"{name}: values differ with file digests"
    paths = sorted(p for p in root.iterdir() if p.is_file()) if root.is_dir() else [root]
    expected = {
        (p.name if root.is_dir() else p.name): {"size": p.stat().st_size, "digest": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in paths
    }
    assert m["files"] == expected, f"{name}: files {m['files']} != {expected}"


def crossed_tensors():
    g = torch.Generator().manual_seed(37)
    # 512 KiB halves: two 256 KiB pieces each.
    return torch.randn(256, 1024, generator=g), torch.randn(256, 1024, generator=g)


def crossed_worker(rank, store, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    x, y = crossed_tensors()
    forward = DeviceMesh("cpu", torch.tensor([0, 1]))
    backward = DeviceMesh("cpu", torch.tensor([1, 0]))
    local = {
        "x": DTensor.from_local(x.chunk(2)[backward.get_coordinate()[0]].clone(), backward, [Shard(0)]),
        "y": DTensor.from_local(y.chunk(2)[forward.get_coordinate()[0]].clone(), forward, [Shard(0)]),
    }
    # Equal sizes: each rank's file keeps its state dict's order.
    dcp.save(local if rank == 0 else {"y": local["y"], "x": local["x"]}, checkpoint_id=out)
    finish()


def check_crossed() -> None:
    from torch.distributed.checkpoint import FileSystemReader

    out = WORK / "crossed_dcp"
    store = os.path.join(tempfile.mkdtemp(prefix="shardscope-store-"), "store")
    spawn(crossed_worker, (store, str(out)), 2)
    # The layout is the one meant: file order crosses C order.
    meta = FileSystemReader(str(out)).read_metadata()
    stored = {(i.fqn, tuple(i.offset)): (s.relative_path, s.offset) for i, s in meta.storage_data.items()}
    assert stored[("x", (128, 0))] == ("__0_0.distcp", 0), stored
    assert stored[("y", (0, 0))][0] == "__0_0.distcp" and stored[("y", (0, 0))][1] > 0, stored
    assert stored[("y", (128, 0))] == ("__1_0.distcp", 0), stored
    assert stored[("x", (0, 0))][0] == "__1_0.distcp" and stored[("x", (0, 0))][1] > 0, stored
    x, y = crossed_tensors()
    no_files = shardscope_hash(out)
    check_tensors("crossed dcp", no_files["tensors"], {"x": x, "y": y})
    for threads in (1, 2, 3):
        check_files(f"crossed dcp, {threads} threads", out, no_files, threads)


def check_one_large_file() -> None:
    """One file of 8 MiB tensors (32 pieces each): its one stream of file digest is fed by one
    thread while the others copy pieces ahead for it; any thread count gives torch's digests."""
    g = torch.Generator().manual_seed(11)
    tensors = {f"w{i}": torch.randn(512, 4096, generator=g) for i in range(3)}
    tensors["bias"] = torch.randn(4096, generator=g).to(torch.bfloat16)
    path = WORK / "large.safetensors"
    save_file(tensors, str(path))
    no_files = shardscope_hash(path)
    check_tensors("large safetensors", no_files["tensors"], tensors)
    for threads in (1, 2, 4):
        check_files(f"large safetensors, {threads} threads", path, no_files, threads)


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    dcp = ROOT / "examples" / "fsdp2_dcp"
    full_pt = WORK / "full.pt"
    dcp_to_torch_save(str(dcp), str(full_pt))
    full = torch.load(full_pt, weights_only=False)
    flat = paths(full)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert len(tensors) > 10, len(tensors)
    st = WORK / "full.safetensors"
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(st))

    inputs = {"dcp": dcp, "pt": full_pt, "safetensors": st}
    manifests = {name: shardscope_hash(p) for name, p in inputs.items()}
    for name, m in manifests.items():
        check_tensors(name, m["tensors"], tensors)
        check_files(name, inputs[name], m)
    # Non-tensor values (param_groups, step): the same keys in the DCP and the .pt, each with the
    # digest of what torch loaded at that path.
    dcp_values, pt_values = manifests["dcp"]["values"], manifests["pt"]["values"]
    assert dcp_values and sorted(dcp_values) == sorted(pt_values), (sorted(dcp_values), sorted(pt_values))
    for k, v in dcp_values.items():
        assert k in flat, k
        assert v["digest"] == value_digest(flat[k]), (k, flat[k])
        assert pt_values[k]["digest"] == v["digest"], k
    assert manifests["safetensors"]["values"] == {}, manifests["safetensors"]["values"]

    # FSDP2 per-rank files: the full tensor is the ranks' local shards joined along the sharded dim.
    fsdp2 = ROOT / "tests" / "fixtures" / "formats" / "fsdp2"
    ranks = [torch.load(fsdp2 / f"rank{r}_model.pt", weights_only=False) for r in range(2)]
    expected = {}
    for k, v in ranks[0].items():
        placement = v._spec.placements[0] if hasattr(v, "_spec") else None
        if placement is not None and placement.is_shard():
            whole = torch.cat([rk[k]._local_tensor for rk in ranks], dim=placement.dim)
        else:
            whole = getattr(v, "_local_tensor", v)
        assert list(whole.shape) == list(v.shape), (k, whole.shape, v.shape)
        expected[k] = whole
    m = shardscope_hash(fsdp2 / "rank0_model.pt", fsdp2 / "rank1_model.pt")
    check_tensors("fsdp2 per-rank", m["tensors"], expected)
    # The whole folder (model and optimizer per rank) names the model under `model`.
    folder = shardscope_hash(fsdp2)["tensors"]
    check_tensors("fsdp2 folder", {k[len("model."):]: v for k, v in folder.items() if k.startswith("model.")}, expected)
    check_crossed()
    check_one_large_file()
    print(f"{len(tensors)} tensors and {len(dcp_values)} values in 3 serializations, {len(expected)} per-rank tensors")
    print("ok")


if __name__ == "__main__":
    main()
