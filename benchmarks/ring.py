"""Ring attention (context parallelism) on the devices at hand: exactness, speed, length.

    python -m benchmarks.ring --out benchmarks/results/ring.jsonl      # 2 GPUs, < 5 min
    python -m benchmarks.ring --long 1048576,2097152 --out ...         # also very long T
    python -m benchmarks.ring --memory 1048576 --skip-check --skip-time --out ...  # memory
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.ring --tiny

Four parts, one JSONL row per measurement (run, device, jax, commit, shape, ...):
(a) "check": ring attention on 2 devices against single-device flash_attention at a
    length both fit (B=1, T=32k, N=16, H=128, bf16, causal): max errors of o, lse, dq,
    dk, dv (with random cotangents for o and lse), next to the error of the
    single-device kernel itself (bf16 against float32 inputs), which sizes them.
(b) "time": forward and forward+backward at T=128k on 1 device (flash_attention) and
    on 2 (ring attention), as benchmarks/bench.py times them (jit, warm-up, median of
    rounds, block_until_ready); TFLOP/s count the whole computation over all devices,
    and `speedup` is the 1-device time over the ring's.
(c) "long" (--long T1,T2,...): one forward+backward on 2 devices at each length, its
    time and per-device memory (the compiled call's bytes), and whether 1 device runs
    out of memory there (our kernels' memory is linear in T, so 1 device reaches long
    lengths too; this finds where it stops). On GPU, give JAX the memory:
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95.
(d) "memory" (--memory T1,T2,...): the forward+backward compiled, never run (nothing
    is allocated, so any length can be asked), on 2 devices at T and on 1 at T/2 (the
    same per-device shape): argument, output and temporary bytes per device, and the
    temporaries in units of one device's query shard (`temp_per_shard`), the figure
    ring.py's docstring itemizes. With --opaque the kernels are opaque calls, as XLA
    sees them compiled on a GPU, so that any machine gives the GPU's figure:
        XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.ring \
            --memory 4096 --opaque --impl triton --skip-check --skip-time
Every row with memory has `temp_per_shard`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_flash
from benchmarks.bench import environment, time_fn
from pallas_flash import vjp
from pallas_flash.logits import backward_stats

AXIS = "ring"


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int = 1
    heads: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    check_seq: int = 32768
    time_seq: int = 131072


FULL = Sizes()
TINY = Sizes(heads=4, head_dim=16, check_seq=64, time_seq=128)


def flops(sizes: Sizes, seq: int, pass_: str) -> float:
    """FlashAttention's convention: forward 4*B*N*T*S*H, halved for causal; backward 2.5x."""
    fwd = 4.0 * sizes.batch * sizes.heads * seq * seq * sizes.head_dim / 2
    return fwd if pass_ == "fwd" else 3.5 * fwd


def attention(mesh: Mesh | None, impl: str | None, residual: bool = False):
    """Causal attention: flash_attention on one device (mesh None) or the ring over mesh."""
    if mesh is None:
        return lambda q, k, v: pallas_flash.flash_attention(
            q, k, v, is_causal=True, implementation=impl, return_residual=residual
        )
    return lambda q, k, v: pallas_flash.ring_attention(
        q,
        k,
        v,
        mesh=mesh,
        axis_name=AXIS,
        is_causal=True,
        implementation=impl,
        return_residual=residual,
    )


def inputs(sizes: Sizes, seq: int, sharding, dtype=None, seed: int = 0):
    """q, k, v and the output cotangent, made directly with `sharding` (no gather)."""
    shape = (sizes.batch, seq, sizes.heads, sizes.head_dim)
    dtype = dtype or jnp.dtype(sizes.dtype)

    def make(key):
        return tuple(jax.random.normal(k, shape, dtype) for k in jax.random.split(key, 4))

    return jax.jit(make, out_shardings=(sharding,) * 4)(jax.random.PRNGKey(seed))


