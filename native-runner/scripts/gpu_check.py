#!/usr/bin/env python3
"""The `cuda` gather backend on a real GPU, checked against torch. Needs a machine with an NVIDIA GPU, the
driver, torch, safetensors and NCCL (`nvidia-nccl-cu13`) in this Python, and a `shardscope` built with
`native-runner/scripts/build-cuda.sh`. Not part of CI (CI has no GPU).

    python3 native-runner/scripts/gpu_check.py BIN WORKDIR [--backend cuda] [--synthetic-mib 2048]

1. Every layout fixture (`tests/fixtures/layout/<case>/`, written by real FSDP under torch 2.15): the full
   parameters torch saved (`full/<fqn>` in `values.safetensors`) are written to a plain safetensors file
   by torch, then gathered with `--backend cuda --verify -o OUT` on one GPU at world size 1 (NCCL's
   all-gather over a communicator of one rank, copy-in/copy-out on the GPU; the first case under
   `torchrun --no-python`, the others with the variables torchrun sets). The run
   must exit 0 with no mismatch; OUT, loaded by torch, must equal torch's parameters; and OUT must be
   byte-identical to the `cpu` backend's. The `*_err_*` cases (layouts FSDP refuses) must exit 2 on both
   backends with the same message.
2. A larger synthetic model (`--synthetic-mib`) is gathered and verified on the GPU; its summary (copy-in,
   all-gather and copy-out bandwidth, and the device's own copy bandwidth in the same run) is printed.

With `--backend cpu` the same script runs without a GPU (a rehearsal: it compares the cpu backend with
itself and with torch). Writes `WORKDIR/gpu_check.json` and exits 1 on any failure.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "layout"


def free_port() -> int:
    # Two consecutive free ports: the launcher's and the NCCL id rendezvous (MASTER_PORT + 1).
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as b:
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def layout_flags(case: dict, model: Path) -> list:
    flags = ["--model", str(model), "--world-size", "1", "--api", case["api"]]
    if case.get("use_orig_params"):
        flags.append("--use-orig-params")
    strategy = case.get("strategy")
    # HYBRID_SHARD needs more than one rank; at world size 1 its shard group is the world.
    if case["api"] == "fsdp1" and strategy and strategy != "hybrid_shard":
        flags += ["--strategy", strategy]
    if case.get("param_dtype"):
        flags += ["--param-dtype", case["param_dtype"]]
    return flags


# The first cuda run goes through torchrun (its launch environment); the others set the same
# variables themselves, which saves torchrun's start on every case.
LAUNCHED = {"torchrun": False}


def run(binary: str, backend: str, args: list, log: list, torchrun_ok: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # torchrun turns a worker's exit 2 into its own exit 1: the refused layouts run without it.
    if backend == "cuda" and not LAUNCHED["torchrun"] and torchrun_ok:
        LAUNCHED["torchrun"] = True
        port = free_port()
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--no-python", "--nnodes", "1",
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
            binary, *args, "--backend", "cuda",
        ]
    elif backend == "cuda":
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        cmd = [binary, *args, "--backend", "cuda"]
    else:
        cmd = [binary, *args, "--backend", "cpu"]
    t = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    log.append({"cmd": cmd, "rc": out.returncode, "secs": round(time.monotonic() - t, 3),
                "stderr_tail": out.stderr[-600:]})
    return out


def first_error_line(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("error"):
            return line
    return text.strip().splitlines()[-1] if text.strip() else ""


def check_case(binary: str, backend: str, case_dir: Path, work: Path, log: list) -> list:
    problems = []
    case = json.loads((case_dir / "case.json").read_text())
    d = work / case_dir.name
    d.mkdir(parents=True, exist_ok=True)
    # The cases FSDP refuses have no values: they are gathered from synthetic data, and must fail.
    expect_error = not (case_dir / "values.safetensors").exists()
    full = {}
    if expect_error:
        src_args = ["--synthetic"]
    else:
        values = load_file(str(case_dir / "values.safetensors"))
        full = {k[len("full/"):]: v for k, v in values.items() if k.startswith("full/")}
        src = d / "full.safetensors"
        save_file({k: v.contiguous() for k, v in full.items()}, str(src))
        src_args = [str(src)]
    flags = layout_flags(case, case_dir / "model.json")
    outs = {}
    for b in dict.fromkeys([backend, "cpu"]):
        dst = d / f"out_{b}.safetensors"
        args = ["gather", *src_args, *flags, "--verify", "-o", str(dst), "--json", "-q",
                "--trace", str(d / f"trace_{b}.json")]
        outs[b] = (run(binary, b, args, log, torchrun_ok=not expect_error), dst)
    for b, (out, dst) in outs.items():
        if expect_error:
            if out.returncode != 2:
                problems.append(f"{b}: exit {out.returncode}, expected 2 (FSDP refuses this layout)")
            continue
        if out.returncode != 0:
            problems.append(f"{b}: exit {out.returncode}: {out.stderr.strip()[-2000:]}")
            continue
        try:
            report = json.loads(out.stdout)
        except json.JSONDecodeError:
            problems.append(f"{b}: stdout is not JSON: {out.stdout[-500:]}")
            continue
        verify = report.get("verify") or {}
        if verify.get("mismatches") or not verify.get("checks"):
            problems.append(f"{b}: verify {verify}")
        got = load_file(str(dst))
        # Ignored parameters are not FSDP's: nothing gathers them.
        ignored = set(json.loads((case_dir / "model.json").read_text()).get("ignored", []))
        for fqn, want in full.items():
            if fqn in ignored:
                if fqn in got:
                    problems.append(f"{b}: ignored `{fqn}` is in the output")
                continue
            if fqn not in got:
                problems.append(f"{b}: `{fqn}` missing from the output")
            elif got[fqn].dtype != want.dtype or got[fqn].shape != want.shape:
                problems.append(f"{b}: `{fqn}` is {got[fqn].dtype} {tuple(got[fqn].shape)}, torch {want.dtype} {tuple(want.shape)}")
            elif not torch.equal(got[fqn].view(torch.uint8), want.contiguous().view(torch.uint8)):
                problems.append(f"{b}: `{fqn}` differs from torch's parameter")
    if backend != "cpu":
        (a, da), (c, dc) = outs[backend], outs["cpu"]
        if expect_error:
            if first_error_line(a.stderr) != first_error_line(c.stderr):
                problems.append(f"error differs: {backend} `{first_error_line(a.stderr)}`, cpu `{first_error_line(c.stderr)}`")
        elif a.returncode == 0 and c.returncode == 0 and da.read_bytes() != dc.read_bytes():
            problems.append(f"{backend} output differs from the cpu backend's")
    return problems


def synthetic(binary: str, backend: str, mib: int, work: Path, log: list, hidden: int = 4096) -> dict:
    # A transformer-like model: per layer a bf16 block (4 square matrices) and a float32 norm.
    per_layer = 4 * hidden * hidden * 2
    layers = max(1, (mib << 20) // per_layer)
    params, units = [], []
    for i in range(layers):
        for w in ("q", "k", "v", "o"):
            params.append({"fqn": f"layers.{i}.attn.{w}.weight", "shape": [hidden, hidden], "dtype": "bfloat16"})
        params.append({"fqn": f"layers.{i}.norm.weight", "shape": [hidden], "dtype": "float32"})
        units += [f"layers.{i}.attn", f"layers.{i}.norm"]
    model = work / f"synthetic_model_{hidden}.json"
    model.write_text(json.dumps({"params": params, "units": units}))
    args = ["gather", "--synthetic", "--model", str(model), "--world-size", "1", "--api", "fsdp2",
            "--verify", "--json", "-q", "--trace", str(work / f"synthetic_trace_{hidden}.json")]
    out = run(binary, backend, args, log)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr.strip()[-2000:]}"}
    report = json.loads(out.stdout)
    s = report["summary"]
    return {
        "hidden": hidden,
        "layers": layers,
        "param_bytes": s["total"]["param_bytes"],
        "verify": report.get("verify"),
        "total": s["total"],
        "device_copy_gbps": s.get("device_copy_gbps"),
        "wall_secs": s["wall_secs"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("binary")
    p.add_argument("workdir")
    p.add_argument("--backend", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--synthetic-mib", type=int, default=2048)
    p.add_argument("--synthetic-hidden", type=int, nargs="+", default=[4096],
                   help="one synthetic run per hidden size (the matrices are HIDDEN x HIDDEN bf16)")
    p.add_argument("--no-cases", action="store_true", help="only the synthetic runs")
    a = p.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    log, results = [], {}
    for case_dir in sorted(x for x in FIXTURES.iterdir() if (x / "case.json").exists() and not a.no_cases):
        problems = check_case(a.binary, a.backend, case_dir, work, log)
        results[case_dir.name] = problems
        print(f"{case_dir.name}: {'OK' if not problems else 'FAIL'}", flush=True)
        for pr in problems:
            print(f"    {pr}", flush=True)
    synth = [synthetic(a.binary, a.backend, a.synthetic_mib, work, log, h)
             for h in a.synthetic_hidden] if a.synthetic_mib else []
    for one in synth:
        print("synthetic:", json.dumps(one, indent=1), flush=True)
    failed = [k for k, v in results.items() if v]
    synth_failed = any("error" in one or one["verify"].get("mismatches") for one in synth)
    summary = {"env": env, "backend": a.backend, "cases": results, "failed": failed,
               "synthetic": synth, "runs": log}
    (work / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(results) - len(failed)}/{len(results)} cases OK"
          + ("" if not synth else f"; synthetic {'FAIL' if synth_failed else 'OK'}"), flush=True)
    return 1 if failed or synth_failed else 0


if __name__ == "__main__":
    sys.exit(main())
