"""The public entry point: `flash_attention`, a drop-in for `jax.nn.dot_product_attention`.

It validates every argument in Python (shapes and dtypes only, so it works on tracers
and raises before anything is traced), builds a static `vjp.Plan` and dispatches:

* `"triton"`: Pallas kernels lowered through Triton (GPUs of compute capability >= 8.0;
  on CPU they run in Pallas's interpret mode, slowly, for testing).
* `"xla_blockwise"`: the same tiled algorithm in plain JAX; linear memory anywhere.
* `"xla"`: the reference (`reference.py`); quadratic memory, every feature.
* `None`: the first of those, in that order, that can serve the call on this device.
  A backend named explicitly either serves the call or raises NotImplementedError.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from pallas_flash import configs, dropout, masks, reference, sparsity, vjp
from pallas_flash.logits import Logits
from pallas_flash.mosaic import support as mosaic_support
from pallas_flash.sparsity import BlockSparse

IMPLEMENTATIONS = ("mosaic", "triton", "xla_blockwise", "xla")
# What implementation=None tries on a GPU, in order: the first that can serve the call.
# "mosaic" needs a Hopper GPU (sm_90), 16-bit inputs and no bias, mask, dropout, soft cap
# or block sparsity; elsewhere "triton" serves. On the H200, forward + backward, Mosaic
# runs 1.1-1.2x our Triton path at head dim 64 from 1k (0.90x causal at 512, 0.98-0.99x
# causal at 1k), 1.2-1.3x at 128 and 1.9-2.7x at 256 (benchmarks/results/fa-a8d81d9/,
# mosaic-e5ca198/), and its compiled tests pass (README: Correctness, compiled).
AUTO_GPU = ("mosaic", "triton", "xla_blockwise", "xla")
# The config types each implementation takes (forward, backward).
CONFIG_TYPES = {
    "mosaic": (configs.MosaicConfig, configs.MosaicBwdConfig),
    "triton": (configs.TritonConfig, configs.TritonBwdConfig),
    "xla_blockwise": (configs.BlockwiseConfig, configs.BlockwiseConfig),
    "xla": (type(None), type(None)),
}
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MAX_HEAD_DIM = 256


def flash_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K H"],
    bias: Float[Array, "#B #N #T #S"] | None = None,
    mask: Bool[Array, "#B #N #T #S"] | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    query_seq_lengths: Int[Array, " B"] | None = None,
    key_value_seq_lengths: Int[Array, " B"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: Int[Array, "B T"] | tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    block_sparse: BlockSparse | None = None,
    implementation: Literal["mosaic", "triton", "xla_blockwise", "xla"] | None = None,
    return_residual: bool = False,
    config: configs.TritonConfig | configs.MosaicConfig | configs.BlockwiseConfig | None = None,
    backward_config: (
        configs.TritonBwdConfig | configs.MosaicBwdConfig | configs.BlockwiseConfig | None
    ) = None,
):
    """Exact scaled dot-product attention with linear memory (FlashAttention).

    softmax(scale * Q K^T + bias, masked) V for each head, with the shapes and meaning of
    `jax.nn.dot_product_attention`. Query head n uses key/value head n // (N // K), so
    GQA and MQA need no repeated K/V.

    Causal masking (`is_causal=True`) follows jax.nn: query i attends keys j <= i
    ("top_left"). For KV-cache decoding, where the T queries are the last T of the S
    keys, pass `causal_alignment="bottom_right"`: query i attends keys
    j <= i + (S_b - T_b), with S_b and T_b the valid lengths of batch element b:

        is_causal, T=2, S=4:     top_left        bottom_right
                                 k0 k1 k2 k3     k0 k1 k2 k3
                             q0   x  .  .  .      x  x  x  .
                             q1   x  x  .  .      x  x  x  x

    Padding: with `query_seq_lengths` / `key_value_seq_lengths`, keys at or past the
    length are masked out and query rows at or past it are padding:

        T=S=4, query_seq_lengths=[3], key_value_seq_lengths=[2]
             k0 k1 k2 k3
        q0    x  x  .  .
        q1    x  x  .  .
        q2    x  x  .  .
        q3    .  .  .  .     <- padding row: output 0, logsumexp -inf

    Fully masked query rows (padding rows, a zero key length, or bottom-right causal
    rows with no key at or before them) give output 0, logsumexp -inf, and gradient 0:
    never NaN. (jax.nn's "xla" path instead averages V over such rows.)

    Args:
      query: [B, T, N, H] bfloat16, float16 or float32; H <= 256.
      key: [B, S, K, H], same dtype, N % K == 0.
      value: [B, S, K, H], same dtype and shape as key.
      bias: additive, broadcastable to [B, N, T, S] (e.g. ALiBi [1, N, T, S]); read in
        tiles, never expanded; differentiable (its gradient is dS summed over the
        broadcast dims).
      mask: boolean, broadcastable to [B, N, T, S], True = attend; read in tiles.
      scale: the softmax scale; default 1 / sqrt(H).
      is_causal: apply a causal mask, skipping the tiles above the diagonal.
      causal_alignment: "top_left" (jax.nn's) or "bottom_right" (see above).
      query_seq_lengths: int [B], valid query lengths.
      key_value_seq_lengths: int [B], valid key/value lengths.
      local_window_size: an int w (= (w, w)) or (left, right): query i attends keys
        within [diag - left, diag + right] of its diagonal (jax.nn's meaning, with the
        diagonal aligned as `causal_alignment` says); tiles outside are skipped.
      segment_ids: [B, T] ids for self-attention, or a pair ([B, T], [B, S]); a query
        attends only keys with its own id (packed sequences). With non-decreasing ids
        the tiles between documents are skipped; other ids are masked tile by tile.
      block_sparse: a `BlockSparse` layout (block-sparse FlashAttention): only the listed
        (query block, key block) tiles are computed, forward and backward; the kernels'
        tiles divide the layout's blocks. "triton" and "xla" serve it.
      logits_soft_cap: if set, scores become cap * tanh(scores / cap) after scale and
        bias (Gemma-2 style), with the matching backward.
      dropout_rate: probability of dropping each attention probability (kept ones are
        scaled by 1 / (1 - rate)); fused in the kernels, the mask is never stored.
      dropout_rng: a JAX PRNG key; the same key gives the same mask, in the forward and
        the backward pass alike. Needed when dropout_rate > 0, refused otherwise.
      implementation: "mosaic" (Hopper), "triton", "xla_blockwise", "xla", or None for
        the best available: on a GPU the first of `AUTO_GPU` that serves the call
        ("mosaic" on Hopper, else "triton") and takes the configs given; on CPU
        "xla_blockwise".
      return_residual: also return the logsumexp, [B, T, N] float32 (differentiable).
      config: tile config of the forward pass (`TritonConfig` for "triton",
        `MosaicConfig` for "mosaic", `BlockwiseConfig` for "xla_blockwise"); None picks
        the default table's row.
      backward_config: tile config of the backward pass, likewise (`TritonBwdConfig`,
        `MosaicBwdConfig`, `BlockwiseConfig`).

    Returns:
      The output [B, T, N, H] in query's dtype, and with `return_residual` also the
      logsumexp [B, T, N] float32.

    Raises:
      TypeError: an argument has the wrong type or dtype.
      ValueError: an argument has the wrong shape or value.
      NotImplementedError: the named implementation cannot serve this call (the
        message says why); with implementation=None only when none can.
    """
    call = _validate(
        query,
        key,
        value,
        bias,
        mask,
        scale,
        is_causal,
        causal_alignment,
        query_seq_lengths,
        key_value_seq_lengths,
        local_window_size,
        segment_ids,
        implementation,
        return_residual,
    )
    dropout_rate = _validate_dropout(dropout_rate, dropout_rng)
    call.update(dtype=query.dtype, head_dim=query.shape[-1], dropout=dropout_rate > 0)
    call.update(bias=bias is not None, mask=mask is not None)
    call["softcap"] = _validate_softcap(logits_soft_cap)
    call["sparse"] = _validate_sparse(block_sparse, query.shape, key.shape)
    if call["sparse"] is not None:
        call["spec"] = dataclasses.replace(
            call["spec"],
            sparse_per_head=call["sparse"].layout.shape[0] > 1,
            sparse_block=(call["sparse"].block_q, call["sparse"].block_kv),
        )
    seeds = None if dropout_rate == 0 else dropout.seeds_from_key(dropout_rng)
    backend = _choose_backend(call, implementation, config, backward_config)
    _check_configs(backend, config, backward_config)

    if backend == "xla":
        if call["sparse"] is not None:  # the layout means this element mask
            dense = sparsity.dense_mask(call["sparse"], query.shape[1], key.shape[1])[None]
            mask = dense if mask is None else mask & dense
        out, lse = reference.attention(
            query,
            key,
            value,
            bias,
            mask,
            scale=call["scale"],
            mask_spec=call["spec"],
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            segment_ids=call["segment_ids"],
            dropout_rate=dropout_rate,
            dropout_seeds=seeds,
            logits_soft_cap=call["softcap"],
        )
        out = out.astype(query.dtype)
    else:
        B, T, _, H = query.shape
        S = key.shape[1]
        if backend == "mosaic":
            fwd = config or configs.default_mosaic_config(H, S, call["spec"].causal)
            bwd = backward_config or configs.default_mosaic_bwd_config(H, call["spec"].causal)
        elif backend == "triton":
            fwd = config or configs.default_triton_config(H, query.dtype)
            bwd = backward_config or configs.default_triton_bwd_config(H, query.dtype)
            if call["sparse"] is not None:
                fwd, bwd = _sparse_configs(call["sparse"], fwd, bwd, config, backward_config)
        else:
            fwd = config or configs.BlockwiseConfig()
            bwd = backward_config or fwd
        plan = vjp.Plan(
            dropout_rate=dropout_rate,
            backend=backend,
            spec=call["spec"],
            scale=call["scale"],
            fwd_config=fwd,
            bwd_config=bwd,
            interpret=backend in ("triton", "mosaic") and _platform() != "gpu",
            logits=Logits(
                bias_dims=_full_dims(bias, (B, query.shape[2], T, S)),
                mask_dims=_full_dims(mask, (B, query.shape[2], T, S)),
                softcap=call["softcap"],
            ),
        )
        q_len, kv_len = masks.lengths_or_full(query_seq_lengths, key_value_seq_lengths, B, T, S)
        segments = call["segment_ids"]
        if segments is not None:
            segments = tuple(x.astype(jnp.int32) for x in segments)
        layout = None if call["sparse"] is None else call["sparse"].layout
        out, lse = vjp.attention(
            plan,
            query,
            key,
            value,
            q_len,
            kv_len,
            segments,
            seeds,
            bias,
            vjp.kernel_mask(plan, mask),
            layout,
        )
    if return_residual:
        return out, jnp.swapaxes(lse, 1, 2)  # [B, N, T] -> [B, T, N], as jax.nn
    return out


def _shape_of(x, name: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _validate(
    query,
    key,
    value,
    bias,
    mask,
    scale,
    is_causal,
    causal_alignment,
    q_lens,
    kv_lens,
    window,
    segment_ids,
    implementation,
    return_residual,
):
    """Checks every argument before tracing; returns the static facts of the call."""
    qs, ks, vs = _shape_of(query, "query"), _shape_of(key, "key"), _shape_of(value, "value")
    for name, shape in (("query", qs), ("key", ks), ("value", vs)):
        if len(shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {shape}"
            )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name}.dtype must be bfloat16, float16 or float32, got {jnp.dtype(x.dtype)}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "query, key and value must have the same dtype, got "
            f"{query.dtype=}, {key.dtype=}, {value.dtype=}"
        )
    B, T, N, H = qs
    _, S, K, _ = ks
    if ks != vs:
        raise ValueError(f"key and value must have the same shape, got {ks=} and {vs=}")
    if ks[0] != B:
        raise ValueError(f"batch mismatch: query has batch {B}, key/value {ks[0]}")
    if ks[3] != H:
        raise ValueError(f"head_dim mismatch: query has {H}, key/value {ks[3]}")
    if H < 1 or H > MAX_HEAD_DIM:
        raise ValueError(f"head_dim={H} must be in [1, {MAX_HEAD_DIM}]")
    if K < 1 or N % K:
        raise ValueError(
            f"the number of query heads ({N}) must be a multiple of the "
            f"number of key/value heads ({K})"
        )
    if T < 1 or S < 1:
        raise ValueError(f"sequence lengths must be >= 1, got query {T}, key/value {S}")

    if scale is None:
        scale = 1.0 / math.sqrt(H)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"scale must be a Python float (static), got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}"
        )
    if causal_alignment == "bottom_right" and not is_causal and window is None:
        raise ValueError(
            "causal_alignment='bottom_right' needs is_causal=True or a "
            "local_window_size; alone it would be ignored"
        )

    for name, lengths in (("query_seq_lengths", q_lens), ("key_value_seq_lengths", kv_lens)):
        if lengths is None:
            continue
        if _shape_of(lengths, name) != (B,):
            raise ValueError(
                f"{name} must have shape (batch,) = ({B},), got {tuple(lengths.shape)}"
            )
        if not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {lengths.dtype}")

    if window is not None:
        if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
            window = (int(window), int(window))
        if (
            not isinstance(window, tuple)
            or len(window) != 2
            or not all(isinstance(w, (int, np.integer)) and w >= 0 for w in window)
        ):
            raise ValueError(
                "local_window_size must be a non-negative int or a pair "
                f"(left, right) of them, got {window!r}"
            )
        window = (int(window[0]), int(window[1]))

    if bias is not None:
        _check_broadcast("bias", bias, (B, N, T, S))
        if jnp.dtype(bias.dtype) not in _FLOAT_DTYPES:
            raise TypeError(f"bias must be a float array, got {bias.dtype}")
    if mask is not None:
        _check_broadcast("mask", mask, (B, N, T, S))
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be a boolean array, got {mask.dtype}")

    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(
                    "segment_ids must be one [B, T] array or a pair "
                    "(query_segment_ids [B, T], kv_segment_ids [B, S])"
                )
            q_seg, kv_seg = segment_ids
        else:
            if T != S:
                raise ValueError(
                    f"a single segment_ids array needs T == S (got {T=}, "
                    f"{S=}); pass (query_segment_ids, kv_segment_ids)"
                )
            q_seg = kv_seg = segment_ids
        for name, ids, want in (
            ("query segment_ids", q_seg, (B, T)),
            ("key/value segment_ids", kv_seg, (B, S)),
        ):
            if _shape_of(ids, name) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(ids.shape)}")
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
        segment_ids = (q_seg, kv_seg)

    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}"
        )
    if not isinstance(return_residual, (bool, np.bool_)):
        raise TypeError(f"return_residual must be a bool, got {type(return_residual).__name__}")

    spec = masks.MaskSpec(
        causal=bool(is_causal),
        bottom_right=causal_alignment == "bottom_right",
        local_window=window,
        segments=segment_ids is not None,
    )
    return dict(
        scale=float(scale),
        spec=spec,
        segment_ids=segment_ids,
        bias=bias,
        mask=mask,
    )


def _validate_sparse(sparse, q_shape, k_shape):
    """Checks a BlockSparse against the shapes; returns it with layout bool [1 or N, nq, nk]."""
    if sparse is None:
        return None
    if not isinstance(sparse, BlockSparse):
        raise TypeError(
            f"block_sparse must be a pallas_flash.BlockSparse, got {type(sparse).__name__}"
        )
    B, T, N, _ = q_shape
    S = k_shape[1]
    layout = jnp.asarray(sparse.layout)
    if layout.dtype != jnp.bool_:
        raise TypeError(f"block_sparse.layout must be boolean, got {layout.dtype}")
    want = (-(-T // sparse.block_q), -(-S // sparse.block_kv))
    if layout.ndim == 2:
        layout = layout[None]
    if layout.ndim != 3 or tuple(layout.shape[1:]) != want or layout.shape[0] not in (1, N):
        raise ValueError(
            f"block_sparse.layout must have shape {want} or ({N}, *{want}) "
            f"(query blocks of {sparse.block_q}, key blocks of "
            f"{sparse.block_kv}), got {tuple(sparse.layout.shape)}"
        )
    return dataclasses.replace(sparse, layout=layout)


def _sparse_configs(sparse, fwd, bwd, config, backward_config):
    """Kernel tiles must divide the layout's blocks (the kernels restate the layout at
    their own tiles): a tile the caller set must; a default tile shrinks to the block."""
    block = {"q": sparse.block_q, "kv": sparse.block_kv}

    def fit(name, given, cfg):
        tiles = {
            f.name: block[f.name.split("_")[1]]  # block_q, block_kv_dq, ... -> q or kv
            for f in dataclasses.fields(cfg)
            if f.name.startswith("block_")
        }
        for field, size in tiles.items():
            if given is not None and size % getattr(given, field):
                raise ValueError(
                    f"{name}.{field}={getattr(given, field)} must divide the block_sparse "
                    f"block size {size}"
                )
        return dataclasses.replace(cfg, **{f: min(getattr(cfg, f), b) for f, b in tiles.items()})

    return fit("config", config, fwd), fit("backward_config", backward_config, bwd)


def _full_dims(x, full) -> tuple[bool, bool, bool, bool] | None:
    """Which of [B, N, T, S] a broadcastable bias/mask has in full (None if absent)."""
    if x is None:
        return None
    return tuple(d == f for d, f in zip(x.shape, full))


def _validate_softcap(cap) -> float | None:
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.floating)):
        raise TypeError(
            f"logits_soft_cap must be a Python float (static), got {type(cap).__name__}"
        )
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"logits_soft_cap must be a positive finite float, got {cap}")
    return float(cap)


def _validate_dropout(rate, rng) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating)):
        raise TypeError(f"dropout_rate must be a Python float (static), got {type(rate).__name__}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
    if rate > 0 and rng is None:
        raise ValueError(f"dropout_rate={rate} needs dropout_rng, a JAX PRNG key")
    if rate == 0 and rng is not None:
        raise ValueError("dropout_rng was given but dropout_rate is 0; it would be ignored")
    if rng is not None:
        _shape_of(rng, "dropout_rng")
        is_typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
        if not is_typed and (tuple(rng.shape) != (2,) or rng.dtype != jnp.uint32):
            raise TypeError(
                "dropout_rng must be a JAX PRNG key (jax.random.key or "
                f"PRNGKey), got {rng.dtype}{list(rng.shape)}"
            )
    return float(rate)


def _check_broadcast(name, x, full):
    shape = _shape_of(x, name)
    if len(shape) != 4 or any(d not in (1, f) for d, f in zip(shape, full)):
        raise ValueError(
            f"{name} must have rank 4 and broadcast to [B, N, T, S] = "
            f"{list(full)}, got shape {shape}"
        )


def _unsupported(backend: str, call) -> str | None:
    """Why `backend` cannot serve `call` on this device, or None if it can."""
    if backend == "xla":
        return None
    if backend == "xla_blockwise":
        lacks = [
            name for name, present in (("block_sparse", call["sparse"] is not None),) if present
        ]
        if lacks:
            return f"{', '.join(lacks)} not supported by 'xla_blockwise' (use 'triton' or 'xla')"
    if backend == "mosaic":
        if _platform() == "gpu":  # off GPU: Pallas's GPU interpret mode
            reason = mosaic_support.device_unsupported()
            if reason is not None:
                return reason
        return mosaic_support.unsupported(
            call["dtype"],
            call["head_dim"],
            call["spec"],
            segments=call["segment_ids"] is not None,
            dropout=call["dropout"],
            bias=call["bias"],
            mask=call["mask"],
            softcap=call["softcap"] is not None,
        )
    if backend == "triton":
        platform = _platform()
        if platform == "gpu":
            device = jax.devices()[0]
            cc = getattr(device, "compute_capability", None)
            if cc is not None and float(cc) < 8.0:
                return f"'triton' needs compute capability >= 8.0, this GPU has {cc}"
        elif platform != "cpu":
            return f"'triton' runs on NVIDIA GPUs (and in interpret mode on CPU), not {platform}"
    return None


def _platform() -> str:
    return jax.default_backend()


def _choose_backend(call, implementation, config=None, backward_config=None) -> str:
    if implementation is not None:
        reason = _unsupported(implementation, call)
        if reason is not None:
            raise NotImplementedError(reason)
        return implementation
    # On CPU the Triton path would run interpreted (slow): prefer the blockwise scan.
    order = AUTO_GPU if _platform() == "gpu" else ("xla_blockwise", "xla")
    # A config names its family: None picks among the implementations that take it (if
    # none in the order does, the first's type check below says what was expected).
    order = [b for b in order if _takes_configs(b, config, backward_config)] or order
    for backend in order:
        if _unsupported(backend, call) is None:
            return backend
    raise NotImplementedError("no implementation can serve this call")


def _takes_configs(backend, config, backward_config) -> bool:
    return all(
        value is None or isinstance(value, cls)
        for value, cls in zip((config, backward_config), CONFIG_TYPES[backend])
    )


def _check_configs(backend, config, backward_config):
    want = CONFIG_TYPES[backend]
    for name, value, cls in (
        ("config", config, want[0]),
        ("backward_config", backward_config, want[1]),
    ):
        if value is not None and not isinstance(value, cls):
            raise TypeError(
                f"{name} for implementation {backend!r} must be "
                f"{'None' if cls is type(None) else cls.__name__}, "
                f"got {type(value).__name__}"
            )
