"""`shardscope.describe` of modules already wrapped by FSDP1 and FSDP2, in a one-rank gloo group (run by
test_describe.py in a child process: a process group must not outlive its test). Prints one JSON line
with the descriptions, then tears the group down (the result is judged, not the exit status)."""

import functools
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "fixtures", "app_state"))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
from gen_app_state import Layer, Llama  # noqa: E402
from gen_hf_auto_wrap import build  # noqa: E402

import shardscope  # noqa: E402


def main():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    out = {}
    torch.manual_seed(0)
    out["plain"] = shardscope.describe(Llama())
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer})
    for orig in (False, True):
        torch.manual_seed(0)
        model = FSDP(Llama(), auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=orig)
        out[f"fsdp1_orig{int(orig)}"] = shardscope.describe(model)
    torch.manual_seed(0)
    model = Llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    out["fsdp2"] = shardscope.describe(model)
    # GPT-2 ties lm_head.weight to transformer.wte.weight: FSDP1 keeps it as a shared parameter.
    model, block = build("gpt2")
    out["gpt2_plain"] = shardscope.describe(model)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})
    out["gpt2_fsdp1"] = shardscope.describe(FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu")))
    print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
