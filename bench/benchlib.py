"""Shared pieces of the benchmark scripts in this folder (imported as `benchlib`; Python puts the
script's folder on `sys.path`, and spawned torch ranks inherit it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from torch import nn

LAYERS = 8
BIG, SMALL = 8192, 4096  # one [8192, 4096] float32 weight = 128 MiB


class Model(nn.Module):
    """`LAYERS` bias-free Linear layers of 128 MiB each, alternately [BIG, SMALL] and [SMALL, BIG]."""

    def __init__(self) -> None:
        super().__init__()
        dims = [(SMALL, BIG) if i % 2 == 0 else (BIG, SMALL) for i in range(LAYERS)]
        self.layers = nn.Sequential(*[nn.Linear(a, b, bias=False) for a, b in dims])

    def forward(self, x):
        return self.layers(x)


def description() -> dict:
    """The model description (`shardscope layout --model` JSON) of `Model`."""
    params = []
    for i in range(LAYERS):
        shape = [BIG, SMALL] if i % 2 == 0 else [SMALL, BIG]
        params.append({"fqn": f"layers.{i}.weight", "shape": shape, "dtype": "float32"})
    return {"params": params, "units": [f"layers.{i}" for i in range(LAYERS)] + [""], "ignored": []}


def timed(cmd: list[str], warm: list[str] = (), env: dict | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of `cmd`, from /usr/bin/time -v. Dirty pages of earlier
    commands are flushed first, so that no command pays for another's writeback; the files `warm`
    are read into the page cache again first (a large earlier run can evict them), so that every
    command starts from the same state."""
    os.sync()
    if warm:
        subprocess.run(["cat", *warm], stdout=subprocess.DEVNULL, check=True)
    # Wall time from this process's clock (time -v prints hundredths: 10% of a 0.1 s command);
    # it includes starting /usr/bin/time (about a millisecond).
    start = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"{cmd} failed:\n{out.stderr}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr)
    return (wall, int(rss.group(1)) * 1024)
