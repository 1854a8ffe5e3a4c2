"""Turns benchmark JSONL rows into the README's markdown tables and PNG plots.

    python -m benchmarks.render benchmarks/results/*.jsonl --plots benchmarks/results

Tables: one per (suite, head dim, causal, mask, pass), implementations as rows, sequence
lengths as columns, TFLOP/s in the cells; each of ours gets a second line with its
ratio to the best peer measured in the same run. The memory suite's table gives
compiled temporary MiB, with "failed" where an implementation could not compile or run.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def load(paths) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _seq_label(t: int) -> str:
    if t >= 1 << 20:
        return f"{t >> 20}M"
    return f"{t >> 10}k" if t >= 1024 else str(t)


def _ours(impl: str) -> bool:
    return impl.startswith("pallas_flash:")


def speed_tables(rows: list[dict]) -> str:
    groups = collections.defaultdict(list)
    for r in rows:
        if r["suite"] == "memory":
            continue
        key = (r["suite"], r["run_id"], r["head_dim"], r["causal"], r["mask"], r["pass"])
        groups[key].append(r)
    out = []
    for (suite, run_id, hd, causal, mask, p), rs in sorted(groups.items(), key=str):
        seqs = sorted({r["seq_q"] for r in rs})
        cell = {(r["impl"], r["seq_q"]): r for r in rs}
        impls = sorted({r["impl"] for r in rs}, key=lambda i: (not _ours(i), i))
        best_peer = {
            t: max(
                (
                    r["tflops"]
                    for r in rs
                    if r["seq_q"] == t and not _ours(r["impl"]) and r["tflops"] is not None
                ),
                default=None,
            )
            for t in seqs
        }
        title = (
            f"**{suite}**, {p}, head dim {hd}, {'causal' if causal else 'non-causal'}"
            f"{'' if mask == 'none' else ', mask ' + mask} (TFLOP/s; run {run_id}, "
            f"{rs[0]['device']})"
        )
        out += [
            title,
            "",
            "| impl | " + " | ".join(_seq_label(t) for t in seqs) + " |",
            "|---" * (len(seqs) + 1) + "|",
        ]
        for impl in impls:
            vals, ratios = [], []
            for t in seqs:
                r = cell.get((impl, t))
                if r is None:
                    vals.append("")
                    ratios.append("")
                elif r["error"]:
                    vals.append("failed")
                    ratios.append("")
                else:
                    vals.append(f"{r['tflops']:.0f}")
                    b = best_peer[t]
                    ratios.append(f"{r['tflops'] / b:.2f}x" if b else "")
            out.append(f"| {impl} | " + " | ".join(vals) + " |")
            if _ours(impl):
                out.append("| ratio to best peer | " + " | ".join(ratios) + " |")
        out.append("")
    return "\n".join(out)


def memory_table(rows: list[dict]) -> str:
    rs = [r for r in rows if r["suite"] == "memory"]
    if not rs:
        return ""
    seqs = sorted({r["seq_q"] for r in rs})
    cell = {(r["impl"], r["seq_q"]): r for r in rs}
    impls = sorted({r["impl"] for r in rs}, key=lambda i: (not _ours(i), i))
    out = [
        "Compiled temporary memory of jit(forward + backward), MiB; peak device memory "
        "in parentheses where the step was run; causal, B=1, N=16, H=128, bf16",
        "",
        "| impl | " + " | ".join(_seq_label(t) for t in seqs) + " | longest run |",
        "|---" * (len(seqs) + 2) + "|",
    ]
    for impl in impls:
        vals, longest = [], None
        for t in seqs:
            r = cell.get((impl, t))
            if r is None:
                vals.append("")
            elif r["error"]:
                vals.append("failed")
            else:
                v = f"{r['temp_bytes'] / 2**20:,.0f}"
                if r["peak_bytes"] is not None:
                    v += f" ({r['peak_bytes'] / 2**20:,.0f})"
                    longest = t
                else:
                    v += " (compiled, not run)"
                vals.append(v)
        out.append(
            f"| {impl} | " + " | ".join(vals) + f" | {_seq_label(longest) if longest else '-'} |"
        )
    return "\n".join(out) + "\n"


def plots(rows: list[dict], folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    speed = [r for r in rows if r["suite"] != "memory" and not r["error"] and r["tflops"]]
    panels = sorted({(r["suite"], r["head_dim"], r["causal"], r["mask"]) for r in speed}, key=str)
    for suite, hd, causal, mask in panels:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, p in zip(axes, ("fwd", "bwd")):
            sel = [
                r
                for r in speed
                if (r["suite"], r["head_dim"], r["causal"], r["mask"], r["pass"])
                == (suite, hd, causal, mask, p)
            ]
            for impl in sorted({r["impl"] for r in sel}):
                pts = sorted((r["seq_q"], r["tflops"]) for r in sel if r["impl"] == impl)
                ax.plot(*zip(*pts), marker="o", label=impl, lw=2.5 if _ours(impl) else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{p}, head dim {hd}, {'causal' if causal else 'non-causal'}, {mask}")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        name = f"{folder}/{suite}_h{hd}_{'causal' if causal else 'full'}_{mask}.png"
        fig.tight_layout()
        fig.savefig(name, dpi=90)
        plt.close(fig)
        written.append(name)
    mem = [r for r in rows if r["suite"] == "memory" and not r["error"]]
    if mem:
        fig, ax = plt.subplots(figsize=(6, 4))
        for impl in sorted({r["impl"] for r in mem}):
            pts = sorted((r["seq_q"], r["temp_bytes"] / 2**20) for r in mem if r["impl"] == impl)
            ax.plot(*zip(*pts), marker="o", label=impl, lw=2.5 if _ours(impl) else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("temporary MiB, fwd+bwd")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        name = f"{folder}/memory.png"
        fig.tight_layout()
        fig.savefig(name, dpi=90)
        plt.close(fig)
        written.append(name)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", nargs="+")
    parser.add_argument("--plots", default=None, help="folder to write PNG plots into")
    args = parser.parse_args(argv)
    rows = load(args.jsonl)
    print(speed_tables(rows))
    print(memory_table(rows))
    if args.plots:
        for name in plots(rows, args.plots):
            print(f"wrote {name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
