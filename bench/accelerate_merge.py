#!/usr/bin/env python3
"""Benchmark: the model of an accelerate FSDP2 SHARDED_STATE_DICT save to one safetensors file,
`accelerate merge-weights` against `shardscope convert DIR --model-only`, with a durable copy of the
same bytes as the floor, in the same run.

1. Two spawned ranks (gloo, CPU) shard `benchlib.Model` (8 bias-free Linear layers of 128 MiB float32,
   1 GiB of parameters) with FSDP2 `fully_shard` (each layer, then the root, as accelerate's FSDP2
   plugin wraps a model) and write it with accelerate's own `save_fsdp_model` (FSDP2 plugin,
   `SHARDED_STATE_DICT`), the save path of `Accelerator.save_state` and of
   tests/fixtures/trainer_folders/gen_accelerate.py: DIR/pytorch_model_fsdp_0/ (DCP of `{"model": ...}`).
2. Each command is its own process under `/usr/bin/time -v` (wall time, peak RSS), after a `sync`, with
   the input read into the page cache again first; `--runs` rounds, the commands' order rotated each
   round; medians are reported:
   - durable copy: `cat` of the DCP files into one file, then `sync FILE`;
   - `accelerate merge-weights DIR/pytorch_model_fsdp_0 OUT` (accelerate's CLI: `merge_fsdp_weights`,
     which loads the whole state dict with DCP and writes `OUT/model.safetensors`);
   - `shardscope convert DIR --model-only -o OUT.safetensors` (fsyncs its output).
3. The two outputs are compared: byte-identical, else tensor-equal (same names, dtypes, shapes, bytes).

usage: PYTHONPATH=<dir with accelerate 1.15.0 and its deps> python bench/accelerate_merge.py
       [--shardscope target/release/shardscope] [--dir /tmp] [--runs 5]
Needs about 4 GiB of free disk under --dir and ~4 GiB of memory. Prints a table and one JSON line; it
deletes everything it wrote. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchlib import BIG, SMALL, Model, timed

WORLD = 2


def save_worker(rank: int, store: str, out_dir: str) -> None:
    from accelerate import FullyShardedDataParallelPlugin, PartialState
    from accelerate.utils.fsdp_utils import save_fsdp_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from types import SimpleNamespace

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    PartialState(cpu=True)  # accelerate's logging needs its process state
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = Model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, SimpleNamespace(process_index=rank, num_processes=WORLD), model, out_dir)
    dist.barrier()
    dist.destroy_process_group()


def tensor_equal(a: str, b: str) -> bool:
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            return False
        for key in fa.keys():
            x, y = fa.get_tensor(key), fb.get_tensor(key)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardscope", default="target/release/shardscope")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    shardscope = os.path.abspath(args.shardscope)
    import accelerate

    work = tempfile.mkdtemp(prefix="shardscope-bench-accelerate-", dir=args.dir)
    try:
        ckpt = os.path.join(work, "ckpt")
        os.makedirs(ckpt)
        mp.spawn(save_worker, args=(os.path.join(work, "store"), ckpt), nprocs=WORLD, join=True)
        src = os.path.join(ckpt, "pytorch_model_fsdp_0")
        files = sorted(os.path.join(src, f) for f in os.listdir(src))
        input_bytes = sum(os.path.getsize(f) for f in files)

        copy = os.path.join(work, "copy.bin")
        acc_out = os.path.join(work, "merged")
        ours = os.path.join(work, "model.safetensors")
        acc_file = os.path.join(acc_out, "model.safetensors")
        env = {**os.environ, "TMPDIR": work}
        commands = {
            "durable copy (cat + sync)": (
                ["sh", "-c", 'out="$1"; shift; cat "$@" > "$out" && sync "$out"', "sh", copy, *files],
                lambda: os.remove(copy),
            ),
            "accelerate merge-weights": (
                [sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights", src, acc_out],
                lambda: shutil.rmtree(acc_out),
            ),
            "shardscope convert --model-only": (
                [shardscope, "convert", ckpt, "--model-only", "-o", ours, "--quiet"],
                lambda: os.remove(ours),
            ),
        }
        names = list(commands)
        results: dict[str, list[tuple[float, int]]] = {n: [] for n in names}
        loads = [os.getloadavg()[0]]
        same = None
        for run in range(args.runs):
            order = names[run % len(names):] + names[: run % len(names)]
            for name in order:
                cmd, clean = commands[name]
                results[name].append(timed(cmd, warm=files, env=env))
                # The first round keeps both conversions' outputs, to compare them.
                if run > 0 or name == names[0]:
                    clean()
            if run == 0:
                if filecmp.cmp(acc_file, ours, shallow=False):
                    same = "byte-identical"
                else:
                    same = "tensor-equal" if tensor_equal(acc_file, ours) else "DIFFERENT"
                for name in names[1:]:
                    commands[name][1]()
            loads.append(os.getloadavg()[0])
        assert same in ("byte-identical", "tensor-equal"), f"outputs differ: {same}"

        largest = BIG * SMALL * 4
        t_copy = statistics.median(w for w, _ in results[names[0]])
        print(
            f"input: {input_bytes / 2**30:.2f} GiB in {len(files)} files (accelerate {accelerate.__version__}, "
            f"torch {torch.__version__}, {WORLD} ranks); outputs {same}; {args.runs} runs, medians; "
            f"1-minute load average {min(loads):.2f}-{max(loads):.2f} during the runs"
        )
        print(f"{'command':36} {'wall s':>8} {'min-max s':>13} {'GiB/s':>6} {'peak RSS MiB':>13} {'of copy':>8}")
        summary = {"input_bytes": input_bytes, "largest_tensor_bytes": largest, "runs": args.runs,
                   "outputs": same, "load_average_1min": loads, "accelerate": accelerate.__version__}
        for name in names:
            walls = [w for w, _ in results[name]]
            rss = statistics.median(r for _, r in results[name])
            wall = statistics.median(walls)
            print(
                f"{name:36} {wall:8.2f} {min(walls):6.2f}-{max(walls):<6.2f} {input_bytes / 2**30 / wall:6.2f} "
                f"{rss / 2**20:13.0f} {t_copy / wall * 100:7.0f}%"
            )
            summary[name] = {"wall_s": walls, "median_wall_s": wall, "median_peak_rss_bytes": rss}
        print(json.dumps(summary))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
