"""shardscope: the `shardscope` command, packaged. Run it as `shardscope ...` or `python -m shardscope ...`."""

import os
import sys
import sysconfig


def binary() -> str:
    """The path of the `shardscope` executable installed with this package."""
    name = "shardscope.exe" if os.name == "nt" else "shardscope"
    candidates = [
        os.path.join(sysconfig.get_path("scripts"), name),
        os.path.join(sysconfig.get_path("scripts", f"{os.name}_user"), name),
        os.path.join(os.path.dirname(sys.executable), name),
    ]
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"the shardscope executable is not installed (looked in {', '.join(candidates)})")
