"""Bad input raises a clear error naming the argument, before anything is traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import BlockSparse, TritonConfig, flash_attention

B, T, S, N, K, H = 2, 8, 12, 4, 2, 16


def qkv(dtype=jnp.float32, q_shape=(B, T, N, H), kv_shape=(B, S, K, H)):
    return (jnp.ones(q_shape, dtype), jnp.ones(kv_shape, dtype), jnp.ones(kv_shape, dtype))


def expect(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        flash_attention(*args, **kwargs)


@pytest.mark.parametrize("name,pos", [("query", 0), ("key", 1), ("value", 2)])
def test_wrong_rank(name, pos):
    args = list(qkv())
    args[pos] = args[pos][0]
    expect(ValueError, f"{name} must have rank 4", *args)


def test_batch_mismatch():
    q, k, v = qkv(kv_shape=(B + 1, S, K, H))
    expect(ValueError, "batch mismatch: query has batch 2, key/value 3", q, k, v)


def test_key_value_length_mismatch():
    q, k, _ = qkv()
    v = jnp.ones((B, S + 1, K, H))
    expect(ValueError, "key and value must have the same shape", q, k, v)


def test_head_dim_mismatch():
    q, k, v = qkv(kv_shape=(B, S, K, H + 1))
    expect(ValueError, "head_dim mismatch: query has 16, key/value 17", q, k, v)


def test_heads_not_divisible():
    q, k, v = qkv(kv_shape=(B, S, 3, H))
    expect(
        ValueError,
        r"query heads \(4\) must be a multiple of the number of key/value "
        r"heads \(3\)",
        q,
        k,
        v,
    )


def test_head_dim_too_large():
    q, k, v = qkv(q_shape=(1, 4, 1, 257), kv_shape=(1, 4, 1, 257))
    expect(ValueError, r"head_dim=257 must be in \[1, 256\]", q, k, v)


def test_non_float_dtype():
    q, k, v = qkv()
    expect(
        TypeError,
        "query.dtype must be bfloat16, float16 or float32, got int32",
        q.astype(jnp.int32),
        k,
        v,
    )


def test_mixed_dtypes():
    q, k, v = qkv()
    expect(TypeError, "query, key and value must have the same dtype", q.astype(jnp.bfloat16), k, v)


def test_lengths_wrong_shape():
    expect(
        ValueError,
        r"query_seq_lengths must have shape \(batch,\) = \(2,\), got \(3,\)",
        *qkv(),
        query_seq_lengths=jnp.array([1, 2, 3]),
    )
    expect(
        ValueError,
        r"key_value_seq_lengths must have shape \(batch,\)",
        *qkv(),
        key_value_seq_lengths=jnp.ones((B, 1), jnp.int32),
    )


def test_lengths_wrong_dtype():
    expect(
        TypeError,
        "key_value_seq_lengths must be an integer array, got float32",
        *qkv(),
        key_value_seq_lengths=jnp.array([1.0, 2.0]),
    )


def test_lengths_not_an_array():
    expect(
        TypeError, "query_seq_lengths must be an array, got list", *qkv(), query_seq_lengths=[1, 2]
    )


def test_unknown_implementation():
    expect(
        ValueError,
        r"implementation must be one of \('mosaic', 'triton', 'xla_blockwise', 'xla'\)",
        *qkv(),
        implementation="cudnn",
    )


def test_scale_must_be_static():
    expect(TypeError, "scale must be a Python float", *qkv(), scale=jnp.float32(0.1))


def test_bottom_right_alone_is_rejected():
    expect(
        ValueError,
        "causal_alignment='bottom_right' needs is_causal=True",
        *qkv(),
        causal_alignment="bottom_right",
    )


def test_bad_window():
    expect(
        ValueError,
        "local_window_size must be a non-negative int",
        *qkv(),
        local_window_size=(-1, 2),
    )


def test_bad_mask_and_bias():
    expect(TypeError, "mask must be a boolean array", *qkv(), mask=jnp.ones((1, 1, T, S)))
    expect(
        ValueError, "bias must have rank 4 and broadcast", *qkv(), bias=jnp.ones((1, 1, T, S + 1))
    )


def test_single_segment_ids_need_self_attention():
    expect(
        ValueError,
        "a single segment_ids array needs T == S",
        *qkv(),
        segment_ids=jnp.zeros((B, T), jnp.int32),
    )


def test_config_for_the_wrong_backend():
    expect(
        TypeError,
        "config for implementation 'xla' must be None, got TritonConfig",
        *qkv(),
        implementation="xla",
        config=TritonConfig(),
    )


def test_bad_soft_cap():
    expect(
        ValueError, "logits_soft_cap must be a positive finite float", *qkv(), logits_soft_cap=0.0
    )


def test_default_falls_back_to_xla_for_later_features():
    """implementation=None serves the call with the first backend that can: on CPU,
    block sparsity is not in xla_blockwise, so the reference serves it."""
    q, k, v = qkv()
    sparse = BlockSparse(jnp.ones((1, 1), bool), 16, 16)
    got = flash_attention(q, k, v, block_sparse=sparse)
    want = flash_attention(q, k, v, block_sparse=sparse, implementation="xla")
    np.testing.assert_array_equal(got, want)


def test_errors_come_before_tracing():
    """Inside jit the checks see tracers' shapes and still raise the same error."""
    q, k, v = qkv(kv_shape=(B, S, 3, H))
    with pytest.raises(ValueError, match="must be a multiple of the number of key/value"):
        jax.jit(flash_attention)(q, k, v)


