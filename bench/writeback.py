#!/usr/bin/env python3
"""How the order of `fsync`s costs a two-file output on this disk: writes 1 GiB + 2 GiB (the FSDP1
`convert` output: model file + `.optim.pt`) in 128 KiB `write` calls (what shardscope's writers use),

- syncing the first file before writing the second (what `convert` did before `atomic::together`),
- syncing both at the end (what `atomic::together` does),
- one 3 GiB file synced at the end (what the `cat` + `sync FILE` baseline does),
- the same 3 GiB file asking the kernel to start writing back every 32 MiB as they are written
  (`posix_fadvise(POSIX_FADV_DONTNEED)` on the dirty range: what shardscope's outputs do since
  `native-runner/src/writeback.rs`), synced at the end,

in rounds with the order rotated, `sync` before each case. Prints each case's times and median.

usage: python bench/writeback.py DIR [--rounds 7]   (needs 3 GiB free under DIR; removes what it writes)
See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

CHUNK = 128 << 10
GIB = 1 << 30


STEP = 32 << 20  # native-runner/src/writeback.rs STEP_BYTES


def write(path: str, nbytes: int, buf: bytes, early: bool = False) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    done = started = 0
    while done < nbytes:
        done += os.write(fd, buf)
        if early and done - started >= STEP:
            os.posix_fadvise(fd, started, done - started, os.POSIX_FADV_DONTNEED)
            started = done
    return fd


def finish(fd: int) -> None:
    os.fsync(fd)
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    d = args.dir
    buf = os.urandom(CHUNK)
    cases = {
        "1 GiB + fsync, then 2 GiB + fsync": lambda: (finish(write(f"{d}/a", GIB, buf)),
                                                       finish(write(f"{d}/b", 2 * GIB, buf))),
        "1 GiB, 2 GiB, both synced at the end": lambda: [finish(fd) for fd in
                                                         [write(f"{d}/a", GIB, buf), write(f"{d}/b", 2 * GIB, buf)]],
        "one 3 GiB file, synced at the end": lambda: finish(write(f"{d}/a", 3 * GIB, buf)),
        "one 3 GiB file, writeback started every 32 MiB": lambda: finish(write(f"{d}/a", 3 * GIB, buf, True)),
    }
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            os.sync()
            t = time.monotonic()
            cases[name]()
            times[name].append(time.monotonic() - t)
            for f in ("a", "b"):
                if os.path.exists(f"{d}/{f}"):
                    os.unlink(f"{d}/{f}")
        print(f"round {r}: " + ", ".join(f"{times[n][-1]:.2f} s" for n in names), flush=True)
    for n in names:
        print(f"{n}: median {statistics.median(times[n]):.2f} s ({', '.join(f'{x:.2f}' for x in times[n])})")


if __name__ == "__main__":
    main()
