#!/usr/bin/env python3
"""Benchmark: `shardscope inspect` of a DCP checkpoint with 100 000 chunks vs torch's own
`FileSystemReader(path).read_metadata()`.

The `.metadata` is built with torch's own classes (Metadata, TensorStorageMetadata, ...) and
pickled the way DCP pickles it; the data files are sparse files of the right sizes (the chunks'
byte ranges lie inside them, so shardscope's range checks pass, and no tensor bytes exist to be
read). Layout: 1000 tensors of [6400, 64] float32, each split into 100 row chunks (one per rank),
ranks 0..99 writing `__{rank}_0.distcp`.

Usage: python bench/dcp_metadata_100k.py [--shardscope target/release/shardscope] [--runs 7]
Prints one JSON line with median seconds and the ratio; see BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
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


def build(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    sdm, storage = {}, {}
    file_end = [0] * RANKS
    chunk_bytes = ROWS * COLS * 4
    for t in range(TENSORS):
        key = f"model.layers.{t // 10}.block{t % 10}.weight"
        chunks = []
        for r in range(RANKS):
            offsets = torch.Size([r * ROWS, 0])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([ROWS, COLS])))
            storage[MetadataIndex(fqn=key, offset=offsets, index=r)] = _StorageInfo(
                relative_path=f"__{r}_0.distcp", offset=file_end[r], length=chunk_bytes
            )
            file_end[r] += chunk_bytes
        sdm[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([RANKS * ROWS, COLS]),
            chunks=chunks,
        )
    meta = Metadata(
        state_dict_metadata=sdm,
        planner_data={k: ("model", k.removeprefix("model.")) for k in sdm},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(path), save_id="bench", load_id="bench"),
        version="1.0.0",
    )
    with open(path / ".metadata", "wb") as f:
        pickle.dump(meta, f)  # what FileSystemWriter.finish does
    for r in range(RANKS):
        with open(path / f"__{r}_0.distcp", "wb") as f:
            f.truncate(file_end[r])  # sparse: no tensor bytes on disk
    return TENSORS * RANKS


def time_torch(path: Path, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        FileSystemReader(str(path)).read_metadata()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_shardscope(binary: str, path: Path, runs: int) -> tuple[float, str]:
    times = []
    out = ""
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.run([binary, "inspect", str(path)], capture_output=True, text=True, check=True)
        times.append(time.perf_counter() - t0)
        out = p.stdout
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shardscope", default="target/release/shardscope")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        chunks = build(path)
        meta_bytes = (path / ".metadata").stat().st_size
        t_torch = time_torch(path, args.runs)
        t_ss, out = time_shardscope(args.shardscope, path, args.runs)
        summary = [l for l in out.splitlines() if l.startswith(("looks like", "entries"))]
        print(
            json.dumps(
                {
                    "chunks": chunks,
                    "metadata_bytes": meta_bytes,
                    "torch_read_metadata_s": round(t_torch, 4),
                    "shardscope_inspect_s": round(t_ss, 4),
                    "ratio_shardscope_over_torch": round(t_ss / t_torch, 3),
                    "torch": torch.__version__,
                    "summary": summary,
                }
            )
        )


if __name__ == "__main__":
    sys.exit(main())
