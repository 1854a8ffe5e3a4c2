"""The benchmark harness: ours and the peers, same GPU, same process, one JSONL row each.

    python -m benchmarks.bench --suite fa --out benchmarks/results/fa.jsonl
    python -m benchmarks.bench --suite quick --tiny        # CPU, interpret mode, tiny

Method (as ../shared/ANCHORS.md): jit, a warm-up of at least 3 calls and (on a GPU) half a
second, median of 5 rounds of N calls with one block_until_ready per round, each round
after 0.2 s of untimed calls of its own (since 488cafb, PREROLL_S); on each shape
the implementations' rounds are taken in turn (round 1 of each, round 2 of each, ...), so
that a drift of the GPU's speed over the process falls on all of them alike (since
cc0b4cb; before, each implementation was timed whole, in the order named,
after three warm-up calls). Backward time = (forward+backward) - forward.
TFLOP/s by the FlashAttention-2/3 convention: forward 4*B*N*T*S*H, halved for causal;
backward 2.5x that. Before an implementation is timed on a shape family, its output
and gradients are checked against the float32 reference at a size where the reference
fits; a wrong answer is recorded as an error and not timed. A peer that fails is
recorded with its error, never dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from benchmarks import suites
from benchmarks.impls import IMPLS, Impl, lookup, reference_fn

CHECK_SEQ = 1024  # the reference is materialised at most at this length
ROUNDS = 5  # timed rounds of each function (time_fn, time_interleaved)
WARMUP = 3  # warm-up calls at least (Timed.warm)
CALLS = 20  # calls a round at most (Timed.warm sizes a round to ~0.25 s)
# Untimed calls before each round, in seconds (Timed.round). The H200 runs these kernels
# at its 700 W limit, and without them a round ran at the clock the function timed
# before it left: at 488cafb (results/mosaic-488cafb/, head dim 256 non-causal, one
# process each) tokamax's forward, timed right after its own slow, low-power backward,
# read 1.08x / 1.09x ours at 2k / 4k without a pre-roll and 0.97x / 0.99x with 0.2 s.
PREROLL_S = 0.2
CHECK_TOL = 2e-2  # relative max error accepted in the pre-timing check (16-bit inputs)


def attention_flops(s: suites.Shape) -> float:
    """Forward FLOPs of the two matmuls, halved for causal (FlashAttention-2 convention)."""
    flops = 4.0 * s.batch * s.heads * s.seq_q * s.seq_k * s.head_dim
    return flops / 2 if s.causal else flops


def environment(commit: str | None) -> dict:
    try:
        from jax._src.lib import cuda_versions

        cudnn = str(cuda_versions.cudnn_get_version()) if cuda_versions else None
    except Exception:  # noqa: BLE001 - a CPU build has no CUDA versions
        cudnn = None
    if commit is None:
        try:
            commit = subprocess.check_output(
                ["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
            ).strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        cudnn=cudnn,
        commit=commit,
        matmul_tflops=matmul_tflops() if jax.default_backend() == "gpu" else None,
    )


def matmul_tflops(n: int = 8192) -> float:
    """The device's dense bf16 matmul rate in this process (n x n x n, timed like the
    kernels): the ceiling that attention TFLOP/s are read against (ANCHORS.md: 728-785
    on the H200)."""
    a, b = (jax.random.normal(jax.random.PRNGKey(i), (n, n), jnp.bfloat16) for i in (0, 1))
    return 2.0 * n**3 / time_fn(jax.jit(jnp.matmul), (a, b)) / 1e12


def make_inputs(s: suites.Shape, dtype, seed: int = 0):
    """q, k, v, a cotangent, and the masking arguments: (arrays, static) kwargs."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (s.batch, s.seq_q, s.heads, s.head_dim), dtype)
    k = jax.random.normal(ks[1], (s.batch, s.seq_k, s.kv_heads, s.head_dim), dtype)
    v = jax.random.normal(ks[2], (s.batch, s.seq_k, s.kv_heads, s.head_dim), dtype)
    do = jax.random.normal(ks[3], q.shape, dtype)
    arrays, static = masking_arguments(s, ks[4])
    return q, k, v, do, arrays, static


