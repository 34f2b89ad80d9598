#!/usr/bin/env python3
"""Benchmark: `shardscope convert` of a ~2.1 GiB DCP checkpoint at one reader thread, at one reader
thread per core, and split over two processes (`--part 0/2`, `--part 1/2` at once), against a durable
plain copy of the same bytes, in the same run.

1. The checkpoint of bench/convert_dcp.py (two spawned ranks save 17 float32 [8192, 4096] DTensors,
   128 MiB each, sharded on dim 0, plus a small bias; 2.13 GiB in two `.distcp` files).
2. Each command runs as its own process under `/usr/bin/time -v` (wall time, peak RSS; for the
   two-process command the larger of the two). Before each: `sync`, and a read of the input (every
   command starts with it in the page cache). `--runs N` (default 3) runs every command N times in
   turn; the median is shown.
   - plain copy: `cat` of the `.distcp` files into one file, then `sync FILE`;
   - DCP -> one safetensors file (`--select model`), `--threads 1` and `--threads <cores>`;
   - DCP -> HF shards (`--max-shard-size 500MB`: 6 files), `--threads 1`, `--threads <cores>`, and
     two processes `--part 0/2` + `--part 1/2` started together (default threads each).
3. Checks: the shards of every variant are byte-identical. Disk: about 3x the input.

usage: python bench/convert_parallel.py [--shardscope target/release/shardscope] [--dir /tmp] [--runs 3]
Prints a table and one JSON line. Cleans up its temp directory. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import torch.multiprocessing as mp
from benchlib import timed
from convert_dcp import COLS, ROWS, TENSORS, WORLD, save_worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardscope", default="target/release/shardscope")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--runs", type=int, default=3, help="runs per command; the median is shown")
    args = parser.parse_args()
    shardscope = os.path.abspath(args.shardscope)
    work = tempfile.mkdtemp(prefix="shardscope-bench-parallel-", dir=args.dir)
    try:
        src = os.path.join(work, "dcp")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(save_worker, args=(port, src), nprocs=WORLD, join=True)
        data_files = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".distcp"))
        input_bytes = sum(os.path.getsize(f) for f in data_files)
        tensor_bytes = TENSORS * ROWS * COLS * 4 + 4 * 4

        copy = os.path.join(work, "copy.bin")
        one = os.path.join(work, "one.safetensors")
        shards = {k: os.path.join(work, f"shards-{k}") for k in ("t1", "default", "parts")}
        base = [shardscope, "convert", src, "--select", "model", "--quiet"]
        cores = os.cpu_count() or 1
        shard_args = ["--max-shard-size", "500MB"]
        # Both parts at once; fails when either does.
        parts_cmd = [
            "sh", "-c", '"$@" --part 0/2 & p=$!; "$@" --part 1/2 || exit 1; wait $p', "sh",
            *base, "-o", shards["parts"], *shard_args,
        ]
        commands = {
            "plain copy (cat + sync)": (["sh", "-c", 'out="$1"; shift; cat "$@" > "$out" && sync "$out"', "sh", copy, *data_files], copy),
            "-> one safetensors, --threads 1": ([*base, "-o", one, "--threads", "1"], one),
            f"-> one safetensors, --threads {cores}": ([*base, "-o", one, "--threads", str(cores)], one),
            "-> HF shards, --threads 1": ([*base, "-o", shards["t1"], *shard_args, "--threads", "1"], shards["t1"]),
            f"-> HF shards, --threads {cores}": ([*base, "-o", shards["default"], *shard_args, "--threads", str(cores)], shards["default"]),
            "-> HF shards, 2 processes (--part)": (parts_cmd, shards["parts"]),
        }
        runs = {name: [] for name in commands}
        for _ in range(args.runs):
            if os.path.isdir(shards["t1"]):
                shutil.rmtree(shards["t1"])
            for name, (cmd, out) in commands.items():
                runs[name].append(timed(cmd, data_files))
                # Every variant writes the shards of `--threads 1` (which runs first); outputs are
                # removed once checked, to need little disk (about 3x the input at most).
                if out in (shards["default"], shards["parts"]):
                    names = sorted(os.listdir(shards["t1"]))
                    assert len(names) == 7, names
                    assert sorted(os.listdir(out)) == names, (name, os.listdir(out))
                    _, mismatch, errors = filecmp.cmpfiles(shards["t1"], out, names, shallow=False)
                    assert not mismatch and not errors, (name, mismatch, errors)
                if out != shards["t1"]:
                    if os.path.isdir(out):
                        shutil.rmtree(out)
                    else:
                        os.unlink(out)
        results = {name: sorted(v)[len(v) // 2] for name, v in runs.items()}
        all_walls = {name: [round(w, 2) for w, _ in v] for name, v in runs.items()}
        t_copy = results["plain copy (cat + sync)"][0]
        print(f"input: {input_bytes / 2**30:.2f} GiB in {len(data_files)} .distcp files; {os.cpu_count()} cores")
        print(f"{'command':40} {'wall s':>8} {'GiB/s':>7} {'peak RSS MiB':>13} {'of copy':>8}")
        summary = {"input_bytes": input_bytes, "cores": os.cpu_count(), "runs": args.runs, "all_wall_s": all_walls}
        for name, (wall, rss) in results.items():
            print(f"{name:40} {wall:8.2f} {tensor_bytes / 2**30 / wall:7.2f} {rss / 2**20:13.0f} {t_copy / wall * 100:7.0f}%")
            summary[name] = {"wall_s": wall, "peak_rss_bytes": rss, "fraction_of_copy_throughput": t_copy / wall}
        print(json.dumps(summary))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
