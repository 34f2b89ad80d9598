#!/usr/bin/env python3
"""torchtitan's own route from a DCP step to a Hugging Face safetensors file, as a user without
shardscope would run it (the steps of torchtitan's scripts/checkpoint_conversion/convert_to_hf.py,
written with safetensors' `save_file` instead of DCP's HuggingFaceStorageWriter): the baseline that
bench/hf_convert.py times.

  build the model on meta (the config of bench/hf_convert.py), to_empty(device="cpu"),
  dcp.load(model.state_dict(), STEP), spec.state_dict_adapter(config, None).to_hf(sd),
  safetensors.torch.save_file(OUT/model.safetensors) + fsync, CONFIG copied to OUT/config.json.

usage: python bench/hf_convert_torchtitan.py STEP CONFIG_JSON OUT_DIR
"""

import os
import shutil
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from hf_convert import titan_spec

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@torch.no_grad()
def main(step: str, config: str, out: str) -> None:
    spec = titan_spec()
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    state_dict = model.state_dict()
    dcp.load(state_dict, checkpoint_id=step)
    hf = spec.state_dict_adapter(spec.model, None).to_hf(state_dict)
    os.makedirs(out)
    path = os.path.join(out, "model.safetensors")
    save_file(hf, path, metadata={"format": "pt"})
    fsync(path)
    shutil.copy(config, os.path.join(out, "config.json"))
    fsync(os.path.join(out, "config.json"))
    fsync(out)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