def masking_arguments(s: suites.Shape, key) -> tuple[dict, dict]:
    """flash_attention keyword arguments for the shape's mask label.

    "padding": key lengths 50-100 %; "padding-full": lengths = S (pure overhead);
    "segments:D": D packed documents per row; "window:W": local window (W, W);
    "mask": a random boolean mask (90 % attend); "mask-full": an all-True mask;
    "dropout:R": dropout at rate R; "sparse:D": a block layout of density D (128 x 128
    blocks, the same number of tiles in every row).
    """
    label, _, value = s.mask.partition(":")
    B, T, S = s.batch, s.seq_q, s.seq_k
    if label == "none":
        return {}, {}
    if label in ("padding", "padding-full"):
        frac = jax.random.uniform(key, (B,), minval=0.5, maxval=1.0)
        lens = (
            jnp.maximum(1, (frac * S).astype(jnp.int32))
            if label == "padding"
            else (jnp.full((B,), S, jnp.int32))
        )
        return {"key_value_seq_lengths": lens}, {}
    if label == "segments":
        ids = jnp.arange(T) * int(value) // T  # D documents of equal length
        return {"segment_ids": jnp.broadcast_to(ids, (B, T)).astype(jnp.int32)}, {}
    if label == "window":
        return {}, {"local_window_size": (int(value), int(value))}
    if label in ("mask", "mask-full"):
        m = (
            jax.random.bernoulli(key, 0.9, (B, 1, T, S))
            if label == "mask"
            else jnp.ones((B, 1, T, S), bool)
        )
        return {"mask": m}, {}
    if label == "dropout":
        return {"dropout_rng": jax.random.key(0)}, {"dropout_rate": float(value)}
    if label == "sparse":
        nq, nk = -(-T // 128), -(-S // 128)
        per_row = max(1, round(float(value) * nk))
        order = jnp.argsort(jax.random.uniform(key, (nq, nk)), axis=1)
        layout = jnp.zeros((nq, nk), bool).at[jnp.arange(nq)[:, None], order[:, :per_row]].set(True)
        return {"block_sparse": pallas_flash.BlockSparse(layout, 128, 128)}, {}
    raise ValueError(f"unknown mask label {s.mask!r}")


def _bind(impl: Impl, s: suites.Shape, static: dict):
    def fwd(q, k, v, arrays):
        return impl.fn(q, k, v, causal=s.causal, **arrays, **static)

    def fwd_bwd(q, k, v, do, arrays):
        out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, arrays), q, k, v)
        return vjp(do)

    return fwd, fwd_bwd


def _outputs_and_grads(fn, s: suites.Shape, static, q, k, v, do, arrays):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal=s.causal, **arrays, **static), q, k, v)
    return (out, *vjp(do.astype(out.dtype)))


def _output(fn, s: suites.Shape, static, q, k, v, do, arrays):
    return (fn(q, k, v, causal=s.causal, **arrays, **static),)


def check(
    impl: Impl, s: suites.Shape, dtype, backward: bool = True
) -> tuple[float, str, str | None]:
    """Worst relative max error, and which of (o, dq, dk, dv) it is, vs the float32
    reference; and None, or why the implementation has no backward here.

    An implementation whose gradient raises while its forward runs (JAX's Mosaic FA3 has
    no causal backward) is checked and timed on its forward alone: its forward is still a
    peer's forward. Until 2026-12-04 the whole implementation was recorded as failed, so
    FA3 was missing from every causal forward comparison.

    `backward=False` (a run that times the forward only) checks O alone: the backward it
    does not time is not compiled, for it or for the reference (a Mosaic backward's
    compile is seconds of a device call's few minutes)."""
    small = s.replace(batch=1, seq_q=min(s.seq_q, CHECK_SEQ), seq_k=min(s.seq_k, CHECK_SEQ))
    *inputs, static = make_inputs(small, dtype, seed=1)

    def run(fn, what):
        return jax.jit(lambda *a: what(fn, small, static, *a))(*inputs)

    no_backward = None
    what = _outputs_and_grads if backward else _output
    try:
        got = run(impl.fn, what)
    except Exception as e:  # noqa: BLE001 - its forward alone may still run
        if not backward:
            raise
        no_backward = "no backward: " + _error_message(e)
        got = run(impl.fn, _output)  # raises, for the caller to record, if this fails too
    want = run(reference_fn(impl.unscaled), what)
    worst = (0.0, "o")
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if not np.isfinite(g).all():
            return float("nan"), name, no_backward
        err = float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-6))
        worst = max(worst, (err, name))
    return (*worst, no_backward)


