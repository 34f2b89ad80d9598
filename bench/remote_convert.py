#!/usr/bin/env python3
"""Benchmark: `shardscope convert` of a DCP checkpoint read over HTTP from a local nginx, against
downloading the same files with `curl -o` and `sync`, in the same run.

1. Two spawned ranks (gloo, CPU) save `{"model": {...}}` with `dcp.save`: `--tensors` float32
   tensors of [8192, 4096] (128 MiB each; default 8, 1 GiB) as `DTensor`s sharded on dim 0, plus a
   small bias, in two `.distcp` files.
2. nginx (`nginx -c CONF -p PREFIX`, `daemon off;`, 127.0.0.1, a free port, sendfile on) serves the
   folder. Each command runs as its own process under `/usr/bin/time -v`:
   - shardscope (remote): `convert http://127.0.0.1:PORT/dcp/ -o out.safetensors --select model`;
   - download: `curl -s -o FILE URL` for `.metadata` and every `.distcp` (one curl process, the
     files one after another), then `sync` of the files: the ceiling for moving these bytes over
     this HTTP server to disk;
   - shardscope (local): the same conversion from the folder on disk, for reference.
   Before each command `sync` runs and the served files are read into the page cache again.
   `--runs N` (default 3) runs the three commands N times in turn; the median is shown.
   `--compare OTHER_BINARY` adds a fourth command, the same remote conversion by another build
   (an earlier commit), in the same turns.
3. The remote output equals the local output byte for byte (and the other build's, with `--compare`).

Target: the remote conversion at 90% or more of the throughput of `curl -o` + `sync`.

usage: python bench/remote_convert.py [--shardscope target/release/shardscope] [--dir /tmp]
       [--runs 3] [--tensors 8] [--nginx nginx] [--compare OTHER_BINARY]
Prints a table and one JSON line. Stops nginx and removes its temp directory. See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from benchlib import timed

ROWS, COLS = 8192, 4096  # 128 MiB of float32
WORLD = 2


def save_worker(rank: int, port: int, out_dir: str, tensors: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = ROWS // WORLD
    sd = {}
    for i in range(tensors):
        g = torch.Generator().manual_seed(1000 * i + rank)
        sd[f"layers.{i:02d}.weight"] = DTensor.from_local(torch.randn(rows, COLS, generator=g), mesh, [Shard(0)])
    sd["head.bias"] = DTensor.from_local(torch.full((4,), float(rank)), mesh, [Shard(0)])
    dcp.save({"model": sd}, checkpoint_id=out_dir)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nginx(nginx: str, prefix: str, root: str) -> tuple[subprocess.Popen, int]:
    for d in ("logs", "tmp"):
        os.makedirs(os.path.join(prefix, d), exist_ok=True)
    for _ in range(5):
        port = free_port()
        conf = os.path.join(prefix, "nginx.conf")
        with open(conf, "w") as f:
            f.write(
                f"daemon off;\nworker_processes 2;\npid {prefix}/nginx.pid;\nerror_log {prefix}/logs/error.log;\n"
                "events { worker_connections 256; }\n"
                f"http {{ access_log off; sendfile on; tcp_nopush on; client_body_temp_path {prefix}/tmp;\n"
                f"  proxy_temp_path {prefix}/tmp; fastcgi_temp_path {prefix}/tmp; uwsgi_temp_path {prefix}/tmp;\n"
                f"  scgi_temp_path {prefix}/tmp;\n  server {{ listen 127.0.0.1:{port}; root {root}; }}\n}}\n"
            )
        proc = subprocess.Popen([nginx, "-c", conf, "-p", prefix], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return proc, port
            except OSError:
                time.sleep(0.05)
        proc.kill()
        proc.wait()
    sys.exit("nginx did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardscope", default="target/release/shardscope")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--runs", type=int, default=3, help="runs per command; the median is shown")
    parser.add_argument("--tensors", type=int, default=8, help="128 MiB tensors in the checkpoint")
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    parser.add_argument("--compare", help="another shardscope binary: its remote conversion too")
    args = parser.parse_args()
    shardscope = os.path.abspath(args.shardscope)
    work = tempfile.mkdtemp(prefix="shardscope-bench-remote-", dir=args.dir)
    os.chmod(work, 0o755)  # nginx workers (`nobody` when started as root) read the served files
    server = None
    try:
        www = os.path.join(work, "www")
        src = os.path.join(www, "dcp")
        mp.spawn(save_worker, args=(free_port(), src, args.tensors), nprocs=WORLD, join=True)
        served = sorted(f for f in os.listdir(src) if f.endswith(".distcp") or f == ".metadata")
        served_paths = [os.path.join(src, f) for f in served]
        input_bytes = sum(os.path.getsize(p) for p in served_paths)
        tensor_bytes = args.tensors * ROWS * COLS * 4 + 4 * 4
        server, port = start_nginx(args.nginx, os.path.join(work, "nginx"), www)
        url = f"http://127.0.0.1:{port}/dcp/"

        down = os.path.join(work, "down")
        os.makedirs(down)
        curl_cmd = ["sh", "-c", 'cd "$1" && shift && curl -sf "$@" && sync .metadata *.distcp', "sh", down]
        for f in served:
            curl_cmd += ["-o", f, url + f]
        remote_out = os.path.join(work, "remote", "model.safetensors")
        local_out = os.path.join(work, "local", "model.safetensors")
        os.makedirs(os.path.dirname(remote_out))
        os.makedirs(os.path.dirname(local_out))
        commands = {
            "shardscope convert URL/ (nginx)": [shardscope, "convert", url, "-o", remote_out, "--select", "model", "--quiet"],
            "curl -o + sync (same files)": curl_cmd,
            "shardscope convert DIR (local)": [shardscope, "convert", src, "-o", local_out, "--select", "model", "--quiet"],
        }
        outputs = {
            "shardscope convert URL/ (nginx)": [remote_out],
            "curl -o + sync (same files)": [os.path.join(down, f) for f in served],
            "shardscope convert DIR (local)": [local_out],
        }
        other_out = os.path.join(work, "other", "model.safetensors")
        if args.compare:
            os.makedirs(os.path.dirname(other_out))
            other = os.path.abspath(args.compare)
            commands["other build: convert URL/"] = [other, "convert", url, "-o", other_out, "--select", "model", "--quiet"]
            outputs["other build: convert URL/"] = [other_out]
        runs = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, cmd in commands.items():
                for p in outputs[name]:
                    if os.path.exists(p):
                        os.unlink(p)
                runs[name].append(timed(cmd, served_paths))
        results = {name: sorted(v)[len(v) // 2] for name, v in runs.items()}
        all_walls = {name: [round(w, 2) for w, _ in v] for name, v in runs.items()}
        assert filecmp.cmp(remote_out, local_out, shallow=False), "remote output differs from local"
        if args.compare:
            assert filecmp.cmp(other_out, local_out, shallow=False), "the other build's output differs"

        t_remote = results["shardscope convert URL/ (nginx)"][0]
        t_curl = results["curl -o + sync (same files)"][0]
        print(f"input: {input_bytes / 2**30:.2f} GiB served ({len(served)} files); tensors {tensor_bytes / 2**30:.2f} GiB")
        print(f"{'command':36} {'wall s':>8} {'GiB/s':>7} {'peak RSS MiB':>13} {'of curl':>8}")
        summary = {"input_bytes": input_bytes, "runs": args.runs, "all_wall_s": all_walls}
        for name, (wall, rss) in results.items():
            print(f"{name:36} {wall:8.2f} {input_bytes / 2**30 / wall:7.2f} {rss / 2**20:13.0f} {t_curl / wall * 100:7.0f}%")
            summary[name] = {"wall_s": wall, "peak_rss_bytes": rss, "fraction_of_curl_throughput": t_curl / wall}
        summary["targets"] = {"at_least_90pct_of_curl": t_curl / t_remote >= 0.9}
        summary["remote_equals_local"] = True
        print(json.dumps(summary))
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
