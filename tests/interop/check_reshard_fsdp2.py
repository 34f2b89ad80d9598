"""Interop test of FSDP2 per-rank output: `shardscope reshard ... --to-api fsdp2` (run by
native-runner/tests/it/reshard_fsdp2.rs).

usage: check_reshard_fsdp2.py SHARDSCOPE_BIN WORKDIR

Fixtures: tests/fixtures/fsdp2_optim and tests/fixtures/fsdp2_hsdp (torch-written FSDP2 per-rank
files of the same `Net`, and torch's own full state dicts of them). For each case, shardscope writes
`rank{r}_model.pt` + `rank{r}_optim.pt` for B ranks; B spawned gloo ranks (CPU) build a fresh FSDP2
model + Adam on the target mesh and load them as a user would:
`model.load_state_dict(torch.load(..., weights_only=True))`, `optim.load_state_dict(...)`. Torch's
own path loads torch's full state dicts into another fresh model with
`set_model_state_dict`/`set_optimizer_state_dict(full_state_dict=True)`. Every DTensor must sit on
the model's own mesh with its placements, every local shard and optimizer state must be equal bit
for bit, and stay equal after two more training steps.
Exits non-zero with a message on the first mismatch; prints "ok" last.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
sys.path.insert(0, str(FIXTURES / "fsdp2_optim"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_fsdp2_optim import same  # noqa: E402
from gen_fsdp2_optim import build, train  # noqa: E402
from ranks import finish, spawn  # noqa: E402

MODEL_JSON = FIXTURES / "fsdp2_optim" / "model.json"


def fresh_store():
    return os.path.join(tempfile.mkdtemp(prefix="shardscope-store-"), "store")


def spec_errors(loaded, live, what):
    """Every DTensor of `loaded` must have the spec of the live one (mesh, placements, shape)."""
    from torch.distributed.tensor import DTensor

    errors = []
    for k, v in loaded.items():
        p = live.get(k)
        if isinstance(p, DTensor) != isinstance(v, DTensor):
            errors.append(f"{what}.{k}: {type(v).__name__}, the model has {type(p).__name__}")
        elif isinstance(p, DTensor):
            if v.device_mesh != p.device_mesh:
                errors.append(f"{what}.{k}: mesh {v.device_mesh} vs {p.device_mesh}")
            elif v.device_mesh._dim_group_names != p.device_mesh._dim_group_names:
                # The names DeviceMesh.__setstate__ resolves to the live process groups.
                errors.append(
                    f"{what}.{k}: process groups {v.device_mesh._dim_group_names} vs "
                    f"{p.device_mesh._dim_group_names}"
                )
            elif v.placements != p.placements or v.shape != p.shape:
                errors.append(f"{what}.{k}: {v.placements} {v.shape} vs {p.placements} {p.shape}")
            elif v.to_local().shape != p.to_local().shape:
                errors.append(f"{what}.{k}: local {v.to_local().shape} vs {p.to_local().shape}")
    return errors


def load_worker(rank, world_size, mesh_shape, names, store, ours, expected, result):
    import torch.distributed.tensor  # noqa: F401 - DTensor globals for weights_only loads
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    # Ours, loaded as a user loads per-rank files. A different seed: the load must overwrite.
    model, optim = build(world_size, seed=123, mesh_shape=mesh_shape, mesh_dim_names=names)
    msd = torch.load(Path(ours) / f"rank{rank}_model.pt", weights_only=True)
    osd = torch.load(Path(ours) / f"rank{rank}_optim.pt", weights_only=True)
    errors = spec_errors(msd, model.state_dict(), "model")
    for i, st in osd["state"].items():
        errors += spec_errors(
            {f"{i}.{k}": v for k, v in st.items() if k != "step"},
            {f"{i}.{k}": p for k in st if k != "step" for p in [list(model.parameters())[i]]},
            "optim.state",
        )
    model.load_state_dict(msd)
    optim.load_state_dict(osd)
    # Torch's own path: its full state dicts, distributed by DSD.
    ref_model, ref_optim = build(world_size, seed=7, mesh_shape=mesh_shape, mesh_dim_names=names)
    full = torch.load(expected, weights_only=True)
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(ref_model, full["model"], options=opts)
    set_optimizer_state_dict(ref_model, ref_optim, full["optim"], options=opts)
    for when in ("loaded", "after two more steps"):
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


def reshard(bin_path, *args):
    out = subprocess.run([bin_path, "reshard", *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"shardscope reshard {' '.join(map(str, args))} failed:\n{out.stderr}")
    return out.stdout


def main():
    bin_path, work = sys.argv[1], Path(sys.argv[2])
    ws2 = FIXTURES / "fsdp2_optim" / "ws2"
    ws2_full = FIXTURES / "fsdp2_optim" / "expected" / "ws2_full.pt"
    hsdp = FIXTURES / "fsdp2_hsdp" / "ws4_2x2"
    hsdp_full = FIXTURES / "fsdp2_hsdp" / "expected" / "ws4_2x2_full.pt"
    cases = [
        # (name, source, expected full state, B, shard group size, mesh dim names)
        ("ws2 folder -> 3 ranks", ws2, ws2_full, 3, None, None),
        ("ws2 folder -> HSDP 2x2", ws2, ws2_full, 4, 2, ("replicate", "shard")),
        ("full {model, optim} file -> 2 ranks, named mesh", ws2_full, ws2_full, 2, None, ("dp",)),
        ("HSDP 2x2 folder -> 3 ranks", hsdp, hsdp_full, 3, None, None),
        ("HSDP 2x2 folder -> HSDP 3x1", hsdp, hsdp_full, 3, 1, ("replicate", "shard")),
    ]
    for i, (name, src, expected, b, group, names) in enumerate(cases):
        out = work / f"case{i}"
        args = [src, "-o", out, "--model", MODEL_JSON, "--to-world-size", b, "--to-api", "fsdp2"]
        if group is not None:
            args += ["--to-shard-group-size", group]
        if names is not None:
            args += ["--to-mesh-dim-names", ",".join(names)]
        reshard(bin_path, *args)
        files = sorted(p.name for p in out.iterdir())
        want = sorted(f"rank{r}_{k}.pt" for r in range(b) for k in ("model", "optim"))
        if files != want:
            sys.exit(f"{name}: wrote {files}, expected {want}")
        mesh_shape = (b // group, group) if group is not None else (b,)
        result = work / f"result{i}"
        spawn(load_worker, (b, mesh_shape, names, fresh_store(), str(out), str(expected), str(result)), b)
        for r in range(b):
            text = Path(f"{result}.{r}").read_text()
            if text != "ok":
                sys.exit(f"{name}: {text}")
        print(f"{name}: loads into FSDP2 model + optimizer as torch's own path does, and trains alike")
    print("ok")


if __name__ == "__main__":
    main()
