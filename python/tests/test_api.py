"""The command-shaped functions (`doctor`, `diff`, `verify`, `convert`, `layout`) and the command itself
(`python -m shardscope`, the `shardscope` entry point) of the Python package: the same reports as the
command line, and what they write loads in torch as torch's own tools give it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardscope

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIX = REPO / "tests" / "fixtures"
DCP = REPO / "examples" / "fsdp2_dcp"


def cli(*args, ok=(0,)):
    """`python -m shardscope ARGS` (this wheel's command): (status, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "shardscope", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    assert proc.returncode in ok, proc.stderr
    return proc.returncode, proc.stdout, proc.stderr


def test_the_command_runs_from_python_with_its_exit_statuses():
    status, out, _ = cli("--version")
    assert out.startswith("shardscope ")
    status, _, err = cli("inspect", "--no-such-flag", ok=(2,))
    assert "--no-such-flag" in err
    # diff: 0 equal, 1 differ, 2 unreadable (its documented statuses).
    cli("diff", DCP, DCP, "--quiet", ok=(0,))
    cli("diff", FIX / "doctor/clean.pt", FIX / "doctor/other_config.pt", "--quiet", ok=(1,))
    status, _, err = cli("inspect", FIX / "doctor/truncated.pt", ok=(2,))
    assert err.startswith("error: ") and "truncated.pt" in err


@pytest.mark.parametrize(
    "args",
    [
        ["doctor", FIX / "doctor/clean.pt", "--reference", FIX / "doctor/reference.pt"],
        ["doctor", FIX / "doctor/compiled.pt", "--reference", FIX / "doctor/reference.pt"],
        ["verify", DCP],
        ["diff", FIX / "doctor/clean.pt", FIX / "doctor/other_config.pt"],
    ],
    ids=["doctor-ok", "doctor-not-loadable", "verify", "diff"],
)
def test_functions_report_what_the_command_reports(args):
    _, out, _ = cli(*args, "--json", ok=(0, 1))
    expected = json.loads(out)
    command, *rest = args
    if command == "doctor":
        got = shardscope.doctor(rest[0], reference=rest[2])
    elif command == "verify":
        got = shardscope.verify(rest[0])
    else:
        got = shardscope.diff(rest[0], rest[1])
    assert got == expected


def test_doctor_takes_a_live_state_dict_as_reference():
    reference = torch.load(FIX / "doctor/reference.pt", weights_only=True)
    by_path = shardscope.doctor(FIX / "doctor/compiled.pt", reference=FIX / "doctor/reference.pt")
    by_dict = shardscope.doctor(FIX / "doctor/compiled.pt", reference=reference)
    assert by_dict["loadable"] is False
    assert by_dict["findings"] == by_path["findings"]


def test_layout_is_the_commands_layout(tmp_path):
    model = REPO / "examples" / "tiny_model.json"
    _, out, _ = cli("layout", "--model", model, "--world-size", "3", "--use-orig-params", "--json")
    assert shardscope.layout(model, world_size=3, use_orig_params=True) == json.loads(out)
    description = json.loads(model.read_text())
    assert shardscope.layout(description, world_size=3, use_orig_params=True) == json.loads(out)


def test_convert_writes_what_torch_loads_as_dcp_to_torch_save_gives(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(DCP), str(tmp_path / "torch.pt"))
    theirs = torch.load(tmp_path / "torch.pt", weights_only=True)
    written = shardscope.convert(DCP, tmp_path / "ours.pt", to="torch")
    assert written["outputs"]
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    a, b = dict(flat(theirs)), dict(flat(ours))
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_failures_are_shardscope_errors_with_the_commands_text(tmp_path):
    with pytest.raises(shardscope.ShardscopeError) as e:
        shardscope.doctor(tmp_path / "missing.pt")
    _, _, err = cli("doctor", tmp_path / "missing.pt", "--json", ok=(2,))
    assert str(e.value) == err.strip()[len("error: ") :]
    with pytest.raises(shardscope.ShardscopeError, match="unexpected argument"):
        shardscope.verify(DCP, no_such_option=True)
    with pytest.raises(shardscope.ShardscopeError, match="framework"):
        shardscope.open(DCP).read("model.embed.weight", framework="jax")
    ck = shardscope.open(DCP)
    with pytest.raises(shardscope.ShardscopeError, match="not inside its 32 rows"):
        ck.read("model.embed.weight", rows=(30, 40))
    with pytest.raises(shardscope.ShardscopeError, match="no key under `nothing.`"):
        ck.state_dict(select="nothing", framework="torch")


def test_the_readme_notebook_example_runs():
    proc = subprocess.run(
        [sys.executable, str(REPO / "python/examples/notebook.py"), str(DCP)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # torch wrote it on 2 ranks (examples/gen_fsdp2_dcp.py).
    assert lines[0].startswith("dcp_torch_save 2 ")
    assert lines[2] == "(2, 16)"
    assert lines[-1].startswith("error: ") and "no.such.key" in lines[-1]


def test_importing_shardscope_does_not_import_torch_or_numpy():
    code = "import sys, shardscope; ck = shardscope.open(sys.argv[1]); ck.keys(); ck.info(ck.keys()[0]); print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code, str(DCP)], stdout=subprocess.PIPE, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_mypy_checks_the_example_against_the_package_types():
    from mypy import api as mypy

    out, err, status = mypy.run(["--strict", str(REPO / "python/examples/notebook.py")])
    assert status == 0, out + err


def test_mmap_maps_whole_stored_tensors_and_never_writes_the_file(tmp_path):
    import hashlib
    import mmap

    from safetensors.torch import load_file

    path = REPO / "tests/fixtures/app_state/merged.safetensors"
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    want = load_file(str(path))
    ck = shardscope.open(path)
    mapped = ck.state_dict(mmap=True, framework="torch")
    assert mapped.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(mapped[k], v), k
    def owner(a):
        """What a numpy array's memory belongs to, through views."""
        while True:
            if isinstance(a, memoryview):
                a = a.obj
            elif getattr(a, "base", None) is not None:
                a = a.base
            else:
                return a

    key = next(iter(want))
    arr = ck.read(key, mmap=True)
    assert isinstance(owner(arr), mmap.mmap), "a whole stored tensor is mapped, not read"
    assert not isinstance(owner(ck.read(key)), mmap.mmap), "without mmap=True it is read"
    rows = ck.read(key, mmap=True, rows=slice(1, 3))
    assert torch.equal(torch.from_numpy(rows.copy()), want[key][1:3])
    # Copy-on-write: the tensors are writable, the file is never modified.
    mapped[key].add_(1.0)
    arr[...] = 0
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    # A tensor split over ranks' files is read, whatever mmap says.
    dcp = shardscope.open(DCP)
    split = dcp.read("model.embed.weight", mmap=True)
    assert not isinstance(owner(split), mmap.mmap)
    assert (split == dcp.read("model.embed.weight")).all()


def test_without_numpy_torch_tensors_are_read_into_a_bytearray(monkeypatch):
    ck = shardscope.open(DCP)
    want = {k: ck.read(k, framework="torch") for k in ck.keys() if ck.info(k)["kind"] == "tensor"}
    real = shardscope._optional
    monkeypatch.setattr(shardscope, "_optional", lambda m: None if m == "numpy" else real(m))
    for k, v in want.items():
        got = ck.read(k, framework="torch")
        assert torch.equal(got, v), k
    got = ck.read("model.embed.weight", framework="torch", dtype="bfloat16", rows=slice(2, 5))
    assert torch.equal(got, want["model.embed.weight"][2:5].to(torch.bfloat16))


def test_the_docstring_examples_run(monkeypatch):
    """The module's and Checkpoint's examples, on the bundled example they name."""
    import doctest

    monkeypatch.chdir(REPO)
    ck = shardscope.open(DCP)
    globs = {"shardscope": shardscope, "ck": ck}
    for obj in (shardscope, shardscope.Checkpoint.info, shardscope.Checkpoint.read):
        finder = doctest.DocTestFinder(recurse=False)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in finder.find(obj, globs=dict(globs)):
            runner.run(test)
        assert runner.failures == 0, f"{obj.__name__}: {runner.failures} docstring examples failed"


def test_reads_from_several_threads_equal_one_thread():
    """The reader releases the GIL: reads from threads overlap; results do not depend on them."""
    from concurrent.futures import ThreadPoolExecutor

    ck = shardscope.open(FIX / "fsdp2_hsdp/ws4_2x2")
    one = ck.state_dict(threads=1, framework="torch")
    many = ck.state_dict(threads=8, framework="torch")
    assert one.keys() == many.keys()
    tensors = [k for k, v in one.items() if isinstance(v, torch.Tensor)]
    assert tensors
    for k in tensors:
        assert torch.equal(one[k], many[k]), k
    keys = [k for k in ck.keys() if ck.info(k)["kind"] == "tensor"] * 4
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda k: ck.read(k, framework="torch"), keys))
    for k, v in zip(keys, got):
        assert torch.equal(v, ck.read(k, framework="torch")), k


def test_a_rank_pattern_opens_the_files_of_every_rank():
    folder = FIX / "fsdp2_hsdp/ws4_2x2"
    by_pattern = shardscope.open(str(folder / "rank{r}_model.pt"), ranks=4)
    by_list = shardscope.open([folder / f"rank{r}_model.pt" for r in range(4)])
    assert by_pattern.keys() == by_list.keys() and by_pattern.world_size == 4
    for k in by_list.keys():
        if by_list.info(k)["kind"] == "tensor":
            assert torch.equal(by_pattern.read(k, framework="torch"), by_list.read(k, framework="torch")), k
    with pytest.raises(shardscope.ShardscopeError, match="--ranks"):
        shardscope.open(str(folder / "rank{r}_model.pt"))


def test_a_megatron_checkpoint_reads_as_megatron_saved_it():
    """tests/fixtures/trainer_folders/gen_megatron.py: Megatron-core's own save, 2 ranks; the
    expected tensors and common state are what the ranks were given (torch, safetensors)."""
    from safetensors.torch import load_file

    folder = FIX / "trainer_folders"
    ck = shardscope.open(folder / "megatron_torch_dist")
    assert ck.written_by.startswith("Megatron-core dist_checkpointing (torch_dist")
    want = load_file(str(folder / "expected/megatron_full.safetensors"))
    common = json.loads((folder / "expected/megatron_common.json").read_text())
    sd = ck.state_dict(framework="torch")
    for k, v in want.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    assert sd["iteration"] == common["iteration"] and sd["args.lr"] == common["args"]["lr"]
    assert shardscope.open(DCP).written_by is None


def test_state_dict_shows_progress_when_asked(capsys):
    ck = shardscope.open(DCP)
    ck.state_dict(progress=True, framework="torch")
    err = capsys.readouterr().err
    assert err.rstrip().endswith("(100%)") and ck.label in err, err
    ck.state_dict(progress=False, framework="torch")
    assert capsys.readouterr().err == ""
