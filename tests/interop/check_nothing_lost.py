"""Nothing lost, as a category: every checkpoint among the fixtures (tests/fixtures, examples) that
`shardscope convert` accepts goes to a `.pt`, and what torch loads from that `.pt` equals what
torch's own tools read from the source, value by value: tensors (dtype, shape, bytes), empty dicts
and lists, tuples, None, nested containers, ints, floats, strings, keys and their order (an
`OrderedDict` may come back a `dict`; FSDP1 wrapper names come back clean, as torch's
`clean_tensor_name` cleans them).

The source, as torch reads it:
- a `torch.save` file: `torch.load`;
- a DCP directory: `dcp_to_torch_save` (torch's consolidation), then `torch.load`, with the
  `torch.save` files beside it (Lightning's `meta.pt`, Megatron-core's `common.pt`) at the top;
- a safetensors file: `safetensors.torch.load_file`;
- FSDP2 per-rank files: each rank's `torch.load`, every DTensor joined from its shards, the
  optimizer keyed by the model's FQNs (what `get_*_state_dict(full_state_dict=True)` gives).

Checkpoints are found by what is on disk: a directory with `.metadata` (DCP) or a DeepSpeed
`latest` is one checkpoint, a directory of per-rank files (named alike but for a number) is one,
and any other checkpoint file is one. A checkpoint `convert` refuses must be in `REFUSED`, with
why; one torch's own tools cannot read here is in `NOT_LOADABLE`, with where its conversion is
checked against torch instead; a loss found and not fixed yet is in `KNOWN_LOSSES` (and must keep
showing). Anything else that fails fails the script, and so does a list entry that no longer
applies.

Usage: python check_nothing_lost.py SHARDSCOPE_BIN WORK_DIR. Prints `ok` last.
"""
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp._common_utils import clean_tensor_name

