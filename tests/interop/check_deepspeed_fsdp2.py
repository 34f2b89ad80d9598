"""Interop test of the way from DeepSpeed ZeRO to FSDP2 (run by native-runner/tests/it/deepspeed.rs).

usage: check_deepspeed_fsdp2.py SHARDSCOPE_BIN WORKDIR

Fixtures: tests/fixtures/deepspeed (written by DeepSpeed 0.19.8 itself, gen_deepspeed.py): ZeRO-1/2/3
in fp32 and bf16, on 2 and 3 ranks, a tied weight (`head.weight` is `embed.weight`), a frozen
parameter (`frozen.weight`), two buffers and two parameter groups; and DeepSpeed's universal
checkpoints of `zero2_bf16` and `zero3_fp32` (ds_to_universal, gen_universal.py), checked against
the references of the save they were converted from. ZeRO-1's frozen parameter, which zero_to_fp32
leaves out, is compared with the live engine's module (`frozen.<name>` in the live file).

For N = 2 and 3: `shardscope convert <case> -o dcp --world-size N` for every case, then one launch of
N spawned gloo ranks (CPU) checks all of them. For each case, each rank builds a fresh FSDP2 TinyLM
(the generator's own class, other seed) and a fresh AdamW over the generator's parameter groups
(other hyperparameters), loads the DCP the documented way:

    state = get_model_state_dict(model)
    state["optimizer"] = get_optimizer_state_dict(model, optim)
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, {k: v for k, v in state.items() if k != "optimizer"})
    set_optimizer_state_dict(model, optim, state["optimizer"])

and compares with what DeepSpeed wrote, bit for bit:
- every model entry (parameters, the tie, the frozen parameter, buffers) with the state dict of
  DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` (expected/<case>.zero_to_fp32.safetensors;
  a frozen parameter DeepSpeed kept in bf16 is compared as torch casts it), and every trainable
  parameter with the live engine's `safe_get_full_fp32_param` (expected/<case>.live.safetensors);
- every trainable parameter's `exp_avg` / `exp_avg_sq` with the live engine's
  `safe_get_full_optimizer_state`; its `step` (a tensor) with the step DeepSpeed's wrapped torch
  optimizer saved for the parameter's group (read from DeepSpeed's optimizer file of rank 0); the
  frozen parameter has no optimizer state; each group's hyperparameters are DeepSpeed's;
then runs one more training step, whose loss must be finite and differ from the loss before it.

Negative control: a copy of zero3_fp32 in which one float of rank 1's `exp_avg` (a value of
`embed.weight`) is changed in DeepSpeed's file; the same check must report exactly that moment.

Results are written per rank before the teardown (ranks.finish), so a gloo abort at teardown
cannot fail the test. Exits non-zero with a message on the first mismatch; prints "ok" last.
"""

import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "deepspeed"
sys.path.insert(0, str(FIXTURES))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_deepspeed import TinyLM, param_groups  # noqa: E402
from ranks import finish, spawn  # noqa: E402

# The cases gen_deepspeed.py wrote (its cases.txt, which the Rust tests read too).
CASES = (FIXTURES / "cases.txt").read_text().split()
CORRUPT = "zero3_fp32_corrupt"
# DeepSpeed's universal checkpoints (ds_to_universal, gen_universal.py) of two cases.
UNIVERSAL = {"universal_zero2_bf16": "zero2_bf16", "universal_zero3_fp32": "zero3_fp32"}
# The corrupted copy and the universal checkpoints are checked against their source's references.
CASES_DIR = {CORRUPT: "zero3_fp32", **UNIVERSAL}


class _DeepSpeedObject:
    """Stands for DeepSpeed's own classes in its optimizer files (loss scaler, stage enum): their
    fields are not needed here, and DeepSpeed is not installed where this test runs."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.__dict__["_state"] = state


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.split(".")[0] == "deepspeed":
            return _DeepSpeedObject
        return super().find_class(module, name)


_DS_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")


def deepspeed_file(path):
    """A file DeepSpeed wrote, loaded by torch with DeepSpeed's classes stood in for."""
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_DS_PICKLE)


