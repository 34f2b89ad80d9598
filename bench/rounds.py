#!/usr/bin/env python3
"""Times commands against a durable copy of the same input in rotated rounds, for a disk whose throughput
swings between minutes (a single timed command says little there).

Each round runs the plain copy (`cat` of the input files into one file, then `sync FILE`) and every
command once, in an order rotated by one each round; before each, the output folder is emptied, `sync`
runs and the script sleeps 1 s (so that none pays for another's writeback). Prints each command's times,
its median and the copy's median over it (the fraction of copy throughput: above 100% is faster).

usage: python bench/rounds.py --rounds 6 --out /work/rounds-out --copy '/work/ckpt/src/*.pt' \\
           'new=target/release/shardscope convert /work/ckpt/src -o {out}/full.safetensors --model M.json -q' \\
           'old=/tmp/old/shardscope convert /work/ckpt/src -o {out}/full.safetensors --model M.json -q'

`{out}` in a command is the emptied output folder. Keep a checkpoint for it with the `--keep` flag of
`bench/fsdp1_reshard.py` or `bench/fsdp2_convert.py`. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import statistics
import subprocess
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", required=True, help="scratch output folder (emptied before each command)")
    ap.add_argument("--copy", required=True, help="glob of the input files the plain copy concatenates")
    ap.add_argument("commands", nargs="+", help="NAME=COMMAND, `{out}` standing for the output folder")
    args = ap.parse_args()
    files = sorted(glob.glob(args.copy))
    if not files:
        raise SystemExit(f"--copy {args.copy!r} matches no file")
    commands = {"copy": f"cat {' '.join(map(shlex.quote, files))} > {{out}}/copy.bin && sync {{out}}/copy.bin"}
    for c in args.commands:
        name, _, cmd = c.partition("=")
        if not cmd or name in commands:
            raise SystemExit(f"bad or repeated NAME=COMMAND: {c!r}")
        commands[name] = cmd
    names = list(commands)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            shutil.rmtree(args.out, ignore_errors=True)
            os.makedirs(args.out)
            os.sync()
            time.sleep(1)
            t = time.monotonic()
            subprocess.run(commands[name].replace("{out}", shlex.quote(args.out)), shell=True, check=True,
                           stdout=subprocess.DEVNULL)
            times[name].append(time.monotonic() - t)
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names), flush=True)
    shutil.rmtree(args.out, ignore_errors=True)
    copy = statistics.median(times["copy"])
    result = {}
    for n in names:
        med = statistics.median(times[n])
        result[n] = {"median_s": round(med, 3), "of_copy": round(copy / med, 3),
                     "runs_s": [round(x, 3) for x in times[n]]}
        print(f"{n:>12}: median {med:.2f} s, {copy / med:.0%} of the copy")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
