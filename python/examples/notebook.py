"""The README's notebook example, as a script: checked by mypy against the package's types (`.ci/python`)
and run by the pytest suite (python/tests/test_api.py)."""

import sys
from typing import Any, Dict, List

import shardscope


def main(path: str) -> None:
    ck: shardscope.Checkpoint = shardscope.open(path)
    print(ck.kind, ck.world_size, len(ck))
    keys: List[str] = ck.keys()
    first = keys[0]
    info: Dict[str, Any] = ck.info(first)
    print(first, info["dtype"], info["shape"])
    rows = ck.read(first, rows=slice(0, 2))
    print(rows.shape)
    state = ck.state_dict(select="model", framework="numpy")
    print(sorted(state)[:3])
    try:
        ck.read("no.such.key")
    except shardscope.ShardscopeError as e:
        print("error:", e)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "examples/fsdp2_dcp")
