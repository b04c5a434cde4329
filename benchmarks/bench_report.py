"""Regenerates docs/benchmarks.md: runs the benchmark set, then writes the page from its JSON.

    python benchmarks/bench_report.py                  # the full set: 12-15 minutes, 2 idle cores
    python benchmarks/bench_report.py --quick          # tiny sizes, one repeat: the pipeline only
    python benchmarks/bench_report.py --render-only    # rewrite the page from the JSON there
    python benchmarks/bench_report.py --sections one-host many-ranks   # run these, render all

`make bench-report` runs the first. Each section calls the benchmark scripts next to this
file (collectives.py, fsdp_step.py) as subprocesses with the flags listed in SECTIONS; their
JSON goes to benchmarks/results/report/<section>/, with meta.json (the commands, the date,
the commit, the machine, the elapsed time). A section that fails keeps its previous results.
The page is then rendered from whatever results are there: tables of ratios, one plot per
section at most (docs/images/bench-*.png, when matplotlib is installed), the machine, the
versions and each section's exact commands. The two-host section needs root (network
namespaces, test/multihost.py).

The section titles are linked from the README (their anchors): keep them.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "report")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
IMAGES = os.path.join(ROOT, "docs", "images")
KIB, MIB = 1 << 10, 1 << 20


# --------------------------------------------------------------------------------------------
# What each section runs. Each entry: (name of its JSON, the script's arguments); the output
# path is added. Full sizes fit about 15 minutes on 2 cores; quick ones about 2-3 minutes.

ONE_HOST_OPS = ["all_gather_into_tensor", "reduce_scatter_tensor",
                "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
                "all_reduce", "broadcast"]
LINK_OPS = ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast"]


def _size_arg(nbytes):
    for unit, scale in (("M", MIB), ("K", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def one_host_runs(quick):
    if quick:  # one invocation for both (adjacent sizes, powers of 4)
        return [("sizes", ["collectives.py", "--world-sizes", "2", "4", "--min-bytes", "16K",
                           "--max-bytes", "64K", "--repeats", "1", "--ops", *ONE_HOST_OPS])]
    # One invocation per size: small (latency), medium, large (memory bandwidth).
    return [(f"size_{_size_arg(s)}",
             ["collectives.py", "--world-sizes", "2", "4", "--min-bytes", _size_arg(s),
              "--max-bytes", _size_arg(s), "--repeats", "5", "--ops", *ONE_HOST_OPS])
            for s in (4 * KIB, MIB, 16 * MIB)]


def two_hosts_runs(quick):
    if quick:
        return [("link", ["collectives.py", "--hosts", "2", "--ranks-per-host", "1",
                          "--min-bytes", "16K", "--max-bytes", "64K", "--repeats", "1",
                          "--ops", *LINK_OPS])]
    return [("link", ["collectives.py", "--hosts", "2", "--ranks-per-host", "1", "2",
                      "--min-bytes", "64K", "--max-bytes", "16M", "--repeats", "3",
                      "--ops", *LINK_OPS])]


def fsdp_step_runs(quick):
    if quick:
        return [("ws1", ["fsdp_step.py", "--world-size", "1", "--steps", "3",
                         "--models", "small-blocks"]),
                ("ws2", ["fsdp_step.py", "--world-size", "2", "--steps", "3",
                         "--models", "small-blocks", "--no-memory"])]
    steps = ["--steps", "18"]
    # Memory (each contender alone in fresh processes: nine start-ups per model) is
    # measured for the transformer at world size 2 only, to fit the time.
    return [("ws1", ["fsdp_step.py", "--world-size", "1", *steps,
                     "--models", "small-blocks,transformer", "--no-memory"]),
            ("ws2_small", ["fsdp_step.py", "--world-size", "2", *steps,
                           "--models", "small-blocks", "--no-memory"]),
            ("ws2_transformer", ["fsdp_step.py", "--world-size", "2", *steps,
                                 "--models", "transformer"]),
            ("ws4", ["fsdp_step.py", "--world-size", "4", *steps,
                     "--models", "small-blocks,transformer", "--no-memory"])]


def host_time_runs(quick):
    if quick:
        return [("host_time", ["fsdp_step.py", "--host-time", "--world-sizes", "1,2",
                               "--models", "small-blocks", "--steps", "3"])]
    return [("host_time", ["fsdp_step.py", "--host-time", "--world-sizes", "1,2",
                           "--models", "small-blocks,transformer", "--steps", "45"])]


def many_ranks_runs(quick):
    if quick:
        return [("ranks", ["collectives.py", "--world-sizes", "2", "8", "--min-bytes", "16K",
                           "--max-bytes", "16K", "--repeats", "1", "--ops", "all_reduce"])]
    return [("ranks", ["collectives.py", "--world-sizes", "2", "4", "8", "16",
                       "--min-bytes", "64K", "--max-bytes", "64K", "--repeats", "3",
                       "--ops", "all_reduce", "all_gather_into_tensor"])]


# --------------------------------------------------------------------------------------------
# Formatting helpers

def human(nbytes):
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def times(x):
    """A ratio as 'N.NNx' (two significant digits past 1, fewer for large ones)."""
    if x is None:
        return "–"
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def percent(x):
    return "–" if x is None else f"{100 * x:.0f} %"


def number(x, digits=1):
    return "–" if x is None else f"{x:,.{digits}f}"


def table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def load_json(path):
    with open(path) as f:
        return json.load(f)


def section_dir(key):
    return os.path.join(RESULTS, key)


def section_json(key, name):
    path = os.path.join(section_dir(key), name + ".json")
    return load_json(path) if os.path.exists(path) else None


def plt_or_none():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ratio_axis(ax):
    """A log y axis labelled as ratios (0.5x, 1x, 2x, ...)."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def save_plot(fig, key):
    os.makedirs(IMAGES, exist_ok=True)
    name = f"bench-{key}.png"
    fig.tight_layout()
    fig.savefig(os.path.join(IMAGES, name), dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"images/{name}"


# --------------------------------------------------------------------------------------------
# Section 1: collectives on one host

def _machine_limit(row, name):
    """The machine's limit for this op over `name`'s time, as a fraction: the op cannot
    take less than the cross-core hand-off round trip (a rank must learn that its peer's
    data is ready), nor less than its bus bytes at the copy limit (what the same number
    of ranks reach copying out of peers' freshly written memory at once)."""
    seconds = row[f"{name}_us"] * 1e-6
    moved = row[f"{name}_busbw_GBps"] * 1e9 * seconds
    floor = max(row["handoff_round_trip_us"] * 1e-6, moved / (row["copy_limit_GBps"] * 1e9))
    return floor / seconds


def _pair(row, fmt, key):
    """'ordinary / group buffers' for one row (the second when the row has it)."""
    first = fmt(key(row, "fsdp_ext"))
    if "fsdp_ext+alloc_us" in row:
        return f"{first} / {fmt(key(row, 'fsdp_ext+alloc'))}"
    return first


def collective_rows(key):
    rows, limits = [], []
    for name in sorted(os.listdir(section_dir(key))) if os.path.isdir(section_dir(key)) else []:
        if name.endswith(".json") and name != "meta.json":
            data = load_json(os.path.join(section_dir(key), name))
            rows += data["rows"]
            if data.get("limits"):
                limits.append(data["limits"])
    return rows, limits


def render_one_host(key):
    rows, limits = collective_rows(key)
    if not rows:
        return None, {}
    worlds = sorted({r["world_size"] for r in rows})
    sizes = sorted({r["bytes"] for r in rows})
    by = {(r["op"], r["bytes"], r["world_size"]): r for r in rows}
    header = ["op", "size"]
    for w in worlds:
        header += [f"{w} ranks: µs", f"{w} ranks: × gloo", f"{w} ranks: of the limit"]
    body = []
    for op in ONE_HOST_OPS:
        for size in sizes:
            cells = [f"`{op}`", human(size)]
            present = False
            for w in worlds:
                r = by.get((op, size, w))
                if r is None:
                    cells += ["–"] * 3
                    continue
                present = True
                cells += [_pair(r, lambda v: number(v, 0 if v >= 100 else 1),
                                lambda r, n: r[f"{n}_us"]) + f" ({number(r['gloo_us'], 0)})",
                          _pair(r, times, lambda r, n: r["gloo_us"] / r[f"{n}_us"]),
                          _pair(r, percent, _machine_limit)]
            if present:
                body.append(cells)
    handoff = [lim["handoff_round_trip_us"] for lim in limits]
    copy = {}
    for r in rows:
        copy.setdefault(r["world_size"], {})[r["bytes"]] = r["copy_limit_GBps"]
    copy_text = "; ".join(f"{w} ranks " + ", ".join(f"{human(s)} {copy[w][s]:.1f}"
                                                    for s in sorted(copy[w])) for w in worlds)
    worst = [r[k] for r in rows for k in ("fsdp_ext_worst_over_median",
                                          "fsdp_ext+alloc_worst_over_median") if k in r]
    lo, hi = min(handoff), max(handoff)
    text = [
        "Each cell of the fsdp_ext columns: ordinary tensors / buffers from the group "
        "(`allocate_tensor`, what `set_allocate_memory_from_process_group_for_comm` gives "
        "FSDP2); µs: median time per op, gloo's in brackets. *× gloo*: gloo's time over "
        "ours. *Of the limit*: the least time this machine allows for the op (the longer of "
        "the cross-core hand-off round trip and the op's bus bytes at the copy limit) over "
        "ours; over 100 % where an algorithm moves fewer bytes than the bus-bandwidth "
        "convention counts. Small messages read against gloo: their floor, the hand-off, is a "
        "fraction of a microsecond, while issuing any c10d op from Python costs several.",
        "",
        table(header, body, ["---", "---:"] + ["---:"] * (3 * len(worlds))),
        "",
        f"The limits measured in the same run: hand-off round trip between two cores "
        f"{lo:.2f}" + (f"–{hi:.2f}" if hi > lo else "") +
        f" µs; copy limit, GB/s per rank: {copy_text}. "
        f"Noise: the slowest repeat of an fsdp_ext row is at most {max(worst):.2f}x its median "
        f"(median over rows {statistics.median(worst):.2f}x).",
    ]
    plt = plt_or_none()
    if plt is not None:
        fig, axes = plt.subplots(1, len(worlds), figsize=(5.5 * len(worlds), 3.8), squeeze=False,
                                 sharey=True)
        short = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                 "all_gather_into_tensor_coalesced": "all_gather\ncoalesced",
                 "reduce_scatter_tensor_coalesced": "reduce_scatter\ncoalesced",
                 "all_reduce": "all_reduce", "broadcast": "broadcast"}
        width = 0.8 / len(sizes)
        for ax, w in zip(axes[0], worlds):
            for i, size in enumerate(sizes):
                xs, ys = [], []
                for j, op in enumerate(ONE_HOST_OPS):
                    r = by.get((op, size, w))
                    if r:
                        xs.append(j + (i - (len(sizes) - 1) / 2) * width)
                        ys.append(r["gloo_us"] / r["fsdp_ext_us"])
                ax.bar(xs, ys, width, label=human(size), color=f"C{i}")
            ax.axhline(1, color="k", lw=0.8)
            ratio_axis(ax)
            ax.set_xticks(range(len(ONE_HOST_OPS)))
            ax.set_xticklabels([short[o] for o in ONE_HOST_OPS], fontsize=7)
            ax.set_title(f"{w} ranks, ordinary tensors")
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.legend(fontsize=8, title="message", title_fontsize=8)
        axes[0][0].set_ylabel("gloo's time / fsdp_ext's")
        text += ["", f"![fsdp_ext against gloo on one host, by op and size]"
                     f"({save_plot(fig, key)})"]
    headline = {}
    medium = min(sizes, key=lambda s: abs(s - MIB))
    r = by.get(("all_reduce", medium, min(worlds)))
    if r:
        headline["one-host"] = (
            f"`all_reduce` of {human(medium)}, {r['world_size']} ranks on one host",
            f"{times(r['gloo_us'] / r['fsdp_ext_us'])} as fast as gloo "
            f"({times(r['gloo_us'] / r['fsdp_ext+alloc_us'])} with buffers from the group)"
            if "fsdp_ext+alloc_us" in r else
            f"{times(r['gloo_us'] / r['fsdp_ext_us'])} as fast as gloo")
    return "\n".join(text), headline


