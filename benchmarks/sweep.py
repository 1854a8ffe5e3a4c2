"""Launch-config sweep of our Pallas kernels: the evidence for the default-config tables.

    python -m benchmarks.sweep --out benchmarks/results/sweep.jsonl --time-budget 540
    python -m benchmarks.sweep --family mosaic --out benchmarks/results/sweep-mosaic.jsonl
    python -m benchmarks.sweep --tiny --out /tmp/sweep.jsonl   # CPU, interpret mode, tiny

Families: "triton" sweeps the Triton-lowered kernels' TritonConfig / TritonBwdConfig
(configs.py's table); "mosaic" the Mosaic GPU (Hopper) kernels' MosaicConfig /
MosaicBwdConfig (the tables of mosaic/config.py and mosaic/bwd_config.py): forward
tiles, pipeline stages and FA3's ping-pong; backward tiles, stages and warpgroups of the
dK/dV and dQ kernels, each kernel's part varied around the default with the other's at
its default (the two kernels run one after the other, so their times add: the best of
each part combine).

Shapes: FlashAttention-2's grid at one length, bf16, 16k tokens per batch, hidden 2048
(batch = 16384 // seq, heads = 2048 // head dim), causal off and on. Per (head dim,
causal, pass) the default config runs first, then the candidates in order of distance
from it (Triton: log2 steps of tiles and warps, plus stage steps; Mosaic: 64-wide tile
steps, stage, warpgroup and flag steps): the most plausible first. Groups are visited
round-robin, each group's k-th candidate before any group's (k+1)-th, so that a time
budget that stops the sweep leaves every group with its nearest candidates measured.

Method: bench.py's. The forward pass times the forward; the backward pass times
(forward + backward) - forward with the forward at its default config (bench.py's
"bwd"); TFLOP/s by its convention. Before a candidate is timed, its outputs (O; or dQ,
dK, dV) are compared once with the default config's on the same inputs (max abs error
over the default's max magnitude, bench.CHECK_TOL); a candidate off them is recorded
with check_ok false and not timed. A config that fails to trace or compile (Triton out
of resources, a Mosaic kernel's register or lowering check) is a row with its error;
one whose shared-memory estimate exceeds Hopper's 227 KiB (Triton: `smem_bytes` below;
Mosaic: the config's own `smem_bytes*` against SMEM_BYTES) is a row with that reason,
never compiled.

Hangs: candidates run in this process, and a Mosaic kernel with a barrier bug hangs
rather than fails. The time budget is checked before every candidate, and each
candidate's label is printed before it runs, so a hang leaves its name last in the log;
the guard against the hang itself is the caller's timeout (gpu_run.sh's `timeout`
around the sweep steps). Rows are written as they land, so what ran before stays.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
import uuid

import jax
import jax.numpy as jnp

import pallas_flash
from benchmarks import bench, render, suites
from benchmarks.impls import Impl
from pallas_flash import configs
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import bwd_config
from pallas_flash.mosaic import config as mosaic_config

FAMILIES = ("triton", "mosaic")
TOKENS = 16384  # per batch: batch = TOKENS // seq
HIDDEN = 2048  # heads = HIDDEN // head_dim
SMEM_LIMIT = 227 * 1024  # Hopper's shared memory per thread block (opt-in maximum)

FWD_SPACE = dict(block_q=(64, 128), block_kv=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))
BWD_TILES = (32, 64, 128)  # (block_q, block_kv) pairs, shared by the dK/dV and dQ kernels
BWD_WARPS = (4, 8)
BWD_STAGES = (1, 2, 3)

# Mosaic GPU: P always in registers (FA3's form) on the GPU; 2 consumer warpgroups fixed.
MOSAIC_FWD_SPACE = dict(
    block_q=(64, 128),
    block_kv=(64, 128, 192, 256),
    num_stages=(2, 3, 4),
    schedule_barrier=(True, False),
    rescale_before_turn=(False, True),
    early_k_wait=(False, True),
    intra_overlap=(False, True),  # a schedule of its own: not with the two flags above
    persistent=(False, True),  # not with intra_overlap
    # As every default row: Q's first 64 columns in registers (beside none, timed at
    # 19797c5: 1.01-1.02x; config.Q_REGISTER_COLS).
    q_register_cols=(64,),
)
# The backward's two kernels, each varied with the other at its default.
MOSAIC_DKV_SPACE = dict(
    block_q_dkv=(64, 128), block_kv_dkv=(64, 128), num_stages_dkv=(2, 3), consumers_dkv=(1, 2)
)
MOSAIC_DQ_SPACE = dict(
    block_q_dq=(64, 128), block_kv_dq=(64, 128), num_stages_dq=(2, 3), consumers_dq=(1, 2)
)
MOSAIC_BWD_CHANGES = 2  # fields changed in one kernel's part at most: neighbours, pairs


def fwd_candidates() -> list[configs.TritonConfig]:
    return [
        configs.TritonConfig(**dict(zip(FWD_SPACE, c)))
        for c in itertools.product(*FWD_SPACE.values())
    ]


def bwd_candidates() -> list[configs.TritonBwdConfig]:
    """Each tile pair (a, b) as dK/dV's (q, kv) tiles, with dQ's the same (a, b) or
    mirrored (b, a): each kernel owning a large tile and streaming small ones, as the
    FlashAttention-2 Triton tutorial's backward does (dK/dV 32 x 128, dQ 128 x 32)."""
    out = []
    for (a, b), warps, stages in itertools.product(
        itertools.product(BWD_TILES, repeat=2), BWD_WARPS, BWD_STAGES
    ):
        for dq in dict.fromkeys(((a, b), (b, a))):
            out.append(
                configs.TritonBwdConfig(
                    block_q_dkv=a,
                    block_kv_dkv=b,
                    block_q_dq=dq[0],
                    block_kv_dq=dq[1],
                    num_warps=warps,
                    num_stages=stages,
                )
            )
    return out


