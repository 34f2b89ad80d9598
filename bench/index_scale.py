#!/usr/bin/env python3
"""Benchmark: how `shardscope inspect --json` scales with the number of DCP chunks (issue 22 item 6),
against torch's own `FileSystemReader(path).read_metadata()`.

The `.metadata` is built with torch's own classes (`Metadata`, `TensorStorageMetadata`,
`ChunkStorageMetadata`, `MetadataIndex`, and `filesystem._StorageInfo` for `storage_data`) and pickled
as `FileSystemWriter.finish` does (`pickle.dump(metadata, f)`). A 512-rank run: every tensor is split
into one dim-0 chunk per rank, rank r writing `__{r}_0.distcp`; `--chunks N` gives N / 512 tensors.
The data files are sparse (`truncate` to the end of their last byte range: `inspect` checks byte
ranges against file sizes and reads each file's first 4 bytes, which start like a `torch.save` item).

Each measurement is a process of its own under `/usr/bin/time -v` (peak RSS, wall); each tool's runs
come back to back after one uncounted warm-up run (see `measure`):
- `shardscope inspect DIR --json > /dev/null`, and `shardscope inspect DIR` (the table);
- torch: a Python process that imports torch, then times `read_metadata()` alone; its peak RSS
  includes torch's import (printed beside the same process's RSS just before the read).

Usage:
  python bench/index_scale.py --shardscope /path/to/release/shardscope [--chunks 100000 1000000]
      [--runs 3] [--dir /tmp/index-scale]   (checkpoints are kept in --dir and reused)
Prints one JSON line per size and a Markdown table row. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

RANKS = 512
ROWS, COLS = 16, 64  # rows per chunk, columns: a [512 * 16, 64] float32 tensor per 512 chunks


def build(path: Path, chunks: int) -> int:
    """The checkpoint of `chunks` chunks (rounded to whole tensors of 512 chunks), written by
    bench/dcp_metadata_100k.py's generator."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dcp_metadata_100k import build as build_dcp

    return build_dcp(path, max(1, chunks // RANKS), RANKS, ROWS, COLS, blocks_per_layer=8)


TORCH_READ = """
import resource, sys, time
from torch.distributed.checkpoint import FileSystemReader
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
m = FileSystemReader(sys.argv[1]).read_metadata()
print(time.perf_counter() - t0, before, len(m.storage_data))
"""


def time_v(cmd: list[str], stdout=subprocess.DEVNULL) -> tuple[float, int, str]:
    """Wall seconds and peak RSS (KiB) of `cmd` under /usr/bin/time -v, and its stdout (the
    process's CPU seconds, user + system, go to `CPU[-1]`)."""
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed: {p.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", p.stderr)
    wall = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    cpu = sum(float(re.search(rf"{k} time \(seconds\): ([\d.]+)", p.stderr).group(1)) for k in ("User", "System"))
    CPU.append(cpu)
    return wall, rss, p.stdout


CPU: list[float] = []


def measure(binary: str, path: Path, runs: int) -> dict:
    """Each tool's runs back to back, after one warm-up run of it that is not counted: this machine
    (a VM) hands memory a process frees back to its host, and the next process to touch memory
    pays for faulting it in again; right after torch's 2.5 GiB read that is most of a second, which
    no run should pay for the other tool."""
    ss_wall, ss_rss, plain_wall, plain_rss, ss_cpu = [], [], [], [], []
    torch_read, torch_rss, torch_before = [], [], []
    time_v([binary, "inspect", str(path), "--json"])
    for _ in range(runs):
        w, rss, _ = time_v([binary, "inspect", str(path), "--json"])
        ss_cpu.append(CPU[-1])
        ss_wall.append(w)
        ss_rss.append(rss)
    for _ in range(runs):
        w, rss, _ = time_v([binary, "inspect", str(path)])
        plain_wall.append(w)
        plain_rss.append(rss)
    time_v([sys.executable, "-c", TORCH_READ, str(path)], stdout=subprocess.PIPE)
    for _ in range(runs):
        _, rss, out = time_v([sys.executable, "-c", TORCH_READ, str(path)], stdout=subprocess.PIPE)
        secs, before, _n = out.split()
        torch_read.append(float(secs))
        torch_rss.append(rss)
        torch_before.append(int(before))
    med = statistics.median
    return {
        "shardscope_inspect_wall_s": round(med(ss_wall), 3),
        "shardscope_inspect_wall_all": ss_wall,
        "shardscope_inspect_cpu_s": round(med(ss_cpu), 3),
        "shardscope_peak_rss_mib": round(max(ss_rss) / 1024, 1),
        "shardscope_inspect_plain_wall_s": round(med(plain_wall), 3),
        "shardscope_inspect_plain_peak_rss_mib": round(max(plain_rss) / 1024, 1),
        "torch_read_metadata_s": round(med(torch_read), 3),
        "torch_read_metadata_all": torch_read,
        "torch_peak_rss_mib": round(max(torch_rss) / 1024, 1),
        "torch_rss_after_import_mib": round(med(torch_before) / 1024, 1),
        "x_faster_than_torch": round(med(torch_read) / med(ss_wall), 2),
        "x_faster_than_torch_plain": round(med(torch_read) / med(plain_wall), 2),
        "x_torch_read_over_shardscope_cpu": round(med(torch_read) / med(ss_cpu), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shardscope", default="target/release/shardscope")
    ap.add_argument("--chunks", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/index-scale")
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    for n in args.chunks:
        path = Path(args.dir) / f"dcp-{n}"
        if not (path / ".metadata").exists():
            build(path, n)
        if args.build_only:
            continue
        chunks = (n // RANKS) * RANKS
        r = {"chunks": chunks, "metadata_mib": round((path / ".metadata").stat().st_size / 2**20, 1), "runs": args.runs}
        r.update(measure(args.shardscope, path, args.runs))
        r["bytes_per_chunk"] = round(r["shardscope_peak_rss_mib"] * 2**20 / chunks)
        r["load_average_1min"] = os.getloadavg()[0]
        print(json.dumps(r), flush=True)
        print(
            f"| {chunks:,} | {r['metadata_mib']} MiB | {r['shardscope_inspect_wall_s']} s | "
            f"{r['shardscope_peak_rss_mib']} MiB ({r['bytes_per_chunk']} B/chunk) | "
            f"{r['torch_read_metadata_s']} s | {r['torch_peak_rss_mib']} MiB | {r['x_faster_than_torch']}x | "
            f"{r['shardscope_inspect_plain_wall_s']} s | {r['x_faster_than_torch_plain']}x |",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
