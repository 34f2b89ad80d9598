"""The chart of BENCHMARKS.md's current figures: `docs/img/benchmarks.svg`, drawn from the
"Current figures" table (each row's first ratio: `N% of ...` against a durable copy, `cat` or
`curl`, or `Nx ...` against another tool), so that the picture is the table the benchmarks wrote.

    python bench/chart.py            # rewrite docs/img/benchmarks.svg
    python bench/chart.py --check    # exit 1 when the chart is not the table's (the docs test runs this)

No dependencies: the SVG is written by hand (bars, labels, the 90% and 100% lines).
"""
from __future__ import annotations

import html
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "BENCHMARKS.md"
OUT = ROOT / "docs" / "img" / "benchmarks.svg"


def rows() -> list[tuple[str, str, float, str]]:
    """(measure, kind, value, ratio text) per row whose ratio starts with a number: kind "%" for
    percent of a baseline, "x" for times a baseline."""
    text = TABLE.read_text(encoding="utf-8")
    section = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    out = []
    last = ""
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| measure") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) < 4:
            continue
        measure = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cells[0])
        measure = re.sub(r"[`*]", "", measure)
        if measure.startswith("same"):
            measure = f"{last.split(':')[0]}, {measure.removeprefix('same').strip(' ,')}"
        else:
            last = measure
        if len(measure) > 46:
            measure = measure[:45].rstrip() + "…"
        ratio = re.sub(r"[`*]", "", cells[3])
        m = re.match(r"\s*(?:median\s+)?([0-9]+(?:\.[0-9]+)?)\s*(%|x)", ratio)
        # "27x the parse", "1.56x the memcpy time": a time in units of another, not a speed-up.
        if not m or re.search(r"the (parse|memcpy)", ratio):
            continue
        out.append((measure, m.group(2), float(m.group(1)), ratio.split(";")[0].split(",")[0]))
    return out


def svg(data: list[tuple[str, str, float, str]]) -> str:
    pct = [r for r in data if r[1] == "%"]
    times = [r for r in data if r[1] == "x"]
    width, label_w, bar_w, row_h = 1000, 330, 420, 22
    height = 70 + row_h * (len(pct) + len(times)) + 60
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        '<text x="10" y="20" font-size="15" font-weight="bold">shardscope: current figures '
        "(BENCHMARKS.md, bench/chart.py)</text>",
    ]
    y = 40

    def section(title: str, items, scale: float, unit: str, lines) -> None:
        nonlocal y
        parts.append(f'<text x="10" y="{y + 12}" font-weight="bold">{html.escape(title)}</text>')
        y += 20
        top = y
        for measure, _, value, ratio in items:
            w = min(value, scale) / scale * bar_w
            parts.append(f'<text x="10" y="{y + 14}">{html.escape(measure[:48])}</text>')
            parts.append(f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" fill="#4878a8"/>')
            shown = ratio if len(ratio) <= 30 else ratio[:29].rstrip() + "…"
            parts.append(f'<text x="{label_w + bar_w + 8}" y="{y + 14}">{html.escape(shown)}</text>')
            y += row_h
        for k, (at, name) in enumerate(lines):
            x = label_w + at / scale * bar_w
            parts.append(
                f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{y}" stroke="#c04040" stroke-dasharray="4 3"/>'
            )
            anchor = "end" if k == 0 else "start"
            dx = -3 if k == 0 else 3
            parts.append(
                f'<text x="{x + dx:.1f}" y="{y + 12}" fill="#c04040" text-anchor="{anchor}">{name}</text>'
            )
        y += 24

    if pct:
        section("percent of the baseline (a durable copy, cat or curl, same run)", pct, 130.0, "%",
                [(90.0, "90% target"), (100.0, "100%")])
    if times:
        scale = max(25.0, max(v for _, _, v, _ in times))
        section("times faster than the other tool (same run)", times, scale, "x", [(5.0, "5x"), (10.0, "10x")])
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> int:
    data = rows()
    if not data:
        print("no ratios found in BENCHMARKS.md's current figures", file=sys.stderr)
        return 2
    want = svg(data)
    if "--check" in sys.argv:
        have = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if have != want:
            print(f"{OUT.relative_to(ROOT)} is not the chart of BENCHMARKS.md's table: run `python bench/chart.py`",
                  file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)}: the chart of {len(data)} rows, current")
        return 0
    tmp = OUT.with_suffix(".svg.tmp")
    tmp.write_text(want, encoding="utf-8")
    tmp.replace(OUT)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(data)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
