"""Interop check for `shardscope reshard` / per-rank convert with real torch (gloo, CPU).

  make SRC WS UOP [S [M]]
                      train NestedModel (or M, below) (tests/fixtures/optim/gen_optim.py) under FSDP1 on WS ranks
                      for 2 Adam steps; write per rank model_rank{r}.pt (LOCAL_STATE_DICT) and
                      optim_rank{r}.pt (optim.state_dict()); rank 0 also writes torch's own
                      full_model.pt (FULL_STATE_DICT) and full_optim.pt (FSDP.optim_state_dict).
  check SRC DST WS UOP [S [M]]
                      on WS ranks: model A loads DST/model_rank{r}.pt with LOCAL_STATE_DICT and
                      DST/optim_rank{r}.pt with optim.load_state_dict; model B loads SRC/full_*.pt
                      through torch's own path (FULL_STATE_DICT + optim_state_dict_to_load). The
                      parameters, LOCAL state dicts and optimizer state must be equal; then both take
                      one more step on the same input and must still be equal.
M = `net` checks the `Net` of tests/fixtures/fsdp2_optim/gen_fsdp2_optim.py instead (the model of
the FSDP2 fixtures) with its two-group Adam, wrapped with FSDP1 units `block` and the root (whose
parameters mix requires_grad, so UOP must be 1); `net_split` wraps `frozen`, `block`, `head` and the
root (every flat parameter then has one requires_grad and one parameter group, so UOP 0 works too).
SRC/full then holds torch's full state dicts of an FSDP2 fixture (`expected/*_full.pt`, split into
the two files).
With FSDP1_PARAM_DTYPE=bfloat16 (environment) every unit is wrapped with
`MixedPrecision(param_dtype=...)` in both modes.
S = `no_shard` wraps with NO_SHARD (torch then saves and loads FULL state dicts on every rank).
With S (a shard group size below WS) the model is wrapped with HYBRID_SHARD on the explicit groups of
the 2-D mesh `init_device_mesh("cpu", (WS // S, S))`, passed as `process_group=(shard, replicate)`
(without explicit groups HYBRID_SHARD on CPU silently shards over all ranks; with `device_mesh=`
torch refuses LOCAL_STATE_DICT). Ranks load LOCAL files inside `load_with_process_group(shard
group)`, as torch's ShardedTensors of hybrid models require.
Exit status 0 when every check passes; failures are printed.
"""

