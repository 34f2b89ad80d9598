#!/usr/bin/env python3
"""Benchmark: `shardscope convert` of a ~3 GiB FSDP2 per-rank checkpoint (model + optimizer) written by
torch to one full `torch.save` file, against a plain copy of the same bytes, in the same run.

1. Two spawned ranks (gloo, CPU, `init_device_mesh("cpu", (2,))`) shard a model of 8 bias-free Linear
   layers (alternately [8192, 4096] and [4096, 8192] float32: 128 MiB each, 1 GiB in all) with FSDP2
   `fully_shard` (one per layer plus the root), take one Adam step, and save per rank
   `model.state_dict()` (`rank{r}_model.pt`, DTensor values) and the raw `optim.state_dict()`
   (`rank{r}_optim.pt`, DTensor `exp_avg`/`exp_avg_sq`) with torch.save. Rank 0 also saves the full
   weights of layers 0 and 7 (`full_tensor()`) for a spot check.
2. Each command runs as its own process under `/usr/bin/time -v` (wall time, peak RSS), with the input
   in the page cache and after a `sync`:
   - plain copy: `cat` of the four rank files into one file, then `sync FILE` (shardscope fsyncs its
     outputs too): the floor for moving these bytes;
   - `shardscope convert SRC -o full.pt`;
   - `shardscope convert SRC -o model.safetensors --select model` (staged through a temporary full
     `.pt` under --dir);
   - optionally (`--baseline BIN`) the same command with another build (e.g. the earlier in-memory
     code); its output must be byte-identical.
3. Spot check: layers 0 and 7 of `full.pt["model"]` and of model.safetensors equal torch's full
   parameters.

With `--hsdp`, four ranks on a 2 x 2 mesh (`("replicate", "shard")`: HSDP, replicas {0, 1} and {2, 3})
write the folder; shardscope reads the first replica, so the plain copy is of ranks 0 and 1's files (the
bytes read), and the reshard goes to 4 ranks on a 1-D mesh.

usage: python bench/fsdp2_convert.py [--shardscope target/release/shardscope] [--baseline BIN] [--dir /tmp] [--hsdp]
Needs about 10 GiB of free disk under --dir and ~6 GiB of memory for the torch ranks. Prints a table and
one JSON line; cleans up its temp directory. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchlib import BIG, LAYERS, SMALL, Model, description, timed

WORLD = 2


def save_worker(rank: int, store: str, out_dir: str, ref_path: str, hsdp: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = 2 * WORLD if hsdp else WORLD
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if hsdp:
        mesh = init_device_mesh("cpu", (2, WORLD), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = Model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    model(torch.randn(2, SMALL)).sum().backward()
    optim.step()
    torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}_model.pt"))
    torch.save(optim.state_dict(), os.path.join(out_dir, f"rank{rank}_optim.pt"))
    ref = {}
    for i in (0, LAYERS - 1):
        full = model.layers[i].weight.full_tensor()
        if rank == 0:
            ref[f"layers.{i}.weight"] = full.detach().clone()
    if rank == 0:
        torch.save(ref, ref_path)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardscope", default="target/release/shardscope")
    parser.add_argument("--baseline", help="another shardscope build to time on the same input")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--keep", action="store_true", help="keep the source checkpoint (for profiling)")
    parser.add_argument("--hsdp", action="store_true", help="an HSDP folder: 4 ranks on a 2 x 2 mesh")
    args = parser.parse_args()
    shardscope = os.path.abspath(args.shardscope)
    work = tempfile.mkdtemp(prefix="shardscope-bench-fsdp2-", dir=args.dir)
    try:
        src = os.path.join(work, "src")
        os.makedirs(src)
        ref_path = os.path.join(work, "reference.pt")
        nprocs = 2 * WORLD if args.hsdp else WORLD
        mp.spawn(save_worker, args=(os.path.join(work, "store"), src, ref_path, args.hsdp), nprocs=nprocs, join=True)
        # The bytes shardscope reads: every file, or the first replica's (ranks 0 and 1) of an HSDP folder.
        files = sorted(
            os.path.join(src, f) for f in os.listdir(src) if not args.hsdp or f.startswith(("rank0_", "rank1_"))
        )
        input_bytes = sum(os.path.getsize(f) for f in files)
        largest = BIG * SMALL * 4
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the cache

        copy = os.path.join(work, "copy.bin")
        copy_cmd = ["sh", "-c", 'out="$1"; shift; cat "$@" > "$out" && sync "$out"', "sh", copy, *files]
        full = os.path.join(work, "full.pt")
        results = {}
        results["plain copy (cat + sync)"] = timed(copy_cmd)
        os.remove(copy)
        results["shardscope convert -> full.pt"] = timed([shardscope, "convert", src, "-o", full, "--quiet"])
        if args.baseline:
            # Same file name: torch.save names the archive's folder after it.
            os.makedirs(os.path.join(work, "baseline"))
            base = os.path.join(work, "baseline", "full.pt")
            results["baseline convert -> full.pt"] = timed(
                [os.path.abspath(args.baseline), "convert", src, "-o", base, "--quiet"]
            )
            assert filecmp.cmp(full, base, shallow=False), "outputs differ from the baseline's"
            os.remove(base)

        # FSDP2 per-rank files for 4 ranks (reshard, DTensor output), from the 2-rank folder.
        model_json = os.path.join(work, "model.json")
        with open(model_json, "w") as f:
            json.dump(description(), f)
        dst = os.path.join(work, "ranks4")
        results[f"shardscope reshard {'HSDP 2x2' if args.hsdp else '2'} -> 4 (FSDP2)"] = timed(
            [shardscope, "reshard", src, "-o", dst, "--model", model_json, "--to-world-size", "4", "--quiet"]
        )
        shutil.rmtree(dst)

        # --select model to safetensors: staged through a temporary full .pt (TMPDIR, under --dir).
        sel = os.path.join(work, "model.safetensors")
        results["shardscope convert --select model -> .safetensors"] = timed(
            [shardscope, "convert", src, "-o", sel, "--select", "model", "--quiet"], env={**os.environ, "TMPDIR": work}
        )
        from safetensors import safe_open

        ref = torch.load(ref_path, weights_only=True)
        with safe_open(sel, "pt") as f:
            for key, value in ref.items():
                assert torch.equal(f.get_tensor(key), value), key
        os.remove(sel)
        state = torch.load(full, weights_only=True, mmap=True)
        for key, value in ref.items():
            assert torch.equal(state["model"][key], value), key
        assert set(state["optim"]["state"]) == {f"layers.{i}.weight" for i in range(LAYERS)}
        del state

        t_copy = results["plain copy (cat + sync)"][0]
        print(
            f"input: {input_bytes / 2**30:.2f} GiB in {len(files)} files "
            f"({'the first replica of an HSDP 2 x 2 folder' if args.hsdp else f'{WORLD} ranks'}); "
            f"largest tensor {largest / 2**20:.0f} MiB; target peak RSS {(largest + 64 * 2**20) / 2**20:.0f} MiB"
        )
        print(f"{'command':52} {'wall s':>8} {'GiB/s in':>9} {'peak RSS MiB':>13} {'x largest':>10} {'of copy':>8}")
        summary = {"input_bytes": input_bytes, "largest_tensor_bytes": largest, "output_bytes": os.path.getsize(full)}
        for name, (wall, rss) in results.items():
            print(
                f"{name:52} {wall:8.2f} {input_bytes / 2**30 / wall:9.2f} {rss / 2**20:13.0f} "
                f"{rss / largest:9.2f}x {t_copy / wall * 100:7.0f}%"
            )
            summary[name] = {
                "wall_s": wall,
                "peak_rss_bytes": rss,
                "peak_rss_over_largest_tensor": rss / largest,
                "fraction_of_copy_throughput": t_copy / wall,
                "peak_rss_at_most_largest_plus_64MiB": rss <= largest + 64 * 2**20,
            }
        print(json.dumps(summary))
    finally:
        if args.keep:
            print(f"kept {work}/src and {work}/model.json", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
