"""Self-test of ranks.py (run by native-runner/tests/it/interop_ranks.rs): a rank that aborts at teardown
after its results are written does not fail the run; a rank that aborts or raises during its work
does, and names itself.

usage: check_ranks.py SHARDSCOPE_BIN WORKDIR
"""

import os
import sys
from pathlib import Path

import torch.distributed as dist
from ranks import finish, spawn


def worker(rank, store, out, when):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    if rank == 1 and when == "during":
        os.abort()  # before its results: the run must fail
    if rank == 1 and when == "raise":
        raise ValueError("boom in rank 1")
    Path(out, f"result{rank}").write_text("ok")
    finish()
    if rank == 0 and when == "teardown":
        os.abort()  # after its results: a teardown abort, tolerated


def run(work, when):
    d = Path(work, when)
    d.mkdir()
    spawn(worker, (str(d / "store"), str(d), when), 2, timeout_s=120)
    return d


def main():
    work = sys.argv[2]
    d = run(work, "teardown")
    assert sorted(p.name for p in d.glob("result*")) == ["result0", "result1"], list(d.iterdir())
    for when, expected in [("during", "signal SIGABRT"), ("raise", "boom in rank 1")]:
        try:
            run(work, when)
        except RuntimeError as e:
            assert "rank 1 of worker failed" in str(e) and expected in str(e), str(e)
        else:
            raise AssertionError(f"a rank failing {when} its work did not fail the run")
    print("ok")


if __name__ == "__main__":
    main()
