"""`python -m shardscope ARGS...` runs the `shardscope` command with ARGS."""

from shardscope._cli import main

if __name__ == "__main__":
    main()
