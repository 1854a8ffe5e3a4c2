"""Runs a case through an implementation and through the reference, forward and backward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flash import dropout, flash_attention, masks, reference
from tests.cases import Case

# The arguments of flash_attention that Case.kwargs gives as arrays (the rest are static).
_ARRAY_KWARGS = (
    "query_seq_lengths",
    "key_value_seq_lengths",
    "segment_ids",
    "dropout_rng",
    "mask",
)


def run_impl(case: Case, impl: str, seed: int = 0, **extra):
    """(o, lse [B, N, T], dq, dk, dv) of `impl`, with random cotangents for o and lse.

    Forward and backward in one jitted program: eager, every op around the kernels
    compiles on its own for each new shape, which on CPU (interpret mode) costs more
    than the program. The inputs are made eagerly, as run_references makes them."""
    q, k, v, do = case.inputs(seed)
    dlse = _lse_cotangent(case, seed)
    bias = case.bias_array(seed)
    kw = case.kwargs()
    arrays = {name: kw.pop(name) for name in _ARRAY_KWARGS}
    static = tuple(sorted((kw | extra | dict(implementation=impl)).items()))
    return _run_impl(static, q, k, v, do, dlse, bias, arrays)


@functools.partial(jax.jit, static_argnums=0)
def _run_impl(static, q, k, v, do, dlse, bias, arrays):
    def f(q, k, v, *bias):
        o, lse = flash_attention(q, k, v, *bias, return_residual=True, **dict(static), **arrays)
        return o, jnp.swapaxes(lse, 1, 2)

    args = (q, k, v) if bias is None else (q, k, v, bias)
    (o, lse), vjp = jax.vjp(f, *args)
    return (o, lse, *vjp((do, jnp.where(jnp.isfinite(lse), dlse, 0.0))))


def run_reference(case: Case, seed: int = 0, *, upcast: bool):
    """The same through reference.py: float32 truth (upcast) or naive in case.dtype."""
    return run_references(case, seed)[0 if upcast else 1]


@functools.cache
def run_references(case: Case, seed: int = 0):
    """(float32 truth, naive in case.dtype) through reference.py, each (o, lse, dq, dk, dv
    [, dbias]): both in one jitted program (eager, op by op, compiles each op of each new
    shape: slower on CPU than the program), and kept for the next test of the case."""
    q, k, v, do = case.inputs(seed)
    dlse = _lse_cotangent(case, seed)
    bias = case.bias_array(seed)
    kw = case.kwargs()
    spec = masks.MaskSpec(
        causal=case.causal, bottom_right=case.bottom_right, local_window=case.window
    )
    seeds = dropout.seeds_from_key(kw["dropout_rng"]) if case.dropout else None

    def one(q, k, v, do, dlse, bias, *, upcast):
        if upcast:
            q, k, v, do = (x.astype(jnp.float32) for x in (q, k, v, do))
            bias = None if bias is None else bias.astype(jnp.float32)

        def f(q, k, v, *bias):
            return reference.attention(
                q,
                k,
                v,
                bias[0] if bias else None,
                kw["mask"],
                scale=case.head_dim**-0.5,
                mask_spec=spec,
                upcast=upcast,
                query_seq_lengths=kw["query_seq_lengths"],
                key_value_seq_lengths=kw["key_value_seq_lengths"],
                segment_ids=kw["segment_ids"],
                dropout_rate=case.dropout,
                dropout_seeds=seeds,
                logits_soft_cap=case.softcap,
            )

        args = (q, k, v) if bias is None else (q, k, v, bias)
        (o, lse), vjp = jax.vjp(f, *args)
        return (o, lse, *vjp((do.astype(o.dtype), jnp.where(jnp.isfinite(lse), dlse, 0.0))))

    @jax.jit
    def both(q, k, v, do, dlse, bias):
        return tuple(one(q, k, v, do, dlse, bias, upcast=u) for u in (True, False))

    return both(q, k, v, do, dlse, bias)


def _lse_cotangent(case: Case, seed: int):
    key = jax.random.PRNGKey(seed + 1000)
    return jax.random.normal(key, (case.batch, case.heads, case.seq_q), jnp.float32)
