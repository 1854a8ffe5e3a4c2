"""Block-sparse FlashAttention: equals attention under the layout's mask; skipped tiles
are never read."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import BlockSparse, TritonBwdConfig, TritonConfig, flash_attention, sparsity
from tests.cases import tolerance_check


def _inputs(B, T, S, N, K, H, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (
        jax.random.normal(ks[0], (B, T, N, H), dtype),
        jax.random.normal(ks[1], (B, S, K, H), dtype),
        jax.random.normal(ks[2], (B, S, K, H), dtype),
        jax.random.normal(ks[3], (B, T, N, H), dtype),
    )


def _run(impl, q, k, v, do, **kw):
    """Output and gradients in one jitted program (eager, each op would compile apart)."""

    @jax.jit
    def run(q, k, v, do):
        f = lambda q, k, v: flash_attention(q, k, v, implementation=impl, **kw)  # noqa: E731
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do))

    return run(q, k, v, do)


LAYOUT = sparsity.union(sparsity.local(7, 5, 1), sparsity.global_(7, 5, 1))
CASES = [
    dict(dtype=jnp.float32, kw=dict()),
    dict(dtype=jnp.bfloat16, kw=dict(is_causal=True)),
    dict(dtype=jnp.float16, kw=dict(key_value_seq_lengths=jnp.array([70, 33]))),
    dict(
        dtype=jnp.float32,
        per_head=True,
        kw=dict(is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(0)),
    ),
    dict(
        dtype=jnp.float32,
        kw=dict(
            segment_ids=(jnp.array([[0] * 50 + [1] * 50] * 2), jnp.array([[0] * 30 + [1] * 40] * 2))
        ),
    ),
]


@pytest.mark.kernel
@pytest.mark.parametrize(
    "case",
    # The plain and the causal case are extended: the per-head causal one holds both.
    [pytest.param(c, marks=[pytest.mark.extended] * (i < 2)) for i, c in enumerate(CASES)],
    ids=lambda c: (
        f"{jnp.dtype(c['dtype']).name}-"
        f"{'-'.join(c['kw']) or 'plain'}{'-heads' if c.get('per_head') else ''}"
    ),
)
def test_block_sparse_matches_masked_reference(case):
    dtype = case["dtype"]
    layout = LAYOUT
    if case.get("per_head"):
        layout = np.stack([sparsity.butterfly(7, 5), LAYOUT, ~LAYOUT, LAYOUT])
    sparse = BlockSparse(layout, 16, 16)
    q, k, v, do = _inputs(2, 100, 70, 4, 2, 32, dtype)
    got = _run("triton", q, k, v, do, block_sparse=sparse, **case["kw"])
    ref = _run(
        "xla", *(x.astype(jnp.float32) for x in (q, k, v, do)), block_sparse=sparse, **case["kw"]
    )
    naive = _run("xla", q, k, v, do, block_sparse=sparse, **case["kw"])
    for name, g, r, n in zip(("o", "dq", "dk", "dv"), got, ref, naive):
        tolerance_check(name, g, r, n, dtype)


@pytest.mark.kernel
@pytest.mark.parametrize(
    "dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.extended)]
)
def test_layout_blocks_larger_than_tiles(dtype):
    """A 32 x 64 block layout, run at 16 x 16 kernel tiles (and at the default tiles,
    which shrink to the blocks): the kernels restate the layout at their tiles."""
    layout = sparsity.union(sparsity.local(4, 2, 0), sparsity.global_(4, 2, 1))
    layout[0, 1] = False
    sparse = BlockSparse(layout, 32, 64)
    q, k, v, do = _inputs(2, 100, 90, 4, 2, 32, dtype, seed=1)
    kw = dict(block_sparse=sparse, key_value_seq_lengths=jnp.array([90, 50]))
    ref = _run("xla", *(x.astype(jnp.float32) for x in (q, k, v, do)), **kw)
    naive = _run("xla", q, k, v, do, **kw)
    small = dict(
        config=TritonConfig(block_q=16, block_kv=16, num_warps=4, num_stages=1),
        backward_config=TritonBwdConfig(
            block_q_dkv=16, block_kv_dkv=32, block_q_dq=32, block_kv_dq=16, num_warps=4
        ),
    )
    for configs in (small, {}):
        got = _run("triton", q, k, v, do, **kw, **configs)
        for name, g, r, n in zip(("o", "dq", "dk", "dv"), got, ref, naive):
            tolerance_check(name, g, r, n, dtype)


@pytest.mark.kernel
def test_skipped_tiles_are_never_read():
    """Key block 2 is in no query block's list: NaN there must not reach any output."""
    layout = np.ones((4, 4), bool)
    layout[:, 2] = False
    sparse = BlockSparse(layout, 16, 16)
    q, k, v, do = _inputs(1, 64, 64, 2, 2, 16, jnp.float32)
    clean = _run("triton", q, k, v, do, block_sparse=sparse)
    poison = _run(
        "triton",
        q,
        k.at[:, 32:48].set(jnp.nan),
        v.at[:, 32:48].set(jnp.nan),
        do,
        block_sparse=sparse,
    )
    out, dq, dk, dv = poison
    chex.assert_trees_all_equal(out, clean[0])
    chex.assert_trees_all_equal(dq, clean[1])
    assert (dk[:, 32:48] == 0).all() and (dv[:, 32:48] == 0).all()
    np.testing.assert_array_equal(np.asarray(dk[:, :32]), np.asarray(clean[2][:, :32]))


def test_helpers():
    b = sparsity.butterfly(8, 8)
    assert b[0, 0] and b[0, 1] and b[0, 2] and b[0, 4] and not b[0, 3] and (b == b.T).all()
    assert sparsity.local(4, 4, 0).sum() == 4
    assert sparsity.global_(4, 4, 1).sum() == 7
    assert BlockSparse(np.eye(4, dtype=bool), 16, 16).density() == 0.25


def test_bad_layouts_are_refused():
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"block_sparse.layout must have shape \(4, 4\)"):
        flash_attention(q, k, v, block_sparse=BlockSparse(np.ones((3, 4), bool), 16, 16))
    with pytest.raises(TypeError, match="block_sparse.layout must be boolean"):
        flash_attention(q, k, v, block_sparse=BlockSparse(np.ones((4, 4)), 16, 16))
    with pytest.raises(ValueError, match="BlockSparse.block_q=24 must be a power of two"):
        BlockSparse(np.ones((3, 4), bool), 24, 16)
    with pytest.raises(
        ValueError, match="config.block_q=64 must divide the block_sparse block size 16"
    ):
        flash_attention(
            q,
            k,
            v,
            implementation="triton",
            config=TritonConfig(block_q=64),
            block_sparse=BlockSparse(np.ones((4, 4), bool), 16, 16),
        )
    with pytest.raises(NotImplementedError, match="block_sparse not supported by 'xla_blockwise'"):
        flash_attention(
            q,
            k,
            v,
            implementation="xla_blockwise",
            block_sparse=BlockSparse(np.ones((4, 4), bool), 16, 16),
        )
