"""Interop test of `shardscope convert` for every dtype and for zstd-compressed DCP items (run by
native-runner/tests/it/dtypes.rs).

usage: check_dtypes.py SHARDSCOPE_BIN WORKDIR

1. `tests/fixtures/dtypes/dcp_zstd` (written by torch's `FileSystemWriter(..., _extensions=[ZStandard()])`)
   is converted to safetensors (`--select model`), to `torch.save` and to DCP for 2 ranks; torch loads
   each output and compares it with torch's own `dcp.load` of the compressed fixture: same keys, same
   dtypes, same shapes, equal raw bytes (`torch.equal` on `uint8` views: NaN patterns included).
2. `tests/fixtures/dtypes/all_dtypes.pt` (one tensor of every dtype torch saves: float8 variants,
   uint16/32/64, complex32/64/128, bool) is converted to `torch.save` and to DCP; torch loads both and
   compares them with `torch.load` of the fixture the same way.
Every expected value comes from torch. Exits non-zero with a message on the first mismatch.
"""

import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

BIN, WORK = sys.argv[1], Path(sys.argv[2])
FIX = Path(__file__).resolve().parent.parent / "fixtures" / "dtypes"


def run(*args):
    out = subprocess.run([BIN, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"shardscope {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().flatten().view(torch.uint8)


def same(what: str, got: dict, want: dict) -> None:
    if sorted(got) != sorted(want):
        sys.exit(f"{what}: keys {sorted(got)} != torch's {sorted(want)}")
    for k, w in want.items():
        g = got[k]
        if not isinstance(w, torch.Tensor):
            if g != w:
                sys.exit(f"{what}: {k} = {g!r}, torch says {w!r}")
            continue
        if not isinstance(g, torch.Tensor):
            sys.exit(f"{what}: {k} is a {type(g).__name__}, torch has a tensor")
        if g.dtype != w.dtype or g.shape != w.shape:
            sys.exit(f"{what}: {k} is {g.dtype} {tuple(g.shape)}, torch has {w.dtype} {tuple(w.shape)}")
        if not torch.equal(raw(g), raw(w)):
            sys.exit(f"{what}: {k}: the bytes differ from torch's")


def dcp_load(path: Path, like: dict) -> dict:
    """`dcp.load` into tensors shaped like `like` (nested dicts; non-tensors keep a placeholder)."""

    def empty(v):
        if isinstance(v, dict):
            return {k: empty(x) for k, x in v.items()}
        if isinstance(v, torch.Tensor):
            return torch.empty_like(v)
        return None

    state = empty(like)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
    return state


def torch_view_of_zstd() -> dict:
    """torch's own read of the compressed fixture (the template comes from its metadata)."""
    meta = dcp.FileSystemReader(str(FIX / "dcp_zstd")).read_metadata()
    state = {"model": {}, "extra": {}, "step": 0}
    for key, md in meta.state_dict_metadata.items():
        group, _, name = key.partition(".")
        if group in ("model", "extra"):
            state[group][name] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(FIX / "dcp_zstd")))
    return state


def main() -> None:
    want = torch_view_of_zstd()
    if want["step"] != 7 or len(want["model"]) < 6 or len(want["extra"]) < 4:
        sys.exit(f"unexpected fixture content: {want.keys()}, step {want['step']}")

    run("convert", str(FIX / "dcp_zstd"), "-o", str(WORK / "zstd.safetensors"), "--select", "model")
    same("dcp_zstd -> safetensors", load_file(str(WORK / "zstd.safetensors")), want["model"])

    run("convert", str(FIX / "dcp_zstd"), "-o", str(WORK / "zstd.pt"))
    got = torch.load(WORK / "zstd.pt", weights_only=True)
    same("dcp_zstd -> torch.save (model)", got["model"], want["model"])
    same("dcp_zstd -> torch.save (extra)", got["extra"], want["extra"])
    if got["step"] != 7:
        sys.exit(f"dcp_zstd -> torch.save: step = {got['step']!r}, torch says 7")

    run("convert", str(FIX / "dcp_zstd"), "-o", str(WORK / "zstd_dcp2"), "--world-size", "2")
    back = dcp_load(WORK / "zstd_dcp2", want)
    same("dcp_zstd -> DCP (2 ranks)", back["model"], want["model"])
    same("dcp_zstd -> DCP (2 ranks), extra", back["extra"], want["extra"])

    every = torch.load(FIX / "all_dtypes.pt", weights_only=True)
    dtypes = {v.dtype for v in every.values()}
    for d in (torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.complex32, torch.uint64):
        if d not in dtypes:
            sys.exit(f"all_dtypes.pt has no {d} tensor")

    run("convert", str(FIX / "all_dtypes.pt"), "-o", str(WORK / "all.pt"))
    same("all_dtypes.pt -> torch.save", torch.load(WORK / "all.pt", weights_only=True), every)

    run("convert", str(FIX / "all_dtypes.pt"), "-o", str(WORK / "all_dcp"), "--world-size", "1")
    same("all_dtypes.pt -> DCP", dcp_load(WORK / "all_dcp", every), every)
    print("ok")


if __name__ == "__main__":
    main()
