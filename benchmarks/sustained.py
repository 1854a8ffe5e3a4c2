"""One shape's forward timed three ways, with the GPU's clocks and power sampled throughout.

    python -m benchmarks.sustained --impls pallas_flash:mosaic,tokamax:mosaic \
        --head-dim 256 --seq 4096 --out F.jsonl

Why: under Nsight Compute (each kernel alone, caches flushed, `benchmarks.profile`) our
head-dim-256 forward and tokamax's ran the same time at 4k, 783.0 and 783.2 us, while
the harness, which queues a round of calls behind one sync, read them 616 and 680
TFLOP/s (892 and 808 us a call). Each implementation is timed, their turns interleaved:
- isolated: one call, synced, after a 50 ms pause (the GPU idle before each);
- synced: calls back to back, each synced before the next is dispatched;
- queued: rounds of calls with one sync (the harness's way, `bench.Timed`).
Meanwhile a thread reads NVML (SM clock, power, temperature; gpu_clock.py) every 20 ms; each
phase's row gets the samples taken while it ran. A gap that opens only when queued
is between the calls (dispatch, or work the kernel list does not show); one that
follows the clock is power.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def phase_times(f, args, phase: str, n: int) -> list[float]:
    """Seconds per call, `n` samples of the phase (see the module docstring)."""
    import jax

    if phase == "queued":
        from benchmarks.bench import Timed

        timed = Timed(f, args, calls=20)
        for _ in range(n):
            timed.round()
        return timed.times
    out = []
    for _ in range(n):
        if phase == "isolated":
            time.sleep(0.05)
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    import jax

    from benchmarks import bench, suites
    from benchmarks.gpu_clock import Sampler
    from benchmarks.impls import lookup

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="pallas_flash:mosaic,tokamax:mosaic")
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seq")
    parser.add_argument("--repeats", type=int, default=3, help="turns of each phase")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    hd, seq = args.head_dim, args.seq
    heads = 2048 // hd
    s = suites.Shape(args.tokens // seq, seq, seq, heads, heads, hd, args.causal)
    q, k, v, _, arrays, static = bench.make_inputs(s, s.dtype)
    fns = {}
    for name in args.impls.split(","):
        fwd, _ = bench._bind(lookup(name), s, static)
        try:
            fn = jax.jit(fwd)
            for _ in range(5):
                jax.block_until_ready(fn(q, k, v, arrays))
        except Exception as e:  # noqa: BLE001 - a failing peer is reported, the rest timed
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        fns[name] = fn
    flops = bench.attention_flops(s)
    sampler = Sampler()
    rows = []
    for phase in ("isolated", "synced", "queued"):
        for rep in range(args.repeats):
            for name, f in fns.items():
                t0 = time.time()
                times = phase_times(f, (q, k, v, arrays), phase, 10)
                t1 = time.time()
                sec = float(np.median(times))
                row = dict(impl=name, **s.row(), phase=phase, repeat=rep, us=round(sec * 1e6, 1))
                row["tflops"] = round(flops / sec / 1e12, 1)
                row.update(sampler.between(t0, t1))
                rows.append(row)
                print(json.dumps(row), flush=True)
    sampler.stop()
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
