"""The `shardscope` command of the wheel: `shardscope ARGS...` and `python -m shardscope ARGS...`."""

import signal
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> None:
    """Runs the command with `argv` (default: this process's arguments) and exits with its status."""
    from shardscope import _native

    args = ["shardscope", *(sys.argv[1:] if argv is None else argv)]
    # As the native binary: Ctrl-C stops the command at once (Python would only raise
    # KeyboardInterrupt after the Rust code returns).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(_native.main(args))
