"""Edit a warp-specialised kernel's PTX by hand and reassemble it: what ptxas needs.

    python -m benchmarks.ptx_edit FILE.ptxdump --kernel fused [--loops] \
        [--consumer-registers N] [--cut-loop K ...] [--unhide-loop K ...] \
        [--share drop|half] [--write OUT.ptx]

FILE is PTX that `benchmarks.ptxas --ptx` kept on the GPU machine (one or more modules);
`--kernel` picks the module whose entry name contains it. In that module each consumer
warpgroup's code runs from its `setmaxnreg.inc` to the next `setmaxnreg` (or the end);
its tile loops are the loops there that hold `ex2.approx` (the softmax's exp2), counted
from 1 in the order they appear. Then:
- `--loops` prints each tile loop's loop-invariant values (registers the loop reads but
  never writes: what it holds across all its steps, 64-bit ones counting twice);
- `--consumer-registers N` rewrites every consumer's `setmaxnreg.inc` budget to N;
- `--cut-loop K` makes tile loop K unreachable in every consumer (its entry guard, the
  conditional branch that skips it, made unconditional), so ptxas drops its code;
- `--unhide-loop K` undoes, in tile loop K of every consumer, what da32c91's inline-PTX
  `mov` of the step index did (an opaque copy, then `shr.u32 z, copy, 31`): the copy is
  dropped and z taken from the plain `shr.u32 ..., 31` the loop already has, as at
  29ce459 (so `--unhide-loop 2 --unhide-loop 3` on da32c91's PTX stands for hiding the
  first loop's step alone);
- `--share drop` / `--share half` (the fused backward in FA3's order, whose step issues
  S^T and dP^T as 64-column wgmmas, dV as 128-column ones, then the dQ share as 64-column
  ones, then dK): the share's wgmmas removed, or made 32 columns wide on the first half
  of their accumulators, and the accumulators that are gone read as the zeros they were
  set from: what the consumers would need with no share in their registers, or with
  half of it at a time;
and the edited module goes through the local ptxas (`benchmarks.ptxas.assemble`), which
prints registers, spills and serialized wgmmas (C7512). The edits break what the kernel
computes: they price what each part of it costs ptxas, in seconds a try, without a
device (docs/mosaic.md, "Where the fused kernel's C7512 comes from").
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from benchmarks import ptxas

_INC = re.compile(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);")
_LABEL = re.compile(r"^(\$L__\w+):")
_BRANCH = re.compile(r"^\s*(@!?%p\d+\s+)?bra(\.uni)?\s+(\$L__\w+);")
# General registers (predicates, %p, live in a file of their own and are not counted).
_REG = re.compile(r"%rd\d+|%r\d+|%fd\d+|%f\d+|%rs\d+|%h\d+")
# Instructions without a destination register (their operands are all read).
_NO_DEST = ("st.", "stmatrix", "mbarrier", "bar.", "bra", "cp.", "fence", "wgmma", "ret")


@dataclasses.dataclass(frozen=True)
class Loop:
    """A tile loop in a module's lines: `start` its first label's line, `back` the line of
    its back edge, `guard` the line of the conditional branch that skips it (or None)."""

    start: int
    back: int
    guard: int | None


def pick_module(modules: list[str], kernel: str) -> str:
    """The one module whose `.entry` name contains `kernel`."""
    found = [m for m in modules if re.search(rf"\.entry \w*{re.escape(kernel)}", m)]
    if len(found) != 1:
        names = [n for m in modules for n in re.findall(r"\.entry (\w+)", m)]
        raise ValueError(f"--kernel {kernel!r}: {len(found)} modules match; entries: {names}")
    return found[0]


def consumer_regions(lines: list[str]) -> list[tuple[int, int]]:
    """Each consumer's code: from a `setmaxnreg.inc` line to the next `setmaxnreg` line
    (or the end)."""
    marks = [i for i, line in enumerate(lines) if "setmaxnreg" in line]
    return [
        (i, next((j for j in marks if j > i), len(lines))) for i in marks if _INC.search(lines[i])
    ]


def tile_loops(lines: list[str], region: tuple[int, int]) -> list[Loop]:
    """The loops in `region` that hold an exp2, in order: a branch back to a label above
    it closes a loop, whose exit is the first label after that branch; its guard is the
    last conditional branch to that exit before the loop."""
    lo, hi = region
    labels = {}
    loops = []
    for i in range(lo, hi):
        if m := _LABEL.match(lines[i]):
            labels[m.group(1)] = i
        elif (m := _BRANCH.match(lines[i])) and m.group(1) and m.group(3) in labels:
            start = labels[m.group(3)]
            if any("ex2.approx" in lines[k] for k in range(start, i)):
                loops.append((start, i))
    out = []
    for start, back in loops:
        if out and start <= out[-1].back:
            continue  # an inner back edge of a loop already taken
        exit_ = next((_LABEL.match(lines[k]).group(1) for k in range(back, hi)
                      if _LABEL.match(lines[k])), None)  # fmt: skip
        guard = None
        for k in range(start - 1, lo, -1):
            m = _BRANCH.match(lines[k])
            if m and m.group(1) and m.group(3) == exit_:
                guard = k
                break
        out.append(Loop(start, back, guard))
    return out


def loop_invariants(lines: list[str], loop: Loop) -> tuple[int, int]:
    """(32-bit, 64-bit) registers that `loop` reads and never writes (predicates not
    counted). A destination is an instruction's first operand, or the braced list that a
    vector load or a wgmma (its accumulators, read and written) begins with."""
    written, read = set(), set()
    for line in lines[loop.start : loop.back + 1]:
        text = line.split("//")[0].strip()
        if not text or text.startswith(("$", ".", "}")):
            continue
        body = re.sub(r"^@!?%p\d+\s+", "", text)
        if body.startswith("{"):  # an inline-asm block: the op follows its declarations
            body = body.split(";", 2)[-1].strip() if "wgmma" in body else ""
        regs = _REG.findall(body)
        if "wgmma.mma_async" in body:
            dest = _REG.findall(re.search(r"\{([^}]*)\}", body).group(1))
            read.update(r for r in regs if r not in written)  # accumulators read too
        elif body.startswith(_NO_DEST) or not regs:
            dest = []
            read.update(r for r in regs if r not in written)
        elif (braced := re.match(r"[\w.:]+\s+\{([^}]*)\}", body)) is not None:
            dest = _REG.findall(braced.group(1))
            read.update(r for r in regs if r not in dest and r not in written)
        else:
            dest = regs[:1]
            read.update(r for r in regs[1:] if r not in written)
        written.update(dest)
    held = read - written
    wide = sum(r.startswith(("%rd", "%fd")) for r in held)
    return len(held) - wide, wide


def set_consumer_registers(lines: list[str], n: int) -> list[str]:
    return [_INC.sub(f"setmaxnreg.inc.sync.aligned.u32 {n};", line) for line in lines]


def _chosen_loops(lines: list[str], which: list[int], flag: str):
    """Tile loops `which` (1-based) of every consumer, each as a Loop; `flag` names the
    option in the error a missing loop raises."""
    for region in consumer_regions(lines):
        loops = tile_loops(lines, region)
        for k in which:
            if not 1 <= k <= len(loops):
                raise ValueError(
                    f"{flag} {k}: the consumer at line {region[0]} has {len(loops)} tile loops"
                )
            yield loops[k - 1]


def cut_loops(lines: list[str], which: list[int]) -> list[str]:
    """Tile loops `which` (1-based) of every consumer made unreachable: each one's guard
    becomes an unconditional branch to its exit."""
    out = list(lines)
    for loop in _chosen_loops(lines, which, "--cut-loop"):
        if loop.guard is None:
            raise ValueError(f"--cut-loop: the tile loop at line {loop.start} has no guard")
        g = loop.guard
        out[g] = re.sub(r"^(\s*)@!?%p\d+\s+bra(\.uni)?", r"\1bra.uni", out[g])
    return out


_MOV = re.compile(r"^\s*mov\.b32 (%r\d+), (%r\d+);$")  # inline asm's: no tab after the op
_COPY = re.compile(r"\s*mov\.b32\s+(%r\d+), (%r\d+);")  # any register copy
_SHR31 = re.compile(r"^\s*shr\.u32\s+(%r\d+), (%r\d+), 31;")


def unhide_loops(lines: list[str], which: list[int]) -> list[str]:
    """In tile loops `which` (1-based) of every consumer, the opaque copy of the step
    index removed and the offset computed from it (`shr.u32 z, copy, 31`) replaced by a
    copy of the loop's plain `shr.u32 ..., 31` of the step."""
    out = list(lines)
    for loop in _chosen_loops(lines, which, "--unhide-loop"):
        span = range(loop.start, loop.back + 1)
        copies = {m.group(1): i for i in span if (m := _MOV.match(lines[i]))}
        shifts = [(i, m) for i in span if (m := _SHR31.match(lines[i]))]
        hidden = [(i, m) for i, m in shifts if m.group(2) in copies]
        plain = [(i, m) for i, m in shifts if m.group(2) not in copies]
        if len(hidden) != 1 or len(plain) != 1:
            raise ValueError(
                f"--unhide-loop: want one opaque and one plain shift by 31 in the tile loop "
                f"at line {span[0]}, found {len(hidden)} and {len(plain)}"
            )
        (i, m), (_, p) = hidden[0], plain[0]
        out[copies[m.group(2)]] = ""
        out[i] = f"\tmov.b32 \t{m.group(1)}, {p.group(1)};"
    return out


