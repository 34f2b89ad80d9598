#!/usr/bin/env python3
"""Benchmark: `shardscope convert STEP -o OUT --to hf --config config.json` of a ~1.5 GiB torchtitan
llama3 checkpoint (model-only step written by torchtitan's own CheckpointManager) into a Hugging Face
model directory, against a durable copy of the same bytes and against torchtitan's own route in torch,
in the same run.

1. Checkpoint (generated once, cached under --work, default /tmp/hf-bench; regenerated when the model
   shape below changes or with --regen): torchtitan 0.3.0's own llama3 model, the ModelSpec of
   `model_registry("debugmodel")` with its config scaled up (same builders and inits as `_debugmodel`:
   dim 2048, 6 layers, 16 heads, 4 KV heads, vocab 32000, SwiGLU hidden dim
   `compute_ffn_hidden_dim(2048, multiple_of=256)` = 5632, untied lm_head; 57 float32 tensors,
   1.50 GiB, the largest the 250 MiB embedding and lm_head). Built on meta, materialized on CPU and
   initialized with `init_weights()` after `torch.manual_seed(0)`, then saved in one process by
   torchtitan's `CheckpointManager` (`last_save_model_only=True`, `export_dtype="float32"`,
   `save(curr_step=1, last_step=True)`: the model-only last step, `dcp.save` of the model's state
   dict) to WORK/checkpoint/step-1 (one `__0_0.distcp` + `.metadata`). Beside it
   WORK/hf_config/config.json: transformers' `LlamaConfig(...).save_pretrained` of the same model
   (as tests/fixtures/hf_mapping/gen_torchtitan_hf.py makes it).
2. Each command is its own process under `/usr/bin/time -v` (wall time, peak RSS; benchlib.timed:
   `sync` first, the step's files read into the page cache again); --runs N rounds (default 3), the
   order of the three commands rotated each round; every output is removed before its command runs:
   - `shardscope convert STEP -o OUT --to hf --config config.json -q` (--shardscope, default
     target/release/shardscope): config.json + model.safetensors, RoPE rows of q/k permuted;
   - durable copy: `sh -c 'cat STEP/*.distcp > COPY && sync COPY'` (shardscope fsyncs its outputs
     too): the floor for moving these bytes;
   - torchtitan's route in torch, as a user without shardscope would do it (bench/hf_convert_torchtitan.py,
     the steps of torchtitan's scripts/checkpoint_conversion/convert_to_hf.py with safetensors'
     writer): build the model on meta, `to_empty(device="cpu")`, `dcp.load` into its state dict,
     `spec.state_dict_adapter(model_config, None).to_hf(sd)`, `safetensors.torch.save_file` +
     fsync, config.json copied beside it.
3. Check (after round 1, not timed): shardscope's model.safetensors and the torch route's hold the
   same keys, dtypes, shapes and bytes, tensor by tensor (it exits non-zero otherwise); whether the two
   files are also byte-identical is reported. After the rounds, the torch route's imports alone
   (`python -c "import torch, torch.distributed.checkpoint, safetensors.torch, torchtitan.models.llama3"`)
   are timed once, for context: part of that route's time is starting it.

Reported per run and as medians: wall seconds, peak RSS, throughput (GiB/s of tensor bytes),
"% of a durable copy" (copy time / command time, also as the median of each round's ratio), speedup
over torchtitan's route, shardscope's peak RSS over the largest tensor. Prints markdown tables ready
for BENCHMARKS.md; `--json` prints one JSON object instead (progress goes to stderr either way).

usage (torch 2.15.0 + torchtitan 0.3.0 + transformers, e.g. ~/.cache/shardscope/torch-venv):
  ~/.cache/shardscope/torch-venv/bin/python bench/hf_convert.py \
      [--shardscope target/release/shardscope] [--work /tmp/hf-bench] [--runs 3] [--json] [--regen] [--clean]
Needs ~6.5 GiB of free disk under --work (checkpoint + three outputs) and ~2.6 GiB of memory for the
torch route. Generation takes about a minute on 2 cores; one round 30-40 s. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# The scaled-up debugmodel (torchtitan's debugmodel: dim 256, 6 layers, 16 heads, vocab 2048).
DIM, N_LAYERS, N_HEADS, N_KV_HEADS, VOCAB = 2048, 6, 16, 4, 32000
SEED, STEP = 0, 1
ROPE = dict(theta=500000.0, scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192, max_seq_len=131072)
SHAPE = dict(dim=DIM, n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, vocab=VOCAB, seed=SEED,
             rope=ROPE, format=1)

SHARDSCOPE = "shardscope convert --to hf"
COPY = "durable copy (cat + sync)"
TORCH = "torchtitan route (dcp.load + to_hf + save_file)"


def hidden_dim() -> int:
    from torchtitan.models.common import compute_ffn_hidden_dim

    return compute_ffn_hidden_dim(DIM, multiple_of=256)


def titan_spec():
    """torchtitan's llama3 ModelSpec of `debugmodel`, its config rebuilt at the sizes above with the
    builders `_debugmodel` uses (imported by bench/hf_convert_torchtitan.py too)."""
    from torchtitan.models import llama3 as m
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    spec = m.model_registry("debugmodel")
    cfg = m.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=m._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=m._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=m._output_linear_init(DIM)),
        layers=m._build_llama3_layers(
            fuse_qkv=True, n_layers=N_LAYERS, dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS,
            hidden_dim=hidden_dim(),
            rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=ROPE["max_seq_len"], theta=ROPE["theta"],
                                    scaling="llama", scaling_factor=ROPE["scaling_factor"],
                                    low_freq_factor=ROPE["low_freq_factor"],
                                    high_freq_factor=ROPE["high_freq_factor"],
                                    original_max_position_embeddings=ROPE["original_max_position_embeddings"]),
            attn_backend="flex",
        ),
    )
    return dataclasses.replace(spec, model=cfg)


def hf_config_kwargs() -> dict:
    """transformers' LlamaConfig of the same model (as gen_torchtitan_hf.py's llama3())."""
    return dict(
        architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=DIM, intermediate_size=hidden_dim(),
        num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS,
        head_dim=DIM // N_HEADS, hidden_act="silu", max_position_embeddings=ROPE["max_seq_len"],
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=ROPE["theta"], factor=ROPE["scaling_factor"],
                             low_freq_factor=ROPE["low_freq_factor"], high_freq_factor=ROPE["high_freq_factor"],
                             original_max_position_embeddings=ROPE["original_max_position_embeddings"]),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The checkpoint (cached).
# ----------------------------------------------------------------------------------------------


def generate(work: str) -> dict:
    """Write WORK/checkpoint/step-1 (torchtitan's CheckpointManager, model-only last step) and
    WORK/hf_config/config.json; return the manifest (also WORK/manifest.json, written last)."""
    import torch
    import transformers
    from torchtitan.components.checkpoint import CheckpointManager

    for name in ("checkpoint", "hf_config", "manifest.json"):
        path = os.path.join(work, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.path.exists(path) and os.unlink(path)
    os.makedirs(work, exist_ok=True)
    t0 = time.monotonic()
    spec = titan_spec()
    cfg = spec.model
    # As Trainer.__init__: build on meta, materialize, init_weights (seeded).
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    log(f"model built and initialized in {time.monotonic() - t0:.1f} s")

    t0 = time.monotonic()
    checkpointer = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=1, last_save_model_only=True, export_dtype="float32",
        keep_latest_k=0,
    ).build(
        dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
        sd_adapter=spec.state_dict_adapter(cfg, None), base_folder=work,
    )
    assert checkpointer.save(curr_step=STEP, last_step=True)
    checkpointer.close()
    step = os.path.join(work, "checkpoint", f"step-{STEP}")
    log(f"CheckpointManager saved {step} in {time.monotonic() - t0:.1f} s")

    sd = model.state_dict()
    tensors = {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                   "bytes": v.numel() * v.element_size()} for k, v in sd.items()}
    largest = max(tensors, key=lambda k: tensors[k]["bytes"])
    config_dir = os.path.join(work, "hf_config")
    transformers.LlamaConfig(**hf_config_kwargs()).save_pretrained(config_dir)
    files = sorted(os.listdir(step))
    manifest = {
        "shape": SHAPE,
        "hidden_dim": hidden_dim(),
        "versions": {"torch": torch.__version__, "torchtitan": _version("torchtitan"),
                     "transformers": transformers.__version__},
        "saved_by": "torchtitan CheckpointManager (last_save_model_only=True, export_dtype=float32), 1 process",
        "step": step,
        "config": os.path.join(config_dir, "config.json"),
        "files": {f: os.path.getsize(os.path.join(step, f)) for f in files},
        "tensor_count": len(tensors),
        "tensor_bytes": sum(t["bytes"] for t in tensors.values()),
        "largest_tensor": largest,
        "largest_tensor_bytes": tensors[largest]["bytes"],
        "tensors": tensors,
    }
    assert any(f.endswith(".distcp") for f in files), files
    del model, sd
    with open(os.path.join(work, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def checkpoint(work: str, regen: bool) -> dict:
    path = os.path.join(work, "manifest.json")
    if not regen and os.path.exists(path):
        with open(path) as f:
            manifest = json.load(f)
        step = manifest.get("step", "")
        if (manifest.get("shape") == SHAPE and os.path.isdir(step)
                and all(os.path.exists(os.path.join(step, n)) and os.path.getsize(os.path.join(step, n)) == s
                        for n, s in manifest["files"].items())):
            log(f"reusing the checkpoint in {step}")
            return manifest
    log(f"generating the checkpoint under {work} ...")
    return generate(work)


# ----------------------------------------------------------------------------------------------
# The check: same keys, dtypes, shapes and bytes.
# ----------------------------------------------------------------------------------------------


def verify(ours_dir: str, torch_dir: str, manifest: dict) -> dict:
    import warnings

    import torch
    from safetensors import safe_open

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    ours_files = sorted(f for f in os.listdir(ours_dir) if f.endswith(".safetensors"))
    if ours_files != ["model.safetensors"]:
        sys.exit(f"FAIL: shardscope wrote {ours_files} in {ours_dir}, expected one model.safetensors")
    if not os.path.exists(os.path.join(ours_dir, "config.json")):
        sys.exit(f"FAIL: no config.json in {ours_dir}")
    ours, ref = os.path.join(ours_dir, "model.safetensors"), os.path.join(torch_dir, "model.safetensors")
    with safe_open(ours, "pt") as a, safe_open(ref, "pt") as b:
        ka, kb = set(a.keys()), set(b.keys())
        if ka != kb:
            sys.exit(f"FAIL: keys differ: only shardscope {sorted(ka - kb)}, only torch {sorted(kb - ka)}")
        for key in sorted(ka):
            x, y = a.get_tensor(key), b.get_tensor(key)
            if x.dtype != y.dtype or x.shape != y.shape:
                sys.exit(f"FAIL: {key}: shardscope {x.dtype} {list(x.shape)}, torch {y.dtype} {list(y.shape)}")
            if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
                sys.exit(f"FAIL: {key}: bytes differ between shardscope and the torch route")
    # The RoPE permutation really happened (the check above is not of two renames only).
    with safe_open(ours, "pt") as a:
        q = a.get_tensor("model.layers.0.self_attn.q_proj.weight")
    import torch.distributed.checkpoint as dcp

    raw = {"layers.0.attention.qkv_linear.wq.weight": torch.empty(q.shape, dtype=q.dtype)}
    dcp.load(raw, checkpoint_id=manifest["step"])
    if torch.equal(q, raw["layers.0.attention.qkv_linear.wq.weight"]):
        sys.exit("FAIL: q_proj equals the stored wq: no RoPE permutation")
    with open(os.path.join(ours_dir, "config.json")) as f:
        cfg = json.load(f)
    return {"tensors": len(ka), "tensor_bytes_equal": True,
            "files_byte_identical": filecmp.cmp(ours, ref, shallow=False),
            "output_bytes": os.path.getsize(ours), "torch_output_bytes": os.path.getsize(ref),
            "config_architectures": cfg.get("architectures"), "config_torch_dtype": cfg.get("torch_dtype", cfg.get("dtype"))}


# ----------------------------------------------------------------------------------------------
# Timing and report.
# ----------------------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def thousands(n: float) -> str:
    return f"{n:,.0f}".replace(",", " ")


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shardscope", default="target/release/shardscope")
    parser.add_argument("--work", default="/tmp/hf-bench", help="cache of the checkpoint and the outputs")
    parser.add_argument("--runs", type=int, default=3, help="rounds; the median is shown")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--regen", action="store_true", help="write the checkpoint again")
    parser.add_argument("--clean", action="store_true", help="remove the outputs (not the checkpoint) at the end")
    args = parser.parse_args()
    from benchlib import timed

    shardscope = os.path.abspath(args.shardscope)
    if not os.access(shardscope, os.X_OK):
        sys.exit(f"no shardscope binary at {shardscope} (cargo build --release -p shardscope-runner)")
    work = os.path.abspath(args.work)
    manifest = checkpoint(work, args.regen)
    step, config = manifest["step"], manifest["config"]
    data_files = sorted(os.path.join(step, f) for f in manifest["files"] if f.endswith(".distcp"))
    warm = sorted(os.path.join(step, f) for f in manifest["files"])
    tensor_bytes, largest = manifest["tensor_bytes"], manifest["largest_tensor_bytes"]
    input_bytes = sum(os.path.getsize(f) for f in data_files)

    out_ours = os.path.join(work, "out-shardscope")
    out_copy = os.path.join(work, "copy.distcp")
    out_torch = os.path.join(work, "out-torch")
    commands = {
        SHARDSCOPE: [shardscope, "convert", step, "-o", out_ours, "--to", "hf", "--config", config, "-q"],
        COPY: ["sh", "-c", 'cat "$1"/*.distcp > "$2" && sync "$2"', "sh", step, out_copy],
        TORCH: [sys.executable, os.path.join(HERE, "hf_convert_torchtitan.py"), step, config, out_torch],
    }
    output_of = {SHARDSCOPE: out_ours, COPY: out_copy, TORCH: out_torch}
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
    loads = [os.getloadavg()[0]]
    check = None
    names = list(commands)
    for r in range(args.runs):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            remove(output_of[name])
            wall, rss = timed(commands[name], warm)
            runs[name].append((wall, rss))
            log(f"round {r + 1}/{args.runs}: {name}: {wall:.2f} s, peak RSS {rss / 2**20:.0f} MiB")
        loads.append(os.getloadavg()[0])
        if check is None:
            check = verify(out_ours, out_torch, manifest)
            log(f"check: {check['tensors']} tensors equal bit for bit (files byte-identical: "
                f"{check['files_byte_identical']})")
    if args.clean:
        for path in output_of.values():
            remove(path)
    # Context for the torch route (not in the rounds): what starting it costs before any byte moves.
    imports = [sys.executable, "-c", "import torch, torch.distributed.checkpoint, safetensors.torch, torchtitan.models.llama3"]
    import_wall, import_rss = timed(imports)
    log(f"torch route imports alone: {import_wall:.2f} s, peak RSS {import_rss / 2**20:.0f} MiB")

    gib = 2**30
    walls = {n: [w for w, _ in v] for n, v in runs.items()}
    rsses = {n: [m for _, m in v] for n, v in runs.items()}
    per_round = [
        {
            "round": i + 1,
            **{n: {"wall_s": walls[n][i], "peak_rss_bytes": rsses[n][i]} for n in names},
            "shardscope_fraction_of_copy": walls[COPY][i] / walls[SHARDSCOPE][i],
            "shardscope_speedup_vs_torch": walls[TORCH][i] / walls[SHARDSCOPE][i],
        }
        for i in range(args.runs)
    ]
    med = {n: {"wall_s": median(walls[n]), "min_s": min(walls[n]), "max_s": max(walls[n]),
               "peak_rss_bytes": median(rsses[n]), "gib_per_s": tensor_bytes / gib / median(walls[n])}
           for n in names}
    for n in names:
        med[n]["fraction_of_copy"] = med[COPY]["wall_s"] / med[n]["wall_s"]
        med[n]["speedup_vs_torch"] = med[TORCH]["wall_s"] / med[n]["wall_s"]
    ours = med[SHARDSCOPE]
    summary = {
        "checkpoint": {k: manifest[k] for k in ("step", "config", "saved_by", "versions", "tensor_count",
                                                "tensor_bytes", "largest_tensor", "largest_tensor_bytes", "files")},
        "model": {**SHAPE, "hidden_dim": manifest["hidden_dim"]},
        "input_bytes": input_bytes,
        "runs": args.runs,
        "load_average_1min": loads,
        "commands": {n: " ".join(c) for n, c in commands.items()},
        "per_round": per_round,
        "median": med,
        "shardscope": {
            "median_round_fraction_of_copy": median([p["shardscope_fraction_of_copy"] for p in per_round]),
            "median_round_speedup_vs_torch": median([p["shardscope_speedup_vs_torch"] for p in per_round]),
            "peak_rss_over_largest_tensor": ours["peak_rss_bytes"] / largest,
        },
        "check": check,
        "torch_route_imports_only": {"command": " ".join(imports), "wall_s": import_wall, "peak_rss_bytes": import_rss},
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return

    mib = 2**20
    print(f"Checkpoint: torchtitan llama3 (`model_registry(\"debugmodel\")` scaled: dim {DIM}, {N_LAYERS} layers, "
          f"{N_HEADS} heads, {N_KV_HEADS} KV heads, vocab {VOCAB}, hidden {manifest['hidden_dim']}), model-only step "
          f"by torchtitan's CheckpointManager: {manifest['tensor_count']} float32 tensors, "
          f"{tensor_bytes / gib:.2f} GiB ({input_bytes / gib:.2f} GiB in {len(data_files)} .distcp file(s)); "
          f"largest tensor `{manifest['largest_tensor']}` {largest / mib:.0f} MiB. "
          f"{args.runs} round{'s' * (args.runs != 1)}, order rotated; 1-minute load average "
          f"{', '.join(f'{x:.1f}' for x in loads)} (start, after each round).")
    print()
    print("| command | wall (median, range) | GiB/s (tensor bytes) | peak RSS (median) | % of a durable copy | x torchtitan route |")
    print("|---|---|---|---|---|---|")
    for n in names:
        m = med[n]
        print(f"| {n} | {m['wall_s']:.2f} s ({m['min_s']:.2f}–{m['max_s']:.2f}) | {m['gib_per_s']:.2f} | "
              f"{thousands(m['peak_rss_bytes'] / mib)} MiB | {m['fraction_of_copy'] * 100:.0f}% | "
              f"{m['speedup_vs_torch']:.1f}x |")
    print()
    print("| round | " + " | ".join(names) + " | shardscope % of copy | shardscope x torch |")
    print("|---|" + "---|" * (len(names) + 2))
    for p in per_round:
        cells = [f"{p[n]['wall_s']:.2f} s / {thousands(p[n]['peak_rss_bytes'] / mib)} MiB" for n in names]
        print(f"| {p['round']} | " + " | ".join(cells) +
              f" | {p['shardscope_fraction_of_copy'] * 100:.0f}% | {p['shardscope_speedup_vs_torch']:.1f}x |")
    print()
    s = summary["shardscope"]
    print(f"shardscope: {s['median_round_fraction_of_copy'] * 100:.0f}% of a durable copy (median of the rounds' "
          f"ratios), {s['median_round_speedup_vs_torch']:.1f}x faster than torchtitan's route; peak RSS "
          f"{ours['peak_rss_bytes'] / mib:.0f} MiB = {s['peak_rss_over_largest_tensor']:.2f}x the largest tensor "
          f"({largest / mib:.0f} MiB). Output check: {check['tensors']} tensors equal to the torch route's bit for "
          f"bit; files byte-identical: {'yes' if check['files_byte_identical'] else 'no'} "
          f"({thousands(check['output_bytes'])} vs {thousands(check['torch_output_bytes'])} bytes). "
          f"The torch route's imports alone (torch, DCP, safetensors, torchtitan's llama3): {import_wall:.2f} s, "
          f"{import_rss / mib:.0f} MiB.")


if __name__ == "__main__":
    main()
