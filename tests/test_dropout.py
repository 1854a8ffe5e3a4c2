"""Fused dropout: the kernels' mask is the reference's, reproducible, and unbiased."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import dropout, flash_attention

IMPLS = [pytest.param("triton", marks=pytest.mark.kernel), "xla_blockwise", "xla"]


def _mask_probe(impl, rate, key, B=2, T=40, S=64, N=4, K=2):
    """Recovers the keep mask an implementation used: with q = 0 every valid key gets
    probability 1/S, and V = identity makes output column j equal keep[i, j] / ((1-rate) S)."""
    q = jnp.zeros((B, T, N, S), jnp.float32)
    k = jax.random.normal(jax.random.PRNGKey(1), (B, S, K, S), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, K, S))
    o = flash_attention(q, k, v, dropout_rate=rate, dropout_rng=key, implementation=impl)
    return np.asarray(o * (1 - rate) * S > 0.5).transpose(0, 2, 1, 3)  # [B, N, T, S]


@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_mask_equals_the_hash(impl):
    rate, key = 0.3, jax.random.key(11)
    got = _mask_probe(impl, rate, key)
    B, N, T, S = got.shape
    batch_head = (jnp.arange(B)[:, None] * N + jnp.arange(N)[None, :])[:, :, None, None]
    want = dropout.keep_mask(
        dropout.seeds_from_key(key),
        batch_head,
        jnp.arange(T)[:, None],
        jnp.arange(S)[None, :],
        rate,
    )
    np.testing.assert_array_equal(got, np.asarray(want))
    assert 0.6 < got.mean() < 0.8  # about 1 - rate of the entries kept


@pytest.mark.parametrize("impl", IMPLS)
def test_same_key_same_result_and_other_key_differs(impl):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (2, 48, 2, 32), jnp.bfloat16) for kk in ks)

    def loss(q, k, v, key):
        o = flash_attention(
            q, k, v, is_causal=True, dropout_rate=0.25, dropout_rng=key, implementation=impl
        )
        return jnp.sum(o.astype(jnp.float32) ** 2)

    # One jitted program, the key an argument (eager, each op compiles on its own).
    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    def grads(key):
        return value_and_grad(q, k, v, key)

    first, again, other = (
        grads(jax.random.key(5)),
        grads(jax.random.key(5)),
        grads(jax.random.key(6)),
    )
    chex.assert_trees_all_equal(first, again)
    assert float(first[0]) != float(other[0])


@pytest.mark.kernel
def test_mean_over_keys_approaches_no_dropout():
    """E[dropout output] = output: over n keys the mean is within 6 standard errors
    (estimated from the same samples) of the no-dropout output, everywhere."""
    n, rate = 256, 0.5
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    q, k, v = (jax.random.normal(kk, (1, 32, 2, 16), jnp.float32) for kk in ks)
    plain = flash_attention(q, k, v, implementation="triton")
    keys = jax.random.split(jax.random.key(9), n)
    samples = jax.vmap(
        lambda key: flash_attention(
            q, k, v, dropout_rate=rate, dropout_rng=key, implementation="triton"
        )
    )(keys)
    mean, sem = samples.mean(0), samples.std(0) / np.sqrt(n)
    z = np.abs(np.asarray(mean - plain)) / np.asarray(sem)
    assert z.max() < 6.0, z.max()
    assert float(jnp.abs(samples - plain).mean()) > 0.05  # dropout really happened
