"""An optimizer is found by what it holds, whatever its item is called.

Usage: python check_optimizer_by_content.py SHARDSCOPE_BIN WORK_DIR

tests/fixtures/trainer_folders/one_file_per_rank: FSDP2 per-rank files `checkpoint_{r}.pt`, each
`{"model": ..., "optimizer": ...}` (DTensor shards; gen_one_file_per_rank.py). `shardscope convert
ck -o full.pt` must hold both, as torch's own full state dicts (`expected/full.pt`): every model
tensor, every optimizer moment and step bit for bit, and the param groups equal.
"""
import subprocess
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "trainer_folders" / "one_file_per_rank"


def same(got, want, where):
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            raise SystemExit(f"{where}: {got!r} is not like torch's {want.dtype} {tuple(want.shape)}")
        if not torch.equal(got.view(torch.uint8) if got.dim() else got, want.view(torch.uint8) if want.dim() else want):
            raise SystemExit(f"{where}: values differ")
    elif isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            raise SystemExit(f"{where}: keys {sorted(got) if isinstance(got, dict) else got!r} != torch's {sorted(want)}")
        for k in want:
            same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise SystemExit(f"{where}: {got!r} != torch's {want!r}")
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{where}[{i}]")
    elif got != want:
        raise SystemExit(f"{where}: {got!r} != torch's {want!r}")


def main():
    bin_, work = sys.argv[1], Path(sys.argv[2])
    out = work / "full.pt"
    done = subprocess.run([bin_, "convert", str(FIXTURE / "ck"), "-o", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"convert failed:\n{done.stderr}")
    if "not written" in done.stderr:
        raise SystemExit(f"convert left entries out:\n{done.stderr}")
    got = torch.load(out, weights_only=True)
    want = torch.load(FIXTURE / "expected" / "full.pt", weights_only=True)
    same(got, want, "full.pt")
    print(f"{len(want['model'])} model tensors and the optimizer `optimizer` "
          f"({len(want['optimizer']['state'])} parameters' state) equal torch's full state dicts")
    print("ok")


if __name__ == "__main__":
    main()