class Timed:
    """One function's timing, warmed and then timed a round at a time, so that several
    can take their rounds in turn (`time_interleaved`)."""

    def __init__(self, f, args, calls: int = CALLS, preroll_s: float = 0.0):
        self.f, self.args, self.calls, self.times = f, args, calls, []
        self.preroll_s, self.preroll = preroll_s, 0
        self.spans: list[tuple[float, float]] = []  # host times of the timed rounds

    def warm(self, warmup: int = WARMUP, warmup_s: float | None = None):
        """At least `warmup` calls and at least `warmup_s` seconds of them (by default half
        a second on a GPU, none elsewhere), then one call that sizes a round (~0.25 s).

        The GPU idles while the CPU compiles and checks each implementation, and three
        calls did not bring it back: at f309273 the first implementation timed in a
        process read its forward 1-4 % slower than the same kernels timed later in that
        process (head dim 256, 615.0 against 622.6 TFLOP/s non-causal, 643.1 against
        667.1 causal; `benchmarks/results/mosaic-f309273/`), which favoured whatever was
        timed after it, and, since the backward is fwd+bwd less fwd, flattered the first
        one's backward."""
        if warmup_s is None:
            warmup_s = 0.5 if jax.default_backend() == "gpu" else 0.0
        start, n = time.perf_counter(), 0
        while n < warmup or time.perf_counter() - start < warmup_s:
            jax.block_until_ready(self.f(*self.args))
            n += 1
        t0 = time.perf_counter()
        jax.block_until_ready(self.f(*self.args))
        once = time.perf_counter() - t0
        self.calls = max(1, min(self.calls, int(0.25 / max(once, 1e-6))))
        if self.preroll_s > 0:
            self.preroll = max(1, round(self.preroll_s / max(once, 1e-6)))

    def round(self):
        """`calls` calls, one sync: seconds per call. With a pre-roll (`preroll_s`), first
        that long of untimed calls and a sync, so that the round runs in this function's
        own steady state of clock and power rather than in the one the function timed
        before it left (the H200 runs these kernels at its power limit, gpu_clock.py)."""
        if self.preroll:
            for _ in range(self.preroll):
                out = self.f(*self.args)
            jax.block_until_ready(out)
        start = time.time()
        t0 = time.perf_counter()
        for _ in range(self.calls):
            out = self.f(*self.args)
        jax.block_until_ready(out)
        self.times.append((time.perf_counter() - t0) / self.calls)
        self.spans.append((start, time.time()))

    def median(self) -> float:
        return float(np.median(self.times))


def time_fn(
    f,
    args,
    *,
    warmup: int = WARMUP,
    warmup_s: float | None = None,
    rounds: int = ROUNDS,
    calls: int = CALLS,
) -> float:
    """Median seconds per call: `rounds` rounds of `calls` calls, one sync per round,
    after the warm-up (`Timed.warm`)."""
    timed = Timed(f, args, calls)
    timed.warm(warmup, warmup_s)
    for _ in range(rounds):
        timed.round()
    return timed.median()


def time_interleaved(timed: dict, rounds: int = ROUNDS) -> dict:
    """Median seconds per call of each Timed (already warmed), their rounds taken in turn:
    round 1 of each, then round 2 of each, ... A drift of the GPU's speed over the
    process (its clocks, its temperature) then falls on all of them alike rather than
    on whichever ran last: at 26e6916 four identical forwards timed one after another
    read 614.6 / 612.4 / 605.8 / 601.9 TFLOP/s (head dim 128;
    `benchmarks/results/mosaic-26e6916/fa-mosaic-128-aba.jsonl`). A Timed whose call
    raises gets the exception as its result and leaves the turn."""
    out, live = {}, dict(timed)
    for _ in range(rounds):
        for key, t in list(live.items()):
            try:
                t.round()
            except Exception as e:  # noqa: BLE001 - one failing call ends its own timing only
                out[key] = e
                del live[key]
    out.update({key: t.median() for key, t in live.items()})
    return out


def measure_memory(f, args, run: bool) -> tuple[int, int | None, float | None]:
    """Compiled temporary bytes; if `run`, also the device's peak bytes and one call's time."""
    compiled = jax.jit(f).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    if not run:
        return temp, None, None
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    seconds = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats() or {}
    return temp, stats.get("peak_bytes_in_use"), seconds


def _error_message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