import atexit
import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "tests" / "fixtures" / "optim"))
sys.path.insert(0, str(HERE.parents[2] / "tests" / "interop"))
sys.path.insert(0, str(HERE.parents[2] / "tests" / "fixtures" / "fsdp2_optim"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gen_fsdp2_optim import Net  # noqa: E402
from gen_optim import NestedModel, train, wrap_nested  # noqa: E402
from ranks import finish, spawn  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from torch.distributed.fsdp import (  # noqa: E402
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    StateDictType,
)


MESH = None
NO_SHARD = False
MODEL = "nested"


def init_mesh(ws, shard):
    """The (replicate, shard) mesh of a hybrid run, or None; `shard` -1 means NO_SHARD."""
    global MESH, NO_SHARD
    NO_SHARD = shard == -1
    if shard and 0 < shard < ws:
        from torch.distributed.device_mesh import init_device_mesh

        MESH = init_device_mesh("cpu", (ws // shard, shard), mesh_dim_names=("replicate", "shard"))


def build(uop):
    torch.manual_seed(0)
    model = NestedModel() if MODEL == "nested" else Net()
    kw = dict(device_id=torch.device("cpu"), use_orig_params=uop)
    if os.environ.get("FSDP1_PARAM_DTYPE"):
        from torch.distributed.fsdp import MixedPrecision

        kw.update(mixed_precision=MixedPrecision(param_dtype=getattr(torch, os.environ["FSDP1_PARAM_DTYPE"]), cast_forward_inputs=True))
    if NO_SHARD:
        from torch.distributed.fsdp import ShardingStrategy

        kw.update(sharding_strategy=ShardingStrategy.NO_SHARD)
    if MESH is not None:
        from torch.distributed.fsdp import ShardingStrategy

        # torch 2.15 refuses LOCAL_STATE_DICT for a model wrapped with `device_mesh=` ("DeviceMesh
        # is not compatible with LOCAL_STATE_DICT"), so the mesh's two groups are passed as the
        # explicit (intra-node, inter-node) process groups instead.
        kw.update(
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            process_group=(MESH.get_group("shard"), MESH.get_group("replicate")),
        )
    if MODEL != "nested":
        # gen_fsdp2_optim.build with FSDP1 units in place of `fully_shard`; its two Adam groups
        # are `block` and `head` (second) and the rest (first), by name as FSDP1 wraps them.
        units = ["frozen", "block", "head"] if MODEL == "net_split" else ["block"]
        for unit in units:
            setattr(model, unit, FSDP(getattr(model, unit), **kw))
        model = FSDP(model, **kw)
        groups = ([], [])
        for name, p in model.named_parameters():
            groups[".block." in name or ".head." in name].append(p)
        optim = torch.optim.Adam(
            [
                {"params": groups[0]},
                {"params": groups[1], "lr": 0.02, "betas": (0.8, 0.95), "weight_decay": 0.1},
            ],
            lr=0.01,
        )
        return model, optim
    model, _ = wrap_nested(model, kw)
    if "mixed_precision" in kw:
        # block2[0] is not wrapped: it keeps float32 weights and gets block1's bfloat16 output.
        model.block2[0].register_forward_pre_hook(lambda _m, args: tuple(a.float() for a in args))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optim


def step_input(step):
    if MODEL != "nested":
        return torch.randint(0, 5, (3, 2), generator=torch.Generator().manual_seed(step))
    return NestedModel.input(step)


def full_ctx(model):
    return FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
    )


def local_ctx(model):
    return FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig())


def make(rank, ws, uop, src):
    model, optim = build(uop)
    train(model, optim, step_input, steps=2)
    # Hybrid: torch 2.15 builds a LOCAL ShardedTensor with the rank *within* the shard group as
    # its placement, which it then rejects on every replica but the first ("Global rank 0 does not
    # exist in input process group: [2, 3]"), so only the first replica saves per-rank files.
    if MESH is None or rank < MESH.size(1):
        with local_ctx(model):
            torch.save(model.state_dict(), src / f"model_rank{rank}.pt")
        torch.save(optim.state_dict(), src / f"optim_rank{rank}.pt")
    with full_ctx(model):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, optim)
    if rank == 0:
        torch.save(msd, src / "full" / "full_model.pt")
        torch.save(osd, src / "full" / "full_optim.pt")


def equal(a, b, path, errors):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if hasattr(a, "local_tensor"):
            a, b = a.local_tensor(), b.local_tensor()
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            errors.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
        elif a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            errors.append(f"{path}: tensors differ ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)})")
    elif isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            errors.append(f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b)) if isinstance(b, dict) else b}")
            return
        for k in a:
            equal(a[k], b[k], f"{path}/{k}", errors)
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            errors.append(f"{path}: {a!r} vs {b!r}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            equal(x, y, f"{path}/{i}", errors)
    elif a != b:
        errors.append(f"{path}: {a!r} vs {b!r}")


def local_tensors(sd):
    """A LOCAL state dict with each ShardedTensor replaced by its local shard."""
    return {k: (v.local_shards()[0].tensor.clone() if v.local_shards() else torch.empty(0)) if hasattr(v, "local_shards") else v.clone() for k, v in sd.items()}


def local_sd(model):
    with local_ctx(model):
        return local_tensors(model.state_dict())


def check(rank, ws, uop, src, dst):
    errors = []
    # A: our files through torch's LOCAL path.
    a, opt_a = build(uop)
    with local_ctx(a):
        if MESH is not None:
            from torch.distributed._shard.api import load_with_process_group

            with load_with_process_group(MESH.get_group("shard")):
                sd = torch.load(dst / f"model_rank{rank}.pt", weights_only=False)
        else:
            sd = torch.load(dst / f"model_rank{rank}.pt", weights_only=False)
        ours = local_tensors(sd)
        if uop:
            # torch 2.15 converts the `_flat_param` entries of a use_orig_params=True LOCAL state
            # dict, then reports them as unexpected (it does so for its own files too) and loads
            # the per-parameter entries, so load non-strictly and require exactly those keys to be
            # reported (the `_flat_param` entries are checked against torch's below).
            res = a.load_state_dict(sd, strict=False)
            flat = sorted(k for k in sd if k.endswith("_flat_param"))
            if res.missing_keys or sorted(res.unexpected_keys) != flat:
                errors.append(f"rank{rank}: LOCAL load reported {res}")
        else:
            a.load_state_dict(sd)
    opt_a.load_state_dict(torch.load(dst / f"optim_rank{rank}.pt", weights_only=True))
    # B: torch's own full dicts.
    b, opt_b = build(uop)
    full_m = torch.load(src / "full" / "full_model.pt", weights_only=True)
    full_o = torch.load(src / "full" / "full_optim.pt", weights_only=True)
    with full_ctx(b):
        b.load_state_dict(full_m)
        opt_b.load_state_dict(FSDP.optim_state_dict_to_load(b, opt_b, full_o))
    # torch's own path can hand several parameters one shared 0-d `step` tensor (the unflattened
    # state of one flat parameter), which Adam then increments once per parameter; a training run
    # has one per parameter. Compare against that.
    shared = {}
    for st in opt_b.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                if id(v) in shared:
                    st[k] = v.clone()
                shared[id(v)] = True
    # Our file itself must hold what torch's own LOCAL state dict holds: with use_orig_params the
    # load takes the per-parameter entries and ignores `_flat_param`, which only this sees.
    if MESH is None or rank < MESH.size(1):
        equal(ours, local_sd(b), f"rank{rank} our model file vs torch's LOCAL state dict", errors)
    for stage in ("loaded", "after one more step"):
        equal(dict(a.named_parameters()), dict(b.named_parameters()), f"rank{rank} {stage} params", errors)
        if MESH is None or rank < MESH.size(1):  # torch cannot build LOCAL dicts on other replicas
            equal(local_sd(a), local_sd(b), f"rank{rank} {stage} LOCAL state dict", errors)
        equal(opt_a.state_dict(), opt_b.state_dict(), f"rank{rank} {stage} optimizer", errors)
        if stage == "loaded":
            for m, o in ((a, opt_a), (b, opt_b)):
                o.zero_grad()
                m(step_input(7)).pow(2).sum().backward()
                o.step()
    for e in errors[:20]:
        print(e, file=sys.stderr)
    return not errors


def worker(rank, ws, store, mode, uop, src, dst, results, shard, model):
    global MODEL
    import warnings

    warnings.filterwarnings("ignore")
    MODEL = model
    # A file store, not a TCP port: no race with other tests picking the same free port.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ws)
    torch.use_deterministic_algorithms(True)
    init_mesh(ws, shard)
    ok = True
    if mode == "make":
        make(rank, ws, uop, Path(src))
    else:
        ok = check(rank, ws, uop, Path(src), Path(dst))
    if not ok:
        Path(results, f"fail{rank}").write_text("x")
    finish()


def fresh_store():
    """A path for a new gloo FileStore (the file must not exist yet)."""
    d = tempfile.mkdtemp(prefix="shardscope-store-")
    atexit.register(shutil.rmtree, d, True)
    return os.path.join(d, "store")


def shard_arg(arg):
    """S (hybrid shard group size; 0: FULL_SHARD) or `no_shard` (-1)."""
    return -1 if arg == "no_shard" else int(arg)


def main():
    mode = sys.argv[1]
    if mode == "make":
        src, ws, uop, dst = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", ""
        shard = shard_arg(sys.argv[5]) if len(sys.argv) > 5 else 0
        model = sys.argv[6] if len(sys.argv) > 6 else "nested"
        (src / "full").mkdir(parents=True, exist_ok=True)
    else:
        src, dst, ws, uop = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
        shard = shard_arg(sys.argv[6]) if len(sys.argv) > 6 else 0
        model = sys.argv[7] if len(sys.argv) > 7 else "nested"
    if model not in ("nested", "net", "net_split"):
        sys.exit(f"unknown model {model!r} (nested, net, net_split)")
    results = Path(src) / "full"
    spawn(worker, (ws, fresh_store(), mode, uop, str(src), str(dst), str(results), shard, model), ws)
    fails = sorted(p.name for p in results.glob("fail*"))
    for p in results.glob("fail*"):
        p.unlink()
    if fails:
        sys.exit(f"{mode}: checks failed on {fails}")
    print(f"{mode}: ok ({ws} ranks, use_orig_params={uop}, shard group {shard or ws}, {model})")  # -1: NO_SHARD


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, PYTHONHASHSEED="0"))
    main()
