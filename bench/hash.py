#!/usr/bin/env python3
"""Benchmark: `shardscope hash` of a 1 GiB DCP written by torch, against `cat FILES > /dev/null`
of the same `.distcp` files, in the same run.

1. Two spawned ranks (gloo, CPU) save `{"model": {...}}` with `dcp.save`: 8 float32 tensors of
   [8192, 4096] (128 MiB each) as `DTensor`s sharded on dim 0 (one chunk per rank, as FSDP2 writes
   them); 1.00 GiB in two `.distcp` files. And a model-shaped DCP of the same size (MODEL): 16
   blocks of four [2048, 2048] projections and two norms, 96 tensors, sharded the same way.
2. Each command runs as its own process under `/usr/bin/time -v`; the page cache is WARM for every
   command (the files are read with `cat` right before each one, see `benchlib.timed`), so this
   measures the CPU cost of reading and hashing against the cheapest read there is:
   - `cat FILES > /dev/null`;
   - `shardscope hash DCP --no-files -o M.json` (xxh3-128 tensor digests: every tensor byte once);
   - `shardscope hash DCP -o M.json` (also each file's digest, in the same read);
   - the same three for MODEL (`cat`, `--no-files`, the default);
   - `shardscope hash DCP --no-files --algorithm sha256 -o M.json`.
   `--runs N` rounds (default 5), the order rotated each round; medians, and the median of each
   command's ratio to the `cat` of its round.
3. Check: one tensor's SHA-256 digest, computed here with hashlib (docs/hash.md's framing), equals
   the manifest's.

usage: python bench/hash.py [--shardscope target/release/shardscope] [--dir /tmp] [--runs 5]
Prints a table and one JSON line. Cleans up its temp directory. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
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

TENSORS = 8
ROWS, COLS = 8192, 4096  # 128 MiB of float32
WORLD = 2


def save_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    sd = {}
    for i in range(TENSORS):
        g = torch.Generator().manual_seed(1000 * i + rank)
        sd[f"layers.{i:02d}.weight"] = DTensor.from_local(torch.randn(ROWS // WORLD, COLS, generator=g), mesh, [Shard(0)])
    dcp.save({"model": sd}, checkpoint_id=out_dir)
    dist.barrier()
    dist.destroy_process_group()


# A model-shaped DCP of the same size: 16 blocks of 4 [2048, 2048] projections (16 MiB each) and 2
# norms [2048], 96 tensors, as FSDP2 shards a transformer's (each file: every tensor's half, in
# order). The one read of `hash` passes the tensors' halves from one file to the other's: the
# second file's first chunk waits for the first's, one chunk of the 48 in each file.
BLOCKS, DIM = 16, 2048


def model_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    g = torch.Generator().manual_seed(7 + rank)
    sd = {}
    for b in range(BLOCKS):
        for name in ("wq", "wk", "wv", "wo"):
            sd[f"layers.{b:02d}.attn.{name}.weight"] = DTensor.from_local(torch.randn(DIM // WORLD, DIM, generator=g), mesh, [Shard(0)])
        for name in ("attn_norm", "ffn_norm"):
            sd[f"layers.{b:02d}.{name}.weight"] = DTensor.from_local(torch.ones(DIM // WORLD), mesh, [Shard(0)])
    dcp.save({"model": sd}, checkpoint_id=out_dir)
    dist.barrier()
    dist.destroy_process_group()


def full_tensor(i: int) -> torch.Tensor:
    parts = [torch.randn(ROWS // WORLD, COLS, generator=torch.Generator().manual_seed(1000 * i + r)) for r in range(WORLD)]
    return torch.cat(parts)


def save(worker, out_dir: str) -> list[str]:
    """Runs `worker` on WORLD spawned ranks to save a DCP into `out_dir`; its `.distcp` files."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, out_dir), nprocs=WORLD, join=True)
    return sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".distcp"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardscope", default="target/release/shardscope")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    shardscope = os.path.abspath(args.shardscope)
    work = tempfile.mkdtemp(prefix="shardscope-bench-hash-", dir=args.dir)
    try:
        src, model = os.path.join(work, "dcp"), os.path.join(work, "model_dcp")
        data_files = save(save_worker, src)
        model_files = save(model_worker, model)
        input_bytes = sum(os.path.getsize(f) for f in data_files)
        # The same tensors whole, in one safetensors file written by the safetensors library:
        # one chunk per tensor, so each byte is hashed once (a DCP's sharded tensor also has
        # per-chunk digests: twice).
        st = os.path.join(work, "full.safetensors")
        from safetensors.torch import save_file

        save_file({f"layers.{i:02d}.weight": full_tensor(i) for i in range(TENSORS)}, st)
        out = os.path.join(work, "m.json")
        out_sha = os.path.join(work, "sha.json")
        cat = "cat FILES > /dev/null"
        cat_st = "cat SAFETENSORS > /dev/null"
        cat_model = "cat MODEL FILES > /dev/null"
        # name: (command, files read warm first, the cat it is measured against)
        commands = {
            cat: (["sh", "-c", 'cat "$@" > /dev/null', "sh", *data_files], data_files, cat),
            "hash --no-files (xxh3)": ([shardscope, "hash", src, "--no-files", "-o", out, "--quiet"], data_files, cat),
            "hash (xxh3, + file digests)": ([shardscope, "hash", src, "-o", out, "--quiet"], data_files, cat),
            "hash --no-files --algorithm sha256": (
                [shardscope, "hash", src, "--no-files", "--algorithm", "sha256", "-o", out_sha, "--quiet"],
                data_files,
                cat,
            ),
            cat_model: (["sh", "-c", 'cat "$@" > /dev/null', "sh", *model_files], model_files, cat_model),
            "hash MODEL --no-files (xxh3)": ([shardscope, "hash", model, "--no-files", "-o", out, "--quiet"], model_files, cat_model),
            "hash MODEL (xxh3, + file digests)": ([shardscope, "hash", model, "-o", out, "--quiet"], model_files, cat_model),
            cat_st: (["sh", "-c", 'cat "$1" > /dev/null', "sh", st], [st], cat_st),
            "hash SAFETENSORS --no-files (xxh3)": ([shardscope, "hash", st, "--no-files", "-o", out, "--quiet"], [st], cat_st),
            "hash SAFETENSORS (xxh3, + file digest)": ([shardscope, "hash", st, "-o", out, "--quiet"], [st], cat_st),
        }
        names = list(commands)
        runs = {n: [] for n in names}
        ratios = {n: [] for n in names}
        for r in range(args.runs):
            round_ = {}
            for name in names[r % len(names):] + names[: r % len(names)]:
                cmd, warm, _ = commands[name]
                wall, rss = timed(cmd, warm)
                runs[name].append((wall, rss))
                round_[name] = wall
            for name in names:
                ratios[name].append(round_[commands[name][2]] / round_[name])

        # The sha256 manifest: one tensor against hashlib.
        with open(out_sha) as f:
            manifest = json.load(f)
        t = full_tensor(3)
        header = b"tensor\0float32\0" + f"{ROWS},{COLS}".encode() + b"\0"
        want = hashlib.sha256(header + t.numpy().tobytes()).hexdigest()
        assert manifest["tensors"]["model.layers.03.weight"]["digest"] == want

        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        model_bytes = sum(os.path.getsize(f) for f in model_files)
        print(f"MODEL: {model_bytes / 2**30:.2f} GiB in {len(model_files)} .distcp files, {BLOCKS * 6} tensors")
        print(f"input: {input_bytes / 2**30:.2f} GiB in {len(data_files)} .distcp files (and the same tensors in one safetensors file), page cache warm, {os.cpu_count()} cores, {args.runs} runs; `of cat`: against the cat of the same files")
        print(f"{'command':40} {'wall s':>8} {'GiB/s':>7} {'peak RSS MiB':>13} {'of cat':>8}")
        summary = {"input_bytes": input_bytes, "runs": args.runs, "cache": "warm"}
        for name in names:
            wall, rss = med(runs[name])
            ratio = med(ratios[name])
            nbytes = model_bytes if "MODEL" in name else input_bytes
            print(f"{name:40} {wall:8.3f} {nbytes / 2**30 / wall:7.2f} {rss / 2**20:13.0f} {ratio * 100:7.0f}%")
            summary[name] = {"wall_s": wall, "peak_rss_bytes": rss, "fraction_of_cat": ratio, "all_wall_s": [round(w, 3) for w, _ in runs[name]]}
        print(json.dumps(summary))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
