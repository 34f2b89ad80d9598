#!/usr/bin/env python3
"""Benchmark: `import shardscope` reading whole checkpoints into torch tensors, against torch's and
safetensors' own loaders, in the same run (issue: `import shardscope`).

1. Two spawned ranks (gloo, CPU) save `{"model": {...}}` with `dcp.save`: 8 float32 tensors of
   [8192, 4096] (128 MiB each) as DTensors sharded on dim 0 (one chunk per rank, as FSDP2 writes
   them): 1.0 GiB in two `.distcp` files. The same tensors are saved as one `.safetensors` file.
2. Each reader runs as its own process under `/usr/bin/time -v` (wall time, peak RSS), after `sync`
   and with its input read into the page cache first:
   - torch, DCP:  `dcp_to_torch_save(dcp, tmp.pt)` then `torch.load(tmp.pt)` (torch's way to get a
     DCP checkpoint as one state dict without a process group);
   - shardscope, DCP: `shardscope.open(dcp).state_dict(framework="torch")`;
   - safetensors: `safetensors.torch.load_file(file)`;
   - shardscope, safetensors: `shardscope.open(file).state_dict(framework="torch")` (read into memory
     the tensors own), and with `mmap=True` (tensors over a copy-on-write mapping, as load_file does);
   - baseline for memory: `import torch, shardscope` alone (the interpreter and torch's own RSS).
   `--runs N` (default 3) rounds, the order rotated each round; medians shown. Memory above the
   baseline is compared with the output's size (1 GiB): the target is output + 64 MiB.
3. Check: in a separate (untimed) process, every tensor of both shardscope reads equals torch's.
4. The same readers in one process, each call timed alone (no interpreter start, no imports): what a
   notebook sees.
5. Start-up of the command: `shardscope --version` through the wheel's entry point (Python starts,
   then the extension) against the native binary (`--shardscope`, default target/release/shardscope),
   median of 10.

usage: python bench/python_api.py [--dir /tmp] [--runs 3] [--shardscope target/release/shardscope]
Needs the wheel installed in this Python (`maturin build --release` + pip install). Prints a table and
one JSON line. Cleans up its temp directory. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

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
    rows = ROWS // WORLD
    sd = {}
    for i in range(TENSORS):
        g = torch.Generator().manual_seed(1000 * i + rank)
        sd[f"layers.{i}.weight"] = DTensor.from_local(torch.randn(rows, COLS, generator=g), mesh, [Shard(0)])
    dcp.save({"model": sd}, checkpoint_id=out_dir)
    dist.barrier()
    dist.destroy_process_group()


def full_tensors() -> dict:
    """The same tensors, whole (rank 0's rows, then rank 1's)."""
    out = {}
    rows = ROWS // WORLD
    for i in range(TENSORS):
        parts = [torch.randn(rows, COLS, generator=torch.Generator().manual_seed(1000 * i + r)) for r in range(WORLD)]
        out[f"layers.{i}.weight"] = torch.cat(parts)
    return out


TORCH_DCP = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
sd = torch.load(sys.argv[2], weights_only=True)
assert len(sd["model"]) == {n}
""".format(n=TENSORS)

OURS = """
import sys, torch, shardscope
sd = shardscope.open(sys.argv[1]).state_dict(framework="torch", mmap=sys.argv[2] == "mmap")
assert len(sd) >= {n}
""".format(n=TENSORS)

SAFETENSORS = """
import sys, torch
from safetensors.torch import load_file
sd = load_file(sys.argv[1])
assert len(sd) == {n}
""".format(n=TENSORS)

BASELINE = """
import torch, shardscope
"""

CHECK = """
import sys, torch, shardscope
from safetensors.torch import load_file
want = load_file(sys.argv[2])
a = shardscope.open(sys.argv[1]).state_dict(select="model", framework="torch")
b = shardscope.open(sys.argv[2]).state_dict(framework="torch")
assert a.keys() == b.keys() == want.keys(), (a.keys(), want.keys())
for k, v in want.items():
    assert torch.equal(a[k], v) and torch.equal(b[k], v), k
print("ok")
"""


INPROCESS = """
import json, statistics, sys, time, gc, torch, shardscope
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
ckpt, st, tmp, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
readers = {
    "torch: dcp_to_torch_save + torch.load": lambda: (dcp_to_torch_save(ckpt, tmp), torch.load(tmp, weights_only=True)),
    "shardscope: open(dcp).state_dict()": lambda: shardscope.open(ckpt).state_dict(),
    "safetensors: load_file": lambda: load_file(st),
    "shardscope: open(file.safetensors).state_dict()": lambda: shardscope.open(st).state_dict(),
    "shardscope: ... .state_dict(mmap=True)": lambda: shardscope.open(st).state_dict(mmap=True),
}
out = {}
for name, f in readers.items():
    times = []
    for _ in range(runs):
        gc.collect()
        t = time.perf_counter()
        r = f()
        times.append(time.perf_counter() - t)
        del r
    out[name] = statistics.median(times)
print(json.dumps(out))
"""


