"""Shared helpers for the shardscope Python API tests: torch (and safetensors) are the oracle."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[1]  # python/tests -> python -> repo root
FIXTURES = REPO / "tests" / "fixtures"
EXAMPLES = REPO / "examples"


# ----- comparing with torch, bit for bit ---------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as bytes, in row-major order (NaN-safe: no float comparison)."""
    t = t.detach().contiguous().clone()
    return bytes(t.untyped_storage())


def assert_bitwise(got, want: torch.Tensor, key: str) -> None:
    """`got` (a torch tensor or a numpy array) equals torch's `want` bit for bit, dtype and shape included."""
    assert isinstance(want, torch.Tensor), f"{key}: torch's value is {type(want).__name__}, not a tensor"
    if isinstance(got, torch.Tensor):
        assert type(got) is torch.Tensor, f"{key}: got {type(got).__name__}, expected a plain torch.Tensor"
        assert got.dtype == want.dtype, f"{key}: dtype {got.dtype} != torch's {want.dtype}"
        assert tuple(got.shape) == tuple(want.shape), f"{key}: shape {tuple(got.shape)} != torch's {tuple(want.shape)}"
        assert raw_bytes(got) == raw_bytes(want), f"{key}: bytes differ from torch's"
    else:
        import numpy as np

        assert isinstance(got, np.ndarray), f"{key}: got {type(got).__name__}"
        want_np = want.detach().contiguous().numpy()
        assert got.dtype == want_np.dtype, f"{key}: numpy dtype {got.dtype} != torch's {want_np.dtype}"
        assert got.shape == want_np.shape, f"{key}: shape {got.shape} != torch's {want_np.shape}"
        assert np.ascontiguousarray(got).tobytes() == want_np.tobytes(), f"{key}: bytes differ from torch's"


def jsonish(v):
    """A torch-loaded non-tensor value in the form JSON gives back (tuples -> lists)."""
    if isinstance(v, (list, tuple)):
        return [jsonish(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonish(x) for k, x in v.items()}
    return v


def flatten(obj, prefix: str = "") -> dict:
    """Nested dicts (and lists/tuples holding tensors or dicts) flattened with dots, as DCP names keys."""
    out: dict = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in obj):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = obj
    return out


def tensors_of(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def torch_load(path) -> object:
    """torch.load of a fixture written by the repo's own generators (trusted; DTensors need weights_only=False)."""
    return torch.load(str(path), weights_only=False, map_location="cpu")


def dcp_as_torch(folder: Path, tmp_path: Path) -> dict:
    """torch's own reading of a DCP folder: dcp_to_torch_save + torch.load, flattened with dots."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / (folder.name + ".pt")
    dcp_to_torch_save(str(folder), str(out))
    return flatten(torch.load(str(out), weights_only=False))


# ----- nginx on 127.0.0.1 --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nginx_binary():
    env = os.environ.get("SHARDSCOPE_NGINX")
    if env:
        return Path(env) if Path(env).is_file() else None
    p = Path("/usr/sbin/nginx")
    if p.is_file():
        return p
    found = shutil.which("nginx")
    return Path(found) if found else None


class Nginx:
    def __init__(self, prefix: Path, port: int, proc: subprocess.Popen) -> None:
        self.prefix = prefix
        self.port = port
        self.proc = proc

    @property
    def www(self) -> Path:
        return self.prefix / "www"

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"


@pytest.fixture(scope="session")
def nginx():
    binary = _nginx_binary()
    if binary is None:
        msg = "nginx not found (set SHARDSCOPE_NGINX)"
        if os.environ.get("SHARDSCOPE_REQUIRE_REMOTE") == "1":
            pytest.fail(msg + " and SHARDSCOPE_REQUIRE_REMOTE=1")
        pytest.skip(msg)
    # nginx started as root serves as `nobody`: the served tree must be world-readable, so the
    # prefix is a fresh 0755 folder directly under the system temp dir (pytest's are 0700).
    prefix = Path(tempfile.mkdtemp(prefix="shardscope-nginx-"))
    prefix.chmod(0o755)
    for d in ("www", "logs", "tmp"):
        (prefix / d).mkdir()
        (prefix / d).chmod(0o755)
    proc = None
    last_log = ""
    for _attempt in range(5):
        port = _free_port()
        p = prefix
        conf = (
            f"daemon off;\nworker_processes 1;\npid {p}/nginx.pid;\nerror_log {p}/logs/error.log;\n"
            "events { worker_connections 256; }\n"
            "http {\n"
            f"  access_log {p}/logs/access.log;\n"
            f"  client_body_temp_path {p}/tmp;\n  proxy_temp_path {p}/tmp;\n"
            f"  fastcgi_temp_path {p}/tmp;\n  uwsgi_temp_path {p}/tmp;\n  scgi_temp_path {p}/tmp;\n"
            f"  server {{ listen 127.0.0.1:{port}; root {p}/www; }}\n}}\n"
        )
        (p / "nginx.conf").write_text(conf)
        proc = subprocess.Popen(
            [str(binary), "-c", str(p / "nginx.conf"), "-p", str(p)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        up = False
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    up = True
                    break
            except OSError:
                time.sleep(0.05)
        if up:
            break
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log = p / "logs" / "error.log"
        last_log = log.read_text() if log.exists() else ""
        proc = None
    if proc is None:
        shutil.rmtree(prefix, ignore_errors=True)
        pytest.fail(f"nginx did not start in 5 attempts: {last_log[-2000:]}")
    server = Nginx(prefix, port, proc)
    try:
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(prefix, ignore_errors=True)


def cli_error(path, *extra) -> str:
    """What `python -m shardscope inspect PATH` prints on stderr, `error: ` prefix stripped."""
    r = subprocess.run(
        [sys.executable, "-m", "shardscope", "inspect", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
    )
    assert r.returncode != 0, f"the CLI succeeded on {path}: {r.stdout[:500]}"
    err = r.stderr.strip()
    return err[len("error: ") :] if err.startswith("error: ") else err
