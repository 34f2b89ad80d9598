"""`shardscope convert --to hf` and `--to torchtitan` against torchtitan and transformers themselves.

Usage: python check_hf_mapping.py SHARDSCOPE_BIN WORK_DIR

For every model folder of tests/fixtures/hf_mapping (written by torchtitan 0.3.0's own
CheckpointManager: gen_torchtitan_hf.py):
1. `convert step-1 --to hf` (a training step: the model part found as --model-only finds it) and
   `convert step-2 --to hf` (a model-only step): every tensor bit-identical (names, dtype, shape,
   bytes) to `expected/hf.safetensors` (torchtitan's own `StateDictAdapter.to_hf`; gpt_oss experts in
   HF's own layout), `config.json` written, and transformers' `from_pretrained(OUT)` giving the
   torchtitan model's logits (`expected/logits.safetensors`) within 1e-4;
2. `convert OUT --to torchtitan` (a .safetensors file) equal to `expected/from_hf.safetensors`
   (torchtitan's `from_hf`), and with `--world-size 2` a DCP that `torch.distributed.checkpoint.load`
   reads into the torchtitan model's own state dict (as its CheckpointManager loads a model-only
   step), equal to the same reference.
Prints one line per model and `ok` last; exits non-zero naming the first tensor that differs.
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "hf_mapping"
BIN = sys.argv[1]
WORK = Path(sys.argv[2])


def run(*args: str) -> None:
    out = subprocess.run([BIN, *args, "-q"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"shardscope {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")


def load_hf_dir(path: Path) -> dict:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
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
        if not torch.equal(g.view(torch.uint8) if g.dim() else g, w.view(torch.uint8) if w.dim() else w):
            raise SystemExit(f"{what}: {k}: bytes differ (max |diff| {(g.float() - w.float()).abs().max()})")


def logits_check(out: Path, fixture: Path) -> str:
    ref = fixture / "expected" / "logits.safetensors"
    if not ref.exists():
        return "no logits reference"
    import transformers

    t = load_file(ref)
    config = json.loads((out / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    model = cls.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(t["tokens"]).logits.float()
    diff = (logits - t["logits"].float()).abs().max().item()
    if not diff <= 1e-4:
        raise SystemExit(f"{out}: from_pretrained logits differ from torchtitan's by {diff}")
    return f"logits within {diff:.1e}"


def titan_dcp_check(dcp_dir: Path, want: dict) -> str:
    """Loads the DCP as a model-only step is loaded (`dcp.load` into a state dict of the model's
    keys and shapes) and compares it with the reference."""
    import torch.distributed.checkpoint as dcp

    sd = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(sd, checkpoint_id=str(dcp_dir))
    same(sd, want, f"{dcp_dir} loaded with dcp.load")
    return "the --world-size 2 DCP loads with dcp.load, equal"


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    models = sorted(p for p in FIXTURES.iterdir() if (p / "config.json").exists())
    if not models:
        raise SystemExit(f"no fixtures in {FIXTURES}")
    for fixture in models:
        name = fixture.name
        want_hf = load_file(fixture / "expected" / "hf.safetensors")
        notes = []
        for step in ("step-1", "step-2"):
            out = WORK / f"{name}-{step}-hf"
            run("convert", str(fixture / step), "-o", str(out), "--to", "hf", "--config", str(fixture / "config.json"))
            if not (out / "config.json").exists():
                raise SystemExit(f"{out}: no config.json")
            same(load_hf_dir(out), want_hf, f"{name} {step} --to hf")
        notes.append(logits_check(WORK / f"{name}-step-2-hf", fixture))
        back_ref = fixture / "expected" / "from_hf.safetensors"
        if back_ref.exists():
            want_back = load_file(back_ref)
            # What from_hf leaves out and torchtitan's model holds (gpt_oss's expert_bias_E, kept at
            # zero by the generator since HF's model has none): the torchtitan model's own values.
            titan = load_file(fixture / "expected" / "titan.safetensors")
            want_back.update({k: v for k, v in titan.items() if k not in want_back})
            back = WORK / f"{name}-back.safetensors"
            run("convert", str(WORK / f"{name}-step-2-hf"), "-o", str(back), "--to", "torchtitan",
                "--config", str(fixture / "config.json"))
            same(load_file(back), want_back, f"{name} --to torchtitan")
            back_dcp = WORK / f"{name}-back-dcp"
            run("convert", str(WORK / f"{name}-step-2-hf"), "-o", str(back_dcp), "--to", "torchtitan",
                "--config", str(fixture / "config.json"), "--world-size", "2")
            notes.append(titan_dcp_check(back_dcp, want_back))
        print(f"{name}: --to hf bit-identical to torchtitan's to_hf; " + "; ".join(notes))
    print("ok")


if __name__ == "__main__":
    main()
