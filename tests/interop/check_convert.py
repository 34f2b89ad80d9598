"""Interop test of `shardscope convert` against real torch (run by native-runner/tests/it/convert_interop.rs).

usage: check_convert.py SHARDSCOPE_BIN WORKDIR

1. Two spawned ranks (gloo, CPU) train a small FSDP2 model one Adam step and `dcp.save` the
   `{"model": ..., "optim": ...}` state dict (DTensor chunks, bytes items, tuples such as `betas`).
2. `shardscope convert` turns that DCP into: a `torch.save` file, compared with what torch's own
   `dcp_to_torch_save` gives (same nesting, same types, equal tensors); safetensors with
   `--select model`, and HF shards with `--max-shard-size`, compared with the `model` subtree.
3. A full `torch.save` model state dict is converted to DCP for 2 ranks (`--api fsdp2` and
   `--api fsdp1`); two spawned ranks `dcp.load` it into a real FSDP2 model and compare every
   parameter's full tensor with the state dict loaded torch's own way (`model.load_state_dict`).
4. The 2-rank DCP of step 1 (model + optimizer) is converted to DCP for 3 ranks; three spawned ranks
   load it into FSDP2 + Adam and get the same full model and optimizer state as torch's own load of
   the original 2-rank DCP at 3 ranks.
5. A DCP whose weight (17.6 MB, sharded over two ranks) is larger than the 16 MiB pieces `convert`
   reads and writes large tensors in: `-o .pt` streams it into one zip member in parts; torch loads
   it equal to `dcp_to_torch_save`'s, and Python's `zipfile` checks every member's CRC-32.
Every expected value comes from torch. Exits non-zero with a message on the first mismatch.
"""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import finish, spawn
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict

WORLD = 2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 6)
        self.lin = torch.nn.Linear(6, 5)
        self.out = torch.nn.Linear(5, 3, bias=False)
        self.register_buffer("scale", torch.arange(3, dtype=torch.float64))

    def forward(self, x):
        return self.out(self.lin(self.emb(x))) * self.scale.float()


def init(rank, store, world=WORLD):
    # A file store, not a TCP port: no race with other tests picking the same free port.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def save_worker(rank, store, out_dir):
    from torch.distributed.fsdp import fully_shard

    init(rank, store)
    torch.manual_seed(0)
    model = Net()
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    model(torch.tensor([1, 2, 3, 6])).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out_dir)
    finish()


def save_big_worker(rank, store, out_dir):
    from torch.distributed.fsdp import fully_shard

    init(rank, store)
    torch.manual_seed(1)
    # 1100 x 4000 float32: 17.6 MB, more than one 16 MiB piece, not a multiple of it.
    model = torch.nn.Linear(4000, 1100)
    fully_shard(model)
    dcp.save({"model": model.state_dict()}, checkpoint_id=out_dir)
    finish()


def load_worker(rank, store, dcp_dir, full_path, result_path):
    from torch.distributed.fsdp import fully_shard

    init(rank, store)
    torch.manual_seed(123)  # different init: the load must overwrite everything
    model = Net()
    fully_shard(model)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=dcp_dir)
    model.load_state_dict(sd)
    # torch's own way: the full state dict into a plain model.
    ref = Net()
    ref.load_state_dict(torch.load(full_path, weights_only=True))
    bad = []
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if not torch.equal(full, ref.state_dict()[name]):
            bad.append(name)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(bad, f)
    finish()