def mosaic_fwd_candidates(head_dim: int) -> list[configs.MosaicConfig]:
    """The forward's space, less the combinations the config rejects (intra_overlap with
    rescale_before_turn or early_k_wait). As every default row, the ping-pong's turns on
    named barriers wherever there is a ping-pong (NAMED_TURNS_DEFAULT), and the head
    dim's conditional rescale (the long-key row's rescale_slack) wherever the schedule
    takes one (not intra_overlap's)."""
    slack = configs.default_mosaic_config(head_dim).rescale_slack
    out = []
    for c in itertools.product(*MOSAIC_FWD_SPACE.values()):
        fields = dict(zip(MOSAIC_FWD_SPACE, c))
        pingpong = fields["schedule_barrier"] and not fields["intra_overlap"]
        try:
            out.append(
                configs.MosaicConfig(
                    **fields,
                    named_turns=pingpong and mosaic_config.NAMED_TURNS_DEFAULT,
                    rescale_slack=None if fields["intra_overlap"] else slack,
                )
            )
        except ValueError:
            continue
    return out


def _dq_register_options(default, change: dict, head_dim: int) -> dict:
    """The default's dQ register options where a candidate's dQ kernel still takes them:
    Q and dO in registers where they fit beside dQ (`q_do_fit_registers`), every
    register to the dQ warpgroup when it is the only one."""
    block_q = change.get("block_q_dq", default.block_q_dq)
    return dict(
        q_do_in_registers=default.q_do_in_registers
        and bwd_config.q_do_fit_registers(block_q, head_dim),
        solo_dq_registers=default.solo_dq_registers
        and change.get("consumers_dq", default.consumers_dq) == 1,
    )