# --------------------------------------------------------------------------------------------
# Section 2: collectives across two hosts

def render_two_hosts(key):
    rows, _ = collective_rows(key)
    if not rows:
        return None, {}
    layouts = sorted({r["ranks_per_host"] for r in rows})
    all_sizes = sorted({r["bytes"] for r in rows})
    shown = sorted({all_sizes[0], min(all_sizes, key=lambda s: abs(s - MIB)), all_sizes[-1]})
    by = {(r["op"], r["bytes"], r["ranks_per_host"]): r for r in rows}
    header = ["op", "size"]
    for n in layouts:
        label = f"2 × {n}"
        header += [f"{label}: µs (gloo)", f"{label}: × gloo", f"{label}: of the link (gloo)"]
    body = []
    for op in LINK_OPS:
        for size in shown:
            if not any((op, size, n) in by for n in layouts):
                continue
            cells = [f"`{op}`", human(size)]
            for n in layouts:
                r = by.get((op, size, n))
                if r is None:
                    cells += ["–"] * 3
                    continue
                cells += [f"{number(r['fsdp_ext_us'], 0)} ({number(r['gloo_us'], 0)})",
                          times(r["gloo_us"] / r["fsdp_ext_us"]),
                          f"{percent(r['fsdp_ext_over_link'])} ({percent(r['gloo_over_link'])})"]
            body.append(cells)
    links = []
    for n in layouts:
        # Each row holds the link's best figure in its op's pattern: one way for
        # broadcast, both ways at once for the others.
        mine = [r for r in rows if r["ranks_per_host"] == n]
        one = [r["link_limit_GBps"] for r in mine if r["op"] == "broadcast"]
        both = [r["link_limit_GBps"] for r in mine if r["op"] != "broadcast"]
        parts = ([f"{one[0]:.2f} GB/s one way"] if one else []) + \
            ([f"{both[0]:.2f} GB/s per direction both ways at once"] if both else [])
        links.append(f"with {n} rank{'s' if n > 1 else ''} per host " + ", ".join(parts))
    worst = [r["fsdp_ext_worst_over_median"] for r in rows]
    text = [
        "2 × N: two hosts with N ranks each. fsdp_ext with ordinary tensors. *Of the link*: "
        "the bytes the op must move across the link per second (the other host's share of "
        "the message each way; all_reduce twice that; broadcast the whole message one way) "
        "over what plain TCP carried between the same two hosts in the same pattern, in the "
        "same run.",
        "",
        table(header, body, ["---", "---:"] + ["---:"] * (3 * len(layouts))),
        "",
        "The link in this run (plain TCP between the hosts, best of 3 rounds before and after "
        "the collectives): " + "; ".join(links) + ". Sizes measured: "
        + ", ".join(human(s) for s in all_sizes) + f" (the plot has all). Noise: the slowest "
        f"repeat of an fsdp_ext row is at most {max(worst):.2f}x its median.",
    ]
    plt = plt_or_none()
    if plt is not None:
        fig, axes = plt.subplots(1, len(layouts), figsize=(5.5 * len(layouts), 3.8),
                                 squeeze=False, sharey=True)
        for ax, n in zip(axes[0], layouts):
            for i, op in enumerate(LINK_OPS):
                mine = [r for r in rows if r["op"] == op and r["ranks_per_host"] == n]
                if not mine:
                    continue
                mine.sort(key=lambda r: r["bytes"])
                xs = [r["bytes"] for r in mine]
                ax.plot(xs, [100 * r["fsdp_ext_over_link"] for r in mine], "o-", color=f"C{i}",
                        label=f"{op} fsdp_ext", ms=4)
                ax.plot(xs, [100 * r["gloo_over_link"] for r in mine], "^--", color=f"C{i}",
                        label=f"{op} gloo", ms=4, alpha=0.6)
            ax.set_xscale("log", base=2)
            ax.set_xticks(all_sizes)
            ax.set_xticklabels([human(s) for s in all_sizes], fontsize=8)
            ax.minorticks_off()
            ax.set_xlabel("message size")
            ax.set_title(f"2 hosts × {n} rank{'s' if n > 1 else ''}")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel("% of what plain TCP carried")
        axes[0][-1].legend(fontsize=6, ncol=2)
        text += ["", f"![share of the link against message size, fsdp_ext and gloo]"
                     f"({save_plot(fig, key)})"]
    headline = {}
    r = by.get(("all_reduce", all_sizes[-1], layouts[0]))
    if r:
        headline["two-hosts"] = (
            f"`all_reduce` of {human(r['bytes'])} across two hosts, {layouts[0]} rank"
            f"{'s' if layouts[0] > 1 else ''} each",
            f"{times(r['gloo_us'] / r['fsdp_ext_us'])} as fast as gloo; "
            f"{percent(r['fsdp_ext_over_link'])} of the link (gloo "
            f"{percent(r['gloo_over_link'])})")
    return "\n".join(text), headline