def test_dropout_arguments():
    expect(
        ValueError,
        r"dropout_rate must be in \[0, 1\), got 1.0",
        *qkv(),
        dropout_rate=1.0,
        dropout_rng=jax.random.key(0),
    )
    expect(ValueError, "dropout_rate=0.1 needs dropout_rng", *qkv(), dropout_rate=0.1)
    expect(
        ValueError,
        "dropout_rng was given but dropout_rate is 0",
        *qkv(),
        dropout_rng=jax.random.key(0),
    )
    expect(
        TypeError,
        "dropout_rng must be a JAX PRNG key",
        *qkv(),
        dropout_rate=0.1,
        dropout_rng=jnp.zeros((3,), jnp.int32),
    )
    expect(
        TypeError,
        "dropout_rate must be a Python float",
        *qkv(),
        dropout_rate=jnp.float32(0.1),
        dropout_rng=jax.random.key(0),
    )


@pytest.mark.parametrize(
    "arg,match",
    [
        ("q_seg", r"segments\[0\] \(query ids\) must have shape \(2, 8\), got \(1, 8\)"),
        ("kv_seg", r"segments\[1\] \(key ids\) must have shape \(2, 16\), got \(2, 8\)"),
        ("kv_len", r"kv_len must have shape \(2,\), got \(1,\)"),
    ],
    ids=["q_seg", "kv_seg", "kv_len"],
)
@pytest.mark.parametrize("kernel", ["forward", "backward"])
@pytest.mark.parametrize("family", ["triton", "mosaic"])
def test_backend_functions_check_shapes(family, kernel, arg, match):
    """Each kernel family's forward and backward check the lengths' and segment ids'
    shapes themselves (masks.check_shapes), before tracing: called directly (tests,
    benchmarks), ids of batch 1 against a batch of 2 used to broadcast and run."""
    from pallas_flash import configs, masks
    from pallas_flash.mosaic import backward as mosaic_backward
    from pallas_flash.mosaic import forward as mosaic_forward
    from pallas_flash.mosaic.bwd_config import MosaicBwdConfig
    from pallas_flash.mosaic.config import MosaicConfig
    from pallas_flash.triton import backward as triton_backward
    from pallas_flash.triton import forward as triton_forward

    q, k = jnp.ones((2, 8, 2, 64), jnp.bfloat16), jnp.ones((2, 16, 2, 64), jnp.bfloat16)
    good = dict(
        q_seg=jnp.zeros((2, 8), jnp.int32),
        kv_seg=jnp.zeros((2, 16), jnp.int32),
        q_len=jnp.full((2,), 8, jnp.int32),
        kv_len=jnp.full((2,), 16, jnp.int32),
    )
    bad = {"q_seg": (1, 8), "kv_seg": (2, 8), "kv_len": (1,)}[arg]
    a = {**good, arg: jnp.zeros(bad, jnp.int32)}
    lens_segs = (a["q_len"], a["kv_len"], (a["q_seg"], a["kv_seg"]))
    common = dict(spec=masks.MaskSpec(segments=True), scale=1.0, interpret=True)
    fwd, bwd = {
        "triton": (triton_forward.forward, triton_backward.backward),
        "mosaic": (mosaic_forward.forward, mosaic_backward.backward),
    }[family]
    fwd_config, bwd_config = {
        "triton": (configs.TritonConfig(), configs.TritonBwdConfig()),
        "mosaic": (MosaicConfig(), MosaicBwdConfig()),
    }[family]
    with pytest.raises(ValueError, match=match):
        if kernel == "forward":
            fwd(q, k, k, *lens_segs, config=fwd_config, **common)
        else:
            lse = jnp.zeros((2, 2, 8), jnp.float32)
            bwd(q, k, k, q, lse, q, None, *lens_segs, config=bwd_config, **common)