def place(mesh: Mesh | None, devices):
    """Where the sequence axis lives: sharded over the ring, or on one device."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(devices[0])
    return NamedSharding(mesh, P(None, AXIS))


def fwd_bwd(attn):
    """o and the gradients of (o, lse) or o alone, for a random cotangent."""

    def f(q, k, v, do, *dlse):
        out, pull = jax.vjp(attn, q, k, v)
        cot = (do, *dlse) if dlse else do
        return (out, *pull(cot))

    return f


def check(sizes: Sizes, mesh: Mesh, devices, impl) -> dict:
    """(a): ring vs single device, with the single device's own bf16 error as the scale."""
    seq = sizes.check_seq
    one = place(None, devices)
    q, k, v, do = inputs(sizes, seq, one, seed=1)
    dlse = jax.random.normal(jax.random.PRNGKey(2), (sizes.batch, seq, sizes.heads))
    single = jax.jit(fwd_bwd(attention(None, impl, residual=True)))
    want = single(q, k, v, do, dlse)
    ring_in = [jax.device_put(x, place(mesh, devices)) for x in (q, k, v, do)]
    ring = jax.jit(fwd_bwd(attention(mesh, impl, residual=True)))
    got = ring(*ring_in, jax.device_put(dlse, place(mesh, devices)))
    up = [x.astype(jnp.float32) for x in (q, k, v, do)]
    exact = single(*up, dlse)  # the same kernel on float32 inputs

    def err(a, b):
        a, b = (np.asarray(jax.device_put(x, devices[0]), np.float32) for x in (a, b))
        b_max = float(np.max(np.abs(b)))
        return float(np.max(np.abs(a - b))), float(np.max(np.abs(a - b)) / max(b_max, 1e-30))

    names = ("o", "lse", "dq", "dk", "dv")
    want = (*want[0], *want[1:])  # ((o, lse), dq, dk, dv) -> (o, lse, dq, dk, dv)
    got, exact = (*got[0], *got[1:]), (*exact[0], *exact[1:])
    errors = {n: err(g, w) for n, g, w in zip(names, got, want)}
    kernel = {n: err(w, x) for n, w, x in zip(names, want, exact)}
    return dict(
        seq=seq,
        max_abs_err={n: e[0] for n, e in errors.items()},
        max_rel_err={n: e[1] for n, e in errors.items()},
        kernel_rel_err={n: e[1] for n, e in kernel.items()},
        # The ring should add no more than the kernel's own 16-bit error.
        ok=all(errors[n][1] <= 2 * kernel[n][1] + 2**-8 for n in names),
    )


def timing(sizes: Sizes, mesh: Mesh | None, devices, impl) -> list[dict]:
    """(b): forward and forward+backward times at sizes.time_seq."""
    seq = sizes.time_seq
    q, k, v, do = inputs(sizes, seq, place(mesh, devices))
    attn = attention(mesh, impl)
    fwd = jax.jit(attn)
    both = jax.jit(fwd_bwd(attn))
    rows = []
    for pass_, f, args in (("fwd", fwd, (q, k, v)), ("fwd+bwd", both, (q, k, v, do))):
        seconds = time_fn(f, args, warmup=2, rounds=5, calls=1)
        rows.append(
            dict(
                seq=seq,
                **{"pass": pass_},
                ms=seconds * 1e3,
                tflops=flops(sizes, seq, pass_) / seconds / 1e12,
                **memory(f.lower(*args).compile(), shard_bytes(sizes, seq, mesh)),
            )
        )
    return rows


def shard_bytes(sizes: Sizes, seq: int, mesh: Mesh | None) -> int:
    """Bytes of one device's query shard (of the whole query on one device)."""
    devices = 1 if mesh is None else mesh.shape[AXIS]
    itemsize = jnp.dtype(sizes.dtype).itemsize
    return sizes.batch * (seq // devices) * sizes.heads * sizes.head_dim * itemsize


def memory(compiled, shard: int) -> dict:
    """Per-device bytes of one compiled call: its temporaries, and all it holds (arguments,
    outputs and temporaries). Static, so rows of one process do not see each other's
    peaks as the device's peak-memory counter would."""
    m = compiled.memory_analysis()
    held = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return dict(
        temp_bytes=m.temp_size_in_bytes,
        device_bytes=held - m.alias_size_in_bytes,
        temp_per_shard=m.temp_size_in_bytes / shard,
    )


def opaque_kernels(plan, bias_grad: bool = False):
    """Stand-ins for the kernels as XLA sees them compiled on a GPU: each one custom call
    that reads its operands and writes fresh outputs, with no XLA temporaries of its
    own (here a host callback: compiled, never run). The backward's XLA-side prologue
    (the base-2 lse and D) is the real one. Plain attention only (no bias, mask,
    segments or dropout), as ring attention calls them."""
    del plan, bias_grad

    def call(like, *operands):
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in like)
        zeros = lambda *_: tuple(np.zeros(x.shape, x.dtype) for x in shapes)  # noqa: E731
        return jax.pure_callback(zeros, shapes, *operands)

    def forward(q, k, v, q_len, kv_len, *_):
        B, T, N, _ = q.shape
        return call((q, jnp.zeros((B, N, T))), q_len, kv_len, q, k, v)

    def backward(q, k, v, o, lse, do, dlse, q_len, kv_len, *_):
        stats = backward_stats(o, do, lse, dlse)
        return (*call((q, k, v), q_len, kv_len, q, k, v, do, *stats), None)

    return forward, backward