# --tiny (CPU smoke runs): one call a round, one warm-up call, two rounds. The numbers
# mean nothing there, and the default's 3 + 5 x up to 20 calls of each interpreted
# kernel were most of the tiny suites' time.
TINY_TIMING = dict(warmup=1, rounds=2, calls=1)


def run_shape(
    impl: Impl, s: suites.Shape, passes, *, memory: bool, run: bool, checked: dict, timing=None
):
    """Yields one row per pass for this implementation and shape."""
    yield from run_shapes([impl], s, passes, memory=memory, run=run, checked=checked, timing=timing)


def run_shapes(
    impls, s: suites.Shape, passes, *, memory: bool, run: bool, checked: dict, timing=None
):
    """Yields one row per pass for each implementation on this shape, in their order.

    Each is checked against the reference, compiled and warmed; then all of them are
    timed with their rounds interleaved (`time_interleaved`), so that none is favoured
    by its place in the process. (So a shape's rows come once every implementation has
    run: a call that hangs leaves none of that shape's rows.) With `memory`, each has one
    compiled call instead, measured alone. `timing`: warmup, rounds and calls (a round's
    most) where not the defaults (TINY_TIMING for --tiny)."""
    timing = timing or {}
    calls, warmup = timing.get("calls", CALLS), timing.get("warmup", WARMUP)
    preroll_s = timing.get("preroll_s", 0.0)
    flops = attention_flops(s)
    timed, bases = {}, {}
    for impl in impls:
        dtype = s.dtype if s.dtype in impl.dtypes else impl.dtypes[0]
        base = dict(
            impl=impl.name,
            **s.row(),
            dtype=jnp.dtype(dtype).name,
            ms=None,
            tflops=None,
            temp_bytes=None,
            peak_bytes=None,
            check_err=None,
            check_worst=None,
            check_ok=None,
            error=None,
        )
        # The backward is checked where it is timed (or its memory measured).
        backward = memory or bool(set(passes) & {"bwd", "fwd+bwd"})
        key = (impl.name, s.family(), backward)
        try:
            if key not in checked:
                checked[key] = check(impl, s, dtype, backward)
            err, worst, no_backward = checked[key]
            # A result off the reference is recorded (check_ok False, and which output) and
            # still timed: the table marks it, rather than hide a fast peer's number.
            base.update(check_err=err, check_worst=worst, check_ok=bool(err <= CHECK_TOL))
            if no_backward and (memory or "fwd" not in passes):
                raise NotImplementedError(no_backward)
            q, k, v, do, arrays, static = make_inputs(s, dtype)
            fwd, fwd_bwd = _bind(impl, s, static)
            if memory:  # one compiled call: temporary bytes, peak bytes, its time
                temp, peak, seconds = measure_memory(fwd_bwd, (q, k, v, do, arrays), run)
                ms = None if seconds is None else seconds * 1e3
                tflops = None if seconds is None else 3.5 * flops / seconds / 1e12
                yield dict(
                    base,
                    **{"pass": "fwd+bwd"},
                    temp_bytes=temp,
                    peak_bytes=peak,
                    ms=ms,
                    tflops=tflops,
                )
                continue
            mine = {}
            # fwd+bwd is timed only where a pass needs it (the backward is that minus fwd).
            if not no_backward and set(passes) & {"bwd", "fwd+bwd"}:
                mine["all"] = Timed(jax.jit(fwd_bwd), (q, k, v, do, arrays), calls, preroll_s)
            if set(passes) & {"fwd", "bwd"}:
                mine["fwd"] = Timed(jax.jit(fwd), (q, k, v, arrays), calls, preroll_s)
            for t in mine.values():
                t.warm(warmup)  # compiles, and brings the GPU up to speed
        except Exception as e:  # noqa: BLE001 - a failing peer is a result, not a crash
            for p in passes:
                yield dict(base, **{"pass": p, "error": _error_message(e)})
            continue
        bases[impl.name] = base, no_backward
        timed.update({(impl.name, which): t for which, t in mine.items()})
    seconds = time_interleaved(timed, timing.get("rounds", ROUNDS))
    for name, (base, no_backward) in bases.items():
        t_all, t_fwd = seconds.get((name, "all")), seconds.get((name, "fwd"))
        failed = [t for t in (t_all, t_fwd) if isinstance(t, BaseException)]
        if failed:
            for p in passes:
                yield dict(base, **{"pass": p, "error": _error_message(failed[0])})
            continue
        fwd_spans = timed[name, "fwd"].spans if (name, "fwd") in timed else []
        all_spans = timed[name, "all"].spans if (name, "all") in timed else []
        spans = {"fwd": fwd_spans, "bwd": fwd_spans + all_spans, "fwd+bwd": all_spans}
        by_pass = {
            "fwd": (t_fwd, flops),
            "bwd": (None if None in (t_fwd, t_all) else t_all - t_fwd, 2.5 * flops),
            "fwd+bwd": (t_all, 3.5 * flops),
        }
        for p in passes:
            t, f = by_pass[p]
            if no_backward and p != "fwd":
                yield dict(base, **{"pass": p, "error": no_backward})
                continue
            if t is not None and t <= 0:  # tiny shapes: fwd+bwd within noise of fwd alone
                yield dict(base, **{"pass": p, "error": "below timing noise: fwd+bwd <= fwd"})
            else:
                clock = _gpu_state(spans[p])
                if preroll_s:
                    clock["preroll_s"] = preroll_s
                yield dict(base, **{"pass": p, "ms": t * 1e3, "tflops": f / t / 1e12}, **clock)


