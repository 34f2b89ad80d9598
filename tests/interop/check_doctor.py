"""Interop test of `shardscope doctor` fixes (run by native-runner/tests/it/doctor.rs).

usage: check_doctor.py SHARDSCOPE_BIN WORKDIR

Fixtures: tests/fixtures/doctor (written by its gen_doctor.py with torch). For each broken
checkpoint below, copied into WORKDIR: `shardscope doctor --json` against the reference must report
the expected code; then every fix it gives is applied as given (a `shardscope …` command is run, a
line of Python is executed with the loaded state dict as `sd`), doctor must find no error in the
result, and torch must load it strictly (`load_state_dict(strict=True)`) into a fresh `Net` with
exactly the values torch itself would have (compared with the source checkpoint read by torch).
No process group is used. Prints "ok" last.
"""

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "doctor"
sys.path.insert(0, str(FIXTURES))
from gen_doctor import Net  # noqa: E402

BIN = sys.argv[1]
WORK = Path(sys.argv[2])


def doctor(path: Path, *extra: str) -> dict:
    out = subprocess.run(
        [BIN, "doctor", str(path), "--reference", str(WORK / "reference.pt"), "--json", *extra],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode not in (0, 1):
        sys.exit(f"doctor {path} exited {out.returncode}: {out.stderr}")
    report = json.loads(out.stdout)
    assert report["loadable"] == (out.returncode == 0), (path, report)
    return report


def apply_fix(fix: str, ckpt: Path) -> Path:
    """Runs one fix; returns the checkpoint it produced."""
    command = fix.split("  #")[0].strip()
    if command.startswith("shardscope "):
        argv = shlex.split(command)
        argv[0] = BIN
        out = Path(argv[argv.index("-o") + 1])
        subprocess.run(argv + ["-q"], check=True)
        return out
    # A line of Python over `sd`.
    sd = torch.load(ckpt, weights_only=True)
    exec(command, {"sd": sd, "torch": torch})  # noqa: S102 - doctor's own fix line
    out = ckpt.with_suffix(".fixed.pt")
    torch.save(sd, out)
    return out


def expected_values(name: str) -> dict:
    """What the checkpoint holds, cleaned the way torch's own helpers clean it."""
    src = FIXTURES / name
    if src.is_dir():
        # FSDP1 LOCAL files: no single-process torch reader; the reference layout is checked by
        # the strict load, the values by the trained-free seed (Net() with seed 1).
        torch.manual_seed(1)
        return dict(Net().state_dict())
    sd = torch.load(src, weights_only=True)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "_orig_mod.")
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
    sd = {k.replace("_fsdp_wrapped_module.", ""): v for k, v in sd.items()}
    if "scale" in sd and sd["scale"].shape[0] == 2:
        sd["scale"] = sd["scale"][:1]
    return sd


CASES = [
    ("compiled.pt", "wrapper-prefix", []),
    ("ddp.pt", "wrapper-prefix", []),
    ("fsdp_wrapped.pt", "wrapper-prefix", []),
    ("replicated_concat.pt", "replicated-concatenated", []),
    ("local", "flat-param", ["--model", "MODEL"]),
]


def main() -> None:
    shutil.copy(FIXTURES / "reference.pt", WORK / "reference.pt")
    shutil.copy(FIXTURES / "model.json", WORK / "model.json")
    for name, code, extra in CASES:
        src = FIXTURES / name
        ckpt = WORK / name
        if src.is_dir():
            shutil.copytree(src, ckpt)
        else:
            shutil.copy(src, ckpt)
        extra = [str(WORK / "model.json") if e == "MODEL" else e for e in extra]
        # --model replaces --reference for the description case.
        if "--model" in extra:
            out = subprocess.run(
                [BIN, "doctor", str(ckpt), "--json", *extra], capture_output=True, text=True
            )
            report = json.loads(out.stdout)
        else:
            report = doctor(ckpt)
        codes = {f["code"] for f in report["findings"] if f["severity"] == "error"}
        assert codes == {code}, (name, report)
        fixed = ckpt
        for f in report["findings"]:
            if f["severity"] == "error":
                fixed = apply_fix(f["fix"], fixed)
        after = doctor(fixed)
        assert after["loadable"], (name, after)
        model = Net()
        sd = torch.load(fixed, weights_only=True)
        model.load_state_dict(sd, strict=True)
        want = expected_values(name)
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), (name, k)
        print(f"{name}: {code} fixed, strict load ok")
    print("ok")


if __name__ == "__main__":
    main()
