#!/usr/bin/env python3
"""Benchmark: `shardscope inspect` of a DCP checkpoint with 100 000 chunks vs torch's own
`FileSystemReader(path).read_metadata()`.

The `.metadata` is built with torch's own classes (Metadata, TensorStorageMetadata, ...) and
pickled the way DCP pickles it; the data files are sparse files of the right sizes (the chunks'
byte ranges lie inside them, so shardscope's range checks pass, and no tensor bytes exist to be
read; each file starts with a zip signature, as its first torch.save item would). Layout: 1000 tensors of [6400, 64] float32, each split into 100 row chunks (one per rank),
ranks 0..99 writing `__{rank}_0.distcp`.

Usage: python bench/dcp_metadata_100k.py [--shardscope target/release/shardscope] [--runs 7]
Prints one JSON line with median wall and CPU seconds and the ratios (shardscope / torch);
the CPU figures matter on a shared machine. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

TENSORS = 1000
RANKS = 100
ROWS, COLS = 64, 64  # rows per chunk, columns


def build(
    path: Path,
    tensors: int = TENSORS,
    ranks: int = RANKS,
    rows: int = ROWS,
    cols: int = COLS,
    blocks_per_layer: int = 10,
) -> int:
    """Writes a DCP of `tensors` float32 tensors of [ranks * rows, cols], each split into one dim-0
    chunk per rank (rank r writing `__{r}_0.distcp`), as torch's own classes describe it; returns
    the number of chunks. `.metadata` appears last (written aside, then renamed), so a folder that
    has one is complete. Also used by bench/index_scale.py."""
    path.mkdir(parents=True, exist_ok=True)
    sdm, storage = {}, {}
    file_end = [0] * ranks
    chunk_bytes = rows * cols * 4
    for t in range(tensors):
        key = f"model.layers.{t // blocks_per_layer}.block{t % blocks_per_layer}.weight"
        chunks = []
        for r in range(ranks):
            offsets = torch.Size([r * rows, 0])
            # A Size object per chunk, as torch's planner makes them (no pickle memo hits).
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, cols])))
            storage[MetadataIndex(fqn=key, offset=offsets, index=r)] = _StorageInfo(
                relative_path=f"__{r}_0.distcp", offset=file_end[r], length=chunk_bytes
            )
            file_end[r] += chunk_bytes
        sdm[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([ranks * rows, cols]),
            chunks=chunks,
        )
    meta = Metadata(
        state_dict_metadata=sdm,
        planner_data={k: ("model", k.removeprefix("model.")) for k in sdm},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(path), save_id="bench", load_id="bench"),
        version="1.0.0",
    )
    tmp = path / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(meta, f)  # what FileSystemWriter.finish does
    for r in range(ranks):
        with open(path / f"__{r}_0.distcp", "wb") as f:
            # Sparse: no tensor bytes on disk. Only the first item starts like the torch.save
            # archive it would be (readers look at a file's first item to tell the serialization).
            f.write(b"PK\x03\x04")
            f.truncate(file_end[r])
    tmp.rename(path / ".metadata")
    return tensors * ranks


def time_torch(path: Path, runs: int) -> tuple[float, float]:
    """Median wall and CPU seconds of torch's own metadata read."""
    walls, cpus = [], []
    for _ in range(runs):
        w0, c0 = time.perf_counter(), time.process_time()
        FileSystemReader(str(path)).read_metadata()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def time_shardscope(binary: str, path: Path, runs: int) -> tuple[float, float, str]:
    """Median wall and CPU (user + sys of the child) seconds of `shardscope inspect`."""
    walls, cpus = [], []
    out = ""
    for _ in range(runs):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        w0 = time.perf_counter()
        p = subprocess.run([binary, "inspect", str(path)], capture_output=True, text=True, check=True)
        walls.append(time.perf_counter() - w0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
        out = p.stdout
    return statistics.median(walls), statistics.median(cpus), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", help="build the checkpoint here and keep it (no timing)")
    ap.add_argument("--shardscope", default="target/release/shardscope")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    if args.keep:
        build(Path(args.keep))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        chunks = build(path)
        meta_bytes = (path / ".metadata").stat().st_size
        torch_wall, torch_cpu = time_torch(path, args.runs)
        ss_wall, ss_cpu, out = time_shardscope(args.shardscope, path, args.runs)
        summary = [l for l in out.splitlines() if l.startswith(("looks like", "entries"))]
        print(
            json.dumps(
                {
                    "chunks": chunks,
                    "metadata_bytes": meta_bytes,
                    "runs": args.runs,
                    "torch_read_metadata": {"wall_s": round(torch_wall, 4), "cpu_s": round(torch_cpu, 4)},
                    "shardscope_inspect": {"wall_s": round(ss_wall, 4), "cpu_s": round(ss_cpu, 4)},
                    "ratio_wall": round(ss_wall / torch_wall, 3),
                    "ratio_cpu": round(ss_cpu / torch_cpu, 3),
                    "load_average_1min": os.getloadavg()[0],
                    "torch": torch.__version__,
                    "summary": summary,
                }
            )
        )
    return None


if __name__ == "__main__":
    sys.exit(main())
