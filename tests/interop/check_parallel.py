"""`shardscope convert --part auto` launched by torchrun: three processes write HF shards and a DCP
directory together; the result equals a single-process run byte for byte, and torch reads it to the
values torch's own `dcp_to_torch_save` gives for the source.

usage: check_parallel.py SHARDSCOPE_BIN WORKDIR

`torch.distributed.run --standalone --nproc-per-node 3` starts three copies of a launcher that
execs the binary (torchrun sets RANK and WORLD_SIZE; `--standalone` picks a free port). The
processes never join a process group, so nothing can abort at teardown; the test is judged by the
files they leave, torchrun's exit code is only printed. Prints `ok` last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "examples", "fsdp2_dcp")
PROCS = 3

LAUNCHER = """import os, sys
os.execv(sys.argv[1], sys.argv[1:])
"""


def tree(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def convert(bin_path: str, dest: str, args: list[str]) -> None:
    cmd = [bin_path, "convert", SRC, "-o", dest, *args, "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise AssertionError(f"{cmd} failed ({out.returncode}): {out.stderr}")


def torchrun(bin_path: str, work: str, dest: str, args: list[str]) -> None:
    launcher = os.path.join(work, "launch.py")
    with open(launcher, "w") as f:
        f.write(LAUNCHER)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(PROCS), launcher,
        bin_path, "convert", SRC, "-o", dest, *args, "--part", "auto", "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(f"torchrun exit {out.returncode}")
    if not os.path.isdir(dest):
        raise AssertionError(f"torchrun wrote nothing at {dest}:\n{out.stdout}\n{out.stderr}")
    # Each process printed its JSON summary; exactly one wrote the index.
    summaries = []
    depth, start = 0, None
    for i, ch in enumerate(out.stdout):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0 and start is not None:
                summaries.append(json.loads(out.stdout[start : i + 1]))
    parts = sorted(s["part"] for s in summaries)
    assert parts == [f"{r}/{PROCS}" for r in range(PROCS)], (parts, out.stdout, out.stderr)
    assert sum(s["complete"] for s in summaries) == 1, summaries


def same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def flatten(obj, prefix: str = "", out=None) -> dict:
    """Dotted keys as DCP flattens a state dict (a list holding containers is traversed by index)."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj):
        items = enumerate(obj)
    else:
        out[prefix] = obj
        return out
    for k, v in items:
        flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    return out


def main() -> None:
    bin_path, work = sys.argv[1], sys.argv[2]
    ref_pt = os.path.join(work, "ref.pt")
    dcp_to_torch_save(SRC, ref_pt)
    ref = torch.load(ref_pt, weights_only=True)

    # HF shards of the model.
    args = ["--select", "model", "--max-shard-size", "3KB"]
    single = os.path.join(work, "hf_single")
    convert(bin_path, single, args)
    parted = os.path.join(work, "hf_parts")
    torchrun(bin_path, work, parted, args)
    assert tree(parted) == tree(single), "HF shards: torchrun parts differ from one run"
    with open(os.path.join(parted, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= PROCS, files
    loaded = {}
    for name in files:
        for k, v in load_file(os.path.join(parted, name)).items():
            assert index["weight_map"][k] == name, k
            loaded[k] = v
    same(loaded, ref["model"], "hf")

    # DCP for 3 ranks.
    args = ["--world-size", "3"]
    single = os.path.join(work, "dcp_single")
    convert(bin_path, single, args)
    parted = os.path.join(work, "dcp_parts")
    torchrun(bin_path, work, parted, args)
    assert tree(parted) == tree(single), "DCP: torchrun parts differ from one run"
    out_pt = os.path.join(work, "parts.pt")
    dcp_to_torch_save(parted, out_pt)
    # The output's keys are the flattened FQNs (no --nest), as `convert --world-size` writes them.
    same(torch.load(out_pt, weights_only=True), flatten(ref), "dcp")
    print("ok")


if __name__ == "__main__":
    main()
