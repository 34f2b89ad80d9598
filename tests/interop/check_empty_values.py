"""Nothing lost: values with no tensor in them (empty dicts at any depth, empty lists and tuples,
None, nested containers, plain leaves) round-trip through `shardscope convert` to a `.pt` file.

Usage: python check_empty_values.py SHARDSCOPE_BIN WORK_DIR

torch writes a checkpoint shaped like Lightning's (`loops.fit_loop.state_dict = {}` beside the
model and its training state); `convert CKPT -o OUT.pt` must give back, under torch.load, exactly
what torch saved. Prints `ok` last.
"""
import subprocess
import sys
from pathlib import Path

import torch

from check_nothing_lost import same

BIN, WORK = sys.argv[1], Path(sys.argv[2])


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ckpt = {
        "state_dict": {"layer.weight": torch.randn(3, 2), "layer.bias": torch.randn(3)},
        "loops": {
            "fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1, "completed": 1}}},
            "validate_loop": {"state_dict": {}},
        },
        "callbacks": {},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}],
        # An optimizer's own `state_dict()`: `state` keyed by int ids stays a dict, not a list.
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}, 2: {"step": torch.tensor(1.0)}},
                  "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]},
        "by_id": {0: {}, 1: "x"},
        "lr_schedulers": [],
        "hparams": {"name": "x", "none": None, "sizes": (4, 5), "empty": ()},
        "epoch": 1,
    }
    src = WORK / "lightning_like.ckpt"
    torch.save(ckpt, src)
    out = WORK / "out.pt"
    r = subprocess.run([BIN, "convert", str(src), "-o", str(out), "-q"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"convert failed:\n{r.stdout}\n{r.stderr}")
    same(ckpt, torch.load(out, weights_only=True))
    print("every value round-trips, empty containers included")
    print("ok")


if __name__ == "__main__":
    main()