def reshard_worker(rank, store, ours_dir, torch_dir, result_path):
    """At world size 3: load our resharded DCP and torch's original 2-rank DCP (torch reshards it
    itself on load) into a real FSDP2 model + Adam, and compare the full model and optimizer state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from torch.distributed.fsdp import fully_shard

    init(rank, store, world=3)
    full = {}
    for name, ckpt in [("ours", ours_dir), ("torch", torch_dir)]:
        torch.manual_seed(123)  # a different init: the load must overwrite everything
        model = Net()
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=0.5, betas=(0.1, 0.2))
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        full[name] = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    problem = None
    try:
        same(full["ours"][0], full["torch"][0], "model")
        same(full["ours"][1], full["torch"][1], "optim")
        # And the values really are the trained ones, not the fresh init.
        assert full["torch"][1]["param_groups"][0]["betas"] == (0.8, 0.95), full["torch"][1]["param_groups"]
    except AssertionError as e:
        problem = f"rank {rank}: {e}"
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(problem, f)
    finish()


def fresh_store():
    """A path for a new gloo FileStore (the file must not exist yet)."""
    d = tempfile.mkdtemp(prefix="shardscope-store-")
    atexit.register(shutil.rmtree, d, True)
    return os.path.join(d, "store")


def same(a, b, where):
    """Structural equality with types: dict/list/tuple kept, tensors equal with dtype and shape."""
    if type(a) is not type(b) and not (isinstance(a, dict) and isinstance(b, dict)):
        raise AssertionError(f"{where}: {type(a).__name__} vs {type(b).__name__}")
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError(f"{where}: tensors differ")
    elif isinstance(a, dict):
        if set(a) != set(b):
            raise AssertionError(f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}")
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise AssertionError(f"{where}: lengths {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif a != b:
        raise AssertionError(f"{where}: {a!r} vs {b!r}")


def convert(bin_path, *args):
    out = subprocess.run([bin_path, "convert", *args, "--quiet"], capture_output=True, text=True)
    if out.returncode != 0:
        raise AssertionError(f"convert {args} failed ({out.returncode}): {out.stderr}")


def main():
    bin_path, work = sys.argv[1], sys.argv[2]
    src = os.path.join(work, "dcp")
    spawn(save_worker, (fresh_store(), src), WORLD)
    ref_pt = os.path.join(work, "torch_ref.pt")
    dcp_to_torch_save(src, ref_pt)
    ref = torch.load(ref_pt, weights_only=True)

    # DCP -> torch.save: same nesting and types as dcp_to_torch_save.
    ours_pt = os.path.join(work, "ours.pt")
    convert(bin_path, src, "-o", ours_pt)
    same(torch.load(ours_pt, weights_only=True), ref, "torch.save")
    assert isinstance(ref["optim"]["param_groups"][0]["betas"], tuple)

    # DCP -> safetensors --select model: HF-ready keys, the model subtree.
    ours_st = os.path.join(work, "model.safetensors")
    convert(bin_path, src, "-o", ours_st, "--select", "model")
    same(load_file(ours_st), dict(ref["model"]), "safetensors")

    # --select optim: non-tensor values land in the metadata as JSON.
    optim_st = os.path.join(work, "optim.safetensors")
    convert(bin_path, src, "-o", optim_st, "--select", "optim")
    from safetensors import safe_open

    with safe_open(optim_st, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt", meta
    assert json.loads(meta["param_groups.0.lr"]) == ref["optim"]["param_groups"][0]["lr"], meta
    assert json.loads(meta["param_groups.0.betas"]) == list(ref["optim"]["param_groups"][0]["betas"]), meta

    # HF shards.
    shards = os.path.join(work, "hf")
    convert(bin_path, src, "-o", shards, "--select", "model", "--max-shard-size", "100B")
    with open(os.path.join(shards, "model.safetensors.index.json")) as f:
        index = json.load(f)
    loaded = {}
    for name in sorted(set(index["weight_map"].values())):
        part = load_file(os.path.join(shards, name))
        for k in part:
            assert index["weight_map"][k] == name, (k, name)
        loaded.update(part)
    same(loaded, dict(ref["model"]), "hf shards")
    total = sum(t.numel() * t.element_size() for t in ref["model"].values())
    assert index["metadata"]["total_size"] == total, index["metadata"]

    # Full -> DCP at the new world size, loaded into a real FSDP2 model.
    full_pt = os.path.join(work, "full.pt")
    torch.save(dict(ref["model"]), full_pt)
    for api in ["fsdp2", "fsdp1"]:
        out_dir = os.path.join(work, f"dcp_{api}")
        convert(bin_path, full_pt, "-o", out_dir, "--world-size", str(WORLD), "--api", api)
        result = os.path.join(work, f"result_{api}.json")
        spawn(load_worker, (fresh_store(), out_dir, full_pt, result), WORLD)
        with open(result) as f:
            bad = json.load(f)
        if bad:
            raise AssertionError(f"dcp.load of our {api} DCP: parameters differ: {bad}")
    # DCP (2 ranks, model + optimizer) -> DCP for 3 ranks: torch loads ours at 3 ranks and gets what
    # its own load of the original 2-rank DCP gives (dcp.load reshards by itself).
    out_dir = os.path.join(work, "dcp_ws3")
    convert(bin_path, src, "-o", out_dir, "--world-size", "3")
    result = os.path.join(work, "result_ws3.json")
    spawn(reshard_worker, (fresh_store(), out_dir, src, result), 3)
    with open(result) as f:
        problem = json.load(f)
    if problem:
        raise AssertionError(f"DCP resharded 2 -> 3 ranks: {problem}")
    # safetensors full -> DCP too.
    out_dir = os.path.join(work, "dcp_from_st")
    convert(bin_path, ours_st, "-o", out_dir, "--world-size", str(WORLD))
    result = os.path.join(work, "result_st.json")
    spawn(load_worker, (fresh_store(), out_dir, full_pt, result), WORLD)
    with open(result) as f:
        bad = json.load(f)
    if bad:
        raise AssertionError(f"dcp.load of DCP from safetensors: parameters differ: {bad}")

    # A tensor larger than a piece: written into its zip member in parts.
    big = os.path.join(work, "dcp_big")
    spawn(save_big_worker, (fresh_store(), big), WORLD)
    big_ref = os.path.join(work, "big_ref.pt")
    dcp_to_torch_save(big, big_ref)
    big_pt = os.path.join(work, "big.pt")
    convert(bin_path, big, "-o", big_pt)
    same(torch.load(big_pt, weights_only=True), torch.load(big_ref, weights_only=True), "large .pt")
    import zipfile

    with zipfile.ZipFile(big_pt) as z:
        bad_member = z.testzip()
        sizes = sorted(i.file_size for i in z.infolist())
    assert bad_member is None, f"CRC-32 of {bad_member} does not match its data"
    assert sizes[-1] == 1100 * 4000 * 4 > 16 << 20, sizes
    print("ok")


if __name__ == "__main__":
    main()