BIN, WORK = sys.argv[1], Path(sys.argv[2])
ROOT = Path(__file__).resolve().parents[2]
CKPT_EXT = {".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".tar"}
RANK = re.compile(r"(rank|_)\d+")

# Refused by `convert`, on purpose: relative path -> why.
F = "tests/fixtures/"
REFUSED = {
    **{F + "malformed/" + n: "malformed on purpose (tests/tests/it/formats_malformed.rs)" for n in [
        "memo_bomb.pt", "missing_storage.pt", "overflow.safetensors", "recursive.pt",
        "view_past_storage.pt", "zip_bomb.pt"]},
    F + "doctor/truncated.pt": "cut short on purpose (doctor finds it)",
    F + "doctor/lfs_pointer.pt": "a Git LFS pointer, not a checkpoint (doctor names it)",
    F + "doctor/dcp_missing": "a DCP whose rank file is missing, on purpose",
    F + "doctor/local": "FSDP1 LOCAL per-rank files: need --model (their layout)",
    F + "doctor/tp_ranks": "tensor-parallel DTensors (StridedShard on a 2-D mesh) convert does not place: refused, named",
    F + "formats/expected": "expected values of several fixtures side by side, not one checkpoint (each file is one)",
    F + "trainer_folders/tc_items_ws1/x_0.bin": "a plain pickle, not torch.save: shardscope never runs pickles",
    F + "trainer_folders/tc_raw/dataloader": "plain pickles, not torch.save: shardscope never runs pickles",
    F + "trainer_folders/tc_safetensors/model":
        "one item of the tc_safetensors folder (replicated shards its metadata.pkl places; the folder is the checkpoint)",
    F + "dtypes/dcp_rot13": "a DCP transform (`stream.rot13/1`) shardscope cannot decode, on purpose",
    F + "formats/hf_distributed/shard-00002-model-00001-of-00001.safetensors":
        "one rank's piece of a distributed HF save (the folder is the checkpoint)",
    F + "formats/fsdp1_orig0": "three FSDP1 file sets at once (full, local, sharded): --model-files chooses",
    F + "formats/fsdp1_orig1": "three FSDP1 file sets at once (full, local, sharded): --model-files chooses",
    F + "fsdp2_optim/bad_id": "an optimizer id outside the model, on purpose",
    F + "fsdp2_optim/bad_names/rank1_optim.pt": "one rank's optimizer file without rank 0's, on purpose",
    F + "trainer_folders/verl_fsdp1": "FSDP1 flat optimizer pieces beside DTensors: needs --model (the message says so)",
    F + "trainer_folders/expected/tc_safetensors_loaded.pt":
        "written by torch with zip records shardscope's reader refuses (an open question, not a loss)",
    F + "trainer_folders/step-2":
        "torchtitan's train_state holds io.BytesIO objects, which a weights_only .pt cannot hold: refused, named",
}
# FSDP1 LOCAL per-rank files: their tensors have no global shape without --model.
for case in ["nested_ws2_uop0", "nested_ws2_uop1", "tied_ws2_uop0"]:
    REFUSED[F + f"optim/{case}"] = "FSDP1 LOCAL per-rank files: need --model (their layout)"
# Accepted, but torch's own tools cannot give the source's values here (DeepSpeed's loaders need
# deepspeed; the torch_checkpointing library, accelerate and verl folders need their libraries):
# path -> where the conversion is checked against torch's full state dicts instead.
NOT_LOADABLE = {
    **{F + f"deepspeed/{c}": "native-runner/tests/it/deepspeed.rs (zero_to_fp32's output)" for c in [
        "zero1_bf16", "zero1_fp32", "zero2_bf16", "zero2_fp32", "zero2_fp32_ws3", "zero3_bf16",
        "zero3_bf16_ws3", "zero3_fp32", "zero1_bf16_padded", "zero2_fp32_padded"]},
    **{F + f"deepspeed/{c}": "native-runner/tests/it/deepspeed_universal.rs (DeepSpeed's universal files)"
       for c in ["universal_zero2_bf16", "universal_zero3_fp32"]},
    **{F + f"trainer_folders/{c}": "native-runner/tests/it/trainer_sets.rs (expected/tc_full_*.pt)" for c in [
        "tc_default", "tc_items", "tc_raw", "tc_resharder", "tc_safetensors"]},
    F + "doctor/unsafe.pt": "its pickle calls a function when loaded: torch.load would run it (doctor's fixture)",
    F + "trainer_folders/checkpoint-2": "trainer_sets::accelerate_folders_are_read_whole",
    F + "trainer_folders/verl_fsdp2": "trainer_sets::extra_state_holding_float_tensors_stays_extra",
    F + "trainer_folders/one_file_per_rank/ck": "tests/interop/check_optimizer_by_content.py",
}
# Losses this check finds that are not fixed yet: path -> what is lost (the check fails when one
# of them no longer shows, so that the list only shrinks).
KNOWN_LOSSES: dict = {}

# Written by torch from one state dict as another fixture (gen_formats.py saves `state` both
# ways), which torch's `dcp_to_torch_save` reads: path -> that fixture.
SAME_STATE = {F + "formats/dcp_safetensors": F + "formats/dcp_torch_save"}


def same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor != {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        raw = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(raw(a), raw(b)), f"{path}: values differ"
        return
    # The one type not kept: an `OrderedDict` (what `state_dict()` returns) comes back a `dict`, as
    # the reader keeps the two alike (core::formats::pickle::torch_classes); same keys, same order.
    kind = lambda v: dict if isinstance(v, collections.OrderedDict) else type(v)  # noqa: E731
    assert kind(a) is kind(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: nan != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def clean_names(v):
    """Keys as shardscope names them: FSDP1's wrapper names removed by torch's own
    `clean_tensor_name` (docs: FQNs are clean, raw names kept in `inspect`)."""
    if isinstance(v, dict):
        return type(v)((clean_tensor_name(k) if isinstance(k, str) else k, clean_names(x)) for k, x in v.items())
    return v


def rank_pattern(stem: str):
    """`stem` with its last number as `{r}` (`rank1_model` -> `rank{r}_model`), or None."""
    m = re.fullmatch(r"(.*?)(\d+)(\D*)", stem)
    return (m.group(1) + "{r}" + m.group(3), int(m.group(2))) if m else None


def rank_sets(names: list) -> dict:
    """Checkpoint files named alike but for their last number, two or more: pattern -> {rank: name}."""
    sets: dict = {}
    for n in names:
        p = rank_pattern(Path(n).stem)
        if p and Path(n).suffix in CKPT_EXT:
            sets.setdefault(p[0], {})[p[1]] = n
    return {k: v for k, v in sets.items() if len(v) > 1 and sorted(v) == list(range(len(v)))}


def candidates():
    """Every checkpoint: a DCP or DeepSpeed directory (ZeRO or universal), a directory of per-rank files, and every
    checkpoint file not part of a DCP or DeepSpeed directory (a per-rank file alone is one rank's
    piece, not a checkpoint)."""
    for top in [ROOT / "tests" / "fixtures", ROOT / "examples"]:
        taken = set()
        for d in sorted([top, *(p for p in top.rglob("*") if p.is_dir())]):
            if any(d.is_relative_to(t) for t in taken):
                continue
            names = sorted(p.name for p in d.iterdir() if p.is_file())
            if ".metadata" in names or "latest" in names or "latest_universal" in names:
                taken.add(d)
                yield d
                continue
            ranked = {n for v in rank_sets(names).values() for n in v.values()}
            if ranked:
                yield d
            for n in names:
                if Path(n).suffix in CKPT_EXT and n not in ranked:
                    yield d / n


def gather(states: list, path: str = ""):
    """The full value of FSDP2 per-rank states: each DTensor joined from its shards (the ranks of
    the first replica group along a 2-D HSDP mesh), everything else as rank 0 holds it."""
    v = states[0]
    if hasattr(v, "_local_tensor") and hasattr(v, "placements"):
        mesh = v.device_mesh.mesh
        ranks = (mesh if mesh.ndim == 1 else mesh[0]).tolist()
        shard = v.placements[-1]
        if not shard.is_shard():
            return v._local_tensor
        return torch.cat([states[r]._local_tensor for r in ranks], dim=shard.dim)
    if isinstance(v, dict):
        return type(v)((k, gather([s[k] for s in states], f"{path}.{k}")) for k in v)
    if isinstance(v, (list, tuple)) and any(isinstance(x, (torch.Tensor, dict, list, tuple)) for x in v):
        return type(v)(gather([s[i] for s in states], f"{path}.{i}") for i in range(len(v)))
    return v


def per_rank_fsdp2(d: Path):
    """FSDP2 per-rank files (`rank{r}_{class}.pt` or `rank{r}.pt`) as torch's full state dicts:
    `{class: ...}`, DTensors gathered, the optimizer (found by `state` + `param_groups`) keyed by
    the model's DTensor keys in order, as `get_optimizer_state_dict(full_state_dict=True)` keys it."""
    names = sorted(p.name for p in d.iterdir() if p.is_file())
    sets = rank_sets(names)
    if any(Path(n).suffix in CKPT_EXT for n in names if not any(n in v.values() for v in sets.values())):
        return None
    # One set: its files are the state; `rank{r}_NAME` sets: the state is `{NAME: ...}`.
    if len(sets) == 1:
        (files,) = sets.values()
        states = [torch.load(d / files[r], weights_only=False) for r in sorted(files)]
    elif all(re.fullmatch(r"rank\{r\}_\w+", k) for k in sets):
        states = [{k.removeprefix("rank{r}_"): torch.load(d / v[r], weights_only=False) for k, v in sets.items()} for r in range(len(next(iter(sets.values()))))]
    else:
        return None
    if not isinstance(states[0], dict) or not any(hasattr(v, "_local_tensor") for v in states[0].get("model", states[0]).values()):
        return None
    model = states[0].get("model", states[0])
    fqns = [k for k, v in model.items() if hasattr(v, "_local_tensor")]
    full = gather(states)
    for k, v in full.items():
        if isinstance(v, dict) and set(v) == {"state", "param_groups"}:
            v["state"] = {fqns[i]: s for i, s in v["state"].items()}
            for g in v["param_groups"]:
                g["params"] = [fqns[i] for i in g["params"]]
    return full


def source_values(src: Path):
    if str(src.relative_to(ROOT)) in SAME_STATE:
        return source_values(ROOT / SAME_STATE[str(src.relative_to(ROOT))])
    if src.is_file() and src.suffix == ".safetensors":
        # A safetensors header is a map: its names have no order to keep.
        return "safetensors", dict(sorted(load_file(src).items()))
    if src.is_file():
        return "torch.load", torch.load(src, weights_only=False, map_location="cpu")
    if (src / ".metadata").is_file():
        out = WORK / "dcp_to_torch_save.pt"
        out.unlink(missing_ok=True)
        # The fixtures are ours: DCP's reader may unpickle the bytes items torch wrote (an
        # object); only while torch reads the source, never for the `.pt` under test.
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        try:
            dcp_to_torch_save(str(src), str(out))
        finally:
            del os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]
        full = torch.load(out, weights_only=False)
        # `torch.save` files beside the DCP (Lightning's `meta.pt`, Megatron-core's `common.pt`)
        # belong to the checkpoint's top level.
        for f in sorted(src.iterdir()):
            if f.suffix in CKPT_EXT:
                full.update(torch.load(f, weights_only=False))
        return "dcp_to_torch_save + the torch.save files beside", full
    full = per_rank_fsdp2(src)
    if full is not None:
        return "per-rank torch.load, DTensors joined", full
    return None, None


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    checked, problems, seen = [], [], set()
    for i, src in enumerate(candidates()):
        rel = str(src.relative_to(ROOT))
        seen.add(rel)
        out = WORK / f"{i}.pt"
        r = subprocess.run([BIN, "convert", str(src), "-o", str(out), "-q"], capture_output=True, text=True)
        if rel in REFUSED:
            if r.returncode == 0:
                problems.append(f"{rel}: listed as refused ({REFUSED[rel]}) but converts")
            continue
        if r.returncode != 0:
            problems.append(f"{rel}: convert refused it: {r.stderr.strip()[:300]}")
            continue
        if rel in NOT_LOADABLE:
            continue
        try:
            how, want = source_values(src)
        except BaseException as e:  # noqa: BLE001 (torch's checkpoint errors are BaseExceptions)
            problems.append(f"{rel}: torch cannot read it: {type(e).__name__}: {str(e)[:200]}")
            continue
        if how is None:
            problems.append(f"{rel}: no torch reading of it here; list it in NOT_LOADABLE with where it is checked")
            continue
        got = torch.load(out, weights_only=True)
        if how == "safetensors":
            got = dict(sorted(got.items()))
        try:
            same(clean_names(want), got)
            if rel in KNOWN_LOSSES:
                problems.append(f"{rel}: listed as a known loss ({KNOWN_LOSSES[rel]}) but round-trips now")
            checked.append(rel)
        except (AssertionError, RuntimeError) as e:
            if KNOWN_LOSSES.get(rel, "\0") not in str(e):
                problems.append(f"{rel} ({how}): {e}")
    stale = sorted((set(REFUSED) | set(NOT_LOADABLE) | set(SAME_STATE) | set(KNOWN_LOSSES)) - seen)
    problems += [f"{p}: listed, but no such checkpoint among the fixtures" for p in stale]
    for p in problems:
        print("PROBLEM", p)
    assert not problems, f"{len(problems)} problems"
    print(f"{len(checked)} checkpoints round-trip; {len(REFUSED)} refused on purpose; {len(NOT_LOADABLE)} checked elsewhere; {len(KNOWN_LOSSES)} known losses")
    print("ok")


if __name__ == "__main__":
    main()