# --------------------------------------------------------------------------------------------
# Section 3: the fully_shard training step

STEP_CONTENDERS = ["upstream/gloo", "ours/gloo", "upstream/fsdp_ext", "ours/fsdp_ext",
                   "upstream/fsdp_ext+alloc", "ours/fsdp_ext+alloc",
                   "ours/fsdp_ext+alloc+per-param", "ours/fsdp_ext+alloc+per-param+host-shared"]
MODELS = ["small-blocks", "transformer"]


def step_results(key):
    """{(model, world): (result, args)} over the section's JSON files."""
    out = {}
    d = section_dir(key)
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.endswith(".json") and name != "meta.json":
            run = load_json(os.path.join(d, name))
            for result in run["results"].values():
                out[(result["model"], run["args"]["world_size"])] = (result, run["args"])
    return out


def _upstream_of(name):
    """The upstream contender an "ours/..." one is compared with (fsdp_step.py's rule)."""
    return "upstream/" + name.split("/")[1].replace("+per-param", "").replace("+host-shared", "")


def _loss_diffs(results):
    """(ours against upstream on the same backend, upstream over fsdp_ext against upstream
    over gloo): the largest loss difference at any step."""
    ours = backends = 0.0
    for result, _ in results.values():
        losses = result["losses"]
        for name in STEP_CONTENDERS:
            if name not in losses or name == "upstream/gloo":
                continue
            other = _upstream_of(name) if name.startswith("ours/") else "upstream/gloo"
            diff = max(abs(a - b) for a, b in zip(losses[name], losses[other]))
            if name.startswith("ours/"):
                ours = max(ours, diff)
            else:
                backends = max(backends, diff)
    return ours, backends


