"""`shardscope.convert(src, dst, to="hf", config=...)` from Python: torchtitan's own checkpoint to a
Hugging Face model directory equal to torchtitan's `StateDictAdapter.to_hf` (the fixture's reference,
written by tests/fixtures/hf_mapping/gen_torchtitan_hf.py), and back."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

import shardscope
from conftest import FIXTURES, assert_bitwise

HF = FIXTURES / "hf_mapping"


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_convert_to_hf_and_back(model: str, tmp_path: Path) -> None:
    fixture = HF / model
    out = tmp_path / "hf"
    summary = shardscope.convert(fixture / "step-2", out, to="hf", config=fixture / "config.json")
    assert summary["mapping"]["name"] == f"torchtitan-{model}"
    assert (out / "config.json").exists()
    got = load_file(out / "model.safetensors")
    want = load_file(fixture / "expected" / "hf.safetensors")
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert_bitwise(got[key], w, key)
    back = tmp_path / "titan.safetensors"
    shardscope.convert(out, back, to="torchtitan", config=fixture / "config.json")
    got = load_file(back)
    want = load_file(fixture / "expected" / "from_hf.safetensors")
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert_bitwise(got[key], w, key)


def test_convert_to_hf_without_config_says_so(tmp_path: Path) -> None:
    with pytest.raises(shardscope.ShardscopeError, match="needs --config"):
        shardscope.convert(HF / "llama3" / "step-2", tmp_path / "hf", to="hf")