_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16(\S*)\s+\{([^}]*)\}")


def share_wgmmas(lines: list[str], region: tuple[int, int]) -> list[int]:
    """The lines of the fused step's dQ-share wgmmas in a consumer: in each step's
    sequence S^T, dP^T (64 wide), dV (128), share (64), dK (128), the 64-wide ones
    between a dV group and the next 128-wide group."""
    found, state = [], 0  # 0 scores, 1 dV, 2 share, 3 dK
    for i in range(*region):
        if not (m := _WGMMA.search(lines[i])):
            continue
        wide = m.group(1) == "128"
        state = {(0, True): 1, (1, False): 2, (2, True): 3, (3, False): 0}.get((state, wide), state)
        if state == 2:
            found.append(i)
    return found


def cut_share(lines: list[str], how: str) -> list[str]:
    """The share's wgmmas dropped (`how` "drop") or halved ("half"), in every consumer;
    the accumulator registers no longer written read as the register they were zeroed
    from."""
    out = list(lines)
    for region in consumer_regions(lines):
        gone = set()
        for i in share_wgmmas(lines, region):
            m = _WGMMA.search(lines[i])
            regs = _REG.findall(m.group(3))
            if how == "drop":
                out[i], lost = "", regs
            else:
                keep, lost = regs[: len(regs) // 2], regs[len(regs) // 2 :]
                half = f"wgmma.mma_async.sync.aligned.m64n32k16{m.group(2)} {{{','.join(keep)}}}"
                out[i] = lines[i].replace(m.group(0), half)
            gone.update(lost)
        if not gone:
            raise ValueError(f"--share: no share wgmmas in the consumer at line {region[0]}")
        zero = next(
            m.group(2)
            for i in range(*region)
            if (m := _COPY.match(lines[i])) and m.group(1) in gone
        )
        names = re.compile("|".join(rf"{re.escape(r)}(?!\d)" for r in sorted(gone)))
        for i in range(*region):
            if out[i] and "wgmma.mma_async" not in out[i] and names.search(out[i]):
                out[i] = names.sub(zero, out[i])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ptx", help="a file of PTX modules (benchmarks.ptxas --ptx)")
    parser.add_argument("--kernel", required=True, help="part of the module's entry name")
    parser.add_argument("--loops", action="store_true", help="print each tile loop's invariants")
    parser.add_argument("--consumer-registers", type=int, default=None, metavar="N")
    parser.add_argument("--cut-loop", type=int, action="append", default=[], metavar="K")
    parser.add_argument("--unhide-loop", type=int, action="append", default=[], metavar="K")
    parser.add_argument("--share", choices=("drop", "half"), default=None)
    parser.add_argument("--write", default=None, help="also write the edited module here")
    args = parser.parse_args(argv)
    if args.consumer_registers is not None and (
        args.consumer_registers % 8 or not 24 <= args.consumer_registers <= 256
    ):
        parser.error(f"--consumer-registers {args.consumer_registers}: a multiple of 8 in 24-256")
    with open(args.ptx) as f:
        modules = ptxas.ptx_modules(f.read())
    try:
        lines = pick_module(modules, args.kernel).split("\n")
    except ValueError as e:
        parser.error(str(e))
    if args.loops:
        for c, region in enumerate(consumer_regions(lines)):
            for k, loop in enumerate(tile_loops(lines, region), 1):
                narrow, wide = loop_invariants(lines, loop)
                print(f"consumer {c} loop {k} (lines {loop.start}-{loop.back}): "
                      f"{narrow} 32-bit and {wide} 64-bit invariants, "
                      f"{narrow + 2 * wide} registers")  # fmt: skip
    if args.consumer_registers is not None:
        lines = set_consumer_registers(lines, args.consumer_registers)
    try:
        lines = unhide_loops(lines, args.unhide_loop) if args.unhide_loop else lines
        lines = cut_loops(lines, args.cut_loop) if args.cut_loop else lines
        lines = cut_share(lines, args.share) if args.share else lines
    except ValueError as e:
        parser.error(str(e))
    module = "\n".join(lines)
    if args.write:
        with open(args.write, "w") as f:
            f.write(module)
    ptxas.print_kernels(ptxas.assemble([module]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