def render_fsdp_step(key):
    results = step_results(key)
    if not results:
        return None, {}
    keys = sorted(results, key=lambda k: (MODELS.index(k[0]) if k[0] in MODELS else 9, k[1]))
    steps = {args["steps"] for _, args in results.values()}
    med = {k: results[k][0]["median_seconds"] for k in keys}

    def ratio(k, slow, fast):
        m = med[k]
        return times(m[slow] / m[fast]) if slow in m and fast in m else "–"

    body = []
    for k in keys:
        m = med[k]
        body.append([k[0], k[1], f"{m['local'] * 1e3:.1f}", f"{m['ours/fsdp_ext'] * 1e3:.1f}",
                     ratio(k, "upstream/gloo", "ours/gloo"),
                     ratio(k, "upstream/fsdp_ext", "ours/fsdp_ext"),
                     ratio(k, "upstream/fsdp_ext+alloc", "ours/fsdp_ext+alloc"),
                     ratio(k, "upstream/fsdp_ext+alloc",
                           "ours/fsdp_ext+alloc+per-param+host-shared"),
                     ratio(k, "upstream/gloo", "ours/fsdp_ext+alloc+per-param+host-shared")])
    text = [
        "Ours against upstream's `fully_shard` on the same backend: upstream's step time over "
        "ours (over 1.00x: ours is faster). *All options*: ours with buffers from the group, "
        "per-parameter collectives and host-shared parameters, against upstream with buffers "
        "from the group; the last column against what upstream gives by default on CPU (gloo).",
        "",
        table(["model", "ranks", "local step ms", "ours/fsdp_ext ms", "× upstream: gloo",
               "× upstream: fsdp_ext", "× upstream: fsdp_ext, group buffers",
               "× upstream: all options", "all options × upstream/gloo"], body,
              ["---"] + ["---:"] * 8),
        "",
        "Every contender's step over the local step (the same model unsharded, no "
        "communication: the compute each contender also does):",
        "",
    ]
    header = ["contender"] + [f"{m}, {w}" for m, w in keys]
    rows = []
    for name in STEP_CONTENDERS:
        rows.append([f"`{name}`"] + [times(med[k][name] / med[k]["local"]) if name in med[k]
                                     else "–" for k in keys])
    text += [table(header, rows, ["---"] + ["---:"] * len(keys))]
    ours, backends = _loss_diffs(results)
    text += ["", "Losses: ours " + ("bitwise equal to upstream's on the same backend at every "
                                    "step" if ours == 0 else f"within {ours:.1e} of upstream's "
                                    "on the same backend") +
             "; upstream's over fsdp_ext " + ("bitwise equal to" if backends == 0 else
                                             f"within {backends:.1e} of") +
             " upstream's over gloo (the same sums, in the order each backend reduces)."]
    # Memory, where measured.
    for k in keys:
        memory = results[k][0].get("peak_step_memory_mib") or {}
        if not memory:
            continue
        model, world = k
        mem_rows = []
        for name in ["local"] + STEP_CONTENDERS:
            if name not in memory:
                continue
            peak = memory[name]["peak_rss"]
            pss = sum(p for _, p in memory[name]["rss_pss_by_rank"])
            up = memory.get(_upstream_of(name)) if name.startswith("ours/") else None
            mem_rows.append([f"`{name}`", number(peak, 0 if peak >= 100 else 1),
                             times(peak / up["peak_rss"]) if up else "",
                             number(pss, 0 if pss >= 100 else 1),
                             times(pss / sum(p for _, p in up["rss_pss_by_rank"])) if up else ""])
        text += ["", f"Memory, {model} at {world} rank{'s' if world > 1 else ''}: what "
                     "training adds to the built, "
                     "sharded model. *Peak*: rank 0's peak resident memory over the first 4 "
                     "steps, allocator caching included. *Host PSS*: at the start of each FSDP "
                     "module's forward (parameters unsharded), the proportional set size summed "
                     "over the ranks: what the host holds, shared pages counted once. Each "
                     "contender alone in fresh processes.",
                 "",
                 table(["contender", "peak MiB", "÷ upstream", "host PSS MiB", "÷ upstream"],
                       mem_rows)]
    spread = []
    for result, args in results.values():
        local = result["times"]["local"][args["steps"] // 3:]
        spread.append(max(local) / statistics.median(local))
    text += ["", f"Each table cell is the median of steps {min(steps) // 3}..{max(steps) - 1} "
                 f"(each step the slowest rank's). Noise: the local step's slowest step is "
                 f"{min(spread):.2f}x–{max(spread):.2f}x its median across the runs."]
    plt = plt_or_none()
    if plt is not None:
        models = [m for m in MODELS if any(k[0] == m for k in keys)]
        fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
        lines = [("upstream/gloo", "C3", "^--"), ("upstream/fsdp_ext", "C1", "s--"),
                 ("ours/fsdp_ext", "C0", "o-"),
                 ("ours/fsdp_ext+alloc+per-param+host-shared", "C2", "D-")]
        for ax, model in zip(axes[0], models):
            ks = [k for k in keys if k[0] == model]
            for name, color, style in lines:
                ax.plot([k[1] for k in ks], [med[k][name] / med[k]["local"] for k in ks], style,
                        color=color, label=name.replace("+alloc+per-param+host-shared",
                                                        ", all options"), ms=5)
            ax.axhline(1, color="k", lw=0.8)
            ratio_axis(ax)
            ax.set_xticks([k[1] for k in ks])
            ax.set_xlabel("ranks (2 cores)")
            ax.set_ylabel("step time / local step")
            ax.set_title(model)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        text += ["", f"![step time over the local step, by ranks]({save_plot(fig, key)})"]
    headline = {}
    pick = next((k for k in keys if k == ("transformer", 2)), None) or \
        next((k for k in keys if k[1] == 2), keys[-1])
    m = med[pick]
    headline["fsdp-step"] = (
        f"`fully_shard` training step, {pick[0]}, {pick[1]} ranks",
        f"ours over fsdp_ext {times(m['upstream/fsdp_ext'] / m['ours/fsdp_ext'])} as fast as "
        f"upstream's over fsdp_ext, {times(m['upstream/gloo'] / m['ours/fsdp_ext'])} as fast "
        f"as upstream's over gloo; {times(m['ours/fsdp_ext'] / m['local'])} the local step's "
        f"time")
    return "\n".join(text), headline


# --------------------------------------------------------------------------------------------
# Section 4: host time per FSDP group

def render_host_time(key):
    data = section_json(key, "host_time")
    if data is None:
        return None, {}
    steps = data["args"]["steps"]
    steady = steps // 3
    body, per_group_ratio = [], {}
    for world in sorted(data["runs"], key=int):
        for model, result in data["runs"][world].items():
            med = {n: statistics.median(t[steady:]) for n, t in result["times"].items()}
            groups = result["groups"]["ours/fsdp_ext"]
            up = (med["upstream/fsdp_ext"] - med["local"]) / groups * 1e6
            ours = (med["ours/fsdp_ext"] - med["local"]) / groups * 1e6
            per_group_ratio[(model, int(world))] = (ours / up, ours, up)
            body.append([model, world, groups, f"{med['local'] * 1e3:.2f}",
                         times(med["upstream/fsdp_ext"] / med["local"]),
                         times(med["ours/fsdp_ext"] / med["local"]),
                         f"{up:.0f}", f"{ours:.0f}", f"{ours / up:.2f}"])
    text = [
        f"Forward and backward only (no optimizer), over fsdp_ext: the local step against "
        f"upstream's and our `fully_shard`, one step each in turn, median of steps "
        f"{steady}..{steps - 1}. *µs per group*: (step − local step) / FSDP groups, the time "
        f"the runtime adds per group and step. At 1 rank nothing is communicated, so all of "
        f"it is host time; at 2 ranks it includes the collectives.",
        "",
        table(["model", "ranks", "groups", "local ms", "upstream ÷ local", "ours ÷ local",
               "upstream µs per group", "ours µs per group", "ours ÷ upstream per group"], body,
              ["---"] + ["---:"] * 8),
    ]
    headline = {}
    pick = ("small-blocks", 1) if ("small-blocks", 1) in per_group_ratio else \
        next(iter(per_group_ratio))
    headline["host-time"] = (
        f"Host time per FSDP group, {pick[0]}, {pick[1]} rank{'s' if pick[1] > 1 else ''}",
        f"ours {per_group_ratio[pick][0]:.2f} of upstream's ({per_group_ratio[pick][1]:.0f} "
        f"against {per_group_ratio[pick][2]:.0f} µs per group and step)")
    return "\n".join(text), headline


# --------------------------------------------------------------------------------------------
# Section 5: more ranks than cores

def render_many_ranks(key):
    rows, _ = collective_rows(key)
    if not rows:
        return None, {}
    ops = [op for op in ONE_HOST_OPS if any(r["op"] == op for r in rows)]
    body = []
    for op in ops:
        for r in sorted((r for r in rows if r["op"] == op),
                        key=lambda r: (r["bytes"], r["world_size"])):
            worst = max(r["fsdp_ext_worst_over_median"],
                        r.get("fsdp_ext+alloc_worst_over_median", 0))
            body.append([f"`{op}`", human(r["bytes"]), r["world_size"],
                         _pair(r, lambda v: number(v, 0 if v >= 100 else 1),
                               lambda r, n: r[f"{n}_us"]),
                         number(r["gloo_us"], 0),
                         _pair(r, times, lambda r, n: r["gloo_us"] / r[f"{n}_us"]),
                         f"{worst:.2f}"])
    cores = len(os.sched_getaffinity(0))
    text = [
        f"Up to {max(r['world_size'] for r in rows)} ranks on this machine's {cores} cores: "
        f"each rank "
        f"is a process, and fsdp_ext's ranks spin briefly while they wait for a peer. Cells: "
        f"ordinary tensors / buffers from the group. *Slowest ÷ median*: fsdp_ext's slowest "
        f"repeat over its median (the larger of the two): how unstable the op becomes when the "
        f"ranks outnumber the cores.",
        "",
        table(["op", "size", "ranks", "fsdp_ext µs", "gloo µs", "× gloo", "slowest ÷ median"],
              body, ["---", "---:", "---:", "---:", "---:", "---:", "---:"]),
    ]
    plt = plt_or_none()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for i, op in enumerate(ops):
            mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["world_size"])
            ws = [r["world_size"] for r in mine]
            ax.plot(ws, [r["fsdp_ext_us"] for r in mine], "o-", color=f"C{i}",
                    label=f"{op} {human(mine[0]['bytes'])}, fsdp_ext")
            ax.plot(ws, [r["gloo_us"] for r in mine], "^--", color=f"C{i}", alpha=0.6,
                    label=f"{op}, gloo")
            ax.set_xticks(ws)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["world_size"] for r in rows}))
        ax.set_xticklabels([str(w) for w in sorted({r["world_size"] for r in rows})])
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("median time per op (µs, log)")
        ax.set_title(f"ranks beyond the cores ({cores} here)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        text += ["", f"![time per op against the number of ranks]({save_plot(fig, key)})"]
    headline = {}
    big = max(r["world_size"] for r in rows)
    r = next((r for r in rows if r["world_size"] == big and r["op"] == "all_reduce"), None)
    if r:
        headline["many-ranks"] = (
            f"`all_reduce` of {human(r['bytes'])}, {big} ranks on {cores} cores",
            f"{times(r['gloo_us'] / r['fsdp_ext_us'])} as fast as gloo; slowest repeat "
            f"{r['fsdp_ext_worst_over_median']:.2f}x the median")
    return "\n".join(text), headline


# --------------------------------------------------------------------------------------------
# The sections, in page order. The titles make the anchors the README links to.

SECTIONS = {
    "one-host": ("Collectives on one host", one_host_runs, render_one_host,
                 "How much faster than gloo is each collective between ranks of one machine, "
                 "and how close to what the machine's memory allows?"),
    "two-hosts": ("Collectives across two hosts", two_hosts_runs, render_two_hosts,
                  "Across a network, how much of the link does each collective use, against "
                  "gloo? Two hosts are emulated on this machine: two network namespaces "
                  "joined by a veth link, real `torchrun --nnodes 2` jobs, everything between "
                  "hosts over TCP."),
    "fsdp-step": ("FSDP training step", fsdp_step_runs, render_fsdp_step,
                  "How fast is a training step with our `fully_shard` against upstream's, "
                  "over gloo and over fsdp_ext, and against the same model without FSDP? "
                  "Forward, backward and SGD step; each contender trains its own copy of the "
                  "same model on the same data. *small-blocks*: 48 blocks of two 64×64 "
                  "Linears, batch 8, each block its own FSDP group (the runtime's overhead "
                  "dominates). *transformer*: `examples/tiny_transformer.py`, dim 512, 4 "
                  "layers, 12.9M parameters, 5 groups."),
    "host-time": ("Host time per FSDP group", host_time_runs, render_host_time,
                  "How much host time does the `fully_shard` runtime add per FSDP group and "
                  "step, against upstream's?"),
    "many-ranks": ("More ranks than cores", many_ranks_runs, render_many_ranks,
                   "What happens with more ranks than cores? fsdp_ext against gloo at 2, 4, 8 "
                   "and 16 ranks on this machine."),
}


def anchor(title):
    """GitHub's heading anchor."""
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


# --------------------------------------------------------------------------------------------
# Running

def git_commit():
    def git(*args):
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # The page and its images, which this script rewrites, do not count.
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/benchmarks.md",
           ":!docs/images"):
        commit += " (with uncommitted changes)"
    return commit


