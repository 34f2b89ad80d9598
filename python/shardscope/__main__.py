"""`python -m shardscope ARGS...` runs the installed `shardscope` executable with ARGS."""

import os
import sys

from shardscope import binary


def main() -> None:
    path = binary()
    os.execv(path, [path, *sys.argv[1:]])


if __name__ == "__main__":
    main()
