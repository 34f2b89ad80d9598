"""Interop test of FSDP2 optimizer state through `shardscope convert` (run by
native-runner/tests/it/convert_fsdp2_optim.rs).

usage: check_fsdp2_optim.py SHARDSCOPE_BIN WORKDIR

Fixtures: tests/fixtures/fsdp2_optim (written by its gen_fsdp2_optim.py with torch).
1. `shardscope convert ws{2,3} -o full.pt` (per-rank FSDP2 model + raw optimizer files): torch
   loads the result with `weights_only=True` and it equals, key for key (in order) and bit for bit,
   torch's `get_model_state_dict` / `get_optimizer_state_dict(full_state_dict=True)`.
2. That full `{"model", "optim"}` file converted to DCP for N = 2, 3, 4 ranks (`--api fsdp2`): N
   spawned ranks (gloo, CPU) build a fresh FSDP2 model + optimizer, `dcp.load` it and apply it
   with `set_model_state_dict` / `set_optimizer_state_dict`; torch's own path loads torch's full
   state dicts with `StateDictOptions(full_state_dict=True)` into another fresh model. Every
   parameter shard and every optimizer state shard must be equal, and stay equal after one more
   training step.
Exits non-zero with a message on the first mismatch; prints "ok" last.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "fsdp2_optim"
sys.path.insert(0, str(FIXTURES))
from gen_fsdp2_optim import build, train  # noqa: E402
from ranks import finish, spawn  # noqa: E402


def fresh_store():
    # A file store, not a TCP port: no race with other tests picking the same free port.
    return os.path.join(tempfile.mkdtemp(prefix="shardscope-store-"), "store")


def same(a, b, path="", local=False):
    """Bitwise equality of nested values with the same key order and types. With `local`, DTensors
    compare by their local shards."""
    from torch.distributed.tensor import DTensor

    if local and isinstance(a, DTensor):
        a = a.to_local()
    if local and isinstance(b, DTensor):
        b = b.to_local()
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or isinstance(a, DTensor) or isinstance(b, DTensor):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            return f"{path}: values differ"
        return None
    if isinstance(b, dict):
        if not isinstance(a, dict) or list(a.keys()) != list(b.keys()):
            return f"{path}: keys {list(a.keys()) if isinstance(a, dict) else a} vs {list(b.keys())}"
        for k in b:
            err = same(a[k], b[k], f"{path}.{k}", local)
            if err:
                return err
        return None
    if isinstance(b, (list, tuple)):
        # After a load (`local`), a tuple and a list of equal items are the same state: torch's
        # own full-state path (`set_optimizer_state_dict(full_state_dict=True)`) hands the
        # optimizer lists (`betas`), while a DCP keeps the tuple it saved, as torch's
        # `torch_save_to_dcp` does.
        kind_differs = type(a) is not type(b) and not (local and isinstance(a, (list, tuple)))
        if kind_differs or len(a) != len(b):
            return f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            err = same(x, y, f"{path}.{i}", local)
            if err:
                return err
        return None
    if type(a) is not type(b) or a != b:
        return f"{path}: {a!r} vs {b!r}"
    return None


def load_worker(rank, world_size, store, dcp_dir, expected, result):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    # Ours: DCP written by shardscope, loaded the DSD way. Different seeds: loads must overwrite.
    model, optim = build(world_size, seed=123)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    # Torch's own path: its full state dicts, distributed by DSD.
    ref_model, ref_optim = build(world_size, seed=7)
    full = torch.load(expected, weights_only=True)
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(ref_model, full["model"], options=opts)
    set_optimizer_state_dict(ref_model, ref_optim, full["optim"], options=opts)
    errors = []
    for when in ("loaded", "after one more step"):
        for what, a, b in (
            ("model", model.state_dict(), ref_model.state_dict()),
            ("optim", optim.state_dict(), ref_optim.state_dict()),
        ):
            err = same(a, b, what, local=True)
            if err:
                errors.append(f"rank {rank} {when}: {err}")
        if when == "loaded":
            train(model, optim)
            train(ref_model, ref_optim)
    Path(f"{result}.{rank}").write_text("\n".join(errors) if errors else "ok")
    finish()


def convert(bin_path, *args):
    out = subprocess.run([bin_path, "convert", *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"shardscope convert {' '.join(map(str, args))} failed:\n{out.stderr}")


def converts_to_torch_full(bin_path, src, expected, work, what):
    """`convert SRC -o full.pt` equals torch's get_model/optimizer_state_dict(full_state_dict=True)."""
    out = work / f"{src.name}_full.pt"
    convert(bin_path, src, "-o", out)
    err = same(torch.load(out, weights_only=True), torch.load(expected, weights_only=True), what)
    if err:
        sys.exit(f"{what} per-rank files -> full differs from torch's get_*_state_dict: {err}")


