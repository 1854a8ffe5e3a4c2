"""flash_attention composes with jit, grad, vmap, checkpoint and mixed-precision training."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_flash import flash_attention

IMPLS = [pytest.param("triton", marks=pytest.mark.kernel), "xla_blockwise"]


def _inputs(shape_q=(2, 40, 4, 32), shape_kv=(2, 56, 2, 32), dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        jax.random.normal(ks[0], shape_q, dtype),
        jax.random.normal(ks[1], shape_kv, dtype),
        jax.random.normal(ks[2], shape_kv, dtype),
    )


def _loss(impl):
    def loss(q, k, v):
        o = flash_attention(q, k, v, is_causal=True, implementation=impl)
        return jnp.sum(jnp.sin(o.astype(jnp.float32)))

    return loss


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_and_grad_match_reference(impl):
    q, k, v = _inputs()
    got = jax.jit(jax.value_and_grad(_loss(impl), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(_loss("xla"), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_an_extra_leading_axis(impl):
    q, k, v = _inputs((3, 2, 24, 2, 16), (3, 2, 40, 1, 16))
    f = jax.vmap(lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation=impl))
    got = f(q, k, v)
    want = jnp.stack(
        [flash_attention(q[i], k[i], v[i], is_causal=True, implementation="xla") for i in range(3)]
    )
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
    g = jax.grad(lambda q: jnp.sum(f(q, k, v) ** 2))(q)
    g_ref = jax.grad(
        lambda q: jnp.sum(
            jax.vmap(
                lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation="xla")
            )(q, k, v)
            ** 2
        )
    )(q)
    chex.assert_trees_all_close(g, g_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_checkpoint(impl):
    q, k, v = _inputs()
    got = jax.grad(jax.checkpoint(_loss(impl)), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(_loss("xla"), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_mixed_precision_training(impl):
    """float32 master weights, bfloat16 compute: loss falls and matches the reference."""
    d, heads, hd, seq = 64, 4, 16, 48
    key = jax.random.PRNGKey(0)
    params = {
        "qkv": jax.random.normal(key, (d, 3 * d), jnp.float32) * d**-0.5,
        "out": jax.random.normal(jax.random.fold_in(key, 1), (d, d), jnp.float32) * d**-0.5,
    }
    x = jax.random.normal(jax.random.fold_in(key, 2), (2, seq, d), jnp.float32)
    target = jnp.roll(x, 1, axis=1)

    def loss_fn(params, impl):
        p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
        h = x.astype(jnp.bfloat16) @ p["qkv"]
        q, k, v = (t.reshape(2, seq, heads, hd) for t in jnp.split(h, 3, axis=-1))
        o = flash_attention(q, k, v, is_causal=True, implementation=impl)
        y = o.reshape(2, seq, d) @ p["out"]
        return jnp.mean((y.astype(jnp.float32) - target) ** 2)

    opt = optax.adamw(3e-3)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params, impl)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, grads

    _, ref_grads = jax.value_and_grad(loss_fn)(params, "xla")
    state = opt.init(params)
    losses = []
    for i in range(30):
        new_params, state, loss, grads = step(params, state)
        if i == 0:  # bf16 compute: compare the first gradients at bf16 tolerance
            chex.assert_trees_all_close(grads, ref_grads, atol=2e-2, rtol=5e-2)
        params = new_params
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert jax.tree.all(jax.tree.map(lambda w: w.dtype == jnp.float32, params))
    assert losses[-1] < 0.8 * losses[0], losses
