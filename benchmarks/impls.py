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
from pallas_flash.mosaic import bwd_config
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
    bwd = bwd_config.fused_mosaic_bwd_config(q.shape[-1])
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


# pallas_flash:mosaic/FIELD=VALUE/...: the Mosaic kernels with some fields of the default
# forward (MosaicConfig) or backward (MosaicBwdConfig) config replaced, so that a default
# and a candidate time side by side in one process (the two configs share no field name).
# A first item `pair` (pallas_flash:mosaic/pair/...) starts the backward from the pair's
# row (pair_mosaic_bwd_config) where the default is the fused kernel (head dim 128,
# not causal), so the pair keeps a name there; a first item `fused` starts it from the
# fused default's row (fused_full_bwd_config) where the default is the pair (causal, or
# head dim 64), so a fused candidate is one name at every point.
VARIANT_BASE = "pallas_flash:mosaic"
PAIR, FUSED = "pair", "fused"


# A variant's word values; none unsets an optional field (rescale_slack=none: the plain
# rescale).
_WORDS = {"true": True, "false": False, "none": None}


def config_overrides(items, classes: dict[str, type], context: str) -> dict[str, dict]:
    """FIELD=VALUE items (VALUE true, false, none or an int) as replacements for the config
    classes' fields, by the key each class has in `classes`: a field several classes
    have (`row_bound_mask`) is set in each; `context` starts the error a bad item raises."""
    fields = {which: {f.name for f in dataclasses.fields(cls)} for which, cls in classes.items()}
    overrides: dict[str, dict] = {which: {} for which in classes}
    for item in items:
        key, sep, value = item.partition("=")
        which = [w for w in fields if key in fields[w]]
        if not sep or not which:
            known = " or ".join(f"{cls.__name__} {sorted(fields[w])}" for w, cls in classes.items())
            raise ValueError(f"{context}: {item!r} is not FIELD=VALUE with a field of {known}")
        if value not in _WORDS and not value.isdigit():
            raise ValueError(f"{context}: {key}={value!r} is not true, false, none or an int")
        for w in which:
            overrides[w][key] = int(value) if value.isdigit() else _WORDS[value]
    return overrides


def _variant_overrides(name: str) -> tuple[str | None, dict[str, dict]]:
    """(the backward row the variant starts from, PAIR, FUSED or None for the default;
    its config fields)."""
    items = name[len(VARIANT_BASE) + 1 :].split("/")
    base = items[0] if items[0] in (PAIR, FUSED) else None
    overrides = config_overrides(
        items[1:] if base else items,
        {"fwd": mosaic_config.MosaicConfig, "bwd": bwd_config.MosaicBwdConfig},
        f"implementation {name!r}",
    )
    return base, overrides


def variant_configs(name: str, head_dim: int, seq_k: int, causal: bool):
    """The (forward, backward) configs a Mosaic variant (`lookup`) runs at this head dim,
    key length and causal flag: the default rows (or the pair's or fused backward) with the
    variant's fields replaced. Raises ValueError for a field no config has, or for a
    combination the configs refuse."""
    base, overrides = _variant_overrides(name)
    fwd = mosaic_config.default_mosaic_config(head_dim, seq_k, causal)
    if base == PAIR:
        bwd = bwd_config.pair_mosaic_bwd_config(head_dim)
    elif base == FUSED:
        bwd = bwd_config.fused_full_bwd_config(head_dim)
    else:
        bwd = bwd_config.default_mosaic_bwd_config(head_dim, causal)
    return (
        dataclasses.replace(fwd, **overrides["fwd"]),
        dataclasses.replace(bwd, **overrides["bwd"]),
    )


def _mosaic_variant(name: str) -> Impl:
    _variant_overrides(name)  # a field no config has fails here, at lookup

    def fn(q, k, v, *, causal, **extra):
        fwd, bwd = variant_configs(name, q.shape[-1], k.shape[1], causal)
        return pallas_flash.flash_attention(
            q,
            k,
            v,
            is_causal=causal,
            implementation="mosaic",
            config=fwd,
            backward_config=bwd,
            **extra,
        )

    return Impl(name, fn, ours=True)


def lookup(name: str) -> Impl:
    """The implementation called `name`: an entry of IMPLS, or a Mosaic config variant
    (`pallas_flash:mosaic/block_q_dkv=128/num_stages_dkv=3`, `pallas_flash:mosaic/pair`,
    `pallas_flash:mosaic/fused/query_rows=true/fa3_order=false/share_halves=false`).
    KeyError if neither."""
    if name in IMPLS:
        return IMPLS[name]
    if name.startswith(VARIANT_BASE + "/"):
        return _mosaic_variant(name)
    raise KeyError(name)


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