def main():
    bin_path, work = sys.argv[1], Path(sys.argv[2])
    # 1. per-rank files -> full state, against torch's full state dicts.
    for ws in (2, 3):
        out = work / f"ws{ws}_full.pt"
        convert(bin_path, FIXTURES / f"ws{ws}", "-o", out)
        err = same(
            torch.load(out, weights_only=True),
            torch.load(FIXTURES / "expected" / f"ws{ws}_full.pt", weights_only=True),
            f"ws{ws}",
        )
        if err:
            sys.exit(f"per-rank ws{ws} -> full differs from torch's get_*_state_dict: {err}")
        print(f"per-rank ws{ws} -> full.pt equals torch's full state dicts")
    # 1b. HSDP per-rank files (mesh (2 replicas, 2 shards)): the first replica's pieces make the
    #     full state, equal to torch's own full state dicts.
    hsdp = FIXTURES.parent / "fsdp2_hsdp"
    converts_to_torch_full(bin_path, hsdp / "ws4_2x2", hsdp / "expected" / "ws4_2x2_full.pt", work, "HSDP")
    print("HSDP per-rank files -> full.pt equals torch's full state dicts")
    # The same folder is one checkpoint for inspect/verify: `model` and `optim` subtrees.
    out = subprocess.run([bin_path, "inspect", hsdp / "ws4_2x2", "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"inspect of the HSDP folder failed: {out.stderr}")
    # The raw optimizer state (integer ids) is keyed by FQN, as torch's full optimizer state dict
    # (get_optimizer_state_dict(full_state_dict=True)) keys it.
    keys = {e["key"] for e in json.loads(out.stdout)["entries"]}
    torch_model = torch.load(hsdp / "ws4_2x2" / "rank0_model.pt", weights_only=True)
    torch_full = torch.load(hsdp / "expected" / "ws4_2x2_full.pt", weights_only=True)
    want = {f"model.{k}" for k in torch_model} | {
        f"optim.state.{fqn}.{name}" for fqn, st in torch_full["optim"]["state"].items() for name in st
    }
    if want - keys or {k for k in keys if k.startswith(("model.", "optim.state."))} - want:
        sys.exit(f"inspect of the HSDP folder: missing {sorted(want - keys)}, keys {sorted(keys)}")
    out = subprocess.run([bin_path, "verify", hsdp / "ws4_2x2"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"verify of the HSDP folder: {out.stdout}{out.stderr}")
    print("inspect/verify read the HSDP folder as one checkpoint (model + optim)")
    # 1c. A folder as verl leaves it (model, optim and extra_state sets, FSDP2): the conversion
    #     takes the model and optimizer sets, the index shows all three subtrees.
    trainer = FIXTURES.parent / "trainer_folders"
    converts_to_torch_full(
        bin_path, trainer / "verl_fsdp2", trainer / "expected" / "verl_fsdp2_full.pt", work, "verl-style"
    )
    out = subprocess.run([bin_path, "inspect", trainer / "verl_fsdp2", "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"inspect of the verl-style folder failed: {out.stderr}")
    tops = {e["key"].split(".")[0] for e in json.loads(out.stdout)["entries"]}
    if tops != {"model", "optim", "extra"}:
        sys.exit(f"verl-style folder: subtrees {sorted(tops)}")
    print("verl-style folder (model + optim + extra_state sets) converts and inspects")
    # 2. our full state -> DCP for N ranks -> a real FSDP2 model + optimizer.
    for n in (2, 3, 4):
        dcp_dir = work / f"dcp{n}"
        convert(bin_path, work / "ws2_full.pt", "-o", dcp_dir, "--world-size", n, "--api", "fsdp2")
        result = work / f"result{n}"
        expected = FIXTURES / "expected" / "ws2_full.pt"
        spawn(load_worker, (n, fresh_store(), str(dcp_dir), str(expected), str(result)), n)
        for r in range(n):
            text = Path(f"{result}.{r}").read_text()
            if text != "ok":
                sys.exit(f"DCP for {n} ranks: {text}")
        print(f"DCP for {n} ranks loads into FSDP2 model + optimizer as torch's own path does")
    print("ok")


if __name__ == "__main__":
    main()