def startup(cmd: list[str], n: int = 10) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shardscope", default="target/release/shardscope")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="shardscope-pyapi-", dir=args.dir)
    try:
        ckpt = os.path.join(work, "dcp")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(save_worker, args=(port, ckpt), nprocs=WORLD, join=True)
        st = os.path.join(work, "model.safetensors")
        from safetensors.torch import save_file

        save_file(full_tensors(), st)
        dcp_files = [os.path.join(ckpt, f) for f in sorted(os.listdir(ckpt))]
        out_bytes = TENSORS * ROWS * COLS * 4
        py = sys.executable
        tmp_pt = os.path.join(work, "torch.pt")
        commands = {
            "torch: dcp_to_torch_save + torch.load": ([py, "-c", TORCH_DCP, ckpt, tmp_pt], dcp_files),
            "shardscope: open(dcp).state_dict()": ([py, "-c", OURS, ckpt, "read"], dcp_files),
            "safetensors: load_file": ([py, "-c", SAFETENSORS, st], [st]),
            "shardscope: open(file.safetensors).state_dict()": ([py, "-c", OURS, st, "read"], [st]),
            "shardscope: ... .state_dict(mmap=True)": ([py, "-c", OURS, st, "mmap"], [st]),
            "baseline: import torch, shardscope": ([py, "-c", BASELINE], []),
        }
        names = list(commands)
        results: dict[str, list[tuple[float, int]]] = {n: [] for n in names}
        for r in range(args.runs):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                cmd, warm = commands[name]
                results[name].append(timed(cmd, warm=warm))
                if os.path.exists(tmp_pt):
                    os.remove(tmp_pt)
        check = subprocess.run([py, "-c", CHECK, ckpt, st], capture_output=True, text=True)
        if check.returncode != 0 or check.stdout.strip() != "ok":
            sys.exit(f"check failed:\n{check.stderr}")
        med = {n: (statistics.median(t for t, _ in v), statistics.median(m for _, m in v)) for n, v in results.items()}
        base_rss = med["baseline: import torch, shardscope"][1]
        print(f"output: {out_bytes / 2**30:.2f} GiB of float32 in {TENSORS} tensors; {args.runs} runs; medians")
        print(f"{'reader':52} {'wall s':>8} {'peak RSS MiB':>13} {'above baseline MiB':>19}")
        for n in names:
            t, m = med[n]
            print(f"{n:52} {t:8.2f} {m / 2**20:13.0f} {(m - base_rss) / 2**20:19.0f}")
        t_torch = med["torch: dcp_to_torch_save + torch.load"][0]
        t_ours = med["shardscope: open(dcp).state_dict()"][0]
        t_st = med["safetensors: load_file"][0]
        t_ours_st = med["shardscope: open(file.safetensors).state_dict()"][0]
        t_ours_mm = med["shardscope: ... .state_dict(mmap=True)"][0]
        over = (med["shardscope: open(dcp).state_dict()"][1] - base_rss - out_bytes) / 2**20
        print(f"DCP: shardscope {t_torch / t_ours:.1f}x faster than torch's tools (target >= 3x); "
              f"memory above output {over:.0f} MiB (target <= 64)")
        print(f"safetensors: shardscope at {t_st / t_ours_st:.2f}x the speed of load_file reading into memory, "
              f"{t_st / t_ours_mm:.2f}x with mmap=True (load_file maps the file; target >= 1)")
        # The same readers in one process, each timed alone (no interpreter start, no torch import):
        # what a notebook sees.
        os.sync()
        subprocess.run(["cat", *dcp_files, st], stdout=subprocess.DEVNULL, check=True)
        inproc = subprocess.run([py, "-c", INPROCESS, ckpt, st, tmp_pt, str(args.runs)], capture_output=True, text=True)
        if inproc.returncode != 0:
            sys.exit(f"in-process timing failed:\n{inproc.stderr}")
        within = json.loads(inproc.stdout.strip().splitlines()[-1])
        print(f"in one process (median of {args.runs}; no interpreter start or imports):")
        for n, t in within.items():
            print(f"  {n:50} {t:8.3f} s")
        native = os.path.abspath(args.shardscope)
        entry = os.path.join(os.path.dirname(sys.executable), "shardscope")
        entry = entry if os.path.exists(entry) else (shutil.which("shardscope") or "")
        start_native = startup([native, "--version"]) if os.path.exists(native) else float("nan")
        start_entry = startup([entry, "--version"]) if entry else float("nan")
        print(f"start-up `shardscope --version`: native binary {start_native * 1000:.0f} ms, "
              f"wheel entry point {start_entry * 1000:.0f} ms")
        print(json.dumps({
            "bench": "python_api",
            "runs": args.runs,
            "output_bytes": out_bytes,
            "medians": {n: {"wall_s": round(med[n][0], 3), "peak_rss": med[n][1]} for n in names},
            "dcp_speedup_vs_torch": round(t_torch / t_ours, 2),
            "dcp_memory_above_output_mib": round(over, 1),
            "safetensors_speed_vs_load_file": round(t_st / t_ours_st, 2),
            "safetensors_mmap_speed_vs_load_file": round(t_st / t_ours_mm, 2),
            "in_process_s": {n: round(t, 4) for n, t in within.items()},
            "startup_native_ms": round(start_native * 1000, 1),
            "startup_entry_point_ms": round(start_entry * 1000, 1),
        }))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
