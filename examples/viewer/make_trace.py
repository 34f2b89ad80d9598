#!/usr/bin/env python3
"""Writes gather_trace.json: an example Chrome trace shaped like the gather runner's output
(one `pid` per rank, `ph: "X"` spans with `cat` = phase and `args.bytes`), for the bundled
tiny model (examples/tiny_model.json) on 4 ranks. Deterministic: no clock, no randomness, so
running it twice gives identical bytes. Only an example for the viewer; no test takes values
from it. Standard library only."""
import json
import os

# FSDP1 use_orig_params=True, world size 4 on examples/tiny_model.json: unit flat parameter
# sizes (padded, fp32). Rough sizes are enough for an example.
UNITS = [("", 48), ("block1", 48), ("block2", 20)]
RANKS = 4
BYTES_PER_US = 2000.0  # 2 GB/s, a plausible host-memory copy rate


def main():
    events = []
    for rank in range(RANKS):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
    for rank in range(RANKS):
        t = 5.0 * rank  # ranks start staggered
        for unit, numel in UNITS:
            shard_bytes = numel * 4 // RANKS
            for phase, nbytes, factor in (("read", shard_bytes, 1.0),
                                          ("all_gather", shard_bytes * RANKS, 1.5),
                                          ("copy", shard_bytes * RANKS, 0.5)):
                dur = 10.0 + nbytes / BYTES_PER_US * 1000.0 * factor / 100.0
                events.append({
                    "ph": "X", "name": f"{phase} {unit or '(root)'}", "cat": phase,
                    "pid": rank, "tid": 0, "ts": round(t, 3), "dur": round(dur, 3),
                    "args": {"bytes": nbytes, "unit": unit, "dtype": "float32"},
                })
                t += dur + 2.0
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gather_trace.json")
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
