"""`shardscope.describe` of live modules and `shardscope.layout` of the description, against what torch's
FSDP1 builds for the same modules (flat parameters recorded by torch: fixtures/gen_hf_auto_wrap.py,
tests/fixtures/app_state/gen_auto_wrap.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardscope

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "app_state"))
sys.path.insert(0, str(HERE / "fixtures"))
from gen_app_state import Llama  # noqa: E402
from gen_hf_auto_wrap import build  # noqa: E402

FIELDS = ("unit_prefix", "fqns", "numels", "unpadded_unsharded_numel", "sharded_numel")


def assert_layout_matches_torch(description, torch_ranks):
    """Every rank's flat parameters of `layout(description, world_size=2)` equal torch's."""
    ours = shardscope.layout(description, world_size=2)
    ours_fp = ours["flat_params"]
    for rank in torch_ranks:
        r = rank["rank"]
        assert len(ours_fp) == len(rank["flat_params"]), f"rank {r}: number of flat params"
        for o, t in zip(ours_fp, rank["flat_params"]):
            for field in FIELDS:
                assert o[field] == t[field], f"rank {r} {t['unit_prefix']}: {field}"
            assert o["ranks"][r]["shard_numel_padded"] == t["shard_numel_padded"], f"rank {r} {t['unit_prefix']}"


def test_describe_of_the_app_state_llama_lays_out_as_torchs_transformer_auto_wrap():
    oracle = json.loads((REPO / "tests/fixtures/app_state/auto_wrap_ws2.json").read_text())
    torch.manual_seed(0)
    description = shardscope.describe(Llama())
    assert description["units"] == ["", "model.layers.0", "model.layers.1"]
    assert_layout_matches_torch(description, oracle["ranks"])


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_describe_of_hugging_face_models_lays_out_as_torchs_fsdp1(name):
    oracle = json.loads((HERE / "fixtures/hf_auto_wrap_ws2.json").read_text())
    model, _ = build(name)
    description = shardscope.describe(model)
    # The description lists what `named_parameters(remove_duplicate=False)` lists, in its order.
    listed = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert [p["fqn"] for p in description["params"]] == listed
    if name == "gpt2":
        tied = {p["fqn"]: p.get("shared_with") for p in description["params"]}
        assert model.lm_head.weight is model.transformer.wte.weight
        assert tied["lm_head.weight"] == "transformer.wte.weight"
    assert_layout_matches_torch(description, oracle[name]["ranks"])


def test_units_from_a_regex_and_frozen_parameters():
    torch.manual_seed(0)
    model = Llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    description = shardscope.describe(model, units=r"model\.layers\.\d+")
    assert description["units"] == ["", "model.layers.0", "model.layers.1"]
    frozen = [p["fqn"] for p in description["params"] if p.get("requires_grad") is False]
    assert frozen == ["model.embed_tokens.weight"]
    assert shardscope.describe(model, units=[r"model"])["units"] == ["", "model"]
    with pytest.raises(shardscope.ShardscopeError, match="not a regex"):
        shardscope.describe(model, units="(")


def test_describe_of_wrapped_modules_reads_the_wrapping():
    """FSDP1 (flat parameters, with and without use_orig_params) and FSDP2 (DTensor) wrapped modules
    describe as the module before wrapping, with the wrapping's units."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "wrap_and_describe.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        check=False,
    )
    # Results first: gloo may abort at teardown after the line was printed.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    out = json.loads(lines[-1])
    plain = out["plain"]
    for key in ("fsdp1_orig0", "fsdp1_orig1", "fsdp2"):
        assert out[key]["params"] == plain["params"], key
        assert out[key]["units"] == ["", "model.layers.0", "model.layers.1"], key
    assert out["gpt2_fsdp1"]["params"] == out["gpt2_plain"]["params"]
    assert out["gpt2_fsdp1"]["units"] == ["", "transformer.h.0", "transformer.h.1"]
