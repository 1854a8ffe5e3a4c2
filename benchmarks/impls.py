"""Every attention implementation the harness times: ours and the peers, behind one signature.

Each entry turns (q, k, v, causal, **masking arguments) into an output [B, T, N, H];
the masking arguments are flash_attention's names (lengths, segment ids, windows,
masks, dropout, block sparsity). Peers that are not installed or lack an argument
raise; the harness records the error in that row instead of dropping the peer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_flash
from pallas_flash.mosaic import config as mosaic_config


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    fn: Callable  # (q, k, v, *, causal, **masking) -> o
    dtypes: tuple = (jnp.bfloat16, jnp.float16)
    unscaled: bool = False  # computes softmax(Q K^T) with no 1/sqrt(H)
    ours: bool = False


PEER_ARGS = {"query_seq_lengths", "key_value_seq_lengths", "mask", "local_window_size"}


def _only(name: str, extra: dict, allowed=PEER_ARGS) -> None:
    """Peers get only the arguments they have; anything else is a recorded failure."""
    missing = sorted(set(extra) - allowed)
    if missing:
        raise NotImplementedError(f"{name} has no {', '.join(missing)}")


def _ours(backend):
    def fn(q, k, v, *, causal, **extra):
        return pallas_flash.flash_attention(
            q, k, v, is_causal=causal, implementation=backend, **extra
        )

    return fn


def _ours_mosaic_fused(q, k, v, *, causal, **extra):
    """The Mosaic kernels with the fused backward (one kernel, ordered dQ adds): at head
    dim 128 the two consumers split the dQ share's columns, at 64 (128-row query tiles)
    its rows (`fused_mosaic_bwd_config`); above 128 it does not fit, and the row records
    the error."""
    bwd = mosaic_config.fused_mosaic_bwd_config(q.shape[-1])
    return pallas_flash.flash_attention(
        q, k, v, is_causal=causal, implementation="mosaic", backward_config=bwd, **extra
    )


def _jax_nn(backend):
    def fn(q, k, v, *, causal, **extra):
        _only(f"jax.nn:{backend}", extra)
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=backend, **extra
        )

    return fn


def _tokamax(backend):
    def fn(q, k, v, *, causal, **extra):
        _only(f"tokamax:{backend}", extra)
        import tokamax  # imported lazily: only present where the peer wheels were taken

        return tokamax.dot_product_attention(
            q, k, v, is_causal=causal, implementation=backend, **extra
        )

    return fn


def _jax_mosaic_fa3(q, k, v, *, causal, **extra):
    _only("jax:mosaic_fa3", extra, allowed=set())
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    head_dim = q.shape[-1]
    block_kv = 64 if head_dim > 128 else 128
    config = attention_mgpu.TuningConfig(
        block_q=64,
        block_kv=block_kv,
        max_concurrent_steps=2,
        causal=causal,
        block_q_dkv=64,
        block_kv_dkv=64,
        block_q_dq=64,
        block_kv_dq=64,
    )
    return attention_mgpu.attention(q, k, v, config)


IMPLS: dict[str, Impl] = {
    impl.name: impl
    for impl in [
        Impl(
            "pallas_flash:triton",
            _ours("triton"),
            dtypes=(jnp.bfloat16, jnp.float16, jnp.float32),
            ours=True,
        ),
        # Named with --impls until its compiled tests pass (a barrier bug would hang a suite).
        Impl("pallas_flash:mosaic", _ours("mosaic"), ours=True),
        # Likewise until the fused kernel's compiled tests pass (an ordering bug would hang).
        Impl("pallas_flash:mosaic-fused", _ours_mosaic_fused, ours=True),
        Impl(
            "pallas_flash:xla_blockwise",
            _ours("xla_blockwise"),
            dtypes=(jnp.bfloat16, jnp.float16, jnp.float32),
            ours=True,
        ),
        Impl("jax.nn:xla", _jax_nn("xla"), dtypes=(jnp.bfloat16, jnp.float16, jnp.float32)),
        Impl("jax.nn:cudnn", _jax_nn("cudnn")),
        Impl("tokamax:mosaic", _tokamax("mosaic")),
        Impl("tokamax:triton", _tokamax("triton")),
        Impl("jax:mosaic_fa3", _jax_mosaic_fa3, dtypes=(jnp.float16,), unscaled=True),
    ]
}


def reference_fn(unscaled: bool):
    """The float32 oracle with the scale the implementation uses."""

    def fn(q, k, v, *, causal, **extra):
        scale = 1.0 if unscaled else None
        return pallas_flash.flash_attention(
            q.astype(jnp.float32),
            k.astype(jnp.float32),
            v.astype(jnp.float32),
            scale=scale,
            is_causal=causal,
            implementation="xla",
            **extra,
        )

    return fn
