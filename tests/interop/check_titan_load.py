"""A `convert --to torchtitan --world-size 2` DCP loaded by torchtitan's own CheckpointManager.

Usage: python check_titan_load.py SHARDSCOPE_BIN WORK_DIR

For every model folder of tests/fixtures/hf_mapping (torchtitan 0.3.0 fixtures, see
gen_torchtitan_hf.py), the Hugging Face model torchtitan's own `to_hf` gave
(`expected/hf.safetensors` + `config.json`) is converted back with
`shardscope convert HF_DIR -o WORK/<model>-titan-dcp --to torchtitan --config config.json --world-size 2`.
Then, on 2 gloo ranks, each model is built as the fixture generator builds it (same shrunk
debugmodel config, torchtitan's `apply_fsdp_to_decoder`, AdamW, LR schedulers) and torchtitan's
`CheckpointManager` is configured as a fine-tuning run from converted weights is:
`initial_load_path=<the DCP>`, `initial_load_model_only=True`, an empty checkpoint folder. Its
`load()` must return True, and every parameter and buffer of the sharded model, gathered with
`full_tensor()`, must then equal torchtitan's own `from_hf` (`expected/from_hf.safetensors`) bit
for bit. The model starts from its seeded init, which differs from the trained weights, so a load
that read nothing fails the comparison.

Prints one line per model and `ok` last; exits non-zero naming the first tensor that differs.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "hf_mapping"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(FIXTURES))
import ranks  # noqa: E402

warnings.filterwarnings("ignore")
WORLD = 2


def convert(bin_: str, fixture: Path, work: Path) -> Path:
    hf = work / f"{fixture.name}-hf"
    shutil.rmtree(hf, ignore_errors=True)
    hf.mkdir(parents=True)
    shutil.copy(fixture / "expected" / "hf.safetensors", hf / "model.safetensors")
    shutil.copy(fixture / "config.json", hf / "config.json")
    out = work / f"{fixture.name}-titan-dcp"
    shutil.rmtree(out, ignore_errors=True)
    args = [bin_, "convert", str(hf), "-o", str(out), "--to", "torchtitan", "--config",
            str(fixture / "config.json"), "--world-size", str(WORLD), "-q"]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"shardscope {' '.join(args[1:])} failed:\n{done.stdout}\n{done.stderr}")
    return out


def check_rank(rank, store, models, work):
    import gen_torchtitan_hf as gen
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    results = {}
    for name, dcp_dir in models:
        spec, *_ = gen.spec_of(name)
        cfg = spec.model
        torch.manual_seed(gen.SEED)
        model = cfg.build()
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
        optimizers = default_adamw(lr=gen.LR).build(model_parts=[model])
        lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
        checkpointer = CheckpointManager.Config(
            enable=True, folder=f"no-checkpoints-{name}", initial_load_path=dcp_dir, initial_load_model_only=True,
        ).build(
            dataloader=None,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states={},
            sd_adapter=spec.state_dict_adapter(cfg, None),
            base_folder=work,
        )
        loaded = checkpointer.load()
        checkpointer.close()
        want = load_file(str(FIXTURES / name / "expected" / "from_hf.safetensors"))
        # What from_hf leaves out (gpt_oss's expert_bias_E, zero in the fixture: HF's model has
        # none): the torchtitan model's own values.
        titan = load_file(str(FIXTURES / name / "expected" / "titan.safetensors"))
        want.update({k: v for k, v in titan.items() if k not in want})
        problem = None if loaded else "CheckpointManager.load() returned False"
        got_keys = []
        for key, value in model.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            got_keys.append(key)
            if problem:
                break
            w = want.get(key)
            if w is None:
                problem = f"{key}: the model holds it, torchtitan's from_hf does not"
            elif full.dtype != w.dtype or tuple(full.shape) != tuple(w.shape):
                problem = f"{key}: {full.dtype} {tuple(full.shape)} != {w.dtype} {tuple(w.shape)}"
            elif not torch.equal(full.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)):
                problem = f"{key}: bytes differ from from_hf (max |diff| {(full.float() - w.float()).abs().max()})"
        missing = sorted(set(want) - set(got_keys))
        if problem is None and missing:
            problem = f"from_hf holds {missing[:3]}, which the model does not"
        results[name] = {"loaded": bool(loaded), "tensors": len(got_keys), "problem": problem}
    if rank == 0:
        with open(os.path.join(work, "titan_load.json"), "w") as f:
            json.dump(results, f)
    ranks.finish()


def main() -> None:
    bin_, work = sys.argv[1], Path(sys.argv[2]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    fixtures = sorted(p for p in FIXTURES.iterdir() if (p / "expected" / "from_hf.safetensors").exists())
    if not fixtures:
        raise SystemExit(f"no fixtures in {FIXTURES}")
    models = [(f.name, str(convert(bin_, f, work))) for f in fixtures]
    result = work / "titan_load.json"
    result.unlink(missing_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="shardscope-titan-", dir=work))
    ranks.spawn(check_rank, (str(scratch / "store"), models, str(scratch)), nprocs=WORLD)
    results = json.loads((scratch / "titan_load.json").read_text())
    failed = False
    for name, _ in models:
        r = results.get(name)
        if r is None or r["problem"]:
            print(f"{name}: {r['problem'] if r else 'no result'}")
            failed = True
        else:
            print(f"{name}: CheckpointManager loaded the --to torchtitan DCP (initial_load_path, model only); "
                  f"{r['tensors']} tensors equal torchtitan's from_hf")
    if failed:
        raise SystemExit(1)
    print("ok")


if __name__ == "__main__":
    main()
