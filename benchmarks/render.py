"""Turns benchmark JSONL rows into the README's markdown tables and PNG plots.

    python -m benchmarks.render benchmarks/results/*.jsonl --plots benchmarks/results

Tables: one per (suite, head dim, causal, mask, pass), implementations as rows, sequence
lengths as columns, TFLOP/s in the cells; each of ours gets a second line with its
ratio to the best peer measured in the same run. The memory suite's table gives
compiled temporary MiB, with "failed" where an implementation could not compile or run.
The launch-config sweep's table (benchmarks/sweep.py) sets each default config's time
against the fastest candidate's, per head dim, causal and pass. Ring attention's rows
(benchmarks/ring.py) give its errors against one device and its time against one device's.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def load(paths) -> list[dict]:
    """The rows of these JSONL files, less fa-suite rows whose head count or tokens a
    batch are not the grid's (bench --heads, a probe of the launch's waves; --batches):
    a table's cell is a head dim, a length and a causal flag, so another head count or
    batch would take a grid point's place."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if not _off_grid(r)]


def _off_grid(row: dict) -> bool:
    if row.get("suite") != "fa" or "heads" not in row:
        return False
    # suites._fa_shapes' head counts and 16k tokens a batch (this module stays free of
    # JAX, which suites imports)
    if "batch" in row and "seq_q" in row and row["batch"] * row["seq_q"] != 16384:
        return True
    return row["heads"] != (8 if row["head_dim"] == 256 else 2048 // row["head_dim"])


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
        matmul = rs[0].get("matmul_tflops")
        title = (
            f"**{suite}**, {p}, head dim {hd}, {'causal' if causal else 'non-causal'}"
            f"{'' if mask == 'none' else ', mask ' + mask} (TFLOP/s; run {run_id}, "
            f"{rs[0]['device']}"
            f"{f'; dense bf16 matmul {matmul:.0f} in this run' if matmul else ''})"
        )
        out += [
            title,
            "",
            "| impl | " + " | ".join(_seq_label(t) for t in seqs) + " |",
            "|---" * (len(seqs) + 1) + "|",
        ]
        flagged = 0
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
                    mark = "†" if r.get("check_ok") is False else ""
                    flagged += bool(mark)
                    vals.append(f"{r['tflops']:.0f}{mark}")
                    b = best_peer[t]
                    ratios.append(f"{r['tflops'] / b:.2f}x" if b else "")
            out.append(f"| {impl} | " + " | ".join(vals) + " |")
            if _ours(impl) and any(best_peer.values()):  # a run of ours alone has no ratio
                out.append("| ratio to best peer | " + " | ".join(ratios) + " |")
        if flagged:
            out += [
                "",
                "† failed the pre-timing check against the float32 reference (relative "
                "error over 2e-2; `check_err` and `check_worst` in the JSONL); timed anyway, "
                "and still counted as a peer in the ratios.",
            ]
        out.append("")
    return "\n".join(out)


def summary_table(
    rows: list[dict], ours: str = "pallas_flash:mosaic", peer: str = "jax.nn:cudnn"
) -> str:
    """One line per (head dim, causal, pass, run) of the fa suite: `ours` against the best
    peer and against `peer`, as the range of ratios at seq 512-1k and at seq >= 2k (issue
    5's thresholds), and ours at its fastest as a share of the run's dense matmul rate."""
    rs = [r for r in rows if r["suite"] == "fa" and r["mask"] == "none" and r["pass"] != "fwd+bwd"]
    groups = collections.defaultdict(list)
    for r in rs:
        groups[(r["head_dim"], r["causal"], r["pass"], r["run_id"])].append(r)
    out = []
    for (hd, causal, p, run_id), g in sorted(groups.items(), key=lambda kv: kv[0]):
        cell = {(r["impl"], r["seq_q"]): r["tflops"] for r in g if not r["error"] and r["tflops"]}
        seqs = sorted({t for i, t in cell if i == ours})
        if not seqs:
            continue

        def ratios(pick, short):
            xs = []
            for t in seqs:
                if (t >= 2048) == short:
                    continue
                others = [v for (i, u), v in cell.items() if u == t and pick(i)]
                if others:
                    xs.append(cell[(ours, t)] / max(others))
            if not xs:
                return "-"
            lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
            return f"{lo}x" if lo == hi else f"{lo}-{hi}x"

        best = lambda i: not _ours(i)  # noqa: E731
        just = lambda i: i == peer  # noqa: E731
        fastest = max(cell[(ours, t)] for t in seqs)
        matmul = g[0].get("matmul_tflops")
        share = f"{fastest:.0f} ({100 * fastest / matmul:.0f} %)" if matmul else f"{fastest:.0f}"
        out.append(
            f"| {hd} | {'yes' if causal else 'no'} | {p} | {_seq_label(seqs[0])}-"
            f"{_seq_label(seqs[-1])} | {ratios(best, True)} | {ratios(best, False)} | "
            f"{ratios(just, True)} | {ratios(just, False)} | {share} | {run_id} |"
        )
    if not out:
        return ""
    head = [
        f"{ours} against the best peer and against {peer}, per head dim, causal and pass "
        "(ratios of TFLOP/s in the same run; the fastest point as a share of that run's "
        "dense bf16 matmul rate)",
        "",
        "| head dim | causal | pass | seq | vs best peer, < 2k | vs best peer, >= 2k | "
        f"vs {peer}, < 2k | vs {peer}, >= 2k | fastest TFLOP/s (of matmul) | run |",
        "|---" * 10 + "|",
    ]
    return "\n".join(head + out) + "\n"


def _run_letter(i: int) -> str:
    """a, b, ..., z, then aa, ab, ...: a run's tag in the point-by-point table (letters
    only, so that none is a table's cell separator)."""
    letters = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        letters = chr(ord("a") + r) + letters
    return letters


# Commits whose default config at some points was reverted by a later commit, with those
# points ((head dim, causal, key length) -> bool): there `pallas_flash:mosaic` timed a row
# that is no longer the default, so latest_table passes over those rows of ours.
# 99c36a7: three consumer warpgroups at head dim 64 from 8k keys non-causal and 16k causal
# (reverted at 92e495b, mosaic/config.py's `consumers` docstring).
REVERTED_DEFAULTS = {
    "99c36a7": lambda hd, causal, seq_k: hd == 64 and seq_k >= (16384 if causal else 8192),
}


# Commits whose rows' SM clocks are not NVML's: 488cafb's came from `nvidia-smi` in a
# pipe, whose lines arrived seconds late (gpu_clock.py), so the per-clock table skips them.
UNREAD_CLOCKS = {"488cafb"}


def _clock(r: dict) -> float | None:
    return None if r.get("commit") in UNREAD_CLOCKS else r.get("sm_mhz")


def _reverted(r: dict) -> bool:
    at = REVERTED_DEFAULTS.get(r.get("commit"))
    return at is not None and at(r["head_dim"], r["causal"], r.get("seq_k", r["seq_q"]))


def _latest_cells(rows, ours, peer, required, device):
    """latest_table's cells: {(head dim, causal, pass, seq): (ratio, run id, ours' row,
    the row it is against)}, and {run id: pre-roll seconds}."""
    points = collections.defaultdict(lambda: collections.defaultdict(dict))
    preroll: dict[str, float] = {}
    for r in rows:
        if r.get("suite") != "fa" or r["mask"] != "none" or r["pass"] not in ("fwd", "bwd"):
            continue
        if device not in (r.get("device") or device):  # unnamed: counted
            continue
        if r["error"] or not r["tflops"]:
            continue
        if r["impl"] == ours and _reverted(r):
            continue
        key = (r["head_dim"], r["causal"], r["pass"], r["seq_q"])
        points[key][r["run_id"]][r["impl"]] = r
        if r.get("preroll_s"):
            preroll[r["run_id"]] = r["preroll_s"]
    cells = {}
    for key, runs in points.items():
        for run_id in sorted(runs, reverse=True):
            got = runs[run_id]
            if ours not in got:
                continue
            if key[2] == "fwd":
                if not all(i in got for i in required):
                    continue
                peers = [r for i, r in got.items() if not _ours(i)]
                against = max(peers, key=lambda r: r["tflops"])
            elif peer in got:
                against = got[peer]
            else:
                continue
            cells[key] = (got[ours]["tflops"] / against["tflops"], run_id, got[ours], against)
            break
    return cells, preroll


def _cells_table(cells, title: str, cell) -> list[str]:
    """Rows (head dim, causal, pass) by columns (seq) of `cell(cells[key])`, with the
    table's title above."""
    seqs = sorted({key[3] for key in cells})
    out = [
        title,
        "",
        "| head dim | causal | pass | " + " | ".join(_seq_label(t) for t in seqs) + " |",
        "|---" * (len(seqs) + 3) + "|",
    ]
    for hd, causal, p in sorted({key[:3] for key in cells}):
        row = []
        for t in seqs:
            c = cells.get((hd, causal, p, t))
            row.append("-" if c is None else cell(c))
        out.append(f"| {hd} | {'yes' if causal else 'no'} | {p} | " + " | ".join(row) + " |")
    return out


def latest_table(
    rows: list[dict],
    ours: str = "pallas_flash:mosaic",
    peer: str = "jax.nn:cudnn",
    required: tuple[str, ...] = ("jax.nn:cudnn", "tokamax:mosaic"),
    device: str = "H200",
) -> str:
    """Issue 5's standing, point by point: for each (head dim, causal, pass, seq) of the
    fa suite, `ours` (the default config of the run's commit) against the best peer
    (forward) or against `peer` (backward), from the newest run that measured both
    there (run ids begin with the date and time; ours not where REVERTED_DEFAULTS says
    the run's default was later reverted); a forward ratio counts only from a
    run that also timed every peer in `required`, and only runs on the issue's GPU
    (`device` in the row's name of it: a call the tool ran on an H100 does not count).
    The runs used are listed below, each with its pre-roll where it had one
    (bench.PREROLL_S: runs before it favoured a peer whose backward is slow in the
    forward, docs/mosaic.md, "Power limit and the pre-roll").

    A second table gives the same cells per clock: each side's TFLOP/s divided by the
    mean SM clock NVML read over its own timed rounds (gpu_clock.py), where both rows
    have one. The H200 runs these kernels at its power limit, where the clock is the
    board's choice; the ratio per clock says how much of a cell is the kernel's step and
    how much the clock its power draw left it."""
    cells, preroll = _latest_cells(rows, ours, peer, required, device)
    if not cells:
        return ""
    runs = sorted({c[1] for c in cells.values()})
    tag = {run_id: _run_letter(i) for i, run_id in enumerate(runs)}
    out = _cells_table(
        cells,
        f"{ours} point by point, from the newest run that timed it beside the peers there: "
        f"forward against the best peer, backward against {peer} (the letter names the run)",
        lambda c: f"{c[0]:.2f}x {tag[c[1]]}",
    )
    clocked = {k: c for k, c in cells.items() if _clock(c[2]) and _clock(c[3])}
    if clocked:
        out += [""] + _cells_table(
            clocked,
            f"The same cells per clock (TFLOP/s per MHz of each row's mean SM clock): the "
            f"ratio, then {ours}'s clock / the other's, in MHz",
            lambda c: (
                f"{c[0] * c[3]['sm_mhz'] / c[2]['sm_mhz']:.2f}x "
                f"({c[2]['sm_mhz']:.0f} / {c[3]['sm_mhz']:.0f})"
            ),
        )
    out.append("")
    for run_id in runs:
        note = f" (pre-roll {preroll[run_id]:g} s)" if run_id in preroll else ""
        out.append(f"{tag[run_id]}: {run_id}{note}")
    return "\n".join(out) + "\n"


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


def _ours_times(rows, suite):
    """{(head dim, causal, mask, pass): ms} of our successful rows of one suite."""
    return {
        (r["head_dim"], r["causal"], r["mask"], r["pass"]): r["ms"]
        for r in rows
        if r["suite"] == suite and _ours(r["impl"]) and not r["error"]
    }


PASSES = ("fwd", "bwd", "fwd+bwd")


def masks_table(rows: list[dict]) -> str:
    """Each masking argument's time over the unmasked kernel's, same run (issue 4's
    budget: segments, lengths, windows <= 1.10x at full visibility; a mask <= 1.25x)."""
    t = _ours_times(rows, "masks")
    if not t:
        return ""
    shape = next(r for r in rows if r["suite"] == "masks")
    labels = list(dict.fromkeys(m for (_, _, m, _) in t if m != "none"))
    out = [
        f"Time relative to the unmasked kernel, same run (B={shape['batch']}, "
        f"T=S={_seq_label(shape['seq_q'])}, N={shape['heads']}, H={shape['head_dim']}, "
        "bf16); below 1 where the mask removes work",
        "",
        "| mask | " + " | ".join(f"{c} {p}" for c in ("full", "causal") for p in PASSES) + " |",
        "|---" * 7 + "|",
    ]
    for label in labels:
        cells = []
        for causal in (False, True):
            for p in PASSES:
                base = t.get((shape["head_dim"], causal, "none", p))
                got = t.get((shape["head_dim"], causal, label, p))
                cells.append(f"{got / base:.2f}x" if base and got else "")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def mask_layouts_table(rows: list[dict]) -> str:
    """benchmarks.mask_layouts: each in-kernel mask layout's time over the unmasked
    kernel's, same run."""
    rows = [r for r in rows if r.get("suite") == "mask-layouts" and r["ms"] and not r["error"]]
    if not rows:
        return ""
    base = {(r["causal"], r["pass"]): r["ms"] for r in rows if r["layout"] is None}
    cols = [(c, m) for c in (False, True) for m in ("mask-full", "mask")]
    out = [
        "Boolean mask layouts: time relative to the unmasked kernel, same run",
        "",
        "| layout | pass | "
        + " | ".join(f"{'causal' if c else 'full'} {m}" for c, m in cols)
        + " |",
        "|---" * (len(cols) + 2) + "|",
    ]
    for layout in dict.fromkeys(r["layout"] for r in rows if r["layout"]):
        for p in PASSES:
            got = {
                (r["causal"], r["mask"]): r["ms"]
                for r in rows
                if r["layout"] == layout and r["pass"] == p
            }
            cells = [
                f"{got[c, m] / base[c, p]:.2f}x" if (c, m) in got and (c, p) in base else ""
                for c, m in cols
            ]
            out.append(f"| {layout} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def sparse_table(rows: list[dict]) -> str:
    """Block-sparse time against density x dense time (issue 4: within 1.25x), and a
    sliding window against causal."""
    t = _ours_times(rows, "sparse")
    if not t:
        return ""
    out = [
        "Block-sparse forward + backward at T = 16k: time / (density x dense time) "
        "(1.00x = perfect scaling)",
        "",
        "| head dim | dense ms | " + " | ".join(f"density {d}" for d in DENSITIES) + " |",
        "|---" * (len(DENSITIES) + 2) + "|",
    ]
    for hd in sorted({k[0] for k in t if k[2].startswith("sparse")}, reverse=True):
        dense = t.get((hd, False, "none", "fwd+bwd"))
        cells = []
        for d in DENSITIES:
            got = t.get((hd, False, f"sparse:{d}", "fwd+bwd"))
            cells.append(f"{got / (float(d) * dense):.2f}x" if got and dense else "")
        out.append(f"| {hd} | {dense:.2f} | " + " | ".join(cells) + " |")
    causal = {p: t.get((128, True, "none", p)) for p in PASSES}
    window = {p: t.get((128, True, "window:1024", p)) for p in PASSES}
    if all(causal.values()) and all(window.values()):
        out += [
            "",
            "Sliding window (1k, 1k) against causal at T = 32k, head dim 128: "
            + ", ".join(
                f"{p} {causal[p]:.1f} ms vs {window[p]:.2f} ms ({causal[p] / window[p]:.1f}x)"
                for p in PASSES
            ),
        ]
    return "\n".join(out) + "\n"


DENSITIES = ("1.0", "0.5", "0.25", "0.125")


def hbm_table(rows: list[dict]) -> str:
    """DRAM bytes of one forward + backward (Nsight Compute), against the compulsory."""
    rs = [r for r in rows if "total_bytes" in r or ("compulsory_bytes" in r and r.get("error"))]
    if not rs:
        return ""
    r0 = rs[0]
    out = [
        f"DRAM traffic of one forward + backward (B={r0['batch']}, T={r0['seq']}, "
        f"N={r0['heads']}, H={r0['head_dim']}, {r0['dtype']}); compulsory "
        f"{r0['compulsory_bytes'] / 1e9:.2f} GB",
        "",
        "| impl | read GB | write GB | total GB | x compulsory |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(rs, key=lambda r: (not _ours(r["impl"]), r["impl"])):
        if r.get("error"):
            out.append(f"| {r['impl']} | failed | | | |")
            continue
        out.append(
            f"| {r['impl']} | {r['read_bytes'] / 1e9:.2f} | {r['write_bytes'] / 1e9:.2f} | "
            f"{r['total_bytes'] / 1e9:.2f} | {r['over_compulsory']:.2f}x |"
        )
    return "\n".join(out) + "\n"


def ring_table(rows: list[dict]) -> str:
    """benchmarks/ring.py's rows: the check against one device, then the times on one
    device and on the ring, and the ring's share of one device's time."""
    rs = [r for r in rows if r.get("suite") == "ring"]
    if not rs:
        return ""
    out = []
    for c in (r for r in rs if r["kind"] == "check"):
        names = list(c["max_rel_err"])
        out += [
            f"Ring attention on {c['devices']} devices against one, T = {_seq_label(c['seq'])} "
            f"(B={c['batch']}, N={c['heads']}, H={c['head_dim']}, {c['dtype']}, "
            f"{'causal' if c['causal'] else 'non-causal'}): largest relative errors",
            "",
            "| | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
            "| ring against one device | "
            + " | ".join(f"{c['max_rel_err'][n]:.2g}" for n in names)
            + " |",
            "| one device's kernel against float32 | "
            + " | ".join(f"{c['kernel_rel_err'][n]:.2g}" for n in names)
            + " |",
            "",
        ]
    timed = [r for r in rs if r["kind"] == "time"]
    for seq in sorted({r["seq"] for r in timed}):
        cell = {(r["devices"], r["pass"]): r for r in timed if r["seq"] == seq}
        devices = sorted({d for d, _ in cell})
        head = " | ".join(f"{d} device{'s' if d > 1 else ''}" for d in devices)
        out += [
            f"Forward (+ backward) at T = {_seq_label(seq)}: ms (TFLOP/s over all devices); "
            "time against one device's",
            "",
            f"| pass | {head} | " + " | ".join(f"{d} / 1" for d in devices[1:]) + " |",
            "|---|" + "---|" * (2 * len(devices) - 1),
        ]
        for p in ("fwd", "fwd+bwd"):
            got = [cell.get((d, p)) for d in devices]
            if None in got:
                continue
            base = got[0]["ms"]
            out.append(
                f"| {p} | "
                + " | ".join(f"{r['ms']:.1f} ({r['tflops']:.0f})" for r in got)
                + " | "
                + " | ".join(f"{r['ms'] / base:.2f}x" for r in got[1:])
                + " |"
            )
        out.append("")
    return "\n".join(out)


# The Mosaic forward's schedule flags and their labels (all off in MosaicConfig() but
# row_bound_mask, on since 5a15452: rows before it used tile_mask and carry no "row-mask");
# one_way_turns was removed after its timing, whose committed rows carry it
# (results/mosaic-41958b0/).
_MOSAIC_FLAGS = (
    ("rescale_before_turn", "rescale-early"),
    ("early_k_wait", "k-wait-early"),
    ("qk_behind_pv", "qk-behind-pv"),
    ("intra_overlap", "overlap"),
    ("persistent", "persistent"),
    ("one_way_turns", "one-way"),
    ("row_bound_mask", "row-mask"),
    ("named_turns", "named-turns"),
    ("named_releases", "named-releases"),
    ("o_from_registers", "o-regs"),
    ("early_q_load", "q-early"),
)

# The Mosaic backward's flags and their labels (all off in MosaicBwdConfig()).
_MOSAIC_BWD_FLAGS = (
    ("fused", "fused"),
    ("fa3_order", "fa3-order"),
    ("row_bound_mask", "row-mask"),
    ("step_descriptors", "step-desc"),
    ("query_rows", "query-rows"),
    ("dq_pingpong", "dq-pingpong"),
    ("share_halves", "share-halves"),
    ("writer_warp", "writer-warp"),
    ("chained_share", "chained-share"),
    ("rotated_adds", "rotated-adds"),
    ("split_writer", "split-writer"),
)


def _flag_labels(c: dict, flags) -> str:
    """A space and NAME for each (key, NAME) of `flags` set in `c` (a key is absent from
    rows written before its flag existed)."""
    return "".join(f" {name}" for key, name in flags if c.get(key))


def config_label(c: dict) -> str:
    """A config in a cell. Triton: "128x64 w8 s3", or "dkv 64x64 dq 64x64 w4 s2".
    Mosaic: "64x128 s2" (block_q per warpgroup x block_kv, stages; "no-pingpong",
    "p-smem", "rescale-early", "k-wait-early", "overlap", "persistent", "one-way",
    "row-mask", "named-turns", "named-releases", "o-regs", "q-early" where set, and
    "slackN" with rescale_slack N, "3wg" with three consumers), or
    "dkv 2x64 q64 s2 dq 2x64 kv64 s2" (warpgroups x their tile, the streamed tile,
    stages; "split" where dV and dK split the warpgroups; "ops-smem", "fused",
    "fa3-order", "row-mask", "step-desc", "query-rows", "dq-pingpong", "share-halves",
    "writer-warp", "chained-share", "rotated-adds", "split-writer" where set)."""
    if "schedule_barrier" in c:
        flags = ("" if c["schedule_barrier"] else " no-pingpong") + (
            "" if c.get("p_in_registers", True) else " p-smem"
        )
        flags += _flag_labels(c, _MOSAIC_FLAGS)
        if c.get("rescale_slack") is not None:  # the conditional rescale's slack, base 2
            flags += f" slack{c['rescale_slack']:g}"
        if c.get("consumers", 2) != 2:  # consumer warpgroups a CTA
            flags += f" {c['consumers']}wg"
        return f"{c['block_q']}x{c['block_kv']} s{c['num_stages']}{flags}"
    if "consumers_dkv" in c:
        tiles = 1 if c["split_dkv"] else c["consumers_dkv"]
        dkv = f"dkv {tiles}x{c['block_kv_dkv']} q{c['block_q_dkv']} s{c['num_stages_dkv']}"
        dq = f"dq {c['consumers_dq']}x{c['block_q_dq']} kv{c['block_kv_dq']} s{c['num_stages_dq']}"
        flags = "" if c.get("operands_in_registers", True) else " ops-smem"
        flags += _flag_labels(c, _MOSAIC_BWD_FLAGS)
        return f"{dkv}{' split' if c['split_dkv'] else ''} {dq}{flags}"
    tail = f"w{c['num_warps']} s{c['num_stages']}"
    if "block_q" in c:
        return f"{c['block_q']}x{c['block_kv']} {tail}"
    return (
        f"dkv {c['block_q_dkv']}x{c['block_kv_dkv']} dq {c['block_q_dq']}x{c['block_kv_dq']} {tail}"
    )


def _ms_cell(r: dict | None) -> str:
    return f"{r['ms']:.2f} ({r['tflops']:.0f})" if r and r["ms"] else "failed"


SWEEP_FAMILIES = {"triton": "Triton", "mosaic": "Mosaic GPU"}


def sweep_table(rows: list[dict]) -> str:
    """The launch-config sweep (benchmarks/sweep.py), one table per run and kernel
    family: the default config's time against the fastest candidate that matched the
    default's output. Rows without a family are the Triton family's (the first sweeps)."""
    groups = collections.defaultdict(list)
    for r in rows:
        if r.get("suite") == "sweep" and "pass" in r:
            family = r.get("family", "triton")
            groups[(r["run_id"], family, r["head_dim"], r["causal"], r["pass"])].append(r)
    out = []
    for run_id, family in sorted({k[:2] for k in groups}):
        keys = sorted(
            (k for k in groups if k[:2] == (run_id, family)),
            key=lambda k: (k[2], k[3], k[4] != "fwd"),
        )
        r0 = groups[keys[0]][0]
        done = sum(len(groups[k]) for k in keys)
        total = sum(groups[k][0]["candidates"] for k in keys)
        out += [
            f"Launch-config sweep of the {SWEEP_FAMILIES.get(family, family)} kernels "
            f"(run {run_id}, {r0['device']}; "
            f"B={r0['batch']}, T=S={_seq_label(r0['seq_q'])}, hidden "
            f"{r0['heads'] * r0['head_dim']}, {r0['dtype']}; "
            f"{done} of {total} candidates measured): ms (TFLOP/s)",
            "",
            "| head dim | causal | pass | default config ms | best config | best ms | speedup |",
            "|---" * 7 + "|",
        ]
        for key in keys:
            rs = groups[key]
            default = next((r for r in rs if r["default"]), None)
            timed = [r for r in rs if r["ms"] and r["check_ok"] and not r["error"]]
            best = min(timed, key=lambda r: r["ms"], default=None)
            speedup = ""
            if best and default and default["ms"]:
                speedup = f"{default['ms'] / best['ms']:.2f}x"
            out.append(
                f"| {key[2]} | {'yes' if key[3] else 'no'} | {key[4]} | {_ms_cell(default)} | "
                f"{config_label(best['config']) if best else ''} | {_ms_cell(best)} | {speedup} |"
            )
        out.append("")
    return "\n".join(out)


def plots(rows: list[dict], folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    speed = [r for r in rows if r["suite"] != "memory" and not r["error"] and r["tflops"]]
    panels = sorted({(r["suite"], r["head_dim"], r["causal"], r["mask"]) for r in speed}, key=str)
    for suite, hd, causal, mask in panels:
        panel = [
            r
            for r in speed
            if (r["suite"], r["head_dim"], r["causal"], r["mask"]) == (suite, hd, causal, mask)
        ]
        # One run per plot (peers compare only within a run): the newest that has the panel.
        newest = max(r["run_id"] for r in panel)
        panel = [r for r in panel if r["run_id"] == newest]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, p in zip(axes, ("fwd", "bwd")):
            sel = [r for r in panel if r["pass"] == p]
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
    bench_rows = [r for r in rows if "suite" in r]
    hbm_rows = [r for r in rows if "suite" not in r]
    speed = [
        r
        for r in bench_rows
        if r["suite"] not in ("masks", "sparse", "sweep", "mask-layouts", "ring")
    ]
    for text in (
        speed_tables(speed),
        summary_table(speed),
        latest_table(speed),
        memory_table(bench_rows),
        masks_table(bench_rows),
        mask_layouts_table(bench_rows),
        sparse_table(bench_rows),
        hbm_table(hbm_rows),
        sweep_table(bench_rows),
        ring_table(bench_rows),
    ):
        if text:
            print(text)
    if args.plots:
        for name in plots(
            [r for r in speed if r["suite"] != "paper"]
            + [r for r in bench_rows if r["suite"] == "memory"],
            args.plots,
        ):
            print(f"wrote {name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
