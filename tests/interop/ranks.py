"""Spawning gloo ranks for the interop tests, judged by their results and not by their teardown.

On a loaded machine a gloo rank can abort in `destroy_process_group()` or at interpreter exit
("terminate called without an active exception", SIGABRT) after it has done all its work. With
`mp.spawn(join=True)` that abort fails the test, and it also kills the other ranks, possibly before
they wrote their results. Here:

- every worker calls `finish()` once its results are written: a barrier (so every rank's results are
  on disk), then a per-rank "done" marker, then the teardown;
- `spawn()` waits for every rank itself (no rank is killed because another one exited) and fails
  when a rank exits non-zero *without* its marker (an exception, an abort or a crash during the
  work), naming the rank and, for an exception, its traceback. A non-zero exit after the marker is
  a teardown abort: it is reported on stderr and does not fail the test.
"""

import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

_MARKER = None


def finish():
    """Called by every rank after writing its results: barrier, mark done, tear down."""
    dist.barrier()
    if _MARKER is not None:
        with open(_MARKER, "w"):
            pass
    dist.destroy_process_group()


def _entry(rank, fn, args, done_dir):
    global _MARKER
    _MARKER = os.path.join(done_dir, f"done{rank}")
    try:
        fn(rank, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        with open(os.path.join(done_dir, f"error{rank}"), "w") as f:
            f.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    if not os.path.exists(_MARKER):
        with open(os.path.join(done_dir, f"error{rank}"), "w") as f:
            f.write(f"{getattr(fn, '__name__', fn)} returned without calling ranks.finish()\n")
        os._exit(1)


def _describe(code):
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def spawn(fn, args, nprocs, timeout_s=900):
    """Runs `fn(rank, *args)` on `nprocs` spawned processes and waits for all of them.

    Raises RuntimeError when a rank fails before `finish()` marked it done, or after `timeout_s`.
    """
    done_dir = tempfile.mkdtemp(prefix="shardscope-ranks-")
    try:
        ctx = mp.start_processes(
            _entry, args=(fn, args, done_dir), nprocs=nprocs, join=False, start_method="spawn"
        )
        procs = ctx.processes
        deadline = time.monotonic() + timeout_s

        def done(rank):
            return os.path.exists(os.path.join(done_dir, f"done{rank}"))

        while True:
            codes = [p.exitcode for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0) and not done(r)]
            timed_out = time.monotonic() > deadline
            if failed or timed_out:
                for p in procs:
                    if p.exitcode is None:
                        p.terminate()
                for p in procs:
                    p.join(10)
                if timed_out and not failed:
                    raise RuntimeError(f"{nprocs} ranks of {fn.__name__}: still running after {timeout_s} s")
                # Every failed rank is named: a rank that dies takes its peers' collectives down
                # with it, and which of them is seen first is a matter of timing.
                parts = []
                for r in failed:
                    err = os.path.join(done_dir, f"error{r}")
                    detail = open(err).read() if os.path.exists(err) else _describe(codes[r])
                    parts.append(f"rank {r} of {fn.__name__} failed before finishing its work:\n{detail}")
                raise RuntimeError("\n".join(parts))
            if all(c is not None for c in codes):
                break
            time.sleep(0.02)
        for r, c in enumerate(codes):
            if c != 0:
                print(
                    f"note: rank {r} of {fn.__name__} ended with {_describe(c)} during teardown, "
                    "after its results were written; the results stand",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(done_dir, True)
