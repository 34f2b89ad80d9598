#!/usr/bin/env python3
"""Benchmark: `shardscope convert` of a ~2.1 GiB DCP checkpoint written by torch, against torch's own
`format_utils.dcp_to_torch_save` and a plain copy of the same bytes, in the same run.

1. Two spawned ranks (gloo, CPU) save `{"model": {...}}` with `dcp.save`: 17 float32 tensors of
   [8192, 4096] (128 MiB each) as `DTensor`s sharded on dim 0 (one chunk per rank, as FSDP2 writes
   them), plus a small bias; 2.13 GiB in two `.distcp` files.
2. Each command runs as its own process under `/usr/bin/time -v` (wall time, peak RSS):
   - torch:  `dcp_to_torch_save(dcp, out.pt)` (the reference tool; it materialises everything);
   - shardscope: `convert DCP -o out.safetensors --select model` and `convert DCP -o out.pt`;
   - plain copy: `cat` of the `.distcp` files into one file followed by `sync FILE` (shardscope
     fsyncs its outputs too), the throughput ceiling for moving these bytes.
   Before each command `sync` runs (so that none pays for the previous one's writeback) and the
   input is read again (so every command starts with it in the page cache: torch's 2.8 GB run can
   evict it). `--runs N` (default 3): torch's tool runs N times first (its 2.8 GB run slowed
   whichever command came right after it), then N rounds of the other three commands, their order
   rotated each round; the median is shown, and for shardscope also the median of its ratio to the
   copy of the same round.
3. Spot check: a few tensors of shardscope's safetensors equal torch's output.

usage: python bench/convert_dcp.py [--shardscope target/release/shardscope] [--dir /tmp] [--runs 3]
Prints a table and one JSON line. Cleans up its temp directory. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from benchlib import timed

TENSORS = 17
ROWS, COLS = 8192, 4096  # 128 MiB of float32
WORLD = 2


def save_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = ROWS // WORLD
    sd = {}
    for i in range(TENSORS):
        g = torch.Generator().manual_seed(1000 * i + rank)
        local = torch.randn(rows, COLS, generator=g)
        sd[f"layers.{i:02d}.weight"] = DTensor.from_local(local, mesh, [Shard(0)])
    sd["head.bias"] = DTensor.from_local(torch.full((4,), float(rank)), mesh, [Shard(0)])
    dcp.save({"model": sd}, checkpoint_id=out_dir)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardscope", default="target/release/shardscope")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--runs", type=int, default=3, help="runs per command; the median is shown")
    parser.add_argument("--keep", action="store_true", help="keep the DCP checkpoint (for bench/rounds.py)")
    args = parser.parse_args()
    shardscope = os.path.abspath(args.shardscope)
    work = tempfile.mkdtemp(prefix="shardscope-bench-convert-", dir=args.dir)
    try:
        src = os.path.join(work, "dcp")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(save_worker, args=(port, src), nprocs=WORLD, join=True)
        data_files = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".distcp"))
        input_bytes = sum(os.path.getsize(f) for f in data_files)
        tensor_bytes = TENSORS * ROWS * COLS * 4 + 4 * 4
        largest = ROWS * COLS * 4
        subprocess.run(["cat", *data_files], stdout=subprocess.DEVNULL, check=True)  # warm the cache

        py = sys.executable
        torch_pt = os.path.join(work, "torch.pt")
        torch_cmd = [py, "-c", "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])", src, torch_pt]
        ours_st = os.path.join(work, "ours.safetensors")
        ours_pt = os.path.join(work, "ours.pt")
        copy = os.path.join(work, "copy.bin")
        copy_cmd = ["sh", "-c", 'out="$1"; shift; cat "$@" > "$out" && sync "$out"', "sh", copy, *data_files]

        commands = {
            "torch dcp_to_torch_save": torch_cmd,
            "shardscope convert -> safetensors": [shardscope, "convert", src, "-o", ours_st, "--select", "model", "--quiet"],
            "shardscope convert -> torch.save": [shardscope, "convert", src, "-o", ours_pt, "--quiet"],
            "plain copy (cat + sync)": copy_cmd,
        }
        output_of = dict(zip(commands, [torch_pt, ours_st, ours_pt, copy]))
        runs = {name: [] for name in commands}

        def run(name: str) -> None:
            if os.path.exists(output_of[name]):
                os.unlink(output_of[name])  # every command writes a new file, none overwrites
            runs[name].append(timed(commands[name], data_files))

        names = list(commands)
        for _ in range(args.runs):
            run(names[0])
        others = names[1:]
        for r in range(args.runs):
            for name in others[r % len(others):] + others[: r % len(others)]:
                run(name)
        # Median wall time of the runs, with the peak RSS of that run.
        results = {name: sorted(v)[len(v) // 2] for name, v in runs.items()}
        all_walls = {name: [round(w, 2) for w, _ in v] for name, v in runs.items()}

        # Spot check against torch's output.
        from safetensors import safe_open

        ref = torch.load(torch_pt, weights_only=True, mmap=True)["model"]
        with safe_open(ours_st, "pt") as f:
            for key in ["layers.00.weight", f"layers.{TENSORS - 1:02d}.weight", "head.bias"]:
                assert torch.equal(f.get_tensor(key), ref[key]), key
        ours_ref = torch.load(ours_pt, weights_only=True, mmap=True)["model"]
        for key in ["layers.03.weight", "head.bias"]:
            assert torch.equal(ours_ref[key], ref[key]), key

        t_torch = results["torch dcp_to_torch_save"][0]
        t_copy = results["plain copy (cat + sync)"][0]
        print(f"input: {input_bytes / 2**30:.2f} GiB in {len(data_files)} .distcp files; tensors {tensor_bytes / 2**30:.2f} GiB; largest tensor {largest / 2**20:.0f} MiB")
        print(f"{'command':40} {'wall s':>8} {'GiB/s':>7} {'peak RSS MiB':>13} {'x torch':>8} {'of copy':>8}")
        summary = {"input_bytes": input_bytes, "largest_tensor_bytes": largest, "runs": args.runs, "all_wall_s": all_walls}
        for name, (wall, rss) in results.items():
            print(f"{name:40} {wall:8.2f} {tensor_bytes / 2**30 / wall:7.2f} {rss / 2**20:13.0f} {t_torch / wall:7.1f}x {t_copy / wall * 100:7.0f}%")
            summary[name] = {"wall_s": wall, "peak_rss_bytes": rss, "speedup_vs_torch": t_torch / wall, "fraction_of_copy_throughput": t_copy / wall}
        copies = [w for w, _ in runs["plain copy (cat + sync)"]]
        for name in others[:2]:
            ratios = sorted(c / w for c, (w, _) in zip(copies, runs[name]))
            summary[name]["median_round_fraction_of_copy"] = ratios[len(ratios) // 2]
            print(f"{name}: per-round fraction of the copy {', '.join(f'{x * 100:.0f}%' for x in ratios)}")
        st_wall, st_rss = results["shardscope convert -> safetensors"]
        summary["targets"] = {
            "5x_faster_than_torch": t_torch / st_wall >= 5,
            "peak_rss_at_most_largest_plus_64MiB": st_rss <= largest + 64 * 2**20,
            "at_least_60pct_of_copy": t_copy / st_wall >= 0.6,
            "at_least_90pct_of_copy": t_copy / st_wall >= 0.9,
        }
        print(json.dumps(summary))
    finally:
        if args.keep and os.path.isdir(os.path.join(work, "dcp")):
            for name in os.listdir(work):
                if name != "dcp":
                    path = os.path.join(work, name)
                    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
            print(f"kept {os.path.join(work, 'dcp')}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