def mosaic_bwd_candidates(head_dim: int) -> list[configs.MosaicBwdConfig]:
    """The pair's row (pair_mosaic_bwd_config; the default but at head dim 128
    non-causal, where the default_config that `ordered` puts first is the fused kernel)
    with its dK/dV part changed in up to MOSAIC_BWD_CHANGES fields, or its dQ part,
    never both. split_dkv (two warpgroups sharing a key tile, one on dV, one on dK)
    joins the dK/dV fields at padded head dims >= 192, where the default splits (with
    share_probs, which a candidate without the split drops); below, it stays the
    default's. Combinations the config rejects (a split with one warpgroup) are left
    out."""
    default = configs.pair_mosaic_bwd_config(head_dim)
    split = (default.split_dkv,)
    hp = mosaic_config.padded_head_dim(head_dim)
    if hp >= 192:
        split = tuple(dict.fromkeys((default.split_dkv, not default.split_dkv)))
    out = {}
    for space in (dict(MOSAIC_DKV_SPACE, split_dkv=split), MOSAIC_DQ_SPACE):
        for values in itertools.product(*space.values()):
            change = {f: v for f, v in zip(space, values) if getattr(default, f) != v}
            if len(change) > MOSAIC_BWD_CHANGES:
                continue
            if change.get("split_dkv") is False:  # P^T is handed over only within a split
                change["share_probs"] = False
            change.update(_dq_register_options(default, change, head_dim))
            try:
                out[dataclasses.replace(default, **change)] = None
            except ValueError:  # split_dkv with consumers_dkv=1
                continue
    # The fused kernel (one kernel, ordered dQ adds), with the dK/dV fields it can take
    # at this head dim: those that fit its extra shared memory and registers.
    for values in itertools.product(*MOSAIC_DKV_SPACE.values()):
        change = dict(zip(MOSAIC_DKV_SPACE, values), split_dkv=False, share_probs=False, fused=True)
        change.update(q_do_in_registers=False, solo_dq_registers=False)  # no dQ kernel
        try:
            config = dataclasses.replace(default, **change)
            mosaic_backward.check_fits(config, hp)
        except ValueError:
            continue
        out[config] = None
    return list(out)


def candidates(family: str, pass_: str, head_dim: int) -> list:
    """A (family, pass)'s candidate configs at this head dim, unordered."""
    if family == "mosaic":
        return (
            mosaic_fwd_candidates(head_dim) if pass_ == "fwd" else mosaic_bwd_candidates(head_dim)
        )
    return fwd_candidates() if pass_ == "fwd" else bwd_candidates()


def default_config(family: str, pass_: str, s: suites.Shape):
    """The default-config table's row that the API would pick for this shape."""
    head_dim, dtype = s.head_dim, s.dtype
    if family == "mosaic":
        if pass_ == "fwd":
            return configs.default_mosaic_config(head_dim, s.seq_k, s.causal)
        return configs.default_mosaic_bwd_config(head_dim, s.causal)
    if pass_ == "fwd":
        return configs.default_triton_config(head_dim, dtype)
    return configs.default_triton_bwd_config(head_dim, dtype)


def interpretable(c):
    """The config as GPU interpret mode takes it: the forward's P staged through shared
    memory (the interpreter's wgmma reads no registers). A backward config as it is: the
    backward checks that it fits as compiled, then stages its matmul operands itself
    when interpreted (MosaicBwdConfig.interpreted), which at head dim 64 needs more
    shared memory than an SM has, so staging it here would fail that check."""
    if isinstance(c, configs.MosaicConfig):
        return dataclasses.replace(c, p_in_registers=False)
    return c


def _axes(c) -> tuple:
    """A config's coordinates for the distance. Triton: log2 of tiles and warps, stages
    as is. Mosaic: tiles in steps of 64 (wgmma's M), stages and warpgroups as is, flags
    0 or 1."""
    if isinstance(c, configs.MosaicConfig):
        return (
            c.block_q / 64,
            c.block_kv / 64,
            c.num_stages,
            int(not c.schedule_barrier),
            int(c.rescale_before_turn),
            int(c.early_k_wait),
            int(c.intra_overlap),
            int(c.persistent),
        )
    if isinstance(c, configs.MosaicBwdConfig):
        return (
            *(t / 64 for t in (c.block_q_dkv, c.block_kv_dkv)),
            c.num_stages_dkv,
            c.consumers_dkv,
            int(c.split_dkv),
            *(t / 64 for t in (c.block_q_dq, c.block_kv_dq)),
            c.num_stages_dq,
            c.consumers_dq,
            int(c.fused),
        )
    if isinstance(c, configs.TritonConfig):
        tiles = (c.block_q, c.block_kv)
        mirrored = 0
    else:
        tiles = (c.block_q_dkv, c.block_kv_dkv)
        mirrored = int((c.block_q_dq, c.block_kv_dq) != tiles)
    return (*(math.log2(t) for t in tiles), math.log2(c.num_warps), c.num_stages, mirrored)


