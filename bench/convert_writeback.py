#!/usr/bin/env python3
"""Benchmark: two shardscope builds side by side, converting the 1 GiB DCP of bench/remote_convert.py
to safetensors from a URL (a local nginx) and from the folder, against `curl -o` + `sync` of the same
files, in interleaved rounds (the order rotated each round).

Before each command the served files are read into the page cache again and `sync` runs, so no
command pays for another's writeback. Wall time per command; CPU time (user + system) from the
children's rusage. Written to compare a build whose outputs start their writeback while they are
written (native-runner/src/writeback.rs) with the build before it; any two builds can be compared.

usage: python bench/convert_writeback.py --new BIN --old BIN [--nginx /usr/sbin/nginx]
           [--dir /tmp] [--rounds 6]
Prints each round and the medians (and "of curl": curl + sync's median wall over the command's).
See BENCHMARKS.md ("Outputs written back while they are written").
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time

import torch.multiprocessing as mp
from remote_convert import WORLD, free_port, save_worker, start_nginx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", required=True, help="the shardscope build under test")
    ap.add_argument("--old", required=True, help="the build to compare with")
    ap.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    new, old = os.path.abspath(args.new), os.path.abspath(args.old)
    work = tempfile.mkdtemp(prefix="shardscope-bench-writeback-", dir=args.dir)
    os.chmod(work, 0o755)  # nginx workers (`nobody` when started as root) read the served files
    server = None
    try:
        src = os.path.join(work, "www", "dcp")
        mp.spawn(save_worker, args=(free_port(), src, 8), nprocs=WORLD, join=True)
        served = [os.path.join(src, f) for f in sorted(os.listdir(src))]
        server, port = start_nginx(args.nginx, os.path.join(work, "nginx"), os.path.join(work, "www"))
        url = f"http://127.0.0.1:{port}/dcp/"
        out = os.path.join(work, "out.safetensors")
        down = os.path.join(work, "down")
        curl = ["sh", "-c", 'cd "$1" && shift && curl -sf "$@" && sync .metadata *.distcp', "sh", down]
        for f in sorted(os.listdir(src)):
            curl += ["-o", f, url + f]
        commands = {
            "remote old": [old, "convert", url, "-o", out, "--select", "model", "-q"],
            "remote new": [new, "convert", url, "-o", out, "--select", "model", "-q"],
            "curl+sync": curl,
            "local old": [old, "convert", src, "-o", out, "--select", "model", "-q"],
            "local new": [new, "convert", src, "-o", out, "--select", "model", "-q"],
        }
        names = list(commands)
        res: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                if os.path.exists(out):
                    os.unlink(out)
                shutil.rmtree(down, ignore_errors=True)
                os.makedirs(down)
                for p in served:
                    with open(p, "rb") as f:
                        while f.read(8 << 20):
                            pass
                os.sync()
                time.sleep(0.5)
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t = time.perf_counter()
                subprocess.run(commands[name], check=True)
                wall = time.perf_counter() - t
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                res[name].append((wall, cpu))
            print(f"round {r}: " + ", ".join(f"{n} {res[n][-1][0]:.2f}" for n in names), flush=True)
        curl_wall = statistics.median(w for w, _ in res["curl+sync"])
        for name in names:
            wall = statistics.median(w for w, _ in res[name])
            cpu = statistics.median(c for _, c in res[name])
            walls = [round(w, 2) for w, _ in res[name]]
            print(f"{name:12} median wall {wall:.2f} s  cpu {cpu:.2f} s  of curl {curl_wall / wall * 100:.0f}%  all {walls}")
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