def machine():
    info = {"cpu": platform.processor() or "unknown", "virtual": False}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and info["cpu"] in ("unknown", "", "x86_64"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                if line.startswith("flags") and " hypervisor" in line:
                    info["virtual"] = True
    except OSError:
        pass
    info["cores"] = os.cpu_count()
    info["usable_cores"] = len(os.sched_getaffinity(0))
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        info["memory_gib"] = kib / 2**20
    except (OSError, StopIteration):
        info["memory_gib"] = None
    name = platform.system()
    try:
        with open("/etc/os-release") as f:
            fields = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        name = fields.get("PRETTY_NAME", name).strip('"')
    except OSError:
        pass
    info["os"] = f"{name}, kernel {platform.release()}"
    return info


def versions():
    code = ("import json, torch, torch_fsdp_ext\n"
            "from torch_fsdp_ext import _C, _build_info\n"
            "print(json.dumps({'torch': torch.__version__, 'ucx': _C._ucx_library()['version'],"
            " 'ucx_source': _build_info.UCX_SOURCE, 'python': __import__('platform')"
            ".python_version()}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit("torch_fsdp_ext does not import (build it: `make build`):\n"
                         + done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "self,sm,tcp", "UCX_LOG_LEVEL": "error"}


def run_section(key, quick, env_info):
    title, runs, _, _ = SECTIONS[key]
    if key == "two-hosts" and os.geteuid() != 0:
        print(f"== {key}: skipped, needs root (network namespaces); keeping its last results")
        return False
    new = section_dir(key) + ".new"
    shutil.rmtree(new, ignore_errors=True)
    os.makedirs(new)
    env = dict(os.environ)
    for k, v in UCX_ENV.items():
        env.setdefault(k, v)
    commands = []
    started = time.time()
    meta = {"title": title, "quick": quick, "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(), "machine": machine(),
            "versions": env_info, "load_average": os.getloadavg()[0],
            "ucx_env": {k: env[k] for k in UCX_ENV}}
    print(f"== {key}: {len(runs(quick))} command(s)", flush=True)
    log = open(os.path.join(new, "log.txt"), "w")
    for name, argv in runs(quick):
        output = os.path.join(new, name + ".json")
        shown = os.path.join("benchmarks/results/report", key, name + ".json")
        script = [sys.executable, os.path.join(HERE, argv[0]), *argv[1:], "--output", output]
        commands.append(" ".join(["python", "benchmarks/" + argv[0], *argv[1:],
                                  "--output", shown]))
        print("   $ " + commands[-1], flush=True)
        t = time.time()
        proc = subprocess.Popen(script, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        tail = []
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line])[-40:]
            if quick_echo:
                sys.stdout.write("   | " + line)
        proc.wait()
        print(f"   ({time.time() - t:.0f} s)", flush=True)
        if proc.returncode != 0 or not os.path.exists(output):
            log.close()
            failed = section_dir(key) + ".failed"
            shutil.rmtree(failed, ignore_errors=True)
            os.replace(new, failed)
            print(f"== {key}: FAILED (exit {proc.returncode}); keeping its last results; "
                  f"the log: {os.path.relpath(failed, ROOT)}/log.txt. Last lines:\n"
                  + "".join(tail), flush=True)
            return False
    log.close()
    meta["commands"] = commands
    meta["elapsed_s"] = time.time() - started
    with open(os.path.join(new, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    shutil.rmtree(section_dir(key), ignore_errors=True)
    os.replace(new, section_dir(key))
    print(f"== {key}: done in {meta['elapsed_s']:.0f} s", flush=True)
    return True


quick_echo = False


# --------------------------------------------------------------------------------------------
# Rendering the page

def describe_machine(meta):
    m, v = meta["machine"], meta["versions"]
    mem = f", {m['memory_gib']:.0f} GiB memory" if m.get("memory_gib") else ""
    cores = f"{m['cores']} cores" + (f" ({m['usable_cores']} usable)"
                                     if m["usable_cores"] != m["cores"] else "")
    return (f"{m['cpu']}{' (virtual machine)' if m['virtual'] else ''}, {cores}{mem}; "
            f"{m['os']}; torch {v['torch']}, UCX {v['ucx']} ({v['ucx_source']}), Python "
            f"{v['python']}; `" + " ".join(f"{k}={val}" for k, val in meta["ucx_env"].items())
            + "`")


def render_page():
    metas = {}
    for key in SECTIONS:
        path = os.path.join(section_dir(key), "meta.json")
        if os.path.exists(path):
            metas[key] = load_json(path)
    bodies, headline = {}, {}
    for key, (title, _, render, _) in SECTIONS.items():
        if key in metas:
            body, lines = render(key)
            bodies[key] = body
            headline.update(lines)
    latest = max(metas.values(), key=lambda m: m["date"]) if metas else None
    out = ["# Benchmarks", "",
           "What `fsdp_ext` and our `fully_shard` cost and save on CPU, measured on one "
           "machine, against gloo and against upstream's FSDP2. Generated by `make "
           "bench-report` (`benchmarks/bench_report.py`); do not edit by hand.", ""]
    if any(m["quick"] for m in metas.values()):
        quick = [SECTIONS[k][0] for k, m in metas.items() if m["quick"]]
        which = "this page comes" if len(quick) == len(metas) else \
            ", ".join(quick) + (" comes" if len(quick) == 1 else " come")
        out += [f"> **Not a measurement**: {which} from `--quick` (tiny sizes, one repeat), "
                "which only checks the pipeline. Run `make bench-report` on an idle machine.",
                ""]
    out += ["## Headline", "",
            "| question | result | details |", "|---|---|---|"]
    for key in SECTIONS:
        if key in headline:
            what, result = headline[key]
            out.append(f"| {what} | {result} | [{SECTIONS[key][0]}](#{anchor(SECTIONS[key][0])}) |")
    if not headline:
        out.append("| (no results yet) | | |")
    out += [""]
    if latest:
        commits = {m["commit"] for m in metas.values()}
        dates = sorted(m["date"] for m in metas.values())
        when = dates[0] if dates[0] == dates[-1] else (
            f"{dates[0][:-4]}–{dates[-1][11:]}" if dates[0][:10] == dates[-1][:10]
            else f"{dates[0]} to {dates[-1]}")
        total = sum(m["elapsed_s"] for m in metas.values())
        out += ["## This run", "",
                f"- Machine: {describe_machine(latest)}.",
                f"- Commit {', '.join(sorted(commits))}; measured {when}; "
                f"{total / 60:.1f} minutes for the sections below"
                + (" (sections run separately: see each one's note)" if len(commits) > 1 or
                   dates[0][:10] != dates[-1][:10] else "") + ".",
                ""]
    out += [
        "## Method", "",
        "- **Same processes, alternating.** In each benchmark every contender (fsdp_ext, "
        "fsdp_ext with buffers from the group, gloo; our `fully_shard`, upstream's, the local "
        "model) runs inside the same rank processes, one repeat or step of each in turn, so "
        "that noise from the host hits all alike. gloo is a second process group over the "
        "same ranks.",
        "- **Medians, slowest rank.** A collective's repeat is a fixed number of back-to-back "
        "ops after two untimed ones; its time is the slowest rank's, and tables show the "
        "median over repeats. A training step is timed the same way; the median skips the "
        "first third of the steps (warm-up).",
        "- **Ratios within one run.** Each table comes from one run; compare ratios, not "
        "absolute times across sections. Bus bandwidth follows nccl-tests (all-gather, "
        "reduce-scatter S·(n−1)/n; all-reduce 2·S·(n−1)/n; broadcast S).",
        "- **Noise.** This is a small shared virtual machine: absolute times move by up to "
        "±30 % between runs, small-message latencies by up to 2x, and more so while other "
        "work runs. Each section reports its own spread (slowest repeat over median) and the "
        "load average when it started. The ranks are not bound to cores.",
        "",
        "## Reproduce", "",
        "```",
        "make bench-report                                   # every section, then this page "
        "(12-15 minutes, idle machine, root)",
        "python benchmarks/bench_report.py --quick           # the pipeline only (tiny sizes)",
        "python benchmarks/bench_report.py --sections " + " ".join(SECTIONS) +
        "   # a subset",
        "python benchmarks/bench_report.py --render-only     # this page from "
        "benchmarks/results/report/",
        "```", "",
        "`python` is the project's venv (`.venv/bin/python`). Each section lists the commands "
        "it ran; each writes its JSON under `benchmarks/results/report/<section>/`.", ""]
    for key, (title, _, _, question) in SECTIONS.items():
        out += [f"## {title}", "", question, ""]
        meta = metas.get(key)
        body = bodies.get(key)
        if meta is None or body is None:
            out += [f"Not measured yet: `python benchmarks/bench_report.py --sections {key}`.",
                    ""]
            continue
        out += [body, ""]
        differs = (latest and (meta["commit"] != latest["commit"] or
                               meta["machine"] != latest["machine"]))
        note = (f"Measured {meta['date']}" + (f" at {meta['commit']}" if differs else "")
                + f", {meta['elapsed_s']:.0f} s, load average {meta['load_average']:.2f} at "
                f"the start" + (" (**quick run**)" if meta["quick"] else "") + ":")
        out += [note, "", "```"] + meta["commands"] + ["```", ""]
    with open(PAGE, "w") as f:
        f.write("\n".join(out).rstrip("\n") + "\n")
    print(f"wrote {os.path.relpath(PAGE, ROOT)}")


def main():
    global quick_echo
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one repeat, few steps: checks the pipeline (~3 min)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite docs/benchmarks.md from the JSON already there")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        help="the sections to run (the page is rendered from all)")
    parser.add_argument("--verbose", action="store_true",
                        help="echo the benchmarks' own output (always kept in each section's "
                        "log.txt)")
    args = parser.parse_args()
    quick_echo = args.verbose
    failed = []
    if not args.render_only:
        env_info = versions()
        started = time.time()
        elapsed = {}
        for key in args.sections:
            t = time.time()
            if not run_section(key, args.quick, env_info):
                failed.append(key)
            elapsed[key] = time.time() - t
        print("\nelapsed: " + ", ".join(f"{k} {v:.0f} s" for k, v in elapsed.items())
              + f"; total {time.time() - started:.0f} s")
    render_page()
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (their last results were kept)")


if __name__ == "__main__":
    main()