# NVML's readings while the harness runs on a GPU (gpu_clock.Sampler; main starts
# it): each timed row gets the mean SM clock, power and temperature of its rounds.
_SAMPLER = None


def _gpu_state(spans) -> dict:
    if _SAMPLER is None:
        return {}
    return _SAMPLER.during(spans)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(suites.SUITES), required=True)
    parser.add_argument(
        "--impls", default=None, help="comma-separated names (default: all of the suite's)"
    )
    parser.add_argument("--out", default=None, help="JSONL file to append to")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--run-id", default=None)
    parser.add_argument(
        "--max-run-seq",
        type=int,
        default=1 << 20,
        help="memory suite: longer sequences are compiled, not run",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; stop starting new shapes after this (rows so far stay)",
    )
    parser.add_argument(
        "--head-dims", default=None, help="comma-separated head dims to keep (default: all)"
    )
    parser.add_argument(
        "--masks", default=None, help="comma-separated mask labels to keep (default: all)"
    )
    parser.add_argument(
        "--seqs",
        default=None,
        help="comma-separated query lengths to keep, e.g. 16384 (default: all)",
    )
    parser.add_argument(
        "--heads",
        default=None,
        help="comma-separated head counts: each kept shape once per count, its heads and "
        "key/value heads replaced (a probe of the launch's waves, benchmarks/launch_sim.py)",
    )
    parser.add_argument(
        "--batches",
        default=None,
        help="comma-separated batch sizes: each kept shape once per size, its batch "
        "replaced (more or fewer tokens a batch than the grid's 16k: a probe of the "
        "backward's band_pairs, MosaicBwdConfig)",
    )
    parser.add_argument(
        "--causal",
        choices=("true", "false"),
        default=None,
        help="keep only causal (true) or only non-causal (false) shapes (default: both)",
    )
    parser.add_argument(
        "--passes",
        default=None,
        help="comma-separated passes to time, of the suite's (e.g. fwd: a forward-only "
        "variant's backward is not timed); default: all of them",
    )
    parser.add_argument(
        "--preroll-s",
        type=float,
        default=PREROLL_S,
        help="seconds of untimed calls before each timed round (Timed.round; 0: none)",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="memory suite: one process per implementation, so that the "
        "device's peak-memory counter belongs to that implementation",
    )
    args = parser.parse_args(argv)

    suite = suites.SUITES[args.suite]
    # Each name once: a shape's implementations are timed in turn (run_shapes), so a
    # name given twice would only be timed twice over the same rounds.
    names = list(dict.fromkeys(args.impls.split(","))) if args.impls else list(suite.impls)
    impls, unknown = {}, []  # each name resolved once (a config variant is parsed here)
    for n in names:
        try:
            impls[n] = lookup(n)
        except KeyError:
            unknown.append(n)
        except ValueError as e:
            parser.error(str(e))
    if unknown:
        parser.error(
            f"unknown implementations {unknown}; known: {sorted(IMPLS)}, or "
            "pallas_flash:mosaic/FIELD=VALUE/... (a Mosaic config variant)"
        )
    run_id = args.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"

    if args.isolate and len(names) > 1:
        for name in names:
            cmd = [sys.executable, "-m", "benchmarks.bench", *_forward_args(args, name, run_id)]
            subprocess.run(cmd, check=False, env=os.environ.copy())
        return 0

    shapes = suite.tiny_shapes if args.tiny else suite.shapes
    if args.head_dims:
        keep = {int(h) for h in args.head_dims.split(",")}
        shapes = tuple(s for s in shapes if s.head_dim in keep)
    if args.masks:
        labels = set(args.masks.split(","))
        shapes = tuple(s for s in shapes if s.mask in labels)
    if args.causal:
        shapes = tuple(s for s in shapes if s.causal == (args.causal == "true"))
    if args.seqs:
        keep = {int(t) for t in args.seqs.split(",")}
        shapes = tuple(s for s in shapes if s.seq_q in keep)
    if args.heads:
        counts = [int(n) for n in args.heads.split(",")]
        if min(counts) < 1:
            parser.error(f"--heads {args.heads!r}: each must be a count of 1 or more")
        shapes = tuple(s.replace(heads=n, kv_heads=n) for s in shapes for n in counts)
    if args.batches:
        sizes = [int(n) for n in args.batches.split(",")]
        if min(sizes) < 1:
            parser.error(f"--batches {args.batches!r}: each must be a size of 1 or more")
        shapes = tuple(s.replace(batch=n) for s in shapes for n in sizes)
    if not shapes:
        parser.error(f"no {args.suite} shape is left by the filters given")
    passes = tuple(suite.passes)
    if args.passes:
        wanted = args.passes.split(",")
        if not set(wanted) <= set(passes):
            parser.error(f"--passes {args.passes!r}: each must be one of {list(passes)}")
        passes = tuple(p for p in passes if p in wanted)
    env = environment(args.commit)
    global _SAMPLER
    if jax.default_backend() == "gpu" and _SAMPLER is None:
        from benchmarks.gpu_clock import Sampler

        _SAMPLER = Sampler()
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - appended row by row
    checked: dict = {}
    start = time.perf_counter()
    for s in shapes:
        if args.time_budget and time.perf_counter() - start > args.time_budget:
            print(f"time budget of {args.time_budget:.0f} s spent; stopping", flush=True)
            break
        run = s.seq_q <= args.max_run_seq
        shape_impls = [impls[name] for name in names]
        for row in run_shapes(
            shape_impls,
            s,
            passes,
            memory=suite.memory,
            run=run,
            checked=checked,
            timing=TINY_TIMING if args.tiny else dict(preroll_s=args.preroll_s),
        ):
            row = dict(run_id=run_id, suite=args.suite, **env, **row)
            print(_summary(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
    if out:
        out.close()
    return 0


def _forward_args(args, name, run_id):
    fwd = [
        "--suite",
        args.suite,
        "--impls",
        name,
        "--run-id",
        run_id,
        "--max-run-seq",
        str(args.max_run_seq),
    ]
    for flag, value in (
        ("--out", args.out),
        ("--commit", args.commit),
        ("--head-dims", args.head_dims),
        ("--masks", args.masks),
        ("--causal", args.causal),
        ("--seqs", args.seqs),
        ("--passes", args.passes),
        ("--time-budget", args.time_budget and str(args.time_budget)),
        ("--preroll-s", args.preroll_s and str(args.preroll_s)),
    ):
        if value:
            fwd += [flag, value]
    return fwd + (["--tiny"] if args.tiny else [])


def _summary(row) -> str:
    shape = (
        f"b{row['batch']} t{row['seq_q']} s{row['seq_k']} n{row['heads']} "
        f"h{row['head_dim']} {'causal' if row['causal'] else 'full'} {row['mask']}"
    )
    if row["error"]:
        return f"{row['impl']:28s} {row['pass']:8s} {shape:44s} ERROR {row['error'][:120]}"
    parts = []
    if row["tflops"] is not None:
        parts.append(f"{row['ms']:9.3f} ms {row['tflops']:6.1f} TFLOP/s")
    if row["temp_bytes"] is not None:
        parts.append(f"temp {row['temp_bytes'] / 2**20:9.1f} MiB")
    if row["peak_bytes"] is not None:
        parts.append(f"peak {row['peak_bytes'] / 2**20:9.1f} MiB")
    return f"{row['impl']:28s} {row['pass']:8s} {shape:44s} " + "  ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
