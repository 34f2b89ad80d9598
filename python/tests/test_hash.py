"""`shardscope.hash` and `shardscope.verify(manifest=...)` from Python: the digests of the bundled
DCP fixture's tensors (tests/fixtures/formats/dcp_torch_save) equal SHA-256 over docs/hash.md's
framing of the values torch itself wrote (`expected/dcp.safetensors`, gen_formats.py), and a copy
with one flipped byte is named."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

import shardscope
from conftest import FIXTURES

EXAMPLE = FIXTURES / "formats" / "dcp_torch_save"


def digest(t: torch.Tensor) -> str:
    header = b"tensor\0" + str(t.dtype).removeprefix("torch.").encode() + b"\0"
    header += ",".join(str(d) for d in t.shape).encode() + b"\0"
    data = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(header + data).hexdigest()


def test_hash_equals_torchs_values_and_verify_names_a_flipped_tensor(tmp_path: Path) -> None:
    # The expected file names keys with `/` (safetensors), the checkpoint with `.`.
    want = {k.replace("/", "."): v for k, v in load_file(FIXTURES / "formats" / "expected" / "dcp.safetensors").items()}
    manifest = shardscope.hash(EXAMPLE, algorithm="sha256", no_files=True)
    assert manifest["algorithm"] == "sha256"
    tensors = manifest["tensors"]
    assert set(want) <= set(tensors)
    for key, t in want.items():
        assert tensors[key]["digest"] == digest(t), key

    path = tmp_path / "m.json"
    shardscope._run(["hash", str(EXAMPLE), "-o", str(path), "-q"])
    assert shardscope.verify(EXAMPLE, manifest=path)["summary"]["mismatched"] == 0

    # One byte of the largest tensor's stored data, flipped in a copy.
    copy = tmp_path / "copy"
    shutil.copytree(EXAMPLE, copy)
    key, t = max(want.items(), key=lambda kv: kv[1].numel())
    raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()[:64]
    for f in sorted(copy.glob("*.distcp")):
        data = bytearray(f.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at + 5] ^= 0xFF
            f.write_bytes(bytes(data))
            break
    else:
        raise AssertionError(f"{key}'s bytes not found in the .distcp files")
    report = shardscope.verify(copy, manifest=path)
    assert report["summary"]["mismatched"] == 1
    assert [e["fqn"] for e in report["entries"] if e["status"] == "mismatch"] == [key]


def test_checkpoint_verify_checks_the_checkpoint_as_opened(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    shardscope._run(["hash", str(EXAMPLE), "-o", str(path), "-q"])
    report = shardscope.open(EXAMPLE).verify(manifest=path)
    assert report["summary"]["mismatched"] == 0 and report["summary"]["missing"] == 0
    assert report["summary"]["matched"] == len(shardscope.open(EXAMPLE).keys())

    # A copy with one byte of the first row torch wrote for a tensor flipped: that key, named.
    want = {k.replace("/", "."): v for k, v in load_file(FIXTURES / "formats" / "expected" / "dcp.safetensors").items()}
    copy = tmp_path / "copy"
    shutil.copytree(EXAMPLE, copy)
    key, t = max(want.items(), key=lambda kv: (kv[1].numel(), kv[0]))
    row = t[0].contiguous().view(torch.uint8).numpy().tobytes()
    for f in sorted(copy.glob("*.distcp")):
        data = bytearray(f.read_bytes())
        at = data.find(row)
        if at >= 0:
            data[at] ^= 0x01
            f.write_bytes(bytes(data))
            break
    else:
        raise AssertionError(f"{key}'s first row not found in the .distcp files")
    report = shardscope.open(copy).verify(manifest=path, threads=2)
    assert [e["fqn"] for e in report["entries"] if e["status"] != "match"] == [key]

    # The sha256 manifest `convert --write-manifest` writes beside a .pt: the opened .pt matches it.
    pt = tmp_path / "full.pt"
    shardscope.convert(EXAMPLE, pt, write_manifest=True, manifest_algorithm="sha256")
    report = shardscope.open(pt).verify(manifest=tmp_path / "full.pt.manifest.json")
    assert report["summary"]["mismatched"] == 0 and report["summary"]["matched"] > 0
