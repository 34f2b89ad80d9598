"""shardscope: look inside, read, convert and check sharded PyTorch checkpoints (FSDP1, FSDP2, HSDP, DCP,
per-rank files, safetensors, HF shards), local or remote, without torch.

>>> import shardscope
>>> ck = shardscope.open("examples/fsdp2_dcp")            # a folder, a file, per-rank files or a URL
>>> ck.kind, ck.world_size
('dcp_torch_save', 2)
>>> ck.info("model.embed.weight")["shape"]
(32, 16)
>>> w = ck.read("model.embed.weight")                       # numpy.ndarray, assembled from both ranks
>>> sd = ck.state_dict(select="model", framework="torch")  # {name: torch.Tensor}, torch imported only now

Arrays are numpy's unless `framework="torch"` is given, for `read` and `state_dict` alike (numpy is
the default everywhere: torch is imported only when asked for).
>>> sd["embed.weight"].shape
torch.Size([32, 16])

The same reader as the `shardscope` command (which this wheel also installs). Every failure raises
`shardscope.ShardscopeError` with the command's message.
"""

from __future__ import annotations

import builtins
import json
import mmap
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union, cast

from shardscope import _native
from shardscope._native import ShardscopeError

__all__ = [
    "Checkpoint",
    "ShardscopeError",
    "convert",
    "describe",
    "diff",
    "doctor",
    "hash",
    "layout",
    "open",
    "verify",
]
__version__: str = _native.__version__

PathLike = Union[str, "os.PathLike[str]"]
Rows = Union[slice, Tuple[int, int]]

# Floating dtypes a read can be cast to (`dtype=`); others are read as stored.
_CASTABLE = ("float16", "bfloat16", "float32", "float64")
# dtypes numpy has no type for: ml_dtypes has them (when installed).
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def _dtype_name(dtype: Any) -> Optional[str]:
    """`torch.bfloat16`, `numpy.float32`, `"bf16"` -> a name the reader parses (None stays None)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return dtype
    name = str(dtype)
    if name.startswith("torch."):
        return name[len("torch.") :]
    try:  # numpy dtypes and scalar types
        import numpy as np

        return str(np.dtype(dtype))
    except Exception:
        return name


def _framework(framework: str) -> str:
    if framework not in ("numpy", "torch"):
        raise ShardscopeError(f'framework={framework!r}: expected "numpy" or "torch"')
    return framework


def _import(module: str, framework: str) -> Any:
    """numpy or torch, imported only when a tensor is returned as one."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        other = "torch" if framework == "numpy" else "numpy"
        raise ShardscopeError(
            f"framework={framework!r} needs {module}, which is not installed\n"
            f"hint: `pip install {module}`, or read with framework={other!r}"
        ) from None


def _numpy_dtype(name: str, key: str, cast_from: Optional[str] = None) -> Any:
    """The numpy dtype of `name`; `cast_from`: the stored dtype when `name` is a cast's target."""
    np = _import("numpy", "numpy")

    if name in _ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError:
            what = (
                f"{key} ({cast_from}) cast to {name}: numpy has no {name} type"
                if cast_from is not None and cast_from != name
                else f"{key} is {name}, which numpy has no type for"
            )
            raise ShardscopeError(
                f"{what}\n"
                f'hint: read it with framework="torch", or `pip install ml_dtypes`'
            ) from None
        return np.dtype(getattr(ml_dtypes, name))
    if name == "complex32":
        raise ShardscopeError(f'{key} is complex32, which numpy has no type for\nhint: read it with framework="torch"')
    return np.dtype(name).newbyteorder("<")


def _torch_dtype(name: str, key: str) -> Any:
    torch = _import("torch", "torch")

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ShardscopeError(f"{key} is {name}, which this torch ({torch.__version__}) has no dtype for")
    return dtype


