"""Where a kernel's warps wait, instruction by instruction: Nsight Compute's warp-state
sampling joined to the kernel's SASS (its source page), summed over the kernel's steps.

    python -m benchmarks.stall_sites --head-dim 128 --seq 8192 --causal false \
        --impl pallas_flash:mosaic --out-dir DIR          # on the GPU: profile, export
    python -m benchmarks.stall_sites --read DIR/NAME-sass.csv.gz   # anywhere: summarize

`profile` runs one jitted step of the fa suite's shape (as benchmarks.profile does: a
child compiles and warms up, then runs it once between cudaProfilerStart/Stop) under
`ncu --section SourceCounters --section WarpStateStats`, keeping the report only long
enough to export its source page as SASS (`--page source --csv --print-source sass`,
gzipped: every instruction's address, text, executions and warp samples by stall
reason). `summarize` finds the kernel's steps as benchmarks.ptxas does (the innermost
loops, a backward branch to a lower address, of at least ptxas.SASS_MIN_LOOP
instructions, that issue wgmmas) and says what share of all samples each takes and on
which stall reasons and opcodes, and which instructions outside them hold the most.

A sample is one warp's state at one moment, so a role's share of the samples is its
share of the warps' time: the producer's and the writers' waits are there by design,
and a consumer's step samples say where a consumer waits (a wgmma's result: barrier at
WARPGROUP.DEPBAR; a shared-memory load or MUFU result: short_sb; an mbarrier try-wait:
long_sb on the branch after it), not whether the tensor cores are idle meanwhile.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import os
import re
import subprocess
import sys

from benchmarks.hbm import run_ncu
from benchmarks.ptxas import SASS_MIN_LOOP, innermost

_BRANCH = re.compile(r"\bBRA(?:\.\S+)?\s+(?:\S+,\s*)?0x([0-9a-f]+)")
_GUARD = re.compile(r"^@!?U?P\w+\s+")
SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(text: str) -> str:
    """An instruction's base opcode: `@!P2  BRA 0x...` -> BRA, `LDS.64 R2, [R3]` -> LDS."""
    return _GUARD.sub("", text.strip()).split(" ")[0].split(".")[0]


def read_source(text: str) -> dict[str, list[dict]]:
    """Per kernel (ncu writes a `"Kernel Name","NAME"` line before each kernel's table),
    its instructions in address order: address, text, opcode, executions, samples, and
    `reasons`, the samples per stall reason (the `stall_*` columns, issued or not)."""
    kernels: dict[str, list[dict]] = {}
    name, header = None, None
    for row in csv.reader(text.splitlines()):
        if not row:
            continue
        if row[0] == "Kernel Name":
            name, header = row[1], None
            kernels[name] = []
        elif row[0] == "Address":
            header = {h: i for i, h in enumerate(row)}
        elif header is not None and name is not None:
            reasons = {
                h[len("stall_") :]: _number(row[i])
                for h, i in header.items()
                if h.startswith("stall_") and "Not Issued" not in h
            }
            kernels[name].append(
                dict(
                    address=int(row[header["Address"]], 16),
                    text=row[header["Source"]].strip(),
                    opcode=opcode(row[header["Source"]]),
                    executed=_number(row[header["Instructions Executed"]]),
                    samples=_number(row[header[SAMPLES]]),
                    reasons=reasons,
                )
            )
    return kernels


def steps(code: list[dict]) -> list[tuple[int, int]]:
    """The kernel's steps: (first, last) addresses of each innermost loop of at least
    SASS_MIN_LOOP instructions that issues a wgmma (shorter loops are spin-waits)."""
    loops = set()
    for ins in code:
        m = _BRANCH.search(ins["text"])
        if ins["opcode"] == "BRA" and m and int(m.group(1), 16) < ins["address"]:
            start, end = int(m.group(1), 16), ins["address"]
            if sum(start <= x["address"] <= end for x in code) >= SASS_MIN_LOOP:
                loops.add((start, end))
    with_wgmma = [
        (a, b)
        for a, b in loops
        if innermost((a, b), loops)
        and any(a <= x["address"] <= b and x["opcode"] == "HGMMA" for x in code)
    ]
    return sorted(with_wgmma)


def _shares(counter: collections.Counter, total: float, top: int) -> dict[str, float]:
    return {k: round(v / total, 4) for k, v in counter.most_common(top) if v} if total else {}


def summarize(code: list[dict], top: int = 8) -> dict:
    """The samples' split: each step's share of all samples, its stall reasons and
    opcodes (shares of the step's samples), its executions (the most of any of its
    instructions: warps x iterations); and the instructions outside the steps that hold
    the most samples, each with its share and main reason."""
    total = sum(x["samples"] for x in code)
    inside, out = set(), []
    for start, end in steps(code):
        body = [x for x in code if start <= x["address"] <= end]
        inside.update(x["address"] for x in body)
        held = sum(x["samples"] for x in body)
        reasons, ops = collections.Counter(), collections.Counter()
        for x in body:
            reasons.update(x["reasons"])
            ops[x["opcode"]] += x["samples"]
        out.append(
            dict(
                start=start,
                end=end,
                instructions=len(body),
                executed=max(x["executed"] for x in body),
                share=round(held / total, 4) if total else 0.0,
                reasons=_shares(reasons, held, top),
                opcodes=_shares(ops, held, top),
                hot=_hottest(body, held, top),
            )
        )
    rest = [x for x in code if x["address"] not in inside]
    return dict(samples=total, steps=out, outside=_hottest(rest, total, top))


