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


@pytest.mark.parametrize("model", ["llama3", "deepseek_v3", "gpt_oss"])
def test_state_dict_to_hf_equals_torchtitans_to_hf(model: str) -> None:
    """`Checkpoint.state_dict(to="hf", config=...)` of a training step (the model part found as
    `--model-only` finds it): RoPE rows permuted, experts one by one (gpt_oss: HF's own layout),
    every tensor bit-identical to torchtitan's `to_hf`, in memory, with nothing written."""
    fixture = HF / model
    ck = shardscope.open(fixture / "step-1")
    assert any(k.startswith("optimizer.") for k in ck.keys())
    got = ck.state_dict(to="hf", config=fixture / "config.json", framework="torch")
    want = load_file(fixture / "expected" / "hf.safetensors")
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert_bitwise(got[key], w, key)
    # A row slice of a derived tensor (an expert of a grouped one, or permuted q rows) reads the
    # same rows.
    hf = ck.mapped("hf", config=fixture / "config.json")
    derived = next(k for k in hf.keys() if "q_proj" in k or "experts.1." in k)
    rows = hf.read(derived, framework="torch", rows=slice(1, 3))
    assert_bitwise(rows, want[derived][1:3], derived)
    assert any("mapping `torchtitan-" in n for n in hf.notes)


def test_state_dict_to_torchtitan_takes_a_config_dict(tmp_path: Path) -> None:
    import json

    fixture = HF / "qwen3"
    hf_dir = tmp_path / "hf"
    shardscope.convert(fixture / "step-2", hf_dir, to="hf", config=fixture / "config.json")
    config = json.loads((fixture / "config.json").read_text())
    got = shardscope.open(hf_dir).state_dict(to="torchtitan", config=config, framework="torch")
    want = load_file(fixture / "expected" / "from_hf.safetensors")
    assert list(got) == list(shardscope.open(hf_dir).mapped("torchtitan", config).keys())
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert_bitwise(got[key], w, key)


def test_state_dict_to_hf_needs_both_and_names_a_wrong_config() -> None:
    fixture = HF / "llama3"
    ck = shardscope.open(fixture / "step-2")
    with pytest.raises(shardscope.ShardscopeError, match="takes both"):
        ck.state_dict(to="hf", framework="torch")
    wrong = dict(__import__("json").loads((fixture / "config.json").read_text()))
    wrong["hidden_size"] = wrong["hidden_size"] * 2
    with pytest.raises(shardscope.ShardscopeError, match="hidden_size"):
        ck.state_dict(to="hf", config=wrong, framework="torch")
