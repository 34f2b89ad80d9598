"""Checks a torchtitan -> Hugging Face conversion (and the way back) against the oracle that
tests/fixtures/hf_mapping/gen_torchtitan_hf.py wrote with torchtitan's own StateDictAdapter.

  check_hf.py OUT_DIR FIXTURE_DIR
      OUT_DIR: what `shardscope convert CKPT -o OUT_DIR --to hf --config FIXTURE_DIR/config.json` wrote:
      `model.safetensors`, or shards listed by `model.safetensors.index.json`, and `config.json`.
      Checks: the key set equals FIXTURE_DIR/expected/hf.safetensors's, every tensor is bit-identical
      (dtype, shape, bytes); the index (if any) names each key's file truly and no key twice;
      config.json is there; transformers' from_pretrained(OUT_DIR) loads every weight (no missing,
      unexpected or mismatched key) and its logits on expected/logits.safetensors's `tokens` are
      within 1e-4 of `logits` (torchtitan's, float32).

  check_hf.py --torchtitan OUT FIXTURE_DIR
      OUT: a converted-back torchtitan checkpoint, a `.safetensors` file or a DCP folder (read with
      torch's dcp_to_torch_save into a temporary file). Checks it against
      FIXTURE_DIR/expected/from_hf.safetensors bit for bit (key set, dtype, shape, bytes).

Prints one result line; exits 0 when everything matches, 1 on a mismatch (naming the tensor or the
check), 2 on a usage error. Run with the venv of tests/fixtures/requirements.txt, e.g.
  ~/.cache/shardscope/torch-venv/bin/python tests/interop/check_hf.py OUT tests/fixtures/hf_mapping/llama3
"""

import json
import os
import sys
import tempfile

ATOL = 1e-4


class Mismatch(Exception):
    pass


def load_safetensors(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def load_hf_dir(out_dir):
    """The tensors of an HF folder: single file or index + shards (each key in exactly one file)."""
    index = os.path.join(out_dir, "model.safetensors.index.json")
    single = os.path.join(out_dir, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise Mismatch(f"{index}: no weight_map")
        tensors, where = {}, {}
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(out_dir, shard)
            if not os.path.exists(path):
                raise Mismatch(f"index names shard {shard}, which is not there")
            for k, v in load_safetensors(path).items():
                if k in tensors:
                    raise Mismatch(f"tensor {k} is in both {where[k]} and {shard}")
                tensors[k], where[k] = v, shard
        for k, shard in weight_map.items():
            if where.get(k) != shard:
                raise Mismatch(f"index says tensor {k} is in {shard}, found in {where.get(k, 'no shard')}")
        for k in tensors:
            if k not in weight_map:
                raise Mismatch(f"tensor {k} (in {where[k]}) is not in the index")
        return tensors, f"{len(set(weight_map.values()))} shards"
    if os.path.exists(single):
        return load_safetensors(single), "model.safetensors"
    raise Mismatch(f"{out_dir}: neither model.safetensors nor model.safetensors.index.json")


def raw_bytes(t):
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare(got, want, what):
    """Same key set; per tensor the same dtype, shape and bytes. Returns the tensor count."""
    import torch

    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
        if extra:
            parts.append(f"unexpected {len(extra)} ({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''})")
        raise Mismatch(f"{what}: key sets differ: " + "; ".join(parts))
    for k in sorted(want):
        g, w = got[k], want[k]
        if g.dtype != w.dtype:
            raise Mismatch(f"{what}: tensor {k}: dtype {g.dtype} != expected {w.dtype}")
        if tuple(g.shape) != tuple(w.shape):
            raise Mismatch(f"{what}: tensor {k}: shape {list(g.shape)} != expected {list(w.shape)}")
        gb, wb = raw_bytes(g), raw_bytes(w)
        if not torch.equal(gb, wb):
            n = int((gb != wb).sum())
            diff = ""
            if w.is_floating_point():
                diff = f", max |diff| {(g.double() - w.double()).abs().max().item():.3g}"
            raise Mismatch(f"{what}: tensor {k} {list(w.shape)} {w.dtype}: {n} bytes differ{diff}")
    return len(want)


def check_logits(out_dir, fixture):
    """(True, detail) if transformers' logits match, (None, reason) if skipped."""
    import torch
    import transformers

    path = os.path.join(fixture, "expected", "logits.safetensors")
    if not os.path.exists(path):
        return None, f"logits skipped: {path} is not there"
    ref = load_safetensors(path)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise Mismatch(f"from_pretrained({out_dir}) did not load every weight: {bad}")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ref["tokens"]).logits.float()
    if tuple(logits.shape) != tuple(ref["logits"].shape):
        raise Mismatch(f"logits shape {list(logits.shape)} != expected {list(ref['logits'].shape)}")
    d = (logits - ref["logits"]).abs().max().item()
    if not d <= ATOL:
        raise Mismatch(f"{type(model).__name__} logits differ from torchtitan's by {d:.3g} (> {ATOL})")
    return True, f"{type(model).__name__} logits within {d:.1e}"


def check_hf(out_dir, fixture):
    if not os.path.isdir(out_dir):
        raise Mismatch(f"{out_dir} is not a folder")
    got, layout = load_hf_dir(out_dir)
    want = load_safetensors(os.path.join(fixture, "expected", "hf.safetensors"))
    n = compare(got, want, "hf")
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        raise Mismatch(f"{out_dir}/config.json is not there")
    ok, detail = check_logits(out_dir, fixture)
    if ok is None:
        print(f"note: {detail}", file=sys.stderr)
    return f"{n} tensors bit-identical ({layout}), config.json present, {detail}"


def load_torchtitan(out):
    import torch

    if os.path.isdir(out):
        if not os.path.exists(os.path.join(out, ".metadata")):
            raise Mismatch(f"{out}: a folder without a DCP .metadata")
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory(prefix="check_hf-") as tmp:
            path = os.path.join(tmp, "full.pt")
            dcp_to_torch_save(out, path)
            sd = torch.load(path, weights_only=True)
        nested = sorted(k for k, v in sd.items() if not isinstance(v, torch.Tensor))
        if nested:
            raise Mismatch(f"{out}: entries that are not tensors: {', '.join(nested[:5])}")
        return sd, "DCP"
    if out.endswith(".safetensors"):
        return load_safetensors(out), "safetensors"
    raise Mismatch(f"{out}: expected a .safetensors file or a DCP folder")


def check_torchtitan(out, fixture):
    got, kind = load_torchtitan(out)
    want = load_safetensors(os.path.join(fixture, "expected", "from_hf.safetensors"))
    n = compare(got, want, "torchtitan")
    return f"{n} tensors bit-identical to expected/from_hf.safetensors ({kind})"


def main(argv):
    args = list(argv)
    titan = "--torchtitan" in args
    if titan:
        args.remove("--torchtitan")
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, fixture = args
    if not os.path.exists(os.path.join(fixture, "expected")):
        print(f"usage error: {fixture} has no expected/ folder", file=sys.stderr)
        return 2
    name = os.path.basename(os.path.normpath(fixture))
    mode = "torchtitan" if titan else "hf"
    try:
        detail = check_torchtitan(out, fixture) if titan else check_hf(out, fixture)
    except Mismatch as e:
        print(f"FAIL {name} ({mode}): {e}")
        return 1
    print(f"ok {name} ({mode}): {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
