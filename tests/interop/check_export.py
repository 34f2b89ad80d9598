"""Interop test of the HF-style exports (run by native-runner/tests/it/export_interop.rs).

usage: check_export.py SHARDSCOPE_BIN WORKDIR

1. `convert --dtype bf16|fp16|fp32|fp64` equals torch's `Tensor.to(dtype)` bit for bit on random,
   subnormal, halfway (ties-to-even), overflowing, NaN and inf values, from float32, float64 and
   bfloat16 sources; integer and bool tensors are untouched. (NaN bits are not compared: torch
   itself writes 0xFFFF for any float32 NaN cast to bfloat16 on its AVX2 path, 0x7FC0 on its
   scalar path (float64 sources), a sign-keeping quiet NaN with AVX512-BF16; NaN positions are.)
2. A tied model (GPT-2 style: `lm_head.weight` is `wte.weight`) exported to safetensors keeps one
   copy, under the first name, as `save_pretrained` does, and `safetensors.torch.load_model` loads
   it strictly into the model; `--keep-tied` writes both. From `torch.save` (shared storage) and
   from DCP (equal bytes).
3. `layout --from` the tied DCP marks the alias `shared_with` and gives the flat parameters real
   FSDP1 builds for that model at world size 2 (`use_orig_params=True`).
Every expected value comes from torch.
"""

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import finish, spawn
from safetensors import safe_open
from safetensors.torch import load_file, load_model


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 8)


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(16, 8)
        self.h = torch.nn.ModuleList([Block(), Block()])
        self.ln_f = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("pos", torch.arange(6, dtype=torch.int64))


def special_values(n, generator, dtype):
    """Random values plus the cases rounding gets wrong: halfway points, subnormals, overflow, NaN."""
    x = torch.randn(n, generator=generator, dtype=torch.float64) * 3
    specials = [
        0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
        1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-30, -(1 + 2**-8),  # bf16 ties and double rounding
        1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-11 + 2**-40,  # fp16 ties
        1e-40, -3e-39, 2**-133, 5.96e-8, 2.98e-8, 6.1e-5, 1e-310,  # subnormals of every type
        65504.0, 65520.0, 70000.0, 3.39e38, 3.4e38, 1e300, -1e300,  # overflow
    ]
    x[: len(specials)] = torch.tensor(specials, dtype=torch.float64)
    return x.to(dtype)


def run(bin_path, *args):
    out = subprocess.run([bin_path, *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        raise AssertionError(f"shardscope {' '.join(map(str, args))} failed ({out.returncode}):\n{out.stderr}")
    return out


def bits_equal(ours, ref, where):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (where, ours.dtype, ref.dtype, ours.shape, ref.shape)
    if not ref.is_floating_point():
        assert torch.equal(ours, ref), where
        return
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(ours), nan), f"{where}: NaN positions differ"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ref.element_size()]
    a, b = ours[~nan].contiguous().view(ints), ref[~nan].contiguous().view(ints)
    bad = (a != b).nonzero()
    if len(bad):
        i = bad[0].item()
        raise AssertionError(f"{where}: {ours[~nan][i].item()!r} vs torch {ref[~nan][i].item()!r} (element {i} of the non-NaN ones)")


