#!/usr/bin/env python3
"""Benchmark: `shardscope reshard` (4 -> 2 ranks) and `shardscope convert` (-> safetensors) of a ~3 GiB
FSDP1 per-rank checkpoint written by torch, against a plain copy of the same bytes, in the same run.

1. Four spawned ranks (gloo, CPU) wrap a model of 8 bias-free Linear layers (alternately [8192, 4096]
   and [4096, 8192] float32: 128 MiB each, 1 GiB in all) with FSDP1 FULL_SHARD (one unit per layer plus
   the root, `device_id=cpu`), take one Adam step, and save per rank the LOCAL_STATE_DICT model state
   dict (`model_rank{r}.pt`) and the raw `optim.state_dict()` (`optim_rank{r}.pt`) with torch.save.
   Rank 0 also saves the full weights of layers 0 and 7 (`summon_full_params`) for a spot check.
2. Each command runs as its own process under `/usr/bin/time -v` (wall time, peak RSS), with the input
   in the page cache and after a `sync` (so that none pays for another's writeback):
   - plain copy: `cat` of the eight rank files into one file, then `sync FILE` (shardscope fsyncs
     its outputs too): the floor for moving these bytes;
   - `shardscope reshard SRC -o DST --model model.json --to-world-size 2`;
   - `shardscope convert SRC -o full.safetensors --model model.json` (writes full.safetensors and
     the full optimizer state dict full.optim.pt).
3. Spot check: layers 0 and 7 of full.safetensors equal torch's full parameters.

usage: python bench/fsdp1_reshard.py [--shardscope target/release/shardscope] [--dir /tmp]
Needs about 12 GiB of free disk under --dir and ~8 GiB of memory for the torch ranks. Prints a table and
one JSON line; cleans up its temp directory. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import json
import os
import shutil
import subprocess
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchlib import BIG, LAYERS, SMALL, Model, description, timed

WORLD = 4


def save_worker(rank: int, store: str, out_dir: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import LocalStateDictConfig, StateDictType

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = Model()
    for i in range(LAYERS):
        model.layers[i] = FSDP(model.layers[i], device_id=torch.device("cpu"))
    model = FSDP(model, device_id=torch.device("cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    model(torch.randn(2, SMALL)).sum().backward()
    optim.step()
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()):
        torch.save(model.state_dict(), os.path.join(out_dir, f"model_rank{rank}.pt"))
    torch.save(optim.state_dict(), os.path.join(out_dir, f"optim_rank{rank}.pt"))
    ref = {}
    for i in (0, LAYERS - 1):
        with FSDP.summon_full_params(model.layers[i]):
            if rank == 0:
                ref[f"layers.{i}.weight"] = model.layers[i].weight.detach().clone()
    if rank == 0:
        torch.save(ref, os.path.join(out_dir, "..", "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardscope", default="target/release/shardscope")
    parser.add_argument("--baseline", help="another shardscope build whose reshard is timed on the same input")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--keep", action="store_true", help="keep the source checkpoint (for profiling)")
    args = parser.parse_args()
    shardscope = os.path.abspath(args.shardscope)
    work = tempfile.mkdtemp(prefix="shardscope-bench-reshard-", dir=args.dir)
    try:
        src = os.path.join(work, "src")
        os.makedirs(src)
        model_json = os.path.join(work, "model.json")
        with open(model_json, "w") as f:
            json.dump(description(), f)
        mp.spawn(save_worker, args=(os.path.join(work, "store"), src), nprocs=WORLD, join=True)
        files = sorted(os.path.join(src, f) for f in os.listdir(src))
        input_bytes = sum(os.path.getsize(f) for f in files)
        largest = BIG * SMALL * 4
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the cache

        copy = os.path.join(work, "copy.bin")
        copy_cmd = ["sh", "-c", 'out="$1"; shift; cat "$@" > "$out" && sync "$out"', "sh", copy, *files]
        dst = os.path.join(work, "dst")
        full_st = os.path.join(work, "full.safetensors")
        results = {}
        results["plain copy (cat + sync)"] = timed(copy_cmd)
        os.remove(copy)
        results["shardscope reshard 4 -> 2"] = timed(
            [shardscope, "reshard", src, "-o", dst, "--model", model_json, "--to-world-size", "2"]
        )
        out_bytes = {"shardscope reshard 4 -> 2": sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst))}
        if args.baseline:
            base = os.path.join(work, "baseline")
            results["baseline reshard 4 -> 2"] = timed(
                [os.path.abspath(args.baseline), "reshard", src, "-o", base, "--model", model_json, "--to-world-size", "2"]
            )
            for f in os.listdir(dst):
                assert filecmp.cmp(os.path.join(dst, f), os.path.join(base, f), shallow=False), f"{f} differs from the baseline's"
            shutil.rmtree(base)
        shutil.rmtree(dst)
        results["shardscope convert -> safetensors"] = timed(
            [shardscope, "convert", src, "-o", full_st, "--model", model_json, "--quiet"]
        )
        full_optim = os.path.join(work, "full.optim.pt")
        out_bytes["shardscope convert -> safetensors"] = os.path.getsize(full_st) + os.path.getsize(full_optim)

        from safetensors import safe_open

        ref = torch.load(os.path.join(work, "reference.pt"), weights_only=True)
        with safe_open(full_st, "pt") as f:
            for key, value in ref.items():
                assert torch.equal(f.get_tensor(key), value), key

        t_copy = results["plain copy (cat + sync)"][0]
        print(
            f"input: {input_bytes / 2**30:.2f} GiB in {len(files)} files ({WORLD} ranks); "
            f"largest tensor {largest / 2**20:.0f} MiB; target peak RSS {(largest + 64 * 2**20) / 2**20:.0f} MiB"
        )
        print(f"{'command':36} {'wall s':>8} {'GiB/s in':>9} {'peak RSS MiB':>13} {'x largest':>10} {'of copy':>8}")
        summary = {"input_bytes": input_bytes, "largest_tensor_bytes": largest, "output_bytes": out_bytes}
        for name, (wall, rss) in results.items():
            print(
                f"{name:36} {wall:8.2f} {input_bytes / 2**30 / wall:9.2f} {rss / 2**20:13.0f} "
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
