#!/usr/bin/env python3
"""Writes examples/fsdp2_dcp/: the checkpoint a real FSDP2 training run leaves, small enough to ship.

Two gloo ranks (CPU) build a tiny decoder (embedding, two blocks, LM head), wrap each block and
the root with `fully_shard`, train three AdamW steps and `dcp.save` the model and optimizer state
(`get_state_dict`: DTensor chunks on both ranks, optimizer state keyed by FQN, `param_groups`) plus
the step count. torch==2.15.0 (examples/TORCH_VERSION), seeded; `.metadata` carries a fresh uuid on
every save, everything else is reproducible.

usage: python examples/gen_fsdp2_dcp.py   (rewrites examples/fsdp2_dcp/)
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "interop"))


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.attn = torch.nn.Linear(d, d)
        self.mlp = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        return x + self.mlp(torch.relu(self.attn(h)))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=32, d=16, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([Block(d) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def worker(rank, store, out):
    from ranks import finish
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 32, (4, 8), generator=g)
        model(tokens).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 3}, checkpoint_id=out)
    finish()


def main():
    from ranks import spawn

    out = HERE / "fsdp2_dcp"
    shutil.rmtree(out, ignore_errors=True)
    store = os.path.join(tempfile.mkdtemp(), "store")
    spawn(worker, (store, str(out)), 2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