def _hottest(code: list[dict], total: float, top: int) -> list[dict]:
    """The `top` instructions of `code` holding the most samples: each with its share
    of `total` and its main stall reason."""
    return [
        dict(
            address=x["address"],
            text=x["text"],
            executed=x["executed"],
            share=round(x["samples"] / total, 4),
            reason=max(x["reasons"], key=x["reasons"].get) if x["reasons"] else None,
        )
        for x in sorted(code, key=lambda x: -x["samples"])[:top]
        if x["samples"]
    ]


def print_summary(name: str, summary: dict) -> None:
    print(f"{name}: {summary['samples']:.0f} samples")
    for s in summary["steps"]:
        if not s["share"]:
            continue
        print(
            f"  step {s['start']:#x}-{s['end']:#x} ({s['instructions']} instructions, "
            f"{s['executed']:.0f} executions): {s['share']:.3f} of the samples"
        )
        print("    reasons: " + ", ".join(f"{k} {v:.2f}" for k, v in s["reasons"].items()))
        print("    opcodes: " + ", ".join(f"{k} {v:.2f}" for k, v in s["opcodes"].items()))
        for x in s["hot"][:4]:  # shares of the step's samples
            print(f"      {x['share']:.3f} {x['address']:#x} {x['text'][:60]} ({x['reason']})")
    held = sum(s["share"] for s in summary["steps"])
    print(f"  outside the steps: {1 - held:.3f}")
    for x in summary["outside"]:
        print(f"    {x['share']:.3f} {x['address']:#x} {x['text'][:60]} ({x['reason']})")


def fa_index(head_dim: int, seq: int, causal: bool) -> int:
    """The fa suite's shape at this head dim, length and causal flag (its index)."""
    from benchmarks import suites

    for index, s in enumerate(suites.SUITES["fa"].shapes):
        if (s.head_dim, s.seq_q, s.causal) == (head_dim, seq, causal):
            return index
    raise ValueError(
        f"the fa suite has no shape at head dim {head_dim}, seq {seq}, causal {causal}"
    )


def ncu_commands(ncu: str, report: str, kernels: str, child_args: list[str]) -> tuple[list, list]:
    """The profile's command (the report at `report`.ncu-rep) and the export's."""
    record = [ncu, "--clock-control", "none", "--profile-from-start", "off"]
    record += ["--section", "SourceCounters", "--section", "WarpStateStats"]
    record += ["--kernel-name", f"regex:{kernels}", "--import-source", "no", "-f", "-o", report]
    record += [sys.executable, "-m", *child_args]
    export = [ncu, "-i", f"{report}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"]
    return record, export


def profile(args) -> int:
    causal = args.causal == "true"
    index = fa_index(args.head_dim, args.seq, causal)
    name = args.name or f"stalls-{args.head_dim}-{args.causal}-{args.seq}-{args.pass_}"
    report = os.path.join(args.out_dir, name)
    child = ["benchmarks.profile", "--suite", "fa", "--pass", args.pass_]
    child += ["--child", "fa", str(index), args.impl]
    record, export = ncu_commands(args.ncu, report, args.kernels, child)
    proc = run_ncu(record, args.timeout)  # the profiled child killed with ncu past it
    print(proc.stdout[-1500:], proc.stderr[-1500:], sep="\n")
    if proc.returncode:
        return proc.returncode
    exported = subprocess.run(export, capture_output=True, text=True, timeout=120)
    if exported.returncode:
        print(exported.stderr[-1500:])
        return exported.returncode
    os.remove(f"{report}.ncu-rep")  # megabytes; the CSV holds what is read here
    with gzip.open(f"{report}-sass.csv.gz", "wt") as f:
        f.write(exported.stdout)
    # One line a kernel, the file written anew as the export is (a rerun of the same name
    # replaces both).
    with open(f"{report}-summary.json", "w") as f:
        for kernel, code in read_source(exported.stdout).items():
            summary = summarize(code)
            print_summary(kernel, summary)
            f.write(json.dumps(dict(name=name, impl=args.impl, kernel=kernel, **summary)) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read", default=None, help="an exported source CSV (.gz or not)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--causal", choices=("true", "false"), default="false")
    parser.add_argument("--impl", default="pallas_flash:mosaic")
    parser.add_argument("--pass", dest="pass_", choices=("fwd+bwd", "fwd"), default="fwd+bwd")
    parser.add_argument(
        "--kernels",
        default="pallas_flash_mosaic_bwd",
        help="a regular expression: the kernels profiled",
    )
    parser.add_argument("--name", default=None, help="the files' stem (default from the shape)")
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--ncu", default="ncu")
    parser.add_argument("--timeout", type=float, default=150)
    args = parser.parse_args(argv)
    if args.read:
        opener = gzip.open if args.read.endswith(".gz") else open
        with opener(args.read, "rt") as f:
            for kernel, code in read_source(f.read()).items():
                print_summary(kernel, summarize(code))
        return 0
    return profile(args)


if __name__ == "__main__":
    sys.exit(main())
