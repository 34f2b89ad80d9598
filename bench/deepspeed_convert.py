#!/usr/bin/env python3
"""Benchmark: `shardscope convert CKPT --model-only -o model.safetensors` of a ZeRO-3 checkpoint written
by DeepSpeed itself (~1.5 GiB), against DeepSpeed's own `zero_to_fp32` writing the same file, in the
same run.

1. Checkpoint (generated once, cached under --work, default /work/bench-data/deepspeed; regenerated
   when the model shape below changes or with --regen): DeepSpeed 0.19.8 on CPU (`DS_ACCELERATOR=cpu`,
   gloo, `"torch_adam": true`, ninja on PATH), 2 spawned ranks, ZeRO stage 3 with bf16 (fp32 master
   weights), AdamW, `stage3_param_persistence_threshold: 0`; the model: `LAYERS` Linear layers with
   bias, alternately [WIDE, NARROW] and [NARROW, WIDE] (134 M parameters, 512 MiB in fp32), one
   training step, then `engine.save_checkpoint(WORK/checkpoint)` (`latest` + `global_step1/`: per
   rank a model states file and a `bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt` holding the fp32
   partition and the two AdamW moments, ~770 MiB each).
2. Each command is its own process under `/usr/bin/time -v` (wall time, peak RSS; benchlib.timed:
   `sync` first, the checkpoint's files read into the page cache again); --runs N rounds (default 3),
   the order of the commands alternated each round; every output is removed before its command runs:
   - `shardscope convert CKPT --model-only -o OUT/model.safetensors -q` (--shardscope, default
     target/release/shardscope; it fsyncs its output);
   - DeepSpeed's zero_to_fp32: `deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
     CKPT, OUT, max_shard_size=None, safe_serialization=True)` (what `zero_to_fp32.py CKPT OUT
     --safe_serialization` runs; `max_shard_size=None` because its default "5GB" needs
     huggingface_hub, and one file is written either way), then an fsync of the file, so both
     commands pay for their writes;
   - last in each round, a durable copy of shardscope's output (`cat model.safetensors > COPY && sync
     COPY`): the floor for writing these bytes.
3. Check (after round 1, not timed): both model.safetensors hold the same names, dtypes, shapes and
   bytes; whether the files are byte-identical is reported. DeepSpeed's import alone
   (`python -c "import deepspeed.utils.zero_to_fp32"`) is timed once, for context, and the
   zero_to_fp32 process records the seconds of its conversion after the imports (reported as a
   second speed-up: against DeepSpeed's work alone).

Reported per run and as medians: wall seconds, peak RSS, and the ratios shardscope / zero_to_fp32
(speed-up = zero_to_fp32 time / shardscope time, also as the median of each round's ratio; memory as
the fraction of zero_to_fp32's peak RSS). Prints markdown tables ready for BENCHMARKS.md; `--json`
prints one JSON object instead (progress goes to stderr either way).

usage (a venv with torch 2.15.0, deepspeed 0.19.8, ninja, safetensors, e.g. ~/ds-venv):
  PATH=~/ds-venv/bin:$PATH ~/ds-venv/bin/python bench/deepspeed_convert.py \
      [--shardscope target/release/shardscope] [--work /work/bench-data/deepspeed] [--runs 3] [--json] [--regen]
Needs ~2.6 GiB of free disk under --work and ~5 GiB of memory while generating. Generation takes a
minute or two on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))

LAYERS, WIDE, NARROW = 4, 8192, 4096
WORLD, SEED = 2, 0
SHAPE = dict(layers=LAYERS, wide=WIDE, narrow=NARROW, world=WORLD, seed=SEED, stage=3, bf16=True, format=1)
DEEPSPEED_VERSION = "0.19.8"

SHARDSCOPE = "shardscope convert --model-only"
ZERO_TO_FP32 = "DeepSpeed zero_to_fp32 (safetensors)"
COPY = "durable copy of the output (cat + sync)"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_model():
    from torch import nn

    dims = [(NARROW, WIDE) if i % 2 == 0 else (WIDE, NARROW) for i in range(LAYERS)]
    return nn.Sequential(*[nn.Linear(a, b) for a, b in dims])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(SEED)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, NARROW, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out)
    torch.distributed.barrier()


def generate(work: str) -> dict:
    import deepspeed
    import torch.multiprocessing as mp

    if deepspeed.__version__ != DEEPSPEED_VERSION:
        sys.exit(f"needs deepspeed {DEEPSPEED_VERSION}, found {deepspeed.__version__}")
    ckpt = os.path.join(work, "checkpoint")
    shutil.rmtree(ckpt, ignore_errors=True)
    log(f"generating the ZeRO-3 checkpoint with DeepSpeed in {ckpt} ...")
    t0 = time.monotonic()
    mp.spawn(_worker, args=(_free_port(), ckpt), nprocs=WORLD, join=True)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        if os.path.exists(os.path.join(ckpt, script)):
            os.remove(os.path.join(ckpt, script))
    tag = open(os.path.join(ckpt, "latest")).read().strip()
    files = sorted(os.path.join(tag, f) for f in os.listdir(os.path.join(ckpt, tag)))
    manifest = {
        "shape": SHAPE,
        "checkpoint": ckpt,
        "files": files,
        "checkpoint_bytes": sum(os.path.getsize(os.path.join(ckpt, f)) for f in files),
        "params": sum(a * b + b for a, b in [(NARROW, WIDE) if i % 2 == 0 else (WIDE, NARROW) for i in range(LAYERS)]),
        "generated_in_s": round(time.monotonic() - t0, 1),
        "deepspeed": deepspeed.__version__,
    }
    with open(os.path.join(work, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    log(f"generated {manifest['checkpoint_bytes'] / 2**30:.2f} GiB in {manifest['generated_in_s']} s")
    return manifest


def checkpoint(work: str, regen: bool) -> dict:
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "manifest.json")
    if not regen and os.path.exists(path):
        manifest = json.load(open(path))
        if manifest.get("shape") == SHAPE and all(
            os.path.exists(os.path.join(manifest["checkpoint"], f)) for f in manifest["files"]
        ):
            return manifest
    return generate(work)


# Run as `deepspeed_convert.py --zero-to-fp32 CKPT OUT`: DeepSpeed's conversion, then an fsync. The
# seconds of the conversion alone (after the imports) are written to OUT.work_s.
def zero_to_fp32(ckpt: str, out: str) -> None:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    t0 = time.monotonic()
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size=None, safe_serialization=True)
    fd = os.open(os.path.join(out, "model.safetensors"), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    with open(out + ".work_s", "w") as f:
        f.write(str(time.monotonic() - t0))


def verify(ours: str, theirs: str) -> dict:
    import torch
    from safetensors import safe_open

    with safe_open(ours, "pt") as a, safe_open(theirs, "pt") as b:
        if sorted(a.keys()) != sorted(b.keys()):
            sys.exit(f"different names: {sorted(a.keys())} vs {sorted(b.keys())}")
        for k in a.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                sys.exit(f"{k} differs: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        n = len(list(a.keys()))
    same = subprocess.run(["cmp", "-s", ours, theirs]).returncode == 0
    return {"tensors": n, "files_byte_identical": same}


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--zero-to-fp32":
        zero_to_fp32(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shardscope", default="target/release/shardscope")
    parser.add_argument("--work", default="/work/bench-data/deepspeed", help="cache of the checkpoint and the outputs")
    parser.add_argument("--runs", type=int, default=3, help="rounds; the median is shown")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--regen", action="store_true", help="write the checkpoint again")
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    from benchlib import timed

    shardscope = os.path.abspath(args.shardscope)
    if not os.access(shardscope, os.X_OK):
        sys.exit(f"no shardscope binary at {shardscope} (cargo build --release -p shardscope-runner)")
    work = os.path.abspath(args.work)
    manifest = checkpoint(work, args.regen)
    ckpt = manifest["checkpoint"]
    warm = [os.path.join(ckpt, f) for f in manifest["files"]]
    out_ours = os.path.join(work, "out-shardscope")
    out_ds = os.path.join(work, "out-zero_to_fp32")
    commands = {
        SHARDSCOPE: [shardscope, "convert", ckpt, "--model-only", "-o", os.path.join(out_ours, "model.safetensors"), "-q"],
        ZERO_TO_FP32: [sys.executable, os.path.abspath(__file__), "--zero-to-fp32", ckpt, out_ds],
    }
    out_copy = os.path.join(work, "out-copy")
    copied = os.path.join(out_ours, "model.safetensors")
    output_of = {SHARDSCOPE: out_ours, ZERO_TO_FP32: out_ds, COPY: out_copy}
    names = list(commands)
    # Last in every round: the floor for writing the output's bytes durably.
    commands[COPY] = ["sh", "-c", 'cat "$1" > "$2/model.safetensors" && sync "$2/model.safetensors"', "sh",
                      copied, out_copy]
    runs: dict[str, list[tuple[float, int]]] = {n: [] for n in commands}
    loads = [os.getloadavg()[0]]
    work_s: list[float] = []
    check = None
    for r in range(args.runs):
        for name in names[r % 2:] + names[: r % 2] + [COPY]:
            shutil.rmtree(output_of[name], ignore_errors=True)
            os.makedirs(output_of[name])
            wall, rss = timed(commands[name], [copied] if name == COPY else warm)
            runs[name].append((wall, rss))
            log(f"round {r + 1}/{args.runs}: {name}: {wall:.2f} s, peak RSS {rss / 2**20:.0f} MiB")
            if name == ZERO_TO_FP32:
                work_s.append(float(open(out_ds + ".work_s").read()))
                log(f"  (of which the conversion after the imports: {work_s[-1]:.2f} s)")
        loads.append(os.getloadavg()[0])
        if check is None:
            check = verify(os.path.join(out_ours, "model.safetensors"), os.path.join(out_ds, "model.safetensors"))
            log(f"check: {check['tensors']} tensors equal bit for bit (files byte-identical: {check['files_byte_identical']})")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import deepspeed.utils.zero_to_fp32"], check=True, capture_output=True)
    import_s = time.monotonic() - t0

    per_round = [
        {"round": i + 1, "speedup": runs[ZERO_TO_FP32][i][0] / runs[SHARDSCOPE][i][0],
         "speedup_without_imports": work_s[i] / runs[SHARDSCOPE][i][0],
         "rss_fraction": runs[SHARDSCOPE][i][1] / runs[ZERO_TO_FP32][i][1],
         "fraction_of_copy": runs[COPY][i][0] / runs[SHARDSCOPE][i][0]}
        for i in range(args.runs)
    ]
    med = {n: {"wall_s": median([w for w, _ in v]), "min_s": min(w for w, _ in v), "max_s": max(w for w, _ in v),
               "peak_rss_bytes": median([m for _, m in v])} for n, v in runs.items()}
    out_bytes = os.path.getsize(os.path.join(out_ours, "model.safetensors"))
    summary = {
        "checkpoint_bytes": manifest["checkpoint_bytes"], "output_bytes": out_bytes, "params": manifest["params"],
        "runs": args.runs, "load_avg_1min": loads, "median": med, "per_round": per_round, "check": check,
        "deepspeed_import_s": import_s,
        "median_round_speedup": median([p["speedup"] for p in per_round]),
        "zero_to_fp32_work_s": work_s,
        "median_round_speedup_without_imports": median([p["speedup_without_imports"] for p in per_round]),
        "median_round_rss_fraction": median([p["rss_fraction"] for p in per_round]),
        "median_round_fraction_of_copy": median([p["fraction_of_copy"] for p in per_round]),
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    gib = 2**30
    print(f"Checkpoint: DeepSpeed {manifest['deepspeed']} ZeRO-3 bf16, {WORLD} ranks, {LAYERS} Linear layers "
          f"[{WIDE}, {NARROW}]/[{NARROW}, {WIDE}] with bias ({manifest['params'] / 1e6:.0f} M parameters): "
          f"{manifest['checkpoint_bytes'] / gib:.2f} GiB on disk; output model.safetensors {out_bytes / gib:.2f} GiB "
          f"(fp32). {args.runs} rounds, order alternated; 1-minute load average "
          + " / ".join(f"{x:.1f}" for x in loads) + ".")
    print()
    print("| command | wall (median, range) | peak RSS (median) | x zero_to_fp32 (speed) | RSS / zero_to_fp32's |")
    print("|---|---|---|---|---|")
    base = med[ZERO_TO_FP32]
    for n in names + [COPY]:
        m = med[n]
        print(f"| {n} | {m['wall_s']:.2f} s ({m['min_s']:.2f}–{m['max_s']:.2f}) | {m['peak_rss_bytes'] / 2**20:.0f} MiB | "
              f"{base['wall_s'] / m['wall_s']:.1f}x | {m['peak_rss_bytes'] / base['peak_rss_bytes']:.3f} |")
    print()
    print("| round | " + " | ".join(names + [COPY]) + " | speed-up | speed-up vs zero_to_fp32 after its imports | RSS fraction | shardscope % of copy |")
    print("|---|---|---|---|---|---|---|---|")
    for i, p in enumerate(per_round):
        cells = [f"{runs[n][i][0]:.2f} s, {runs[n][i][1] / 2**20:.0f} MiB" for n in names + [COPY]]
        print(f"| {p['round']} | " + " | ".join(cells) + f" | {p['speedup']:.1f}x | "
              f"{p['speedup_without_imports']:.1f}x ({work_s[i]:.2f} s) | {p['rss_fraction']:.3f} | "
              f"{p['fraction_of_copy'] * 100:.0f}% |")
    print()
    print(f"shardscope: {summary['median_round_speedup']:.1f}x faster than zero_to_fp32 (median of the rounds' ratios), "
          f"{summary['median_round_speedup_without_imports']:.1f}x against its conversion alone (imports left out), "
          f"{summary['median_round_rss_fraction'] * 100:.1f}% of its peak RSS, "
          f"{summary['median_round_fraction_of_copy'] * 100:.0f}% of the speed of a durable copy of its output; "
          f"outputs equal bit for bit "
          f"({check['tensors']} tensors, files byte-identical: {check['files_byte_identical']}); "
          f"`import deepspeed.utils.zero_to_fp32` alone takes {import_s:.1f} s.")


if __name__ == "__main__":
    main()
