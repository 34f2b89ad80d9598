"""What a newcomer met in the first hour (issue 38): a cast to bfloat16 with numpy but no ml_dtypes
is named as a cast, and the package works when imported from a folder on `sys.path` (as `pip install
--target DIR` leaves it), the child process of `doctor()`/`verify()`/`convert()` included."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import shardscope
from conftest import REPO

EXAMPLE = REPO / "examples" / "fsdp2_dcp"


def test_a_bf16_cast_without_ml_dtypes_is_named_as_a_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    ck = shardscope.open(EXAMPLE)
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # `import ml_dtypes` raises ImportError
    with pytest.raises(shardscope.ShardscopeError) as e:
        ck.read("model.embed.weight", dtype="bfloat16")
    text = str(e.value)
    assert "model.embed.weight (float32) cast to bfloat16" in text and "ml_dtypes" in text, text
    # Stored as float32 and read as such, it needs nothing more.
    assert ck.read("model.embed.weight").dtype.name == "float32"


def test_imported_from_a_folder_on_sys_path(tmp_path: Path) -> None:
    python = shutil.which("python3")
    assert python is not None
    if subprocess.run([python, "-c", "import shardscope"], capture_output=True).returncode == 0:
        pytest.skip(f"{python} has shardscope installed: the case needs a python without it")
    pkg = tmp_path / "target"
    shutil.copytree(Path(shardscope.__file__).parent, pkg / "shardscope")
    code = (
        f"import sys; sys.path.insert(0, {str(pkg)!r}); import shardscope; "
        f"r = shardscope.verify({str(EXAMPLE)!r}); print(r['kind'], r['summary'])"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "shardscope.verify" in out.stdout, out.stdout


def test_layout_of_the_bundled_model_says_how_to_wrap_its_frozen_parameter() -> None:
    model = REPO / "examples" / "tiny_model.json"
    # torch's own rule: FSDP1 with use_orig_params=False cannot flatten frozen and trained
    # parameters into one unit. The message says the ways out, and each one works.
    with pytest.raises(shardscope.ShardscopeError, match="use_orig_params=True"):
        shardscope.layout(model, world_size=2)
    assert shardscope.layout(model, world_size=2, use_orig_params=True)["world_size"] == 2
    assert shardscope.layout(model, world_size=2, api="fsdp2")["world_size"] == 2


def test_a_bf16_export_is_checked_against_its_fp32_source(tmp_path: Path) -> None:
    """`diff --dtype bf16`: the fp32 checkpoint's floating tensors cast as torch casts them
    (`Tensor.to(torch.bfloat16)`, here by torch itself) equal the export bit for bit; one element
    changed is named."""
    import torch
    from safetensors.torch import save_file

    ck = shardscope.open(EXAMPLE)
    model = ck.state_dict(select="model", framework="torch")
    export = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.items()}
    path = tmp_path / "bf16.safetensors"
    save_file({k: v.contiguous() for k, v in export.items()}, str(path))
    plain = shardscope.diff(EXAMPLE, path, select="model")
    assert plain["summary"]["mismatched"] == len(export)  # float32 vs bfloat16, without a cast
    same = shardscope.diff(EXAMPLE, path, select="model", dtype=torch.bfloat16)
    assert same["summary"] == {**same["summary"], "matched": len(export), "mismatched": 0}, same["summary"]

    key = "embed.weight"
    export[key] = export[key].clone()
    export[key][3, 2] += 1.0
    save_file({k: v.contiguous() for k, v in export.items()}, str(path))
    changed = shardscope.diff(EXAMPLE, path, select="model", dtype="bf16")
    assert [e["fqn"] for e in changed["entries"] if e["status"] == "mismatch"] == [key]


def test_read_and_state_dict_default_to_numpy_and_equal_torch() -> None:
    """One default for both: numpy arrays, unless framework="torch"; the values are torch's own
    (`dcp_to_torch_save` of the bundled example, loaded by torch)."""
    import numpy as np
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ck = shardscope.open(EXAMPLE)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(EXAMPLE), f"{tmp}/full.pt")
        want = torch.load(f"{tmp}/full.pt", weights_only=True)["model"]
    arrays = ck.state_dict(select="model")
    tensors = ck.state_dict(select="model", framework="torch")
    assert set(arrays) == set(tensors) == set(want)
    for key, w in want.items():
        assert isinstance(arrays[key], np.ndarray), (key, type(arrays[key]))
        assert isinstance(tensors[key], torch.Tensor), (key, type(tensors[key]))
        assert isinstance(ck.read("model." + key), np.ndarray)
        assert torch.equal(torch.from_numpy(arrays[key]), w) and torch.equal(tensors[key], w), key
