"""Renders benchmarks/results/*.json as the markdown tables in docs/benchmarks.md.

    python benchmarks/report.py [--collectives results/collectives.json] [--step results/fsdp_step.json]
"""

import argparse
import json
import os

from collectives import human

HERE = os.path.dirname(os.path.abspath(__file__))


def collectives_tables(path):
    with open(path) as f:
        rows = json.load(f)["rows"]
    lines = []
    for world in sorted({r["world_size"] for r in rows}):
        lines += [f"### World size {world}", "",
                  "| op | size | algo | fsdp_ext µs | +alloc µs | gloo µs | speedup | +alloc speedup "
                  "| busbw GB/s | +alloc busbw | gloo busbw | memcpy GB/s | busbw/memcpy | +alloc/memcpy "
                  "| worst/median |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        seen = set()
        for r in rows:
            key = (r["op"], r["bytes"])
            if r["world_size"] != world or key in seen:
                continue  # the smallest sizes round up to the same message
            seen.add(key)
            alloc = "fsdp_ext+alloc_us" in r

            def a(name, fmt):
                return format(r[name], fmt) if alloc else "–"

            worst = r["fsdp_ext_worst_over_median"]
            if alloc:
                worst = max(worst, r["fsdp_ext+alloc_worst_over_median"])
            lines.append(
                f"| {r['op']} | {human(r['bytes'])} | {r['algorithm']} | {r['fsdp_ext_us']:.1f} "
                f"| {a('fsdp_ext+alloc_us', '.1f')} | {r['gloo_us']:.1f} "
                f"| {r['fsdp_ext_speedup_vs_gloo']:.1f}x | {a('fsdp_ext+alloc_speedup_vs_gloo', '.1f')}"
                f"{'x' if alloc else ''} | {r['fsdp_ext_busbw_GBps']:.2f} "
                f"| {a('fsdp_ext+alloc_busbw_GBps', '.2f')} | {r['gloo_busbw_GBps']:.2f} "
                f"| {r['memcpy_GBps']:.1f} | {r['fsdp_ext_busbw_over_memcpy']:.0%} "
                f"| {a('fsdp_ext+alloc_busbw_over_memcpy', '.0%')} | {worst:.2f} |")
        lines.append("")
    return "\n".join(lines)


def step_tables(path):
    from fsdp_step import markdown_tables

    with open(path) as f:
        return markdown_tables(json.load(f))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", default=os.path.join(HERE, "results", "collectives.json"))
    parser.add_argument("--step", nargs="*", default=[os.path.join(HERE, "results", "fsdp_step.json")],
                        help="fsdp_step.py JSON files (one per world size)")
    args = parser.parse_args()
    if os.path.exists(args.collectives):
        print(collectives_tables(args.collectives))
    for path in args.step:
        if os.path.exists(path):
            print(step_tables(path))


if __name__ == "__main__":
    main()