def deepspeed_groups(case_dir):
    """What DeepSpeed saved about the optimizer: per group, its parameter names (`param_shapes` of
    the model states), the step its torch optimizer holds and its hyperparameters (rank 0's
    optimizer file)."""
    tag = case_dir / (case_dir / "latest").read_text().strip()
    model_file = tag / "mp_rank_00_model_states.pt"
    if not model_file.exists():
        model_file = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shapes = deepspeed_file(model_file)["param_shapes"]
    optim_file = next(tag.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    osd = deepspeed_file(optim_file)["optimizer_state_dict"]
    base = osd.get("base_optimizer_state") or osd["optimizer_state_dict"]
    groups = []
    for g, names in enumerate(shapes):
        hyper = {k: v for k, v in base["param_groups"][g].items() if k != "params"}
        groups.append({"names": list(names), "step": base["state"][g]["step"], "hyper": hyper})
    return groups


def expected(case):
    from safetensors.torch import load_file

    src = CASES_DIR.get(case, case)
    exp = FIXTURES / "expected"
    z2f = load_file(exp / f"{src}.zero_to_fp32.safetensors")
    live = load_file(exp / f"{src}.live.safetensors")
    # The model shardscope gives: zero_to_fp32's, and the frozen parameters it leaves out (ZeRO-1:
    # DeepSpeed records none but `module`'s), as the live engine's module holds them.
    for key, value in live.items():
        if key.startswith("frozen.") and key[len("frozen."):] not in z2f:
            z2f[key[len("frozen."):]] = value
    return {
        "zero_to_fp32": z2f,
        "live": live,
        "groups": deepspeed_groups(FIXTURES / src),
    }



def build(world_size):
    """The generator's TinyLM under FSDP2 (two inner groups and the root; the tie and the frozen
    parameter in the root), and a fresh AdamW over the generator's parameter groups with other
    hyperparameters and another seed than DeepSpeed's: the load must overwrite all of them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234)
    mesh = init_device_mesh("cpu", (world_size,))
    model = TinyLM()
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(param_groups(model), lr=0.5, betas=(0.5, 0.6), eps=1e-3)
    return model, optim


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def bit_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def describe(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    x, y = a.reshape(-1), b.reshape(-1)
    i = int((x.view(torch.uint8).reshape(x.numel(), -1) != y.view(torch.uint8).reshape(y.numel(), -1)).any(1).nonzero()[0])
    return f"element {i} is {x[i].item()!r}, DeepSpeed's {y[i].item()!r}"


def as_tuple(x):
    return tuple(x) if isinstance(x, (list, tuple)) else x


def loss_of(model):
    ids = torch.arange(10).reshape(2, 5) % 11
    return model(ids).float().pow(2).mean()


def check_case(world_size, case, dcp_dir):
    """Loads `dcp_dir` into a fresh FSDP2 model + AdamW and compares it with DeepSpeed's values.
    Returns the mismatches (collectives: every rank runs the same calls)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    want = expected(case)
    z2f, live = want["zero_to_fp32"], want["live"]
    model, optim = build(world_size)
    errors = []
    state = get_model_state_dict(model)
    # What the conversion leaves out is not in the DCP either (nothing, since ZeRO-1's frozen
    # parameters are taken from `module`: `expected` adds them to zero_to_fp32's).
    left_out = sorted(k for k in state if k not in z2f)
    kept = {k: full(state[k]).detach().clone() for k in left_out}
    in_dcp = set(dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata)
    if set(left_out) & in_dcp:
        errors.append(f"in the DCP but not in zero_to_fp32's state dict: {sorted(set(left_out) & in_dcp)}")
    for k in left_out:
        del state[k]
    state["optimizer"] = get_optimizer_state_dict(model, optim)
    dcp.load(state, checkpoint_id=dcp_dir)
    options = StateDictOptions(strict=not left_out)
    model_sd = {k: v for k, v in state.items() if k != "optimizer"}
    missing = set_model_state_dict(model, model_sd, options=options).missing_keys
    if sorted(missing) != left_out:
        errors.append(f"model keys not loaded: {sorted(missing)}, expected {left_out}")
    set_optimizer_state_dict(model, optim, state["optimizer"])

    msd = model.state_dict()
    for key in left_out:
        if not bit_equal(full(msd[key]).detach(), kept[key]):
            errors.append(f"{key} (not in the checkpoint) changed")
    if sorted(set(msd) - set(left_out)) != sorted(z2f):
        errors.append(f"model keys {sorted(msd)} vs zero_to_fp32's {sorted(z2f)}")
    for key in sorted(set(msd) & set(z2f)):
        ours = full(msd[key]).detach()
        ref = z2f[key].to(ours.dtype)  # a frozen parameter kept in bf16: cast as torch's copy_ does
        if not bit_equal(ours, ref):
            errors.append(f"model {key}: {describe(ours, ref)} (zero_to_fp32)")
        if f"param.{key}" in live and not bit_equal(ours, live[f"param.{key}"]):
            errors.append(f"model {key}: {describe(ours, live[f'param.{key}'])} (safe_get_full_fp32_param)")
    if model.embed.weight is not model.head.weight:
        errors.append("the tie embed.weight / head.weight is broken")

    group_of = {n: g for g in want["groups"] for n in g["names"]}
    named = dict(model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    if trainable != set(group_of):
        errors.append(f"trainable parameters {sorted(trainable)} vs DeepSpeed's param_shapes {sorted(group_of)}")
    for name, p in named.items():
        st = optim.state.get(p, {})
        if not p.requires_grad:
            if st:
                errors.append(f"frozen {name} has optimizer state {sorted(st)}")
            continue
        for moment in ("exp_avg", "exp_avg_sq"):
            if moment not in st:
                errors.append(f"optimizer {name}: no {moment}")
                continue
            ours = full(st[moment]).detach()
            ref = live[f"{moment}.{name}"]
            if not bit_equal(ours, ref):
                errors.append(f"optimizer {name} {moment}: {describe(ours, ref)} (safe_get_full_optimizer_state)")
        step = st.get("step")
        ds_step = group_of[name]["step"] if name in group_of else None
        if not isinstance(step, torch.Tensor) or ds_step is None or not bit_equal(full(step), ds_step):
            errors.append(f"optimizer {name} step: {step!r} vs DeepSpeed's {ds_step!r}")
    for g, (ours, ds) in enumerate(zip(optim.param_groups, want["groups"])):
        ids = {id(p) for p in ours["params"]}
        if ids != {id(named[n]) for n in ds["names"] if n in named}:
            errors.append(f"param_groups.{g}: other parameters than DeepSpeed's {ds['names']}")
        for k, v in ds["hyper"].items():
            # A tuple and a list of equal items are the same setting (`betas`).
            if as_tuple(ours.get(k)) != as_tuple(v):
                errors.append(f"param_groups.{g}.{k}: {ours.get(k)!r} vs DeepSpeed's {v!r}")

    # One more training step from the loaded state.
    before = loss_of(model)
    before.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        after = loss_of(model)
    b, a = float(before.detach()), float(after)
    if not (math.isfinite(b) and math.isfinite(a)) or a == b:
        errors.append(f"one more training step: loss {b} -> {a}")
    for name, p in named.items():
        if not torch.isfinite(full(p.detach())).all():
            errors.append(f"{name} is not finite after one more step")
    return errors


def load_worker(rank, world_size, store, jobs, result):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    lines = []
    for case, dcp_dir in jobs:
        errors = check_case(world_size, case, dcp_dir)
        lines.append(f"{case}\t" + ("ok" if not errors else " | ".join(errors)))
    Path(f"{result}.{rank}").write_text("\n".join(lines) + "\n")
    finish()


def convert(bin_path, *args):
    out = subprocess.run([bin_path, "convert", *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"shardscope convert {' '.join(map(str, args))} failed:\n{out.stderr}")


def corrupt_copy(work):
    """zero3_fp32 with one float of rank 1's `exp_avg` of group 0 changed in DeepSpeed's file (its
    first element: a value of `embed.weight`, not padding)."""
    dst = work / CORRUPT
    shutil.copytree(FIXTURES / "zero3_fp32", dst)
    path = dst / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    osd = deepspeed_file(path)["optimizer_state_dict"]["optimizer_state_dict"]
    avg = osd["state"][0]["exp_avg"].contiguous()
    raw = bytearray(path.read_bytes())
    old = avg.numpy().tobytes()
    at = raw.find(old)
    if at < 0 or raw.find(old, at + 1) >= 0:
        sys.exit(f"negative control: rank 1's exp_avg is not found once in {path}")
    raw[at : at + 4] = torch.tensor([float(avg[0]) * 2 + 1.0]).numpy().tobytes()
    path.write_bytes(bytes(raw))
    return dst


def main():
    bin_path, work = sys.argv[1], Path(sys.argv[2])
    corrupt = corrupt_copy(work)
    for n in (2, 3):
        jobs = []
        for case in CASES + list(UNIVERSAL) + [CORRUPT]:
            src = corrupt if case == CORRUPT else FIXTURES / case
            dcp_dir = work / f"{case}_dcp{n}"
            convert(bin_path, src, "-o", dcp_dir, "--world-size", n, "-q")
            jobs.append((case, str(dcp_dir)))
        result = work / f"result{n}"
        store = os.path.join(tempfile.mkdtemp(prefix="shardscope-store-"), "store")
        spawn(load_worker, (n, store, jobs, str(result)), n)
        for r in range(n):
            lines = dict(line.split("\t", 1) for line in Path(f"{result}.{r}").read_text().splitlines())
            for case in CASES + list(UNIVERSAL):
                if lines.get(case) != "ok":
                    sys.exit(f"{case} as a DCP for {n} ranks, rank {r}: {lines.get(case)}")
            # The negative control must fail on the changed moment, and on nothing else.
            bad = lines.get(CORRUPT, "")
            if bad == "ok" or not all("embed.weight exp_avg:" in e for e in bad.split(" | ")):
                sys.exit(f"negative control ({CORRUPT}, {n} ranks, rank {r}): expected only an embed.weight exp_avg mismatch, got: {bad}")
        print(f"{len(CASES)} DeepSpeed checkpoints and {len(UNIVERSAL)} universal ones as DCPs for {n} ranks load into FSDP2 (model + AdamW) as DeepSpeed wrote them and train on; a changed moment is caught")
    print("ok")


if __name__ == "__main__":
    main()
