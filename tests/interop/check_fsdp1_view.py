"""Torch side of the FSDP1 per-rank layout view test (native-runner/tests/it/fsdp1_view.rs).

usage:
  check_fsdp1_view.py same OURS.pt TORCH.pt
      `torch.load` both (weights_only) and require the same nested structure, tensors equal bit
      for bit with equal dtype and shape, other values equal, and the same key order in the top
      two levels of dicts (a full state dict's keys; `state` and `param_groups`, and the FQNs of
      `state`). Below that, torch's own order is Python's set order, random per process.
  check_fsdp1_view.py dcp OURS_DCP_DIR FULL_MODEL.pt
      `dcp_to_torch_save` the DCP we wrote (torch's own reader) and require its `model` subtree
      (`--nest model`) to equal torch's FULL_STATE_DICT.
Prints "ok" on success; exits 1 with every difference otherwise.
"""

import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def compare(a, b, path, errors, ordered=99):
    if isinstance(b, dict):
        if not isinstance(a, dict):
            errors.append(f"{path}: ours is {type(a).__name__}, torch's a dict")
            return
        if set(a) != set(b):
            errors.append(f"{path}: keys differ: only ours {sorted(map(str, set(a) - set(b)))}, only torch's {sorted(map(str, set(b) - set(a)))}")
        elif ordered > 0 and list(a) != list(b):
            errors.append(f"{path}: key order differs: ours {list(a)[:6]}..., torch's {list(b)[:6]}...")
        for k in b:
            if k in a:
                compare(a[k], b[k], f"{path}.{k}", errors, ordered - 1)
    elif isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or len(a) != len(b):
            errors.append(f"{path}: ours {a!r}, torch's {b!r}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{path}[{i}]", errors, ordered - 1)
    elif isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            errors.append(f"{path}: ours is {type(a).__name__}, torch's a tensor")
        elif a.dtype != b.dtype or a.shape != b.shape:
            errors.append(f"{path}: ours {a.dtype} {tuple(a.shape)}, torch's {b.dtype} {tuple(b.shape)}")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            errors.append(f"{path}: values differ")
    elif a != b:
        errors.append(f"{path}: ours {a!r}, torch's {b!r}")


def main():
    mode = sys.argv[1]
    errors = []
    if mode == "same":
        ours = torch.load(sys.argv[2], weights_only=True)
        theirs = torch.load(sys.argv[3], weights_only=True)
        compare(ours, theirs, "", errors, ordered=2)
    elif mode == "dcp":
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "full.pt"
            dcp_to_torch_save(sys.argv[2], out)
            ours = torch.load(out, weights_only=True)
        model = torch.load(sys.argv[3], weights_only=True)
        compare(ours.get("model"), model, "model", errors, ordered=0)
    else:
        raise SystemExit(f"unknown mode {mode}")
    if errors:
        print("\n".join(errors))
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
