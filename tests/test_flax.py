"""The Flax layer matches Flax's own attention: same parameters, same inputs."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import pallas_flash.flax as pf_flax

B, T, D, HEADS = 2, 24, 32, 4
TOL = dict(atol=2e-5, rtol=2e-5)
IMPLS = [None, pytest.param("triton", marks=pytest.mark.kernel)]


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """Flax's attention takes XLA's default matmul precision, which on a GPU is TF32
    (about 1e-3 relative); our kernels compute float32 exactly. Comparing at 2e-5 needs
    Flax exact too."""
    with jax.default_matmul_precision("highest"):
        yield


def _x(seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, D), jnp.float32)


def _pairwise():
    """impl x kv_heads x masked: four combinations hold every pair of values (CI's tier),
    the other four are extended."""
    out = []
    for impl in (None, "triton"):
        for kv_heads in (HEADS, 2):
            for masked in (False, True):
                marks = [pytest.mark.kernel] if impl else []
                # CI keeps those with an odd count of (no impl, MHA, masked)
                if ((impl is None) + (kv_heads == HEADS) + masked) % 2 == 0:
                    marks.append(pytest.mark.extended)
                out.append(pytest.param(impl, kv_heads, masked, marks=marks))
    return out


@pytest.mark.parametrize("impl,kv_heads,masked", _pairwise())
def test_nnx_module_matches_flax(impl, kv_heads, masked):
    ours = pf_flax.MultiHeadAttention(
        HEADS, D, num_kv_heads=kv_heads, decode=False, implementation=impl, rngs=nnx.Rngs(0)
    )
    theirs = nnx.MultiHeadAttention(HEADS, D, num_kv_heads=kv_heads, decode=False, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param))
    mask = None
    if masked:  # padding: the last 5 keys of batch element 1 are masked out
        keep = jnp.arange(T)[None, :] < jnp.array([[T], [T - 5]])
        mask = nnx.make_attention_mask(jnp.ones((B, T), bool), keep)
    x = _x()

    def loss(model, x):
        y = model(x, mask=mask, is_causal=not masked)
        return jnp.sum(jnp.sin(y)), y

    # Jitted: eager, each op around the kernels compiles on its own (slower on CPU).
    grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True, argnums=(0, 1)))
    (l1, y1), g1 = grad(ours, x)
    (l2, y2), g2 = grad(theirs, x)
    chex.assert_trees_all_close(y1, y2, **TOL)
    chex.assert_trees_all_close(nnx.state(g1[0], nnx.Param), nnx.state(g2[0], nnx.Param), **TOL)
    chex.assert_trees_all_close(g1[1], g2[1], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_linen_attention_fn_in_flax_module(impl):
    """flax.linen.MultiHeadDotProductAttention with our attention_fn: same params, same
    outputs and gradients as with Flax's own."""
    fn = jax.tree_util.Partial(pf_flax.attention_fn, implementation=impl)
    ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    x = _x(1)
    params = theirs.init(jax.random.PRNGKey(0), x)
    mask = nn.make_causal_mask(jnp.ones((B, T)))

    def loss(module, params):
        y = module.apply(params, x, mask=mask)
        return jnp.sum(jnp.cos(y)), y

    (l1, y1), g1 = jax.value_and_grad(loss, argnums=1, has_aux=True)(ours, params)
    (l2, y2), g2 = jax.value_and_grad(loss, argnums=1, has_aux=True)(theirs, params)
    chex.assert_trees_all_close(y1, y2, **TOL)
    chex.assert_trees_all_close(g1, g2, **TOL)


def test_dropout_goes_to_the_fused_kernel():
    model = pf_flax.MultiHeadAttention(
        HEADS, D, dropout_rate=0.5, decode=False, rngs=nnx.Rngs(0, dropout=1)
    )
    x = _x()
    y_eval = model(x, deterministic=True)
    y_a = model(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    y_b = model(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    chex.assert_trees_all_equal(y_a, y_b)  # same key, same mask
    assert float(jnp.abs(y_a - y_eval).max()) > 1e-3  # dropout happened


def test_weights_and_precision_refused():
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(NotImplementedError, match="never forms the attention weights"):
        pf_flax.attention_fn(q, q, q, module=object())
    with pytest.raises(NotImplementedError, match="the kernels fix their precision"):
        pf_flax.attention_fn(q, q, q, precision=jax.lax.Precision.HIGHEST)
