"""The reading API of `import shardscope` against real PyTorch (and safetensors) as the oracle, bit for bit.

Every expected value comes from torch's own readers (torch.load, dcp_to_torch_save,
safetensors.torch.load_file) or from torch-written expected files next to the fixtures; none from
shardscope.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import shardscope
from shardscope import ShardscopeError

from conftest import (
    EXAMPLES,
    FIXTURES,
    REPO,
    assert_bitwise,
    cli_error,
    dcp_as_torch,
    flatten,
    jsonish,
    raw_bytes,
    tensors_of,
    torch_load,
)

FORMATS = FIXTURES / "formats"


def check_against(ck, want: dict, *, values: bool = True) -> None:
    """Every key of `ck` equals torch's flat dict `want`: same key set, tensors bitwise through
    `read(framework="torch")` and `state_dict()`, non-tensor values through `value()`."""
    keys = ck.keys()
    assert len(keys) == len(set(keys)), "duplicate keys"
    assert len(ck) == len(keys)
    assert sorted(keys) == sorted(want), (
        f"keys differ from torch's: only shardscope {sorted(set(keys) - set(want))}, "
        f"only torch {sorted(set(want) - set(keys))}"
    )
    sd = ck.state_dict(framework="torch")
    assert list(sd) == keys, "state_dict() is not in keys() order"
    for key in keys:
        assert key in ck
        w = want[key]
        if isinstance(w, torch.Tensor):
            info = ck.info(key)
            assert info["kind"] == "tensor", f"{key}: {info}"
            assert tuple(info["shape"]) == tuple(w.shape), f"{key}: info shape {info['shape']} != {tuple(w.shape)}"
            assert info["dtype"] == str(w.dtype).removeprefix("torch."), f"{key}: info dtype {info['dtype']}"
            assert_bitwise(ck.read(key, framework="torch"), w, key)
            assert_bitwise(sd[key], w, f"state_dict()[{key}]")
            if w.dtype == torch.float32:
                assert_bitwise(ck.read(key, framework="numpy"), w, f"{key} (numpy)")
        elif values:
            assert ck.info(key)["kind"] != "tensor", key
            assert ck.value(key) == jsonish(w), f"{key}: value {ck.value(key)!r} != torch's {w!r}"
            assert sd[key] == jsonish(w), f"state_dict()[{key}]"


# ----- 1. DCP ---------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize(
    "folder",
    [
        FIXTURES / "app_state" / "dcp",
        EXAMPLES / "fsdp2_dcp",
        FORMATS / "dcp_torch_save",
        FORMATS / "dcp_safetensors",
        FIXTURES / "dtypes" / "dcp_zstd",
    ],
    ids=lambda p: p.relative_to(REPO).as_posix(),
)
def test_dcp_equals_dcp_to_torch_save(folder, tmp_path):
    if folder.name == "dcp_safetensors":
        # torch 2.15's FileSystemReader (dcp_to_torch_save) reads only torch.save items; the same
        # state was saved by dcp.save in both serializations: torch's reading of the torch_save twin
        want = dcp_as_torch(FORMATS / "dcp_torch_save", tmp_path)
    else:
        want = dcp_as_torch(folder, tmp_path)
    ck = shardscope.open(folder)
    assert ck.format == "dcp"
    check_against(ck, want)


def test_dcp_select_strips_prefix(tmp_path):
    want = dcp_as_torch(EXAMPLES / "fsdp2_dcp", tmp_path)
    ck = shardscope.open(EXAMPLES / "fsdp2_dcp")
    assert ck.world_size == 2
    sd = ck.state_dict(select="model", framework="torch")
    model = {k[len("model.") :]: v for k, v in want.items() if k.startswith("model.")}
    assert sorted(sd) == sorted(model)
    for k, v in model.items():
        assert_bitwise(sd[k], v, k)
    with pytest.raises(ShardscopeError, match="no key under"):
        ck.state_dict(select="nope", framework="torch")


# ----- 2. FSDP1 LOCAL per-rank files through model= ------------------------------------------------


@pytest.mark.parametrize("orig", [0, 1])
def test_fsdp1_local_equals_torch_full_state_dict(orig):
    folder = FORMATS / f"fsdp1_orig{orig}"
    ck = shardscope.open(
        [folder / "rank0_local.pt", folder / "rank1_local.pt"],
        model=FORMATS / "derived" / "model.json",
        world_size=2,
        use_orig_params=bool(orig),
    )
    assert ck.view == "fsdp1"
    for r in (0, 1):  # FULL_STATE_DICT with rank0_only=False: every rank holds the full dict
        want = flatten(torch_load(folder / f"rank{r}_full.pt"))
        check_against(ck, want)


def test_fsdp1_local_model_as_dict():
    folder = FORMATS / "fsdp1_orig0"
    desc = json.loads((FORMATS / "derived" / "model.json").read_text())
    ck = shardscope.open([folder / "rank0_local.pt", folder / "rank1_local.pt"], model=desc, world_size=2)
    check_against(ck, flatten(torch_load(folder / "rank0_full.pt")))


# ----- 3. FSDP2 per-rank and HSDP -------------------------------------------------------------------


def test_fsdp2_hsdp_equals_torch_full_state_dict():
    ck = shardscope.open(FIXTURES / "fsdp2_hsdp" / "ws4_2x2")
    assert ck.kind == "fsdp2"
    assert ck.world_size == 4
    want = flatten(torch_load(FIXTURES / "fsdp2_hsdp" / "expected" / "ws4_2x2_full.pt"))
    check_against(ck, want)


def test_fsdp2_optim_with_model_json_equals_torch_full_state_dict():
    ck = shardscope.open(FIXTURES / "fsdp2_optim" / "ws2", model=FIXTURES / "fsdp2_optim" / "model.json")
    assert ck.world_size == 2
    want = flatten(torch_load(FIXTURES / "fsdp2_optim" / "expected" / "ws2_full.pt"))
    check_against(ck, want)


def test_fsdp2_formats_equals_torch_full_tensor():
    """formats/fsdp2: torch's `full_tensor()` of every DTensor is in expected/dcp.safetensors
    (`model/<fqn>`, `optim/state/<id>/<name>` with ids in named_parameters() order)."""
    ck = shardscope.open(FORMATS / "fsdp2")
    assert ck.kind == "fsdp2" and ck.world_size == 2
    full = load_file(str(FORMATS / "expected" / "dcp.safetensors"))
    params = [p["fqn"] for p in json.loads((FORMATS / "derived" / "model.json").read_text())["params"]]
    want = {}
    for name, t in full.items():
        parts = name.split("/")
        if parts[0] == "model":
            want["model." + parts[1]] = t
        elif parts[0] == "optim" and parts[1] == "state":
            want[f"optim.state.{params[int(parts[2])]}.{parts[3]}"] = t
    got = [k for k in ck.keys() if ck.info(k)["kind"] == "tensor"]
    assert sorted(got) == sorted(want)
    sd = ck.state_dict(framework="torch")
    for k, t in want.items():
        assert_bitwise(ck.read(k, framework="torch"), t, k)
        assert_bitwise(sd[k], t, k)
    # the non-tensor optimizer values against torch.load of rank 0's optimizer state dict
    osd = torch_load(FORMATS / "fsdp2" / "rank0_optim.pt")
    for i, group in enumerate(osd["param_groups"]):
        for name, v in group.items():
            if name != "params":
                assert ck.value(f"optim.param_groups.{i}.{name}") == jsonish(v), name


# ----- 4. safetensors and torch.save files -----------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        FIXTURES / "app_state" / "merged.safetensors",
        FIXTURES / "dtypes" / "float8.safetensors",
        FIXTURES / "dtypes" / "dcp_zstd_model.safetensors",
        FORMATS / "expected" / "plain__state_dict.safetensors",
    ],
    ids=lambda p: p.name,
)
def test_safetensors_equals_load_file(path):
    want = load_file(str(path))
    ck = shardscope.open(path)
    assert ck.format == "safetensors"
    check_against(ck, want)
    assert {str(v.dtype) for v in want.values()}  # the dtypes seen, for the record


def test_all_dtypes_pt_equals_torch_load():
    want = flatten(torch.load(str(FIXTURES / "dtypes" / "all_dtypes.pt"), weights_only=True))
    ck = shardscope.open(FIXTURES / "dtypes" / "all_dtypes.pt")
    check_against(ck, want)


def test_plain_pt_with_views_equals_torch_load():
    want = flatten(torch.load(str(FORMATS / "plain" / "state_dict.pt"), weights_only=True))
    ck = shardscope.open(FORMATS / "plain" / "state_dict.pt")
    check_against(ck, want)


# ----- 5. HF shards ----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    "target",
    [
        FORMATS / "hf_sharded",
        FORMATS / "hf_sharded" / "model.safetensors.index.json",
        FORMATS / "hf_distributed",
    ],
    ids=lambda p: p.relative_to(FORMATS).as_posix(),
)
def test_hf_shards_equal_every_shard(target):
    folder = target if target.is_dir() else target.parent
    want: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        part = load_file(str(f))
        if folder.name == "hf_distributed":
            # save_distributed=True: each rank's file holds its chunk; torch's DCP reader assembles
            continue
        assert not set(part) & set(want)
        want.update(part)
    if folder.name == "hf_distributed":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        # torch's own reader assembles the distributed chunks (no process group: no_dist=True)
        import torch.distributed.checkpoint as dcp

        ref = load_file(str(FORMATS / "expected" / "hf_sharded.safetensors"))
        state = {k: torch.empty_like(v) for k, v in ref.items()}
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
        want = state
    ck = shardscope.open(target)
    check_against(ck, want)


# ----- 6. URLs (nginx, HTTP Range) -----------------------------------------------------------------


def _same_as_local(remote, local) -> None:
    assert remote.keys() == local.keys()
    assert remote.kind == local.kind
    rsd, lsd = remote.state_dict(framework="torch"), local.state_dict(framework="torch")
    for k in local.keys():
        if local.info(k)["kind"] == "tensor":
            assert remote.info(k) == local.info(k), k
            assert raw_bytes(rsd[k]) == raw_bytes(lsd[k]), k
            assert raw_bytes(remote.read(k, framework="torch")) == raw_bytes(local.read(k, framework="torch")), k
        else:
            assert rsd[k] == lsd[k], k


def test_url_dcp_folder_and_safetensors_file(nginx, tmp_path):
    shutil.copytree(EXAMPLES / "fsdp2_dcp", nginx.www / "ck")
    shutil.copy(FIXTURES / "app_state" / "merged.safetensors", nginx.www / "merged.safetensors")
    for p in [nginx.www / "ck", *(nginx.www / "ck").iterdir(), nginx.www / "merged.safetensors"]:
        p.chmod(0o755 if p.is_dir() else 0o644)

    remote = shardscope.open(nginx.url("ck/"))
    assert remote.label == nginx.url("ck/")
    _same_as_local(remote, shardscope.open(EXAMPLES / "fsdp2_dcp"))
    # and the remote read equals torch's own reading
    want = dcp_as_torch(EXAMPLES / "fsdp2_dcp", tmp_path)
    for k, v in tensors_of(want).items():
        assert_bitwise(remote.read(k, framework="torch"), v, k)
    # rows over HTTP
    assert_bitwise(remote.read("model.embed.weight", framework="torch", rows=slice(2, 6)), want["model.embed.weight"][2:6], "rows")

    remote_st = shardscope.open(nginx.url("merged.safetensors"))
    _same_as_local(remote_st, shardscope.open(FIXTURES / "app_state" / "merged.safetensors"))
    for k, v in load_file(str(FIXTURES / "app_state" / "merged.safetensors")).items():
        assert_bitwise(remote_st.read(k, framework="torch"), v, k)


def test_url_errors_name_the_url(nginx):
    url = nginx.url("missing/")
    with pytest.raises(ShardscopeError) as e:
        shardscope.open(url)
    assert nginx.url("missing") in str(e.value), str(e.value)


# ----- 7. rows -----------------------------------------------------------------------------------------


def test_rows_dcp_and_fsdp2(tmp_path):
    dcp_full = dcp_as_torch(EXAMPLES / "fsdp2_dcp", tmp_path)
    hsdp_full = flatten(torch_load(FIXTURES / "fsdp2_hsdp" / "expected" / "ws4_2x2_full.pt"))
    cases = [
        (shardscope.open(EXAMPLES / "fsdp2_dcp"), "model.embed.weight", dcp_full["model.embed.weight"]),
        (shardscope.open(FIXTURES / "fsdp2_hsdp" / "ws4_2x2"), "model.embed.weight", hsdp_full["model.embed.weight"]),
        (shardscope.open(FIXTURES / "fsdp2_hsdp" / "ws4_2x2"), "optim.state.embed.weight.exp_avg", hsdp_full["optim.state.embed.weight.exp_avg"]),
    ]
    for ck, key, full in cases:
        n = full.shape[0]
        slices = [slice(a, b) for a in range(0, n + 1) for b in range(a, n + 1)]
        slices += [slice(-2, None), slice(None, -1), slice(None, None), slice(-100, 100), slice(3, 1), slice(n, None)]
        for s in slices:
            got = ck.read(key, framework="torch", rows=s)
            assert_bitwise(got, full[s], f"{key}[{s}]")
            got_np = ck.read(key, framework="numpy", rows=s)
            assert_bitwise(got_np, full[s], f"{key}[{s}] (numpy)")
        # a tuple is (start, stop), exactly
        assert_bitwise(ck.read(key, framework="torch", rows=(1, 3)), full[1:3], f"{key}(1, 3)")
        for bad in [(0, n + 1), (n + 1, n + 2), (3, 1)]:
            with pytest.raises(ShardscopeError):
                ck.read(key, rows=bad)
        with pytest.raises(ShardscopeError):
            ck.read(key, rows=slice(0, n, 2))


def test_rows_negative_tuple_is_a_shardscope_error():
    """rows=(-1, 2): a tuple is taken as exact bounds, and a negative one is a ShardscopeError (it once
    escaped as OverflowError from the native layer)."""
    ck = shardscope.open(EXAMPLES / "fsdp2_dcp")
    try:
        ck.read("model.embed.weight", rows=(-1, 2))
    except ShardscopeError:
        pass
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"API BUG: read(rows=(-1, 2)) raised {type(e).__name__}: {e} (expected ShardscopeError)")
    else:
        pytest.fail("read(rows=(-1, 2)) returned a tensor for a negative tuple bound")


def test_rows_zero_dim_is_an_error():
    ck = shardscope.open(FIXTURES / "fsdp2_hsdp" / "ws4_2x2")
    with pytest.raises(ShardscopeError, match="0-dim"):
        ck.read("optim.state.embed.weight.step", rows=slice(0, 1))


# ----- 8. dtype casts ------------------------------------------------------------------------------------


def test_read_dtype_cast_equals_tensor_to(tmp_path):
    want = dcp_as_torch(EXAMPLES / "fsdp2_dcp", tmp_path)
    ck = shardscope.open(EXAMPLES / "fsdp2_dcp")
    for key, t in tensors_of(want).items():
        for dt, spelled in [
            (torch.bfloat16, "bfloat16"),
            (torch.float16, torch.float16),
            (torch.float64, "float64"),
            (torch.float32, np.float32),
        ]:
            assert_bitwise(ck.read(key, framework="torch", dtype=spelled), t.to(dt), f"{key} -> {dt}")
    # from bf16 / fp16 sources (specials included) to the wider and narrower floats
    plain = torch.load(str(FORMATS / "plain" / "state_dict.pt"), weights_only=True)
    ckp = shardscope.open(FORMATS / "plain" / "state_dict.pt")
    for key in ["bf16", "f16", "f64", "special", "transposed", "col_slice", "scalar", "empty"]:
        for dt in [torch.bfloat16, torch.float16, torch.float32, torch.float64]:
            name = str(dt).removeprefix("torch.")
            got, want_t = ckp.read(key, framework="torch", dtype=name), plain[key].to(dt)
            if key == "special":  # NaN payloads: see test_cast_nan_bits_equal_torch
                keep = ~torch.isnan(want_t)
                assert torch.isnan(got).equal(~keep), f"{key} -> {name}: NaN positions"
                got, want_t = got[keep], want_t[keep]
            assert_bitwise(got, want_t, f"{key} -> {name}")


def test_cast_nan_bits_equal_torchs_scalar_conversion():
    """torch's own float32 -> bfloat16 `Tensor.to` gives NaN two bit patterns on CPU: 0x7FC0 from its
    scalar conversion (c10::BFloat16, a 0-dim tensor) and 0xFFFF from its vectorized path (which depends
    on the CPU's instruction set). shardscope's cast is bitwise torch's scalar conversion, element by
    element; against the vectorized path only NaN payloads may differ."""
    ck = shardscope.open(FORMATS / "plain" / "state_dict.pt")
    full = torch.load(str(FORMATS / "plain" / "state_dict.pt"), weights_only=True)["special"]
    got = ck.read("special", framework="torch", dtype="bfloat16")
    scalar = torch.stack([x.clone().reshape(()).to(torch.bfloat16) for x in full.reshape(-1)]).reshape(full.shape)
    g = [hex(x & 0xFFFF) for x in got.view(torch.int16).reshape(-1).tolist()]
    w = [hex(x & 0xFFFF) for x in scalar.view(torch.int16).reshape(-1).tolist()]
    assert g == w, f"bf16 cast: shardscope bits {g} != torch's scalar conversion {w}"
    vector = full.to(torch.bfloat16)
    nan = torch.isnan(vector)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), vector[~nan].view(torch.int16))


def test_state_dict_dtype_casts_floats_only():
    path = FORMATS / "plain" / "state_dict.pt"
    want = flatten(torch.load(str(path), weights_only=True))
    sd = shardscope.open(path).state_dict(dtype=torch.float16, framework="torch")
    for k, v in want.items():
        if not isinstance(v, torch.Tensor):
            assert sd[k] == jsonish(v), k
        elif v.is_floating_point():
            assert_bitwise(sd[k], v.to(torch.float16), k)
        else:
            assert_bitwise(sd[k], v, k)  # integers and bools are kept as stored


# ----- 9. tied weights ------------------------------------------------------------------------------------


def _storage_groups(sd: dict) -> list:
    """Key groups that share a storage (same data_ptr, shape, stride, offset), as torch.load gives them."""
    groups: dict = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            sig = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride(), v.dtype)
            groups.setdefault(sig, []).append(k)
    return [g for g in groups.values() if len(g) > 1]


def test_tied_weights_follow_torch_storage_sharing():
    path = FIXTURES / "doctor" / "tied_reference.pt"
    want = torch.load(str(path), weights_only=True)
    tied = _storage_groups(want)
    assert tied, "the fixture must tie at least one pair (embed.weight / head.weight)"
    ck = shardscope.open(path)
    sd = ck.state_dict(keep_tied=True, framework="torch")
    assert list(sd) == list(want)
    for k, v in want.items():
        assert_bitwise(sd[k], v, k)
    for group in tied:
        first = sd[group[0]]
        for other in group[1:]:
            assert sd[other] is first, f"keep_tied=True: {other} is not the same object as {group[0]}"
    # keys that share no storage are distinct objects
    untied = [k for k in want if not any(k in g for g in tied)]
    assert len({id(sd[k]) for k in untied}) == len(untied)

    dropped = ck.state_dict(keep_tied=False, framework="torch")
    aliases = {k for g in tied for k in g[1:]}  # torch keeps the first name of a shared storage
    assert set(dropped) == set(want) - aliases, f"keep_tied=False kept {sorted(set(dropped) & aliases)}"
    for k, v in dropped.items():
        assert_bitwise(v, want[k], k)


def test_untied_fixture_keeps_every_key():
    path = FIXTURES / "doctor" / "tied_noalias.pt"
    want = torch.load(str(path), weights_only=True)
    assert not _storage_groups(want)
    ck = shardscope.open(path)
    for keep in (True, False):
        sd = ck.state_dict(keep_tied=keep, framework="torch")
        assert list(sd) == list(want)
        for k, v in want.items():
            assert_bitwise(sd[k], v, k)


# ----- 10. errors ---------------------------------------------------------------------------------------


def _api_error(fn) -> str:
    try:
        fn()
    except ShardscopeError as e:
        return str(e)
    except BaseException as e:  # noqa: BLE001
        pytest.fail(f"raised {type(e).__name__}, not ShardscopeError: {e}")
    pytest.fail("no error raised")


@pytest.mark.parametrize(
    "path",
    [
        FIXTURES / "does_not_exist.pt",
        FIXTURES / "doctor" / "truncated.pt",
        FIXTURES / "doctor" / "lfs_pointer.pt",
    ],
    ids=lambda p: p.name,
)
def test_open_errors_match_the_cli(path):
    def go():
        ck = shardscope.open(path)
        ck.state_dict(framework="torch")  # a partly readable file may open: reading all of it must fail

    msg = _api_error(go)
    assert path.name in msg, f"the message does not name {path.name}: {msg}"
    cli = cli_error(path)
    assert path.name in cli, cli
    # each of these fails at open in both: the API's message is the command's, word for word
    assert shardscope_open_fails(path), f"shardscope.open({path.name}) succeeded"
    assert msg == cli, f"API: {msg!r}\nCLI: {cli!r}"


def shardscope_open_fails(path) -> bool:
    try:
        shardscope.open(path)
    except ShardscopeError:
        return True
    return False


def test_unsafe_pickle_is_never_executed(capfd):
    """unsafe.pt pickles `os.system("echo this would run")` under `callback`: the reader must never call
    it. The CLI reads the file (exit 0) and lists `callback` as a scalar; the API does the same."""
    path = FIXTURES / "doctor" / "unsafe.pt"
    ck = shardscope.open(path)
    sd = ck.state_dict(framework="torch")
    out, err = capfd.readouterr()
    assert "this would run" not in out + err, "os.system ran"
    assert ck.info("callback")["kind"] != "tensor"
    assert not callable(sd["callback"]) and isinstance(sd["callback"], (str, type(None), dict)), repr(sd["callback"])
    # the model part is the trained Net that gen_doctor.py also saved alone as clean.pt
    clean = torch.load(str(FIXTURES / "doctor" / "clean.pt"), weights_only=True)
    model = ck.state_dict(select="model", framework="torch")
    assert list(model) == list(clean)
    for k, v in clean.items():
        assert_bitwise(model[k], v, k)
    # torch's safe loader refuses it: shardscope must not be more permissive in *executing* it
    with pytest.raises(Exception):
        torch.load(str(path), weights_only=True)


def test_missing_key_and_non_tensor_key():
    path = EXAMPLES / "fsdp2_dcp"
    ck = shardscope.open(path)
    msg = _api_error(lambda: ck.read("model.nope"))
    assert "model.nope" in msg, msg
    msg = _api_error(lambda: ck.info("model.nope"))
    assert "model.nope" in msg, msg
    msg = _api_error(lambda: ck.value("model.nope"))
    assert "model.nope" in msg, msg
    non_tensor = next(k for k in ck.keys() if ck.info(k)["kind"] != "tensor")
    msg = _api_error(lambda: ck.read(non_tensor))
    assert non_tensor in msg and "fsdp2_dcp" in msg, msg
    msg = _api_error(lambda: ck.read("model.embed.weight", framework="jax"))
    assert "framework" in msg
    assert "model.nope" not in ck and 3 not in ck