def ordered(candidates: list, default) -> list:
    """The default first, then the candidates by L1 distance from it on `_axes`."""
    d = _axes(default)

    def key(c):
        return (sum(abs(x - y) for x, y in zip(_axes(c), d)), _axes(c))

    return [default] + sorted((c for c in candidates if c != default), key=key)


def smem_bytes(c, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory a config needs, estimated as Triton's software pipeliner buffers it:
    a tile the program holds once, a tile it streams num_stages times, hp = head dim
    padded to a power of two:
      forward: (block_q + 2 * num_stages * block_kv) * hp * itemsize   (Q; K, V streamed)
      dK/dV:   (2 * block_kv + 2 * num_stages * block_q) * hp * itemsize (K, V; Q, dO)
      dQ:      (2 * block_q + 2 * num_stages * block_kv) * hp * itemsize (Q, dO; K, V)
    the backward's is the larger of its two kernels. Triton's layout-conversion scratch
    is left out: a config under the limit may still fail to compile, and is recorded so.
    A Mosaic config gives its own (`smem_bytes`; the backward's larger of
    `smem_bytes_dkv` and `smem_bytes_dq`, or the first alone when fused) at the head dim
    padded to a multiple of 64.
    """
    if isinstance(c, configs.MosaicConfig):
        return c.smem_bytes(mosaic_config.padded_head_dim(head_dim), itemsize)
    if isinstance(c, configs.MosaicBwdConfig):
        hp = mosaic_config.padded_head_dim(head_dim)
        if c.fused:  # no dQ kernel
            return c.smem_bytes_dkv(hp, itemsize)
        return max(c.smem_bytes_dkv(hp, itemsize), c.smem_bytes_dq(hp, itemsize))
    hp = configs.padded_head_dim(head_dim)
    s = c.num_stages
    if isinstance(c, configs.TritonConfig):
        tiles = c.block_q + 2 * s * c.block_kv
    else:
        tiles = max(
            2 * c.block_kv_dkv + 2 * s * c.block_q_dkv, 2 * c.block_q_dq + 2 * s * c.block_kv_dq
        )
    return tiles * hp * itemsize


@dataclasses.dataclass
class Group:
    """One (shape, pass): its ordered candidates and the default config's outputs."""

    shape: suites.Shape
    pass_: str
    candidates: list
    family: str = "triton"
    want: tuple | None = None  # the default config's outputs, once it has run


# --tiny: one small shape per family that its kernels run in interpret mode on CPU.
TINY_SHAPES = {
    "triton": suites.Shape(1, 128, 128, 2, 2, 32, False),
    "mosaic": suites.Shape(1, 128, 128, 1, 1, 64, False),  # wgmma wants head dims of 64k
}


def groups(head_dims, seq: int, passes, tiny: bool, family: str = "triton") -> list[Group]:
    """Per head dim, causal off and on, each pass (tiny: one tiny shape, 2 candidates,
    as interpret mode runs them)."""
    out = []
    for head_dim in head_dims:
        if tiny:
            shape = TINY_SHAPES[family]
        else:
            shape = suites.Shape(
                TOKENS // seq, seq, seq, HIDDEN // head_dim, HIDDEN // head_dim, head_dim, False
            )
        for causal in (False, True):
            for p in passes:
                s = shape.replace(causal=causal)
                default = default_config(family, p, s)
                cands = ordered(candidates(family, p, s.head_dim), default)
                if tiny:
                    cands = [interpretable(c) for c in cands[:2]]
                out.append(Group(s, p, cands, family))
        if tiny:
            break  # one tiny head dim
    return out


def _family(c) -> str:
    return "mosaic" if isinstance(c, (configs.MosaicConfig, configs.MosaicBwdConfig)) else "triton"


def _impl(c) -> Impl:
    """Our backend of this config's family with it (the forward at its default for a
    backward one)."""
    forward = isinstance(c, (configs.TritonConfig, configs.MosaicConfig))
    kw = {"config": c} if forward else {"backward_config": c}
    family = _family(c)

    def fn(q, k, v, *, causal, **extra):
        return pallas_flash.flash_attention(
            q, k, v, is_causal=causal, implementation=family, **kw, **extra
        )

    return Impl(f"pallas_flash:{family}", fn)


def compare(got, want) -> tuple[float, str]:
    """Worst max abs error over the reference's max magnitude, and which output it is."""
    names = ("o",) if len(got) == 1 else ("dq", "dk", "dv")
    worst = (0.0, names[0])
    for name, g, w in zip(names, got, want):
        g, w = g.astype(jnp.float32), w.astype(jnp.float32)
        if not bool(jnp.isfinite(g).all()):
            return float("nan"), name
        scale = max(float(jnp.max(jnp.abs(w))), 1e-6)
        worst = max(worst, (float(jnp.max(jnp.abs(g - w))) / scale, name))
    return worst


def measure(g: Group, rank: int, inputs, fwd_time, timing: dict) -> dict:
    """One candidate's row: skipped, failed, off the default's output, or timed."""
    c = g.candidates[rank]
    s = g.shape
    smem = smem_bytes(c, s.head_dim, jnp.dtype(s.dtype).itemsize)
    row = dict(
        impl=f"pallas_flash:{g.family}",
        family=g.family,
        **s.row(),
        dtype=jnp.dtype(s.dtype).name,
        **{"pass": g.pass_},
        config=dataclasses.asdict(c),
        default=rank == 0,
        candidate=rank,
        candidates=len(g.candidates),
        smem_kib=smem // 1024,
        ms=None,
        tflops=None,
        check_err=None,
        check_worst=None,
        check_ok=None,
        error=None,
    )
    limit = mosaic_config.SMEM_BYTES if g.family == "mosaic" else SMEM_LIMIT
    if smem > limit:
        row["error"] = (
            f"shared memory estimate {smem // 1024} KiB > {limit // 1024} KiB: not compiled"
        )
        return row
    if rank > 0 and g.want is None:
        row["error"] = "the default config failed: nothing to check against"
        return row
    q, k, v, do, arrays, static = inputs
    fwd, fwd_bwd = bench._bind(_impl(c), s, static)
    f, args = (
        (jax.jit(fwd), (q, k, v, arrays))
        if g.pass_ == "fwd"
        else (jax.jit(fwd_bwd), (q, k, v, do, arrays))
    )
    try:
        got = f(*args)
        got = (got,) if g.pass_ == "fwd" else tuple(got)
        if rank == 0:  # the default is the reference: only checked to be finite
            err, worst = compare(got, got)
            g.want = got if math.isfinite(err) else None
        else:
            err, worst = compare(got, g.want)
        row.update(check_err=err, check_worst=worst, check_ok=bool(err <= bench.CHECK_TOL))
        if not row["check_ok"]:
            return row
        t = bench.time_fn(f, args, **timing)
        if g.pass_ == "bwd":
            t -= fwd_time()
    except Exception as e:  # noqa: BLE001 - a config that cannot compile is a result
        # (Mosaic: its register check and lowering errors raise here, at trace time)
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return row
    if t <= 0:  # tiny shapes: fwd+bwd within noise of fwd alone
        row["error"] = "below timing noise: fwd+bwd <= fwd"
        return row
    flops = bench.attention_flops(s) * (2.5 if g.pass_ == "bwd" else 1.0)
    return dict(row, ms=t * 1e3, tflops=flops / t / 1e12)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSONL file to append to")
    parser.add_argument(
        "--family",
        default="triton",
        choices=FAMILIES,
        help="whose configs: the Triton kernels' or the Mosaic GPU (Hopper) kernels'",
    )
    parser.add_argument("--head-dims", default="64,128,256", help="comma-separated")
    parser.add_argument("--seq", type=int, default=8192, help="sequence length (divides 16384)")
    parser.add_argument("--passes", default="fwd,bwd", help="comma-separated: fwd, bwd")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; stop starting new candidates after this (rows so far stay)",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny, 2 per pass")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--run-id", default=None)
    args = parser.parse_args(argv)
    head_dims = [int(h) for h in args.head_dims.split(",")]
    passes = args.passes.split(",")
    if set(passes) - {"fwd", "bwd"}:
        parser.error(f"--passes must be fwd and/or bwd, got {args.passes!r}")
    if TOKENS % args.seq or any(HIDDEN % h for h in head_dims):
        parser.error(f"--seq must divide {TOKENS} and each head dim {HIDDEN}")

    start = time.perf_counter()
    run_id = args.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    head = dict(run_id=run_id, suite="sweep", **bench.environment(args.commit))
    timing = dict(warmup=1, rounds=1, calls=1) if args.tiny else {}
    todo = groups(head_dims, args.seq, passes, args.tiny, args.family)
    inputs = {}  # per head dim: causal off and on share them
    fwd_times = {}  # per (head dim, causal): the default forward's seconds

    def fwd_time(s: suites.Shape) -> float:
        key = (s.head_dim, s.causal)
        if key not in fwd_times:
            c = default_config(args.family, "fwd", s)
            c = interpretable(c) if args.tiny else c
            q, k, v, _, arrays, static = inputs[s.head_dim]
            fwd, _ = bench._bind(_impl(c), s, static)
            fwd_times[key] = bench.time_fn(jax.jit(fwd), (q, k, v, arrays), **timing)
        return fwd_times[key]

    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - appended row by row
    rows, measured, total = [], 0, sum(len(g.candidates) for g in todo)
    stopped = False
    for rank in range(max(len(g.candidates) for g in todo)):
        for g in todo:
            if rank >= len(g.candidates):
                continue
            # Before every candidate: a budget spent stops the sweep between candidates.
            if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
                stopped = True
                break
            s = g.shape
            if s.head_dim not in inputs:
                inputs[s.head_dim] = bench.make_inputs(s, s.dtype)
            # The label first, so that a candidate that hangs is the last thing logged.
            print(_where(s, g.pass_, rank, g.candidates[rank]), end=" ", flush=True)
            row = dict(
                head, **measure(g, rank, inputs[s.head_dim], lambda s=s: fwd_time(s), timing)
            )
            if row["default"] and row["pass"] == "fwd" and row["ms"]:
                fwd_times.setdefault((s.head_dim, s.causal), row["ms"] / 1e3)
            rows.append(row)
            measured += 1
            print(_result(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
        if stopped:
            break
    elapsed = time.perf_counter() - start
    status = dict(
        head,
        family=args.family,
        status="time budget spent" if stopped else "complete",
        measured=measured,
        total=total,
        elapsed_s=round(elapsed, 1),
        time_budget_s=args.time_budget,
    )
    print(f"{status['status']}: {measured} of {total} candidates in {elapsed:.0f} s", flush=True)
    if out:
        out.write(json.dumps(status) + "\n")
        out.close()
    print(render.sweep_table(rows), flush=True)
    return 0


def _where(s: suites.Shape, pass_: str, rank: int, c) -> str:
    shape = f"h{s.head_dim:<3d} {'causal' if s.causal else 'full':6s} {pass_:3s}"
    return f"{shape} #{rank:<3d} {render.config_label(dataclasses.asdict(c)):28s}"


def _result(row) -> str:
    if row["error"]:
        return f"ERROR {row['error'][:120]}"
    if not row["check_ok"]:
        return f"off the default's output: {row['check_worst']} {row['check_err']:.3g}"
    return f"{row['ms']:9.3f} ms {row['tflops']:6.1f} TFLOP/s"


if __name__ == "__main__":
    sys.exit(main())
