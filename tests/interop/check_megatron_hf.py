"""`shardscope convert --to hf` of a Megatron-core GPTModel against the HF model it is.

Usage: python check_megatron_hf.py SHARDSCOPE_BIN WORK_DIR

tests/fixtures/megatron_gpt (gen_megatron_gpt.py: megatron-core 0.16.1's own GPTModel, local layer spec,
GQA + SwiGLU + RMSNorm + RoPE, untied head) holds the model as `torch.save(model.state_dict())`
(`model.pt`, per-layer names) and as `dist_checkpointing.save` wrote it with tensor parallelism 2
(`dist/`: layers stacked into one tensor per name with a leading layer dimension, the local spec's
norms under Transformer Engine's `layer_norm_weight` names). For each input that the built-in
`megatron-gpt` mapping can read, `convert INPUT --to hf --config config.json` must give every tensor
bit-identical (names, dtype, shape, bytes) to `expected/hf.safetensors` (the HF state dict the
generator derived and proved against Megatron's forward), write `config.json`, and transformers'
`from_pretrained(OUT)` must give Megatron's logits (`expected/logits.safetensors`) within 1e-4.

Both inputs are required: `dist/` goes through the mapping's stacked-layer rules (a `count` split over
the layer dimension, then q/k/v or gate/up).
Prints one line per input and `ok` last; exits non-zero naming the first tensor that differs.
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent / "fixtures" / "megatron_gpt"
ARGS = sys.argv[1:]
if len(ARGS) != 2:
    raise SystemExit(__doc__)
BIN, WORK = ARGS[0], Path(ARGS[1])


def convert(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BIN, "convert", str(src), "-o", str(out), "--to", "hf", "--config", str(FIXTURE / "config.json"), "-q"],
        capture_output=True, text=True,
    )


def load_hf_dir(path: Path) -> dict:
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    sd = {}
    for f in files:
        sd.update(load_file(path / f))
    return sd


def same(got: dict, want: dict, what: str) -> None:
    if set(got) != set(want):
        raise SystemExit(
            f"{what}: keys differ: only in ours {sorted(set(got) - set(want))[:5]}, "
            f"only in the reference {sorted(set(want) - set(got))[:5]}"
        )
    for k, w in want.items():
        g = got[k]
        if g.dtype != w.dtype or g.shape != w.shape:
            raise SystemExit(f"{what}: {k}: {g.dtype} {tuple(g.shape)} != {w.dtype} {tuple(w.shape)}")
        if not torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)):
            raise SystemExit(f"{what}: {k}: bytes differ (max |diff| {(g.float() - w.float()).abs().max()})")


def logits_check(out: Path) -> float:
    import transformers

    t = load_file(FIXTURE / "expected" / "logits.safetensors")
    model = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(t["tokens"]).logits.float()
    diff = (logits - t["logits"].float()).abs().max().item()
    if not diff <= 1e-4:
        raise SystemExit(f"{out}: from_pretrained logits differ from Megatron's by {diff}")
    return diff


def check(src: Path, name: str) -> None:
    out = WORK / f"megatron_gpt-{name}-hf"
    r = convert(src, out)
    if r.returncode != 0:
        raise SystemExit(f"shardscope convert {src} failed:\n{r.stdout}\n{r.stderr}")
    if not (out / "config.json").exists():
        raise SystemExit(f"{out}: no config.json")
    same(load_hf_dir(out), load_file(FIXTURE / "expected" / "hf.safetensors"), f"{name} --to hf")
    diff = logits_check(out)
    print(f"megatron_gpt {name}: --to hf bit-identical to the derived HF weights; logits within {diff:.1e}")


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    check(FIXTURE / "model.pt", "model.pt")
    check(FIXTURE / "dist", "dist")
    print("ok")


if __name__ == "__main__":
    main()