@contextlib.contextmanager
def kernels_opaque():
    """Within: every kernel (ring attention's and flash_attention's) is `opaque_kernels`."""
    saved, vjp._kernels = vjp._kernels, opaque_kernels
    try:
        yield
    finally:
        vjp._kernels = saved


def compiled_memory(sizes: Sizes, seq: int, mesh: Mesh | None, devices, impl) -> dict:
    """(d): one forward+backward compiled for inputs of length `seq` (abstract: nothing is
    allocated), its per-device memory."""
    shape = (sizes.batch, seq, sizes.heads, sizes.head_dim)
    x = jax.ShapeDtypeStruct(shape, jnp.dtype(sizes.dtype), sharding=place(mesh, devices))
    compiled = jax.jit(fwd_bwd(attention(mesh, impl))).lower(x, x, x, x).compile()
    m = compiled.memory_analysis()
    return dict(
        seq=seq,
        **{"pass": "fwd+bwd"},
        argument_bytes=m.argument_size_in_bytes,
        output_bytes=m.output_size_in_bytes,
        **memory(compiled, shard_bytes(sizes, seq, mesh)),
    )


def long_run(sizes: Sizes, seq: int, mesh: Mesh | None, devices, impl) -> dict:
    """(c): one compiled forward+backward at `seq`: time, memory, or the OOM."""
    row = dict(seq=seq, **{"pass": "fwd+bwd"}, ms=None, tflops=None, oom=False, error=None)
    try:
        q, k, v, do = inputs(sizes, seq, place(mesh, devices))
        compiled = jax.jit(fwd_bwd(attention(mesh, impl))).lower(q, k, v, do).compile()
        row.update(memory(compiled, shard_bytes(sizes, seq, mesh)))
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, do))
        seconds = time.perf_counter() - t0
        row.update(ms=seconds * 1e3, tflops=flops(sizes, seq, "fwd+bwd") / seconds / 1e12)
    except Exception as e:  # noqa: BLE001 - running out of memory is the result sought
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        row.update(oom="RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower(), error=msg)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSONL file to append to")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument(
        "--impl", default=None, choices=["triton", "xla_blockwise"], help="per-shard kernel"
    )
    parser.add_argument(
        "--long",
        default="",
        help="comma-separated sequence lengths for part (c), e.g. 1048576,2097152",
    )
    parser.add_argument(
        "--memory",
        default="",
        help="comma-separated sequence lengths for part (d), compiled only, e.g. 1048576",
    )
    parser.add_argument(
        "--opaque", action="store_true", help="part (d) with the kernels as opaque calls"
    )
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--run-id", default=None)
    args = parser.parse_args(argv)

    sizes = TINY if args.tiny else FULL
    devices = jax.devices()
    if len(devices) < 2:
        parser.error(f"needs 2 devices, found {len(devices)} (on CPU: XLA_FLAGS=...count=2)")
    mesh = Mesh(np.array(devices[:2]), (AXIS,))
    run_id = args.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    base = dict(
        run_id=run_id,
        suite="ring",
        **environment(args.commit),
        impl=args.impl or ("triton" if jax.default_backend() == "gpu" else "xla_blockwise"),
        opaque_kernels=args.opaque,
        batch=sizes.batch,
        heads=sizes.heads,
        kv_heads=sizes.heads,
        head_dim=sizes.head_dim,
        dtype=sizes.dtype,
        causal=True,
    )
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - appended row by row

    def emit(**row):
        row = dict(base, **row)
        print(json.dumps({k: v for k, v in row.items() if k not in base}), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
        return row

    if not args.skip_check:
        emit(kind="check", devices=2, **check(sizes, mesh, devices, args.impl))
    if not args.skip_time:
        single = timing(sizes, None, devices, args.impl)
        ring = timing(sizes, mesh, devices, args.impl)
        for row in single:
            emit(kind="time", devices=1, **row)
        for row, alone in zip(ring, single):
            emit(kind="time", devices=2, speedup=alone["ms"] / row["ms"], **row)
    for seq in [int(s) for s in args.long.split(",") if s]:
        emit(kind="long", devices=2, **long_run(sizes, seq, mesh, devices, args.impl))
        emit(kind="long", devices=1, **long_run(sizes, seq, None, devices, args.impl))
    with kernels_opaque() if args.opaque else contextlib.nullcontext():
        for seq in [int(s) for s in args.memory.split(",") if s]:
            ring = compiled_memory(sizes, seq, mesh, devices, args.impl)
            emit(kind="memory", devices=2, **ring)
            one = compiled_memory(sizes, seq // 2, None, devices, args.impl)
            emit(kind="memory", devices=1, **one)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
