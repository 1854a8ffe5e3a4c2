"""Registers and spills of each Mosaic GPU kernel, as ptxas reports them (on the GPU, or
for the H200 without one).

    python -m benchmarks.ptxas --impls pallas_flash:mosaic,pallas_flash:mosaic-fused \
        --head-dims 64,128 --out F.jsonl
    .venv-sm90/bin/python -m benchmarks.ptxas --deviceless --impls pallas_flash:mosaic \
        --sass FOLDER     # on a machine without a GPU (make venv-sm90)

For each implementation (a bench name, config variants included:
`pallas_flash:mosaic/persistent=true`), head dim and causal flag, a child process
compiles one jitted forward + backward (B=1, T=S=1024, bf16, heads = 2048 / head dim)
with MOSAIC_GPU_DUMP_PTXAS=1 and the compilation cache off, so that ptxas runs and
prints its verbose report; every kernel in it becomes a row: registers per thread,
stack frame, spill stores and spill loads (bytes), and ptxas's "Potential Performance
Loss" warnings (wgmmas it had to serialize). A warp-specialised kernel sets its
warpgroups' register budgets itself (setmaxnreg), so a spill here means some warpgroup
holds more than its budget: the first thing to rule out when a kernel is slower than
its matmul count says (the fused backward, docs/mosaic.md). With --sass it also keeps each
child's SASS and adds to each kernel its local loads and stores by register budget
(`spill_regions`), its wgmmas and the groups they are issued in (`wgmma_groups`: one
per instruction where ptxas serialized them) and its loops' instruction mix and stack
traffic (`sass_loops`);
`--read FILE.sass` prints those again from a kept file, on any machine. With --ptx each
child's PTX modules are kept as well (IMPL-hHD-CAUSAL.ptxdump), and `--assemble FILE`
runs them through the ptxas found here (`cuda_tool`: CUDA 13.0's is on the development
machines, no GPU needed) and prints the same report: registers, spills and serialized
wgmmas (C7512) of a kernel that the CPU cannot lower as far as PTX, edited and
reassembled in seconds rather than in a device call. The SASS is Mosaic
GPU's own (MOSAIC_GPU_DUMP_SASS=1, which runs nvdisasm from the CUDA root it found) or,
where that printed none (on the H200 machine at 336cd0b: no nvdisasm there), the
kernels' PTX (MOSAIC_GPU_DUMP_PTX=1) assembled and disassembled here with the first
ptxas and nvdisasm found on PATH, in the CUDA wheels or in Triton's bundled tools
(`cuda_tool`).

With --deviceless each child compiles the same program for the H200 on this machine
(benchmarks/deviceless.py: a compile-only device from JAX's CUDA plugin) instead of
compiling and running it on a GPU: the same ptxas, the same report (on 2b60086's fused
backward the H200's spill bytes exactly), a few seconds a child, no device time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
# e.g. "(C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized
# due to ... in the function 'NAME'": serialized wgmmas alone can halve a kernel's speed.
_LOSS = re.compile(r"Potential Performance Loss")
_FUNCTION = re.compile(r"function '([^']+)'")


def parse_ptxas(text: str) -> list[dict]:
    """One dict per entry function in ptxas's verbose report (`ptxas -v`), in order:
    kernel, registers, stack_bytes, spill_store_bytes, spill_load_bytes (None where the
    report has no such line) and warnings: the "Potential Performance Loss" lines
    (serialized wgmmas), each given to the kernel it names, also when it comes before
    that kernel's entry line (as ptxas prints it for a module compiled after another:
    at 41958b0 the fused backward's warning was filed under the forward), else to the
    one being read (or, before any, the first)."""
    kernels: list[dict] = []
    early: list[str] = []  # unnamed loss lines before the first entry function
    ahead: dict[str, list[str]] = {}  # loss lines naming a kernel not yet entered
    for line in text.splitlines():
        if _LOSS.search(line):
            named = _FUNCTION.search(line)
            owner = next((k for k in kernels if named and k["kernel"] == named.group(1)), None)
            if owner is not None:
                owner["warnings"].append(line.strip())
            elif named:
                ahead.setdefault(named.group(1), []).append(line.strip())
            elif kernels:
                kernels[-1]["warnings"].append(line.strip())
            else:
                early.append(line.strip())
        elif m := _ENTRY.search(line):
            kernels.append(
                dict(
                    kernel=m.group(1),
                    registers=None,
                    stack_bytes=None,
                    spill_store_bytes=None,
                    spill_load_bytes=None,
                    warnings=early + ahead.pop(m.group(1), []),
                )
            )
            early = []
        elif kernels and (m := _FRAME.search(line)):
            k = kernels[-1]
            k["stack_bytes"], k["spill_store_bytes"], k["spill_load_bytes"] = map(int, m.groups())
        elif kernels and (m := _USED.search(line)):
            kernels[-1]["registers"] = int(m.group(1))
    if kernels:  # lines naming a function with no entry line: kept, with the last kernel
        kernels[-1]["warnings"] += [w for ws in ahead.values() for w in ws]
    return kernels


# SASS (nvdisasm, MOSAIC_GPU_DUMP_SASS=1): a function's label, a register-budget change
# (setmaxnreg: USETMAXREG.TRY_ALLOC... raises a warpgroup's budget, ...DEALLOC... lowers
# it) and a local-memory access (STL / LDL: spills, when the kernel has no local arrays).
_SASS_FUNCTION = re.compile(r"^\s*\.text\.([A-Za-z_$][\w$.]*):")
_SASS_SETMAXREG = re.compile(r"SETMAXREG\.(\S+)\s[^;]*?(0x[0-9a-fA-F]+|\b\d+)\s*;")
_SASS_LOCAL = re.compile(r"\b(STL|LDL)(\.\S+)?\s")


def _sass_functions(sass: str) -> dict[str, list[str]]:
    """Each SASS function's lines, from its `.text.NAME:` label to the next one."""
    out: dict[str, list[str]] = {}
    lines = None
    for line in sass.splitlines():
        if m := _SASS_FUNCTION.search(line):
            lines = out[m.group(1)] = []
        elif lines is not None:
            lines.append(line)
    return out


