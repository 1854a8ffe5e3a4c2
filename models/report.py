"""Training runs side by side: the README's tables of loss curves and speed.

    python -m models.report runs/parity-1024-flash runs/parity-1024-xla runs/parity-1024-cudnn
    python -m models.report benchmarks/results/train-parallel-02107c1/{one,seq2,data2}.jsonl

Each argument is a run folder (its metrics.jsonl) or a metrics JSONL file, named in the
table by the folder or the file's stem. One row per run:
- the evaluation at each evaluated step (validation loss; and accuracy for an LRA task),
  and the test accuracy where the run reached its end;
- the largest relative difference of its training loss from the first run's, over the
  steps both ran (the first run is the reference: same seed, same batches, so this is
  how far the curves drift apart);
- for runs that reached a test: a last row with the test accuracies' mean, sample standard
  deviation, min and max (runs apart only in their seed are read by it);
- the steady rate: tokens (or examples) per second of training from step --skip (past
  compilation) to the last step, evaluation excluded. Files written before the trainer
  logged `train_seconds` give the rate over the whole run instead, compilation and
  evaluation in, and say so.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def load(path: str) -> tuple[str, list[dict]]:
    p = pathlib.Path(path)
    name = p.name if p.is_dir() else p.stem
    if p.is_dir():
        p = p / "metrics.jsonl"
    return name, [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def _unit(rows) -> str:
    return "tokens" if any("tokens_per_s" in r for r in rows) else "examples"


def steady_rate(rows: list[dict], skip: int) -> tuple[float | None, bool]:
    """(units per second, steady?): from step `skip` to the last step of the last
    uninterrupted stretch (a resumed run restarts its clock)."""
    unit = _unit(rows)
    steps = [r for r in rows if "loss" in r and f"{unit}_per_s" in r]
    if not steps:
        return None, False
    if "train_seconds" not in steps[-1]:
        return steps[-1][f"{unit}_per_s"], False
    start = max(
        (
            i
            for i in range(1, len(steps))
            if steps[i]["train_seconds"] < steps[i - 1]["train_seconds"]
        ),
        default=0,
    )  # where the last stretch began: its clock and its count start again there
    since = [r for r in steps[start:] if r["step"] >= skip]
    if len(since) < 2:
        return None, True
    first, last = since[0], since[-1]
    seen = last[f"{unit}_seen"] - first[f"{unit}_seen"]
    return seen / (last["train_seconds"] - first["train_seconds"]), True


def fit_steps(rows: list[dict], minutes: float, skip: int = 10, share: float = 0.85) -> int:
    """How many steps `minutes` of training hold at this run's steady rate, `share` of the
    time kept for steps (the rest for compiling, evaluation and the test): the step count
    that lets a recipe longer than the time at hand decay its schedule to the end."""
    rate, steady = steady_rate(rows, skip)
    if rate is None or not steady:
        raise ValueError("the run has no steady rate to fit steps to (too few steps logged)")
    batch = next(r for r in rows if "loss" in r)[f"{_unit(rows)}_seen"]  # step 0's count
    return max(1, int(rate * minutes * 60 * share / batch))


def table(runs: list[tuple[str, list[dict]]], skip: int = 10, evals: int | None = None) -> str:
    """`evals`: show at most this many evaluation columns, evenly spaced, the last kept."""
    ref = {r["step"]: r["loss"] for r in runs[0][1] if "loss" in r}
    steps = sorted({r["step"] for _, rows in runs for r in rows if "val_loss" in r})
    if evals is not None and len(steps) > evals:
        stride = -(-len(steps) // evals)  # ceil: at most `evals` columns
        steps = steps[::-1][::stride][::-1]
    evals = steps
    unit = _unit(runs[0][1])
    has_acc = any("val_acc" in r for _, rows in runs for r in rows)
    has_test = any("test_acc" in r for _, rows in runs for r in rows)
    has_best = any("best_test_acc" in r for _, rows in runs for r in rows)
    rates = [steady_rate(rows, skip) for _, rows in runs]
    steady = all(s for _, s in rates)
    rate_head = (
        f"{unit}/s (steady, from step {skip})"
        if steady
        else f"{unit}/s (whole run, with compilation)"
    )
    head = ["run", *(f"val loss @ {s + 1}" for s in evals)]
    head += ["test accuracy"] if has_test else []
    head += ["test accuracy at the best validation (step)"] if has_best else []
    head += [f"max rel. diff. of loss from {runs[0][0]}", rate_head]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (name, rows), (rate, _) in zip(runs, rates):
        at = {r["step"]: r for r in rows if "val_loss" in r}

        def cell(s):
            if s not in at:
                return "-"
            acc = f" ({100 * at[s]['val_acc']:.2f} %)" if has_acc and "val_acc" in at[s] else ""
            return f"{at[s]['val_loss']:.4f}{acc}"

        test = [r["test_acc"] for r in rows if "test_acc" in r]
        loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
        both = [s for s in loss if s in ref]
        diff = max((abs(loss[s] - ref[s]) / abs(ref[s]) for s in both), default=None)
        cells = [name, *(cell(s) for s in evals)]
        cells += [f"{100 * test[-1]:.2f} %" if test else "-"] if has_test else []
        best = [r for r in rows if "best_test_acc" in r]
        if has_best:
            b = best[-1] if best else None
            cells += [f"{100 * b['best_test_acc']:.2f} % ({b['best_val_step'] + 1})" if b else "-"]
        cells += ["-" if diff is None else f"{100 * diff:.2f} %"]
        cells += ["-" if rate is None else f"{rate:,.0f}"]
        out.append("| " + " | ".join(cells) + " |")
    if has_test:
        out.append(_seed_summary(runs, len(evals), has_best, n_after=2))
    return "\n".join(out)


def _mean_sd(xs: list[float]) -> str:
    mean = sum(xs) / len(xs)
    sd = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return f"{100 * mean:.2f} ± {100 * sd:.2f} % (min {100 * min(xs):.2f}, max {100 * max(xs):.2f})"


def _seed_summary(runs, n_evals: int, has_best: bool, n_after: int) -> str:
    """The runs' test accuracies as mean ± sample sd, min and max: runs that differ only
    in their seed are read by this row, not by their best one."""
    test = [[r["test_acc"] for r in rows if "test_acc" in r] for _, rows in runs]
    best = [[r["best_test_acc"] for r in rows if "best_test_acc" in r] for _, rows in runs]
    cells = [f"mean ± sd of {sum(map(bool, test))} runs", *([""] * n_evals)]
    cells += [_mean_sd([t[-1] for t in test if t])]
    cells += [_mean_sd([b[-1] for b in best if b])] if has_best else []
    cells += [""] * n_after
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders or metrics JSONL files")
    parser.add_argument(
        "--skip", type=int, default=10, help="first step of the steady rate (past compiling)"
    )
    parser.add_argument(
        "--fit-steps",
        type=float,
        metavar="MINUTES",
        help="print only the step count MINUTES hold at the (one) run's steady rate",
    )
    parser.add_argument(
        "--evals", type=int, default=None, help="at most this many evaluation columns"
    )
    args = parser.parse_args(argv)
    if args.fit_steps is not None:
        if len(args.runs) != 1:
            parser.error("--fit-steps takes one run")
        print(fit_steps(load(args.runs[0])[1], args.fit_steps, args.skip))
        return 0
    print(table([load(p) for p in args.runs], args.skip, args.evals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
