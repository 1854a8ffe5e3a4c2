"""Per-kernel time and registers of one jitted forward + backward, from Nsight Compute.

    python -m benchmarks.profile --suite masks --masks none,segments:1 --out F.jsonl
    python -m benchmarks.profile --suite fa --head-dims 256 --seqs 8192 --causal true \
        --impls pallas_flash:mosaic,jax.nn:cudnn --out F.jsonl
    python -m benchmarks.profile --suite fa --head-dims 256 --seqs 4096 --causal false \
        --impls pallas_flash:mosaic,tokamax:mosaic --pass fwd \
        --sections SpeedOfLight,ComputeWorkloadAnalysis,WarpStateStats --out F.jsonl

For each selected shape of a suite (and each implementation), a child process compiles
and warms up one forward + backward, then runs it once between cudaProfilerStart/Stop
under `ncu --clock-control none`; every kernel of that step becomes a row: its name,
duration, registers per thread and the occupancy limit the registers set. Where a
masking argument costs time, this says in which kernel (ours, or XLA's work around
them) and whether the kernel's register count changed. With `--sections`, every metric
of those Nsight Compute sections (tensor-pipe and issue utilisation, warp stall
reasons, shared-memory and L2 traffic) is kept as well, under "sections": why one
kernel is slower than a peer's doing the same matmuls; `--pass fwd` profiles the
forward alone. (Nsight Systems cannot make a report on the H200 machine; Nsight Compute
works, as `benchmarks/hbm.py` uses it.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import sys

from benchmarks.hbm import run_under_ncu

METRICS = (
    "gpu__time_duration.sum",
    "launch__registers_per_thread",
    "launch__occupancy_limit_registers",
    "launch__grid_size",
)


def _value(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def csv_lines(text: str) -> list[str]:
    """The CSV rows of ncu's output (its own "==PROF==" lines and the child's left out)."""
    return [line for line in text.splitlines() if line.startswith('"')]


def parse_ncu_kernels(text: str) -> list[dict]:
    """One dict per profiled kernel (in launch order) of `ncu --csv --print-units base`:
    METRICS at the top level, and the rows of any section (`--section`, which name the
    section they come from) under "sections", keyed "Section / Metric Name"."""
    lines = csv_lines(text)
    kernels: dict[str, dict] = collections.OrderedDict()
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        k = kernels.setdefault(row["ID"], {"kernel": row.get("Kernel Name", "?")})
        name = row.get("Metric Name")
        if name in METRICS:
            k[name] = _value(row["Metric Value"])
        elif row.get("Section Name"):
            unit = row.get("Metric Unit") or ""
            key = f"{row['Section Name']} / {name}" + (f" [{unit}]" if unit else "")
            k.setdefault("sections", {})[key] = _value(row["Metric Value"])
    return list(kernels.values())


def child(suite: str, index: int, impl_name: str, fwd_only: bool = False) -> None:
    import jax

    from benchmarks import bench, suites
    from benchmarks.hbm import _profiler
    from benchmarks.impls import lookup

    s = suites.SUITES[suite].shapes[index]
    q, k, v, do, arrays, static = bench.make_inputs(s, s.dtype)
    fwd, fwd_bwd = bench._bind(lookup(impl_name), s, static)
    if fwd_only:
        step, args = jax.jit(fwd), (q, k, v, arrays)
    else:
        step, args = jax.jit(fwd_bwd), (q, k, v, do, arrays)
    jax.block_until_ready(step(*args))
    start, stop = _profiler()
    start()
    jax.block_until_ready(step(*args))
    stop()


def main(argv=None) -> int:
    from benchmarks import suites

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(suites.SUITES), required=True)
    parser.add_argument("--masks", default=None, help="comma-separated mask labels to keep")
    parser.add_argument("--impls", default="pallas_flash:triton")
    parser.add_argument("--head-dims", default=None, help="comma-separated head dims to keep")
    parser.add_argument("--seqs", default=None, help="comma-separated query lengths to keep")
    parser.add_argument("--causal", choices=("true", "false"), default=None)
    parser.add_argument("--pass", dest="pass_", choices=("fwd+bwd", "fwd"), default="fwd+bwd")
    parser.add_argument(
        "--sections", default="", help="comma-separated Nsight Compute sections to keep too"
    )
    parser.add_argument(
        "--kernels", default=None, help="a regular expression: profile only the kernels it matches"
    )
    parser.add_argument(
        "--details",
        action="store_true",
        help="the sections' bodies too (stall reasons, pipes); each row keeps ncu's CSV",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--ncu", default="ncu")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per shape")
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        suite, index, impl = args.child
        child(suite, int(index), impl, fwd_only=args.pass_ == "fwd")
        return 0
    sections = [x for x in args.sections.split(",") if x]
    labels = set(args.masks.split(",")) if args.masks else None
    head_dims = {int(x) for x in args.head_dims.split(",")} if args.head_dims else None
    seqs = {int(x) for x in args.seqs.split(",")} if args.seqs else None
    for index, s in enumerate(suites.SUITES[args.suite].shapes):
        if labels is not None and s.mask not in labels:
            continue
        if head_dims is not None and s.head_dim not in head_dims:
            continue
        if seqs is not None and s.seq_q not in seqs:
            continue
        if args.causal is not None and s.causal != (args.causal == "true"):
            continue
        for impl in args.impls.split(","):
            child_args = ["benchmarks.profile", "--suite", args.suite, "--pass", args.pass_]
            child_args += ["--child", args.suite, str(index), impl]
            row = dict(impl=impl, **s.row(), error=None, kernels=[], **{"pass": args.pass_})
            try:
                proc = run_under_ncu(
                    args.ncu, METRICS, child_args, args.timeout, sections, args.kernels,
                    args.details,
                )  # fmt: skip
                row["kernels"] = parse_ncu_kernels(proc.stdout)
                if args.details:  # the CSV as ncu wrote it: what the parser does not read too
                    row["ncu_csv"] = "\n".join(csv_lines(proc.stdout))
                if proc.returncode or not row["kernels"]:
                    raise RuntimeError(f"ncu exit {proc.returncode}: {proc.stderr[-300:]}")
            except Exception as e:  # noqa: BLE001 - recorded, as in the harness
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            print(f"== {impl} causal={s.causal} mask={s.mask} {row['error'] or ''}", flush=True)
            for kern in row["kernels"]:
                print(
                    f"  {kern.get('gpu__time_duration.sum', 0) / 1e3:9.1f} us "
                    f"{kern.get('launch__registers_per_thread', 0):4.0f} regs "
                    f"(occupancy limit {kern.get('launch__occupancy_limit_registers', 0):.0f}) "
                    f"{kern['kernel'][:70]}",
                    flush=True,
                )
                for key, value in kern.get("sections", {}).items():
                    print(f"      {key}: {value}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
