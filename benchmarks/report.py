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


def step_table(path):
    with open(path) as f:
        result = json.load(f)
    med = result["median_seconds"]
    args = result["args"]
    lines = [f"{result['params'] / 1e6:.2f}M parameters, {args['world_size']} ranks, dim "
             f"{args['dim']}, {args['layers']} blocks, batch {args['batch']}x{args['seq']}, "
             f"{args['steps']} steps (median of the last two thirds).", "",
             "| contender | step ms | vs gloo | vs fsdp_ext | final loss |",
             "|---|---:|---:|---:|---:|"]
    for name, seconds in med.items():
        lines.append(f"| {name} | {seconds * 1e3:.1f} | {med['gloo'] / seconds:.2f}x "
                     f"| {med['fsdp_ext'] / seconds:.2f}x | {result['losses'][name][-1]:.5f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", default=os.path.join(HERE, "results", "collectives.json"))
    parser.add_argument("--step", default=os.path.join(HERE, "results", "fsdp_step.json"))
    args = parser.parse_args()
    if os.path.exists(args.collectives):
        print(collectives_tables(args.collectives))
    if os.path.exists(args.step):
        print(step_table(args.step))


if __name__ == "__main__":
    main()