def _optional(module: str) -> Any:
    """`module` when it is installed, else None."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _wrap(buf: Any, dtype: str, shape: Sequence[int], framework: str, key: str, offset: int = 0) -> Any:
    """The tensor over `buf` (a numpy uint8 array, a bytearray or a mapping; no copy), `offset` bytes in:
    a numpy array or a torch tensor."""
    count = 1
    for d in shape:
        count *= int(d)
    if framework == "numpy":
        np = _import("numpy", "numpy")
        return np.frombuffer(buf, dtype=_numpy_dtype(dtype, key), count=count, offset=offset).reshape(tuple(shape))
    torch = _import("torch", "torch")
    tdtype = _torch_dtype(dtype, key)
    if count == 0:
        return torch.empty(tuple(shape), dtype=tdtype)
    if sys.byteorder != "little":
        raise ShardscopeError("reading into torch tensors needs a little-endian machine")
    return torch.frombuffer(buf, dtype=tdtype, count=count, offset=offset).reshape(tuple(shape))


# `state_dict` shows progress on a terminal from this many bytes on.
_PROGRESS_BYTES = 1 << 30


class _Progress:
    """`shardscope: <label>: 1.2 of 8.0 GiB (15%)` on stderr, redrawn at most 5 times a second."""

    def __init__(self, total: int, label: str) -> None:
        import threading
        import time

        self._total, self._label, self._done = max(total, 1), label, 0
        self._lock, self._time, self._last = threading.Lock(), time.monotonic, 0.0

    def _draw(self, end: str) -> None:
        gib = 1 << 30
        sys.stderr.write(
            f"\rshardscope: {self._label}: {self._done / gib:.1f} of {self._total / gib:.1f} GiB "
            f"({100 * self._done // self._total}%){end}"
        )
        sys.stderr.flush()

    def advance(self, n: int) -> None:
        with self._lock:
            self._done += n
            now = self._time()
            if now - self._last >= 0.2:
                self._last = now
                self._draw("")

    def finish(self) -> None:
        with self._lock:
            self._draw("\n")


class Checkpoint:
    """A checkpoint opened by `shardscope.open`: its keys, what each holds, and its tensors.

    Keys are the checkpoint's flattened keys (`model.layers.0.attn.weight`,
    `optim.state.model.embed.weight.exp_avg`), in the order the checkpoint stores them. Tensors are
    global: the chunks of every rank assembled, padding removed, as torch's own consolidation gives.
    """

    def __init__(self, native: _native.Checkpoint) -> None:
        self._ck = native
        self._maps: Dict[str, mmap.mmap] = {}

    # -- what it holds -------------------------------------------------------------------------
    def keys(self) -> List[str]:
        """The keys, in stored order (registration order for a state dict, `.metadata` order for DCP)."""
        return self._ck.keys()

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._ck.__contains__(key)

    def __len__(self) -> int:
        return self._ck.__len__()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return self._ck.__repr__()

    @property
    def label(self) -> str:
        """The path or URL it was opened from, as messages name it."""
        return self._ck.label

    @property
    def kind(self) -> str:
        """What it looks like: `dcp`, `fsdp2`, `fsdp1_sharded`, `fsdp1_local`, `rank_local`, `plain`, ..."""
        return self._ck.kind

    @property
    def format(self) -> str:
        """The file format: `dcp`, `safetensors` or `torch_save`."""
        return self._ck.format

    @property
    def world_size(self) -> int:
        """Ranks that wrote it: what it states (a DTensor mesh, DCP's planner), else its highest rank + 1."""
        return self._ck.world_size

    @property
    def view(self) -> str:
        """How it was read: `stored`, `fsdp1` (per-rank pieces through `model=`'s layout) or `fsdp2`."""
        return self._ck.view

    @property
    def notes(self) -> List[str]:
        """What to know about how it was read (the command prints these as `note: ...`)."""
        return self._ck.notes

    @property
    def written_by(self) -> Optional[str]:
        """What wrote it, when its files say: `Megatron-core dist_checkpointing (torch_dist; ...)`,
        `accelerate save_state`, `Hugging Face Trainer checkpoint ...`, `Lightning ...`, ...; else None."""
        return self._ck.written_by

    def info(self, key: str) -> Dict[str, Any]:
        """`dict(kind, dtype, shape, chunks, ranks, nbytes)` of `key`, without reading its values.

        >>> ck.info("model.embed.weight")
        {'kind': 'tensor', 'dtype': 'float32', 'shape': (32, 16), 'chunks': 2, 'ranks': [0, 1], 'nbytes': 2048}
        """
        return self._ck.info(key)

    def verify(self, manifest: PathLike, *, threads: Optional[int] = None) -> Dict[str, Any]:
        """This checkpoint, as opened, checked against a content manifest (`shardscope hash -o`, or
        the one `convert --write-manifest` writes): every tensor and value digested with the manifest's
        algorithm and compared key by key. Returns the report `verify --manifest --json` prints:
        `summary` (`mismatched`, `missing`, `unexpected`, ...) and `entries` naming each key that
        differs with the file and byte range of the differing chunk.

        >>> ck = shardscope.open("ckpt/")
        >>> ck.verify(manifest="ckpt.manifest.json")["summary"]["mismatched"]
        0
        """
        return json.loads(self._ck.verify_manifest(os.fspath(manifest), threads))

    # -- values --------------------------------------------------------------------------------
    def read(
        self,
        key: str,
        *,
        framework: str = "numpy",
        dtype: Any = None,
        rows: Optional[Rows] = None,
        mmap: bool = False,
    ) -> Any:
        """The tensor `key`, assembled from its chunks straight into the returned buffer.

        framework: "numpy" (numpy.ndarray; bfloat16/float8 need `ml_dtypes`) or "torch" (torch.Tensor).
        dtype: cast floating tensors to this (`"bfloat16"`, `torch.float32`, ...), as `Tensor.to` does.
        rows: `slice(a, b)` (or `(a, b)`) of dim 0: only those rows' bytes are read.
        mmap: a tensor stored whole and contiguous in one local file (a safetensors tensor, a
            one-chunk DCP item, a `torch.save` storage) is returned over a copy-on-write mapping of
            the file instead of being read: nothing is read until used, and writes stay private.
            As with `safetensors` and `torch.load(mmap=True)`, a file truncated while such a tensor
            is in use ends the process (SIGBUS); the default reads into memory the tensor owns.

        >>> ck.read("model.embed.weight", rows=slice(0, 2)).shape
        (2, 16)
        """
        framework = _framework(framework)
        info = self._ck.info(key)
        if info["kind"] != "tensor":
            raise ShardscopeError(f"{self.label}: {key} is not a tensor ({info['kind']}): use value()")
        to = _dtype_name(dtype)
        out_dtype = to if to is not None else info["dtype"]
        # Before reading: a missing numpy, ml_dtypes or torch fails at once.
        if framework == "numpy" and out_dtype is not None:
            _numpy_dtype(out_dtype, key, cast_from=info["dtype"] if to is not None else None)
        elif out_dtype is not None:
            _torch_dtype(out_dtype, key)
        span = self._rows(key, info, rows)
        if mmap and (to is None or to == info["dtype"]):
            where = self._ck.locate(key, span)
            if where is not None:
                return self._mapped(key, where, info, span, framework)
        np = _optional("numpy")
        if np is not None:
            need, nbytes, got, shape = self._ck.plan(key, to, span)
            # numpy.empty: fresh memory, not zero-filled; the reader writes every byte of the result.
            buf = np.empty(need, dtype=np.uint8)
            self._ck.read_into(key, buf, to, span)
            if need != nbytes:  # a narrowing cast, done in place: keep the result only
                buf = buf[:nbytes].copy()
            return _wrap(buf, got, shape, framework, key)
        data, got, shape = self._ck.read(key, to, span)
        return _wrap(data, got, shape, framework, key)

    def _mapped(
        self,
        key: str,
        where: Tuple[str, int, int],
        info: Mapping[str, Any],
        span: Optional[Tuple[int, int]],
        framework: str,
    ) -> Any:
        """The tensor over a copy-on-write mapping of the file that holds it."""
        path, offset, length = where
        mapping = self._maps.get(path)
        if mapping is None:
            with builtins.open(path, "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[path] = mapping
        if offset + length > len(mapping):
            raise ShardscopeError(f"{path}: {key}: the file is shorter than when it was opened (was it replaced?)")
        shape = list(info["shape"])
        if span is not None:
            shape[0] = span[1] - span[0]
        return _wrap(mapping, info["dtype"], shape, framework, key, offset=offset)

    def value(self, key: str) -> Any:
        """A non-tensor entry's value (a step count, a learning rate, a param group's list)."""
        return json.loads(self._ck.value_json(key))

    def mapped(
        self,
        to: str,
        config: Union[PathLike, Mapping[str, Any]],
        *,
        mapping: Optional[PathLike] = None,
    ) -> "Checkpoint":
        """The model part (found as `convert --model-only` finds it) in another naming, as
        `shardscope convert --to` writes it: `to="hf"` gives Hugging Face names (RoPE rows
        permuted, experts one by one, the tied head once), `to="torchtitan"` torchtitan's.

        config: the Hugging Face `config.json` (a path, or the dict) of the model: it chooses the
            mapping with the stored names and gives the head counts and shapes checked.
        mapping: a mapping file of one's own (`shardscope mappings NAME` prints a built-in one).

        Nothing is read until a tensor is: a permuted or split tensor is made from the stored
        one when it is read.

        >>> hf = shardscope.open("step-1000/").mapped("hf", config="config.json")
        >>> hf.keys()[:1]
        ['model.embed_tokens.weight']
        """
        if isinstance(config, Mapping):
            text = json.dumps(config)
        else:
            with builtins.open(os.fspath(config), "rb") as f:
                text = f.read().decode("utf-8")
        mapping_text = mapping_name = None
        if mapping is not None:
            mapping_name = os.fspath(mapping)
            with builtins.open(mapping_name, "rb") as f:
                mapping_text = f.read().decode("utf-8")
        return Checkpoint(self._ck.mapped(to, text, mapping_text, mapping_name))

    def state_dict(
        self,
        *,
        select: Optional[str] = None,
        framework: str = "numpy",
        dtype: Any = None,
        keep_tied: bool = True,
        mmap: bool = False,
        threads: Optional[int] = None,
        progress: Optional[bool] = None,
        to: Optional[str] = None,
        config: Union[None, PathLike, Mapping[str, Any]] = None,
        mapping: Optional[PathLike] = None,
    ) -> Dict[str, Any]:
        """Every key (or those under `select.`, prefix removed) as {name: tensor or value}, in stored order.

        to, config, mapping: the model part in another naming, as `mapped(to, config)` gives it
            (`to="hf"`: ready for `AutoModelForCausalLM.from_config(config).load_state_dict`).

        select: an app-state prefix, e.g. "model" for a DCP written as {"model": ..., "optim": ...}.
        dtype: floating tensors are cast to it (integers and bools are kept), as `convert --dtype`.
        keep_tied: True keeps every name of a tied weight (the same tensor object where the checkpoint
            shares the storage, as `model.state_dict()` does); False drops the aliases, as `convert` does.
        mmap: tensors stored whole in one local file are mapped, not read (see `read`): what
            `safetensors.torch.load_file` does.
        threads: tensors read at a time (default: the CPU count, at most 16).
        progress: a progress line on stderr (default: when stderr is a terminal and there is 1 GiB
            or more to read).

        framework: "numpy" (the default, as for `read`: numpy.ndarray, bfloat16/float8 need
            `ml_dtypes`) or "torch" (torch.Tensor, what `load_state_dict` takes).

        >>> model.load_state_dict(shardscope.open("ckpt/").state_dict(select="model", framework="torch"))
        """
        if to is not None or config is not None:
            if to is None or config is None:
                raise ShardscopeError(f"{self.label}: state_dict(to=..., config=...) takes both (to='hf' and the model's config.json)")
            return self.mapped(to, config, mapping=mapping).state_dict(
                select=select, framework=framework, dtype=dtype, keep_tied=keep_tied, mmap=mmap,
                threads=threads, progress=progress,
            )
        if mapping is not None:
            raise ShardscopeError(f"{self.label}: mapping= goes with to= and config=")
        framework = _framework(framework)
        to_dtype = _dtype_name(dtype)
        keys = self.keys()
        if select:
            prefix = select.rstrip(".") + "."
            pairs = [(k, k[len(prefix) :]) for k in keys if k.startswith(prefix) and len(k) > len(prefix)]
            if not pairs:
                tops = sorted({k.split(".", 1)[0] for k in keys})
                raise ShardscopeError(
                    f"{self.label}: no key under `{prefix}`\nhint: its top-level prefixes are {', '.join(tops[:8])}"
                )
        else:
            pairs = [(k, k) for k in keys]
        infos = {k: self._ck.info(k) for k, _ in pairs}
        tensors = [k for k, _ in pairs if infos[k]["kind"] == "tensor"]
        alias_of: Dict[str, str] = {}
        dropped: Set[str] = set()
        if keep_tied:
            for kept, aliases in self._ck.storage_ties(tensors):
                for a in aliases:
                    alias_of[a] = kept
        else:
            dropped = {d for _, d in self._ck.tied_aliases(tensors)}
        # Each stored tensor once (an alias shares its source's tensor), several at a time: the reader
        # releases the GIL, so threads overlap their reads and copies. The result does not depend on
        # the number of threads.
        sources: List[str] = []
        for key, _ in pairs:
            source = alias_of.get(key, key)
            if infos[key]["kind"] == "tensor" and key not in dropped and source not in sources:
                sources.append(source)

        total = sum(int(infos[k].get("nbytes") or 0) for k in sources)
        show = progress if progress is not None else (total >= _PROGRESS_BYTES and sys.stderr.isatty())
        meter = _Progress(total, self.label) if show else None

        def read_one(source: str) -> Any:
            cast = to_dtype if to_dtype is not None and infos[source]["dtype"] in _CASTABLE else None
            tensor = self.read(source, framework=framework, dtype=cast, mmap=mmap)
            if meter is not None:
                meter.advance(int(infos[source].get("nbytes") or 0))
            return tensor

        workers = max(1, min(threads if threads is not None else (os.cpu_count() or 1), 16, len(sources)))
        if workers > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardscope") as pool:
                read = dict(zip(sources, pool.map(read_one, sources)))
        else:
            read = {source: read_one(source) for source in sources}
        if meter is not None:
            meter.finish()
        out: Dict[str, Any] = {}
        for key, name in pairs:
            if infos[key]["kind"] != "tensor":
                out[name] = self.value(key)
            elif key not in dropped:
                out[name] = read[alias_of.get(key, key)]
        return out

    def _rows(self, key: str, info: Mapping[str, Any], rows: Optional[Rows]) -> Optional[Tuple[int, int]]:
        if rows is None:
            return None
        shape = info["shape"]
        if not shape:
            raise ShardscopeError(f"{self.label}: {key} is 0-dim: it has no rows")
        if isinstance(rows, slice):
            start, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ShardscopeError(f"{self.label}: {key}: rows={rows!r}: only a step of 1 is read")
            return (start, max(start, stop))
        try:
            start, stop = (int(rows[0]), int(rows[1]))
        except (TypeError, ValueError, IndexError):
            raise ShardscopeError(f"{self.label}: {key}: rows={rows!r}: expected slice(a, b) or (a, b)") from None
        if start < 0 or stop < start or stop > shape[0]:
            raise ShardscopeError(f"{self.label}: {key}: rows {start}..{stop} are not inside its {shape[0]} rows")
        return (start, stop)


def open(
    path: Union[PathLike, Sequence[PathLike]],
    *,
    model: Union[None, PathLike, Mapping[str, Any]] = None,
    model_files: Optional[str] = None,
    optim_files: Optional[str] = None,
    model_only: bool = False,
    world_size: Optional[int] = None,
    use_orig_params: bool = False,
    strategy: Optional[str] = None,
    shard_group_size: Optional[int] = None,
    param_dtype: Any = None,
    ranks: Optional[int] = None,
) -> Checkpoint:
    """Opens a checkpoint as the `shardscope` command does.

    path: a file, a DCP or per-rank folder, an HF `*.index.json`, several per-rank files (a list), one
        URL (`https://`, `s3://`, `gs://`, `az://`; a presigned `https://…?X-Amz-Signature=…` names one
        file) or several (a list: per-rank files, a DCP's `.metadata` and `.distcp` files).
    ranks: `path` holds `{r}` (`"https://h/ckpt/model_rank{r}.pt?sig=…"`): the files of ranks 0 to
        ranks-1.
    model: the model description (a path to the `--model` JSON, or the dict `describe()` returns): FSDP1
        per-rank (LOCAL) files are read as the original parameters through its layout, with
        `world_size`, `use_orig_params`, `strategy`, `shard_group_size` and `param_dtype` as the model
        was wrapped; FSDP2 per-rank optimizer ids are named by FQN.
    model_files / optim_files: file-name patterns of the per-rank sets to read, `{r}` for the rank.
    model_only: keep the model part of a training checkpoint, with the model's own names.

    >>> ck = shardscope.open("ckpt/", model=shardscope.describe(model), world_size=4)
    """
    paths = _paths(path)
    model_path = model_json = None
    if isinstance(model, Mapping):
        model_json = json.dumps(model)
    elif model is not None:
        model_path = os.fspath(model)
    return Checkpoint(
        _native.open(
            paths,
            model_path=model_path,
            model_json=model_json,
            model_name="model=" if model_json is not None else None,
            model_files=model_files,
            optim_files=optim_files,
            model_only=model_only,
            world_size=world_size,
            use_orig_params=use_orig_params,
            strategy=strategy,
            shard_group_size=shard_group_size,
            param_dtype=_dtype_name(param_dtype),
            ranks=ranks,
        )
    )


# -- the model description of a live module ------------------------------------------------------

def _clean(name: str) -> str:
    """An FQN without the wrappers' segments (FSDP1, activation checkpointing, torch.compile)."""
    for seg in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(seg, "")
    return name


def _fsdp1_class() -> Any:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    except Exception:
        return None


def _fsdp2_class() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except Exception:
        try:
            from torch.distributed._composable import fsdp as composable

            return getattr(composable, "FSDPModule")
        except Exception:
            return None


def _params_of_fsdp1(module: Any) -> List[Tuple[str, Any, Tuple[int, ...], bool, Optional[str]]]:
    """Original parameters of an FSDP1-wrapped module, from its FlatParameters' records, in
    registration order: (fqn, dtype, shape, requires_grad, shared_with)."""
    fsdp = _fsdp1_class()
    by_module: Dict[int, List[Tuple[str, Any, Tuple[int, ...], bool]]] = {}
    shared: Dict[int, List[Tuple[str, int, str]]] = {}
    for m in module.modules():
        if not isinstance(m, fsdp) or getattr(m, "_handle", None) is None:
            continue
        fp = m._handle.flat_param
        for info, shape in zip(fp._param_infos, fp._shapes):
            by_module.setdefault(id(info.module), []).append(
                (info.param_name, fp.dtype, tuple(int(d) for d in shape), bool(fp.requires_grad))
            )
        for s in getattr(fp, "_shared_param_infos", []) or []:
            shared.setdefault(id(s.module), []).append((s.param_name, id(s.prim_module), s.prim_param_name))
    out: List[Tuple[str, Any, Tuple[int, ...], bool, Optional[str]]] = []
    fqn_of: Dict[Tuple[int, str], str] = {}
    meta_of: Dict[Tuple[int, str], Tuple[Any, Tuple[int, ...], bool]] = {}
    for raw, m in module.named_modules(remove_duplicate=False):
        prefix = _clean(raw)
        if isinstance(m, fsdp):
            continue
        join = (prefix + ".") if prefix else ""
        for name, dtype, shape, rg in by_module.get(id(m), []):
            if (id(m), name) in fqn_of:
                continue
            fqn_of[(id(m), name)] = join + name
            meta_of[(id(m), name)] = (dtype, shape, rg)
            out.append((join + name, dtype, shape, rg, None))
        for name, prim_module, prim_name in shared.get(id(m), []):
            prim = fqn_of.get((prim_module, prim_name))
            if prim is None:
                continue
            dtype, shape, rg = meta_of[(prim_module, prim_name)]
            out.append((join + name, dtype, shape, rg, prim))
    return out


def describe(module: Any, *, units: Union[None, str, Sequence[str]] = None) -> Dict[str, Any]:
    """The `--model` description (the `shardscope layout` format) of a live `torch.nn.Module`.

    Parameters come from `named_parameters(remove_duplicate=False)` in registration order; a tied
    parameter (the same object under a second name) is marked `shared_with` its first name; frozen ones
    have `requires_grad: false`. FSDP units:
    - `units`: a regex (or a list of them); every module whose name one matches in full is a unit,
      with the root (`""`);
    - else, for a module already wrapped, the wrapping: FSDP1 (`FullyShardedDataParallel`, original
      parameters read from its FlatParameters) or FSDP2 (`fully_shard`, global DTensor shapes);
    - else the repeated blocks (`model.layers.N`, `transformer.h.N`) and the root, as `layout --from`
      and the transformer-block auto-wrap policies choose them.

    >>> desc = shardscope.describe(model)
    >>> shardscope.layout(desc, world_size=8)["flat_params"][0]["sharded_numel"]  # root unit, per rank
    """
    fsdp1 = _fsdp1_class()
    fsdp2 = _fsdp2_class()
    modules = list(module.named_modules(remove_duplicate=False))
    wrapped1 = fsdp1 is not None and any(isinstance(m, fsdp1) for _, m in modules)
    wrapped2 = fsdp2 is not None and any(isinstance(m, fsdp2) for _, m in modules)
    if wrapped1:
        rows = _params_of_fsdp1(module)
    else:
        rows = []
        first: Dict[int, str] = {}
        for raw, p in module.named_parameters(remove_duplicate=False):
            fqn = _clean(raw)
            shared = first.get(id(p))
            if shared is None:
                first[id(p)] = fqn
            rows.append((fqn, p.dtype, tuple(int(d) for d in p.shape), bool(p.requires_grad), shared))
    params = []
    for fqn, dtype, shape, rg, shared in rows:
        entry: Dict[str, Any] = {"fqn": fqn, "shape": list(shape), "dtype": str(dtype).replace("torch.", "")}
        if not rg:
            entry["requires_grad"] = False
        if shared is not None:
            entry["shared_with"] = shared
        params.append(entry)
    description: Dict[str, Any] = {"params": params}
    names = {_clean(raw) for raw, _ in modules}
    if units is not None:
        patterns = [units] if isinstance(units, str) else list(units)
        try:
            compiled = [re.compile(p) for p in patterns]
        except re.error as e:
            raise ShardscopeError(f"units: not a regex: {e}") from None
        chosen = [""] + [n for n in _module_order(params) if n in names and any(c.fullmatch(n) for c in compiled)]
        description["units"] = chosen
    elif wrapped1:
        description["units"] = _dedupe(_clean(raw) for raw, m in modules if isinstance(m, fsdp1))
    elif wrapped2:
        description["units"] = _dedupe(_clean(raw) for raw, m in modules if isinstance(m, fsdp2))
    else:
        description["units"] = _native.auto_units(json.dumps({"params": params, "units": []}))
    _native.check_description(json.dumps(description), "describe()")
    return description


def _module_order(params: Sequence[Mapping[str, Any]]) -> List[str]:
    """Module prefixes in the order the parameters first reach them."""
    seen: List[str] = []
    known = set()
    for p in params:
        parts = p["fqn"].split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if prefix not in known:
                known.add(prefix)
                seen.append(prefix)
    return seen


def _dedupe(names: Any) -> List[str]:
    out: List[str] = []
    for n in names:
        if n not in out:
            out.append(n)
    return out


# -- the commands, as functions -------------------------------------------------------------------


def _flags(options: Mapping[str, Any]) -> List[str]:
    """`rtol=1e-3, equal_nan=True, rank=[0, 1]` -> `--rtol 1e-3 --equal-nan --rank 0 --rank 1`."""
    argv: List[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                argv += [flag, str(v)]
        else:
            text = _dtype_name(value) if "dtype" in name else value
            argv += [flag, os.fspath(text) if isinstance(text, os.PathLike) else str(text)]
    return argv


def _run(argv: List[str], ok: Sequence[int] = (0,)) -> str:
    """Runs `shardscope ARGV` (this package's command, in a child process) and returns its stdout. An
    exit status outside `ok` raises ShardscopeError with the command's message; its notes and warnings
    go to this process's stderr."""
    # The child imports this very package, wherever it was imported from (`pip install --target DIR`
    # and `sys.path`, a source tree): its parent folder goes first on the child's PYTHONPATH.
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "shardscope", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
        env=env,
    )
    if proc.returncode not in ok:
        message = proc.stderr.strip()
        if message.startswith("error: "):
            message = message[len("error: ") :]
        if not message:
            message = f"shardscope {argv[0]} exited with status {proc.returncode}"
        raise ShardscopeError(message)
    if proc.stderr:
        sys.stderr.write(proc.stderr)
    return proc.stdout


def _json(text: str) -> Dict[str, Any]:
    return cast(Dict[str, Any], json.loads(text))


def _paths(path: Union[PathLike, Sequence[PathLike]]) -> List[str]:
    if isinstance(path, (str, os.PathLike)):
        return [os.fspath(path)]
    return [os.fspath(p) for p in path]


def layout(
    description: Union[PathLike, Mapping[str, Any]],
    *,
    world_size: int,
    api: str = "fsdp1",
    use_orig_params: bool = False,
    **options: Any,
) -> Dict[str, Any]:
    """`shardscope layout --json`: which elements of which parameter every rank holds.

    description: the dict `describe()` returns, or a path to the JSON. options: `strategy`,
    `shard_group_size`, `param_dtype`, as the command's flags.
    """
    with tempfile.TemporaryDirectory(prefix="shardscope-") as tmp:
        if isinstance(description, Mapping):
            path = os.path.join(tmp, "model.json")
            with builtins.open(path, "w") as f:
                json.dump(description, f)
        else:
            path = os.fspath(description)
        argv = ["layout", "--model", path, "--world-size", str(world_size), "--api", api, "--json"]
        argv += _flags({"use_orig_params": use_orig_params, **options})
        return _json(_run(argv))


def doctor(
    path: Union[PathLike, Sequence[PathLike]],
    *,
    reference: Union[None, PathLike, Mapping[str, Any]] = None,
    **options: Any,
) -> Dict[str, Any]:
    """`shardscope doctor --json`: will it load, and how to fix it. `loadable` is in the result.

    reference: what the model expects, as a checkpoint path or a state dict (`model.state_dict()`).
    options: `model` (description path), `world_size`, `api`, `use_orig_params`, `model_files`, ...
    """
    with tempfile.TemporaryDirectory(prefix="shardscope-") as tmp:
        argv = ["doctor", *_paths(path), "--json"]
        if isinstance(reference, Mapping):
            ref = os.path.join(tmp, "reference.pt")
            import torch

            torch.save(dict(reference), ref)
            argv += ["--reference", ref]
        elif reference is not None:
            argv += ["--reference", os.fspath(reference)]
        model = options.pop("model", None)
        if isinstance(model, Mapping):
            mpath = os.path.join(tmp, "model.json")
            with builtins.open(mpath, "w") as f:
                json.dump(model, f)
            model = mpath
        argv += _flags({"model": model, **options})
        return _json(_run(argv, ok=(0, 1)))


def diff(a: Union[PathLike, Sequence[PathLike]], b: Union[PathLike, Sequence[PathLike]], **options: Any) -> Dict[str, Any]:
    """`shardscope diff --json`: the two checkpoints tensor by tensor (`rtol`, `atol`, `equal_nan`, `select`,
    `dtype`: floating tensors cast to it before the comparison, e.g. a bf16 export against its source)."""
    pa, pb = _paths(a), _paths(b)
    if len(pa) != 1 or len(pb) != 1:
        raise ShardscopeError("diff compares two checkpoints: give one path or URL for each")
    return _json(_run(["diff", pa[0], pb[0], "--json", "--quiet", *_flags(options)], ok=(0, 1)))


def hash(path: Union[PathLike, Sequence[PathLike]], **options: Any) -> Dict[str, Any]:  # noqa: A001
    """`shardscope hash --json`: the content manifest of a checkpoint, one digest per tensor of its
    logical value (the same for a DCP, its safetensors twin, per-rank files and torch's consolidated
    `.pt`): `{"version", "algorithm", "tensors": {key: {"dtype", "shape", "digest"}}, "files": ...}`.
    Options: `algorithm="sha256"` (default xxh3), `no_files=True`, `threads`.

    >>> m = shardscope.hash("ckpt/"); shardscope.verify("copy/", manifest="ckpt.manifest.json")"""
    return _json(_run(["hash", *_paths(path), "--json", *_flags(options)]))


def verify(path: Union[PathLike, Sequence[PathLike]], **options: Any) -> Dict[str, Any]:
    """`shardscope verify --json`: the checkpoint checked against itself (`shallow`, `model`, ...), or
    with `manifest=PATH` against a manifest `shardscope hash` wrote (`summary.mismatched`, ...)."""
    return _json(_run(["verify", *_paths(path), "--json", "--quiet", *_flags(options)], ok=(0, 1)))


def convert(src: Union[PathLike, Sequence[PathLike]], dst: PathLike, **options: Any) -> Dict[str, Any]:
    """`shardscope convert -o DST --json`: `to` ("safetensors", "torch", "dcp", "hf", "torchtitan"),
    `config` (with to="hf"/"torchtitan": the model's Hugging Face config.json), `mapping`,
    `hf_assets`, `select`, `dtype`, `world_size`, `api`, `max_shard_size`, `keep_tied`, `rename` and
    `drop` (lists), `strip_wrappers`, `threads`, ... Returns what it wrote.

    >>> shardscope.convert("outputs/checkpoint/step-1000", "llama-hf", to="hf", config="config.json")"""
    argv = ["convert", *_paths(src), "-o", os.fspath(dst), "--json", "--quiet", *_flags(options)]
    return _json(_run(argv))