def spill_regions(sass: str) -> dict[str, dict[str, int]]:
    """Per SASS function, its local stores and loads (STL / LDL) counted by the register
    budget last set before them in address order: "start" (before any setmaxnreg, the
    launch budget) or "<kind> <registers>" (e.g. "TRY_ALLOC.CTAPOOL 232", the consumers'
    raise, or "DEALLOC.CTAPOOL 24", the side warpgroups' cut), each "STL" / "LDL". Address
    order follows the code's layout, not its control flow, so this says which warpgroup's
    code a spill most likely sits in (ptxas's report gives only the kernel's total)."""
    out: dict[str, dict[str, int]] = {}
    for fn, lines in _sass_functions(sass).items():
        counts, region = collections.Counter(), "start"
        for line in lines:
            if m := _SASS_SETMAXREG.search(line):
                region = f"{m.group(1)} {int(m.group(2), 0)}"
            elif m := _SASS_LOCAL.search(line):
                counts[f"{region} {m.group(1)}"] += 1
        out[fn] = dict(counts)
    return out


_SASS_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b[^;]*?`?\(?(\.L_x_\d+)\)?")
# Opcode classes for a loop's mix: what the tensor cores, the special-function units
# (exp2), the float and integer pipes and memory each get.
_SASS_CLASSES = {
    "wgmma": "HGMMA WARPGROUP".split(),
    "mufu": ["MUFU"],
    "float": "FADD FMUL FFMA FMNMX FSEL FSETP F2F F2FP FCHK HADD2 HMUL2 HFMA2".split(),
    "int": (
        "IADD3 IMAD LOP3 SHF ISETP SEL LEA IABS IMNMX PRMT SGXT BMSK POPC FLO BREV I2F F2I "
        "IADD MOV UIADD3 UIMAD ULOP3 USHF UISETP USEL ULEA UMOV S2R S2UR R2UR CS2R P2R R2P "
        "PLOP3 UPLOP3 VOTE VOTEU"
    ).split(),
    "shared": "LDS STS LDSM STSM ATOMS".split(),
    "local": "LDL STL".split(),
    "global": "LDG STG LDC ULDC RED ATOMG UTMALDG UTMASTG UTMAREDG UBLKCP UTMAPF".split(),
    "sync": "BAR SYNCS WARPSYNC DEPBAR MEMBAR FENCE ERRBAR NANOSLEEP USETMAXREG".split(),
}


def _sass_class(opcode: str) -> str:
    return next((name for name, ops in _SASS_CLASSES.items() if opcode in ops), "other")


# Loops shorter than this are barrier and semaphore spin-waits (a try-wait and a branch
# back), not a kernel's steps.
SASS_MIN_LOOP = 16


_SASS_LOAD = re.compile(r"\bLDL(?:\.\S+)?\s+(R\d+),\s*\[(R1(?:\+0x[0-9a-f]+)?)\]")
_SASS_STORE = re.compile(r"\bSTL(?:\.\S+)?\s+\[(R1(?:\+0x[0-9a-f]+)?)\]")


def _local_traffic(body: list[tuple[int, str, str]]) -> dict:
    """A loop's stack traffic (`body`: its (address, opcode, text) in address order):
    loads and stores; `to_uniform`, the loads whose register is next read by an R2UR
    (a move into the uniform registers, which wgmma descriptors are read from); and
    `fixed_slots`, the stack slots the loop loads but never stores, values fixed across
    its iterations (at 9f95796 the fused backward's steps loaded 16-39 such slots each,
    docs/mosaic.md)."""
    loads = stores = to_uniform = 0
    loaded, stored = set(), set()
    for i, (_, op, text) in enumerate(body):
        if m := _SASS_STORE.search(text):
            stores += 1
            stored.add(m.group(1))
        elif m := _SASS_LOAD.search(text):
            loads += 1
            loaded.add(m.group(2))
            reg = re.compile(rf"\b{m.group(1)}\b")
            use = next((o for _, o, t in body[i + 1 :] if reg.search(t.split(";")[0])), None)
            to_uniform += use == "R2UR"
    return dict(loads=loads, stores=stores, to_uniform=to_uniform, fixed_slots=len(loaded - stored))


# A wgmma that reads no accumulator: ptxas folded a fresh accumulator's zeros into it
# (pipeline.held_zero says when it does not).
_SASS_FRESH = re.compile(r"\bHGMMA\.[^;]*,\s*RZ,\s*!UPT")


_SASS_WAIT = re.compile(r"\bWARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")


def _beside_pending(body: list[tuple[int, str, str]]) -> int:
    """The instructions a step issues after a wgmma wait that leaves groups pending
    (WARPGROUP.DEPBAR.LE gsb0, N with N > 0) and before its next wait: what it does
    while a product it issued is still on the tensor cores (0 where every wait is for
    all of them; MosaicBwdConfig.probs_before_dp)."""
    waits = [
        (i, int(m.group(1), 16)) for i, (_, _, t) in enumerate(body) if (m := _SASS_WAIT.search(t))
    ]
    return sum(b - a - 1 for (a, n), (b, _) in zip(waits, waits[1:]) if n > 0)


def _waited_loads(body: list[tuple[int, str, str]]) -> int:
    """The shared-memory loads a step issues after its first wgmma wait and before the
    first float instruction after it: operands the scores' first use waits on once the
    scores are in (the lse before MosaicBwdConfig.early_lse)."""
    waits = [i for i, (_, _, t) in enumerate(body) if _SASS_WAIT.search(t)]
    loads = 0
    for _, op, _ in body[waits[0] + 1 :] if waits else ():
        if _sass_class(op) == "float":
            break
        loads += op == "LDS"
    return loads


def _wgmma_runs(body: list[tuple[int, str, str]]) -> int:
    """The runs of wgmmas a step issues with no wgmma wait between them: 2 where it awaits
    one product before issuing the next (the forward's default step: Q K^T, then P V),
    1 where it issues both and then waits (MosaicConfig.qk_behind_pv)."""
    runs, issuing = 0, False
    for _, op, text in body:
        if op == "HGMMA":
            runs += not issuing
            issuing = True
        elif _SASS_WAIT.search(text):
            issuing = False
    return runs


def _loops(lines: list[str]) -> list[dict]:
    """One SASS function's loops (see sass_loops), in address order."""
    labels, code, branches, here = {}, [], [], []
    for line in lines:
        if m := _SASS_LABEL.search(line):
            here.append(m.group(1))
        elif m := _SASS_INSTRUCTION.search(line):
            addr = int(m.group(1), 16)
            labels.update(dict.fromkeys(here, addr))  # labels name the next instruction
            here = []
            code.append((addr, m.group(3), line))
            if m.group(3) == "BRA" and (b := _SASS_BRANCH.search(line)):
                branches.append((b.group(1), addr))
    loops = {}
    for name, end in branches:
        start = labels.get(name)
        if start is None or start > end or (start, end) in loops:
            continue
        body = [x for x in code if start <= x[0] <= end]
        if len(body) >= SASS_MIN_LOOP:
            mix = dict(collections.Counter(_sass_class(op) for _, op, _ in body))
            fresh = sum(bool(_SASS_FRESH.search(text)) for _, _, text in body)
            loops[(start, end)] = dict(
                start=start,
                end=end,
                instructions=len(body),
                mix=mix,
                fresh_wgmmas=fresh,
                beside_pending=_beside_pending(body),
                waited_loads=_waited_loads(body),
                wgmma_runs=_wgmma_runs(body),
            )
            if mix.get("local"):
                loops[(start, end)]["local_traffic"] = _local_traffic(body)
    for span, loop in loops.items():
        loop["innermost"] = innermost(span, loops)
    return [loops[k] for k in sorted(loops)]


def innermost(span: tuple[int, int], spans) -> bool:
    """Whether no other loop of `spans` ((first, last) addresses) lies inside `span`: in a
    warp-specialised kernel, a step's body (sass_loops)."""
    start, end = span
    return not any(start <= a and b <= end and (a, b) != span for a, b in spans)


def sass_loops(sass: str) -> dict[str, list[dict]]:
    """Per SASS function, its loops (a backward branch to a label: the code from the
    label to the branch) of at least SASS_MIN_LOOP instructions, in address order, each
    with its range, instruction count and mix by class (`_SASS_CLASSES`: wgmma, mufu,
    float, int, shared, local, global, sync, other), its wgmmas that read no
    accumulator (`fresh_wgmmas`: a fresh accumulator's first wgmma, where ptxas folded
    its zeros rather than moving them into its registers), the instructions it issues
    while one of its wgmma groups is still pending (`beside_pending`: from a wait that
    leaves some in flight to the next wait), the shared-memory loads issued between its
    first wgmma wait and the first float instruction after it (`waited_loads`), its runs
    of wgmmas issued with no wait between them (`wgmma_runs`), and whether it is innermost
    (no other loop inside it). An outer loop's count includes its inner loops'; a warp-
    specialised kernel's loops overlap (each step variant, masked or not, branches back
    to its own label and the work-item loop encloses them), so the innermost ones are its
    steps: at 81df3c6 the head-dim-128 causal forward's were 478 instructions unmasked
    and 746 masked. What a kernel's step issues beside its wgmmas: at 41958b0 the lowered
    Mosaic modules hinted that a masked step's index arithmetic and the fused backward's
    exchanges cost more instructions than its math; this says what is left after LLVM
    and ptxas."""
    return {fn: _loops(lines) for fn, lines in _sass_functions(sass).items()}


_SASS_WGMMA = re.compile(r"\bHGMMA\.[^;]*;")
_SASS_GROUP_END = re.compile(r"\bgsb0\s*;")


def wgmma_groups(sass: str) -> dict[str, dict[str, int]]:
    """Per SASS function, its wgmmas (HGMMA instructions) and the groups they form: the
    HGMMAs that carry `gsb0`, each one closing a group that a later `WARPGROUP.DEPBAR`
    awaits. A 64 x N x K matmul is K / 16 HGMMAs and, issued as one group, one `gsb0`;
    where ptxas serializes the wgmmas (its warning C7512) every HGMMA carries it and is
    awaited before the next is issued, so groups == wgmmas says no matmul overlaps
    anything, not even the next 16 columns of its own K (at 67e6e1c the fused backward at
    head dim 128: 192 of 192; the pair's dK/dV kernel 72 in 12 groups, docs/mosaic.md)."""
    out = {}
    for fn, lines in _sass_functions(sass).items():
        wgmmas = [line for line in lines if _SASS_WGMMA.search(line)]
        if wgmmas:
            ends = sum(bool(_SASS_GROUP_END.search(line)) for line in wgmmas)
            out[fn] = dict(wgmmas=len(wgmmas), groups=ends)
    return out


def print_steps(loops: list[dict] | None) -> None:
    """The innermost loops (a kernel's steps) of `sass_loops`, a line each."""
    for loop in [lp for lp in loops or [] if lp["innermost"]]:
        traffic = loop.get("local_traffic")
        print(
            f"    loop {loop['start']:#x}-{loop['end']:#x}: {loop['instructions']} "
            f"instructions {loop['mix']}" + (f" stack: {traffic}" if traffic else ""),
            flush=True,
        )


def read(path: str) -> None:
    """A SASS file already dumped (`--sass`, e.g. a committed one), read again: each
    function's spills by register budget and its steps, as the compiling run prints them."""
    with open(path) as f:
        sass = f.read()
    regions, loops, groups = spill_regions(sass), sass_loops(sass), wgmma_groups(sass)
    for fn in loops:
        print(f"  {fn[:70]}\n    local memory by budget: {regions.get(fn)}", flush=True)
        print(f"    wgmmas: {groups.get(fn)}", flush=True)
        print_steps(loops[fn])


def summary(path: str) -> None:
    """The rows of a --out FILE.jsonl written with --sass, a few lines each: per kernel its
    spill bytes (stored / loaded), whether ptxas serialized its wgmmas, its wgmmas and the
    groups they issue in, and its steps with wgmmas in them (innermost loops, in address
    order: a warp-specialised kernel has one per consumer and mask variant) as
    instructions (int, float, local) and then its fresh wgmmas (sass_loops): what a step
    issues beside its matmuls, the thing to shrink where a kernel is bound by issue slots
    rather than its tensor cores."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        print(f"== {row['impl']} h{row['head_dim']} causal={row['causal']} {row['error'] or ''}")
        for kern in row["kernels"]:
            groups = kern.get("wgmma_groups") or {}
            steps = [
                lp for lp in kern.get("loops") or [] if lp["innermost"] and lp["mix"].get("wgmma")
            ]
            name = kern["kernel"].removesuffix("_mosaic_gpu_kernel")
            print(
                f"  {name}: spills {kern['spill_store_bytes']} / "
                f"{kern['spill_load_bytes']} B, serialized {'yes' if kern['warnings'] else 'no'}, "
                f"wgmmas {groups.get('wgmmas')} in {groups.get('groups')} groups"
            )
            print(
                "    steps: "
                + ", ".join(
                    f"{lp['instructions']} ({lp['mix'].get('int', 0)}, "
                    f"{lp['mix'].get('float', 0)}, {lp['mix'].get('local', 0)})"
                    + (f" {lp['fresh_wgmmas']}f" if "fresh_wgmmas" in lp else "")
                    for lp in steps
                )
            )


def shape(
    head_dim: int, causal: bool, mask: str = "none", kv_heads: int | None = None, seq: int = 1024
):
    """B=1, T=S=seq (1024: the default rows of short keys), bf16, 2048 / head dim query
    heads (and `kv_heads`, GQA; None: as many), `mask` a bench label
    (bench.masking_arguments: "padding", "segments:4", ...)."""
    from benchmarks import suites

    heads = 2048 // head_dim
    return suites.Shape(1, seq, seq, heads, kv_heads or heads, head_dim, causal, mask)


_PTX_START = re.compile(r"^// Generated by LLVM NVPTX Back-End", re.M)


def ptx_modules(text: str) -> list[str]:
    """The PTX modules printed in `text` (MOSAIC_GPU_DUMP_PTX=1), each from its
    "// Generated by LLVM NVPTX Back-End" banner to its last closing brace (ptxas's report
    and other output may follow it)."""
    starts = [m.start() for m in _PTX_START.finditer(text)]
    modules = []
    for start, end in zip(starts, starts[1:] + [len(text)]):
        chunk = text[start:end]
        close = chunk.rfind("\n}")
        if close != -1 and ".entry" in chunk:
            modules.append(chunk[: close + 2] + "\n")
    return modules


def cuda_tool(name: str) -> str | None:
    """An executable CUDA tool (ptxas, nvdisasm): on PATH, else in an NVIDIA CUDA wheel's
    bin folder (nvidia/*/bin, nvidia/*/*/bin) or Triton's bundled tools on sys.path."""
    if found := shutil.which(name):
        return found
    for base in sys.path:
        patterns = ("nvidia/*/bin", "nvidia/*/*/bin", "triton/backends/nvidia/bin")
        for folder in (d for pattern in patterns for d in glob.glob(os.path.join(base, pattern))):
            path = os.path.join(folder, name)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    return None


def _written(modules: list[str], folder: str):
    """Each PTX module written to FOLDER/k{i}.ptx: (i, that path, its object file's path)."""
    for i, module in enumerate(modules):
        ptx, obj = os.path.join(folder, f"k{i}.ptx"), os.path.join(folder, f"k{i}.o")
        with open(ptx, "w") as f:
            f.write(module)
        yield i, ptx, obj


def sass_of_ptx(modules: list[str], gpu_name: str = "sm_90a") -> tuple[str, str]:
    """(SASS, where it came from) of PTX modules: each assembled by ptxas (-O3, as Mosaic
    GPU does) and disassembled by nvdisasm (-c: code only). SASS is empty and the note
    says why when a tool is missing or fails."""
    tools = {name: cuda_tool(name) for name in ("ptxas", "nvdisasm")}
    if not modules:
        return "", "no PTX in the output"
    if missing := [name for name, path in tools.items() if path is None]:
        return "", f"not found: {', '.join(missing)}"
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        for _, ptx, obj in _written(modules, tmp):
            steps = [
                [tools["ptxas"], "--opt-level", "3", "--gpu-name", gpu_name, "-o", obj, ptx],
                [tools["nvdisasm"], "-ndf", "-c", obj],
            ]
            for cmd in steps:
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode:
                    return "", f"{os.path.basename(cmd[0])} failed: {proc.stderr[-300:]}"
            parts.append(proc.stdout)
    return "\n".join(parts), f"{tools['ptxas']} + {tools['nvdisasm']}"


def assemble(modules: list[str], gpu_name: str = "sm_90a") -> list[dict]:
    """ptxas's verbose report of each PTX module (-O3, as Mosaic GPU assembles), parsed
    (parse_ptxas) into one row a kernel; a module ptxas rejects raises with its error."""
    ptxas = cuda_tool("ptxas")
    if ptxas is None:
        raise FileNotFoundError("no ptxas on PATH, in the CUDA wheels or in Triton's tools")
    kernels = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, ptx, obj in _written(modules, tmp):
            cmd = [ptxas, "-v", "--opt-level", "3", "--gpu-name", gpu_name, "-o", obj, ptx]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"ptxas failed on module {i}: {proc.stderr[-500:]}")
            kernels += parse_ptxas(proc.stdout + "\n" + proc.stderr)
    return kernels


def print_kernels(kernels: list[dict]) -> None:
    for kern in kernels:
        print(
            f"  {kern['registers']} regs, spills {kern['spill_store_bytes']} B "
            f"stored / {kern['spill_load_bytes']} B loaded, stack "
            f"{kern['stack_bytes']} B: {kern['kernel'][:70]}",
            flush=True,
        )
        for warning in kern["warnings"]:
            print(f"    {warning[:160]}", flush=True)
        if kern.get("spill_regions"):
            print(f"    local memory by budget: {kern['spill_regions']}", flush=True)
        if kern.get("wgmma_groups"):
            print(f"    wgmmas: {kern['wgmma_groups']}", flush=True)
        print_steps(kern.get("loops"))


def child(
    impl_name: str,
    head_dim: int,
    causal: bool,
    deviceless: bool = False,
    mask: str = "none",
    kv_heads: int | None = None,
    seq: int = 1024,
) -> None:
    """Compiles (on the GPU: and runs) one forward + backward, for the parent to read
    ptxas's report from this process's output; `deviceless`: for the H200, here. An
    implementation without this backward (JAX's Mosaic FA3 is not causal there) is
    compiled forward only, as the harness times it (bench.check)."""
    if deviceless:
        from benchmarks import deviceless as compiler  # before JAX loads its CUDA plugin
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # ptxas must run
    from benchmarks import bench
    from benchmarks.impls import lookup

    s, impl = shape(head_dim, causal, mask, kv_heads, seq), lookup(impl_name)
    dtype = s.dtype if s.dtype in impl.dtypes else impl.dtypes[0]  # JAX's FA3: float16
    q, k, v, do, arrays, static = bench.make_inputs(s, dtype)
    fwd, fwd_bwd = bench._bind(impl, s, static)
    for fn, args in ((fwd_bwd, (q, k, v, do, arrays)), (fwd, (q, k, v, arrays))):
        try:
            if deviceless:
                compiler.compile_on_h200(fn, *args)
            else:
                jax.block_until_ready(jax.jit(fn)(*args))
            return
        except NotImplementedError as e:  # no backward here: the forward alone
            print(f"forward only: {e}", file=sys.stderr, flush=True)
    raise RuntimeError(f"{impl_name}: neither its forward + backward nor its forward compiled")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="pallas_flash:mosaic,pallas_flash:mosaic-fused")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--causal", default="false,true")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--mask",
        default="none",
        help="the masking arguments, as a bench shape's label: padding (ragged key lengths), "
        "segments:D (D packed documents), window:W (a local window)",
    )
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: key/value heads")
    parser.add_argument(
        "--seq",
        type=int,
        default=1024,
        help="T = S (the default rows change with the key length: head dim 64 causal takes "
        "256-key tiles above 2048)",
    )
    parser.add_argument("--timeout", type=float, default=240, help="seconds per child")
    parser.add_argument(
        "--sass",
        default=None,
        help="folder: also dump each child's SASS there (IMPL-hHD-CAUSAL.sass) and add "
        "each kernel's spills by register budget (spill_regions) to its row",
    )
    parser.add_argument(
        "--read",
        default=None,
        metavar="SASS",
        help="no compiling (no GPU needed): read a SASS file that --sass wrote and print "
        "its spills by register budget and its steps",
    )
    parser.add_argument(
        "--ptx",
        default=None,
        help="folder: also keep each child's PTX modules there (IMPL-hHD-CAUSAL.ptxdump)",
    )
    parser.add_argument(
        "--assemble",
        default=None,
        metavar="PTXDUMP",
        help="no compiling (no GPU needed): assemble the PTX modules of a file that --ptx "
        "wrote (or any PTX from LLVM's NVPTX back end) with the ptxas found here, and print "
        "each kernel's registers, spills and serialized-wgmma warnings",
    )
    parser.add_argument(
        "--deviceless",
        action="store_true",
        help="compile for the H200 here, without a GPU (benchmarks/deviceless.py; needs "
        "JAX's CUDA plugin: `make venv-sm90`), rather than compile and run on this GPU",
    )
    parser.add_argument(
        "--summary",
        default=None,
        metavar="JSONL",
        help="no compiling: print a --out file's rows (written with --sass) a few lines "
        "each: spills, serialization, wgmma groups, and each step's instructions as "
        "total (int, float, local)",
    )
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.read:
        read(args.read)
        return 0
    if args.summary:
        summary(args.summary)
        return 0
    if args.assemble:
        with open(args.assemble) as f:
            modules = ptx_modules(f.read())
        if not modules:
            parser.error(
                f"--assemble {args.assemble}: no PTX module (an NVPTX banner and an .entry)"
            )
        print_kernels(assemble(modules))
        return 0
    if args.child:
        impl, head_dim, causal = args.child
        child(
            impl,
            int(head_dim),
            causal == "true",
            args.deviceless,
            args.mask,
            args.kv_heads,
            args.seq,
        )
        return 0
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
    if args.deviceless:
        from benchmarks import deviceless

        if (reason := deviceless.available()) is not None:
            parser.error(f"--deviceless: {reason}")
        env.update(deviceless.ENV)
    if args.sass:  # deviceless: no nvdisasm where Mosaic GPU looks, so from the PTX here
        env.update(MOSAIC_GPU_DUMP_PTX="1")
        if not args.deviceless:
            env.update(MOSAIC_GPU_DUMP_SASS="1")
        os.makedirs(args.sass, exist_ok=True)
    if args.ptx:
        env.update(MOSAIC_GPU_DUMP_PTX="1")
        os.makedirs(args.ptx, exist_ok=True)
    for impl in args.impls.split(","):
        for head_dim in map(int, args.head_dims.split(",")):
            for causal in args.causal.split(","):
                cmd = [sys.executable, "-m", "benchmarks.ptxas", "--child", impl]
                cmd += [str(head_dim), causal, "--mask", args.mask]
                cmd += ["--deviceless"] * args.deviceless
                cmd += ["--kv-heads", str(args.kv_heads)] if args.kv_heads else []
                cmd += ["--seq", str(args.seq)]
                s = shape(head_dim, causal == "true", args.mask, args.kv_heads, args.seq)
                row = dict(impl=impl, **s.row(), error=None)
                try:
                    proc = subprocess.run(
                        cmd, capture_output=True, text=True, env=env, timeout=args.timeout
                    )
                    row["kernels"] = parse_ptxas(proc.stdout + "\n" + proc.stderr)
                    label = (
                        f"{impl}-h{head_dim}-{causal}"
                        + (
                            f"-{args.mask}-kv{args.kv_heads}"
                            if args.mask != "none" or args.kv_heads
                            else ""
                        )
                        + (f"-s{args.seq}" if args.seq != 1024 else "")
                    )
                    name = re.sub(r"[^\w.-]+", "_", label)
                    if args.ptx:
                        modules = ptx_modules(proc.stdout)
                        row["ptx_modules"] = len(modules)
                        with open(os.path.join(args.ptx, name + ".ptxdump"), "w") as f:
                            f.write("".join(modules))
                    if args.sass:
                        sass, row["sass_source"] = proc.stdout, "Mosaic GPU"
                        if not _sass_functions(sass):  # its nvdisasm did not run
                            sass, row["sass_source"] = sass_of_ptx(ptx_modules(proc.stdout))
                            failed = [x for x in proc.stderr.splitlines() if "nvdisasm" in x]
                            row["sass_source"] += "; " + " ".join(failed[:1])[:200]
                        with open(os.path.join(args.sass, name + ".sass"), "w") as f:
                            f.write(sass)
                        regions, loops = spill_regions(sass), sass_loops(sass)
                        groups = wgmma_groups(sass)
                        for kern in row["kernels"]:
                            kern["spill_regions"] = regions.get(kern["kernel"])
                            kern["loops"] = loops.get(kern["kernel"])
                            kern["wgmma_groups"] = groups.get(kern["kernel"])
                    if proc.returncode:
                        row["error"] = f"exit {proc.returncode}: {proc.stderr[-300:]}"
                    elif not row["kernels"]:
                        row["error"] = "no ptxas report in the child's output"
                except subprocess.TimeoutExpired:
                    row["kernels"], row["error"] = [], f"timeout after {args.timeout} s"
                print(f"== {impl} h{head_dim} causal={causal} {row['error'] or ''}", flush=True)
                if "sass_source" in row:
                    print(f"  SASS from: {row['sass_source']}", flush=True)
                print_kernels(row["kernels"])
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