def check_casts(bin_path, work):
    g = torch.Generator().manual_seed(0)
    state = {
        "f32": special_values(4096, g, torch.float32).reshape(64, 64),
        "f64": special_values(1000, g, torch.float64),
        "bf16": special_values(999, g, torch.bfloat16),
        "f16": special_values(998, g, torch.float16),
        "ints": torch.randint(-(2**40), 2**40, (50,), generator=g),
        "mask": torch.rand(17, generator=g) > 0.5,
        "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
    }
    src = os.path.join(work, "casts.pt")
    torch.save(state, src)
    for name, dtype in [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32), ("fp64", torch.float64)]:
        for ext in ("safetensors", "pt"):
            out = os.path.join(work, f"cast_{name}.{ext}")
            run(bin_path, "convert", src, "-o", out, "--dtype", name, "--quiet")
            ours = load_file(out) if ext == "safetensors" else torch.load(out, weights_only=True)
            assert set(ours) == set(state), (sorted(ours), sorted(state))
            for k, v in state.items():
                ref = v.to(dtype) if v.is_floating_point() else v
                bits_equal(ours[k], ref, f"--dtype {name} ({ext}) {k}")
    # DCP output casts too (chunked per rank).
    out = os.path.join(work, "cast_dcp")
    run(bin_path, "convert", src, "-o", out, "--world-size", 3, "--dtype", "bf16", "--quiet")
    loaded = {k: torch.empty_like(v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=out, no_dist=True)
    for k, v in state.items():
        bits_equal(loaded[k], v.to(torch.bfloat16) if v.is_floating_point() else v, f"DCP --dtype bf16 {k}")
    print("casts equal torch's Tensor.to bit for bit")


def check_ties(bin_path, work):
    torch.manual_seed(0)
    model = TiedLM()
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["wte.weight"].data_ptr()
    pt = os.path.join(work, "tied.pt")
    torch.save(sd, pt)
    dcp_dir = os.path.join(work, "tied_dcp")
    dcp.save({"model": sd}, checkpoint_id=dcp_dir, no_dist=True)
    for src, select in [(pt, []), (dcp_dir, ["--select", "model"])]:
        out = os.path.join(work, f"tied_{os.path.basename(src)}.safetensors")
        run(bin_path, "convert", src, "-o", out, *select, "--quiet")
        with safe_open(out, "pt") as f:
            keys = set(f.keys())
        assert keys == set(sd) - {"lm_head.weight"}, (src, sorted(keys))
        fresh = TiedLM()
        missing, unexpected = load_model(fresh, out, strict=True)  # save_pretrained-style loading
        assert fresh.lm_head.weight is fresh.wte.weight
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, sd[k]), (src, k)
        both = os.path.join(work, f"both_{os.path.basename(src)}.safetensors")
        run(bin_path, "convert", src, "-o", both, *select, "--keep-tied", "--quiet")
        assert set(load_file(both)) == set(sd), (src, "--keep-tied")
        # bf16 export of the tied model, the most common HF export.
        bf16 = os.path.join(work, f"bf16_{os.path.basename(src)}.safetensors")
        run(bin_path, "convert", src, "-o", bf16, *select, "--dtype", "bf16", "--quiet")
        got = load_file(bf16)
        for k, v in got.items():
            bits_equal(v, sd[k].to(torch.bfloat16) if sd[k].is_floating_point() else sd[k], f"bf16 {k}")
    # torch.save -> torch.save keeps torch's key order (registration order, not sorted) and the
    # tie itself: both names view one storage after torch.load, as in the source.
    again = os.path.join(work, "tied_again.pt")
    run(bin_path, "convert", pt, "-o", again, "--quiet")
    back = torch.load(again, weights_only=True)
    assert list(back) == list(sd), (list(back), list(sd))
    assert back["lm_head.weight"].untyped_storage().data_ptr() == back["wte.weight"].untyped_storage().data_ptr()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    print("tied weights exported once and load with load_model; .pt -> .pt keeps order and the tie")
    return dcp_dir


def fsdp_worker(rank, store, result):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = FSDP(TiedLM(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
    units = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDP) and module._handle is not None:
            fp = module._handle.flat_param
            prefix = name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
            units[prefix.removesuffix("_fsdp_wrapped_module").rstrip(".")] = {
                "numels_with_padding": list(fp._numels_with_padding),
                "is_padding_mask": list(fp._is_padding_mask),
                "fqns": list(fp._fqns),
            }
    if rank == 0:
        with open(result, "w") as f:
            json.dump(units, f)
    finish()


def check_layout(bin_path, work, dcp_dir):
    emitted = os.path.join(work, "derived.json")
    out = run(
        bin_path, "layout", "--from", dcp_dir, "--select", "model", "--units", r"h\.\d+", "--root-unit",
        "--exclude", "pos", "--world-size", 2, "--use-orig-params", "--emit-model", emitted, "--json",
    )
    derived = json.load(open(emitted))
    tied = {p["fqn"]: p.get("shared_with") for p in derived["params"]}
    assert tied["lm_head.weight"] == "wte.weight", tied
    ours = {u["unit_prefix"]: u for u in json.loads(out.stdout)["flat_params"]}
    result = os.path.join(work, "fsdp_units.json")
    spawn(fsdp_worker, (os.path.join(work, "store"), result), 2)
    theirs = json.load(open(result))
    assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
    for unit, t in theirs.items():
        o = ours[unit]
        assert o["numels_with_padding"] == t["numels_with_padding"], (unit, o["numels_with_padding"], t)
        assert o["is_padding_mask"] == t["is_padding_mask"], (unit, o, t)
    print("layout --from the tied DCP equals FSDP1's flat parameters")


def main():
    bin_path, work = sys.argv[1], sys.argv[2]
    check_casts(bin_path, work)
    dcp_dir = check_ties(bin_path, work)
    check_layout(bin_path, work, dcp_dir)
    print("ok")


if __name__ == "__main__":
    main()
