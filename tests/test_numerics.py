"""Every backend against the float32 reference over the shared case table."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import flash_attention
from tests.cases import CASES, Case, seed_of, tolerance_check
from tests.util import run_impl, run_reference

NAMES = ("o", "lse", "dq", "dk", "dv", "dbias")


def _compare(case: Case, impl: str, seed: int = 0):
    got = run_impl(case, impl, seed)
    ref = run_reference(case, seed, upcast=True)
    naive = run_reference(case, seed, upcast=False)
    for name, g, r, n in zip(NAMES, got, ref, naive):
        tolerance_check(f"{impl} {case.id} {name}", g, r, n, case.dtype)


# Interpret mode on CPU runs these 6 of the table's 25 walked cases (with every extra
# case): together they hold each head dim, each query and each key length (1025 x 1025
# causal and ragged: many tiles each way), each dtype and head layout (MHA, GQA, MQA),
# and every pair of (causal, T != S, padded) values. The GPU runs the whole table.
CPU_WALK = (
    "float32_b2_t128_s128_n4k4_h32_len(128,85)-(128,85)",
    "float32_b2_t257_s97_n4k1_h64",
    "float16_b2_t1_s1_n4k4_h80",
    "float16_b2_t97_s257_n4k1_h128_len(97,64)-(257,171)",
    "float16_b2_t1025_s1025_n4k4_h128_causal_len(1025,683)-(1025,683)",
    "bfloat16_b2_t97_s128_n4k2_h256_causal",
)
WALK = CASES[:25]
assert set(CPU_WALK) <= {c.id for c in WALK}


def _params(cases):
    """The cases, those of WALK beyond CPU_WALK marked full_table (GPU only)."""
    return [
        pytest.param(
            c,
            id=c.id,
            marks=[pytest.mark.full_table] if c in WALK and c.id not in CPU_WALK else [],
        )
        for c in cases
    ]


def _seed(case: Case) -> int:
    """One seed for both tests of a case: pytest -n runs them on one worker (conftest.py),
    which computes the case's reference once (util.run_references)."""
    return seed_of(case)


@pytest.mark.kernel
@pytest.mark.parametrize("case", _params(CASES))
def test_triton_matches_reference(case):
    _compare(case, "triton", seed=_seed(case))


# The XLA blockwise path on CPU: the same covering subset (each of its compiles takes
# seconds on CPU too); the GPU run takes the whole table.
@pytest.mark.parametrize("case", _params(CASES))
def test_blockwise_matches_reference(case):
    _compare(case, "xla_blockwise", seed=_seed(case))


AGREE = [
    Case(2, 97, 130, 4, 2, 64, jnp.float32, causal=True),
    Case(2, 130, 97, 4, 1, 80, jnp.bfloat16, q_lens=(130, 50), kv_lens=(60, 97)),
]


@pytest.mark.kernel
@pytest.mark.parametrize("case", AGREE, ids=lambda c: c.id)
def test_implementations_agree(case):
    """triton, xla_blockwise and xla give the same answers (to rounding) on the same inputs."""
    results = {impl: run_impl(case, impl) for impl in ("triton", "xla_blockwise", "xla")}
    naive = run_reference(case, upcast=False)
    for a, b in (("triton", "xla"), ("xla_blockwise", "xla"), ("triton", "xla_blockwise")):
        for name, x, y, n in zip(NAMES, results[a], results[b], naive):
            # Each is within the reference's tolerance of xla, so of each other within twice it.
            y32 = np.asarray(y, np.float64)
            finite = np.isfinite(y32)
            n_err = np.where(finite, np.asarray(n, np.float64) - np.where(finite, y32, 0), 0)
            tolerance_check(f"{a} vs {b} {name}", x, y32, y32 + 2 * n_err, case.dtype)


@pytest.mark.kernel
@pytest.mark.parametrize("impl", ["triton", "xla_blockwise", "xla"])
def test_fully_masked_rows_are_zero_not_nan(impl):
    # Batch 0: bottom-right causal with T > S, so rows 0..T-S-1 see no key, and the
    # last 10 query rows are padding. Batch 1: no valid key at all.
    case = Case(
        2,
        40,
        24,
        2,
        1,
        32,
        jnp.float32,
        causal=True,
        bottom_right=True,
        q_lens=(30, 40),
        kv_lens=(24, 0),
    )
    o, lse, dq, dk, dv = (np.asarray(x) for x in run_impl(case, impl))
    for x in (o, dq, dk, dv):
        assert np.isfinite(x).all()
    empty_rows = [(0, slice(0, 6)), (0, slice(30, 40)), (1, slice(0, 40))]
    for b, rows in empty_rows:
        assert (o[b, rows] == 0).all() and (dq[b, rows] == 0).all()
        assert np.isneginf(lse[b, :, rows]).all()
    assert np.isfinite(lse[0, :, 6:30]).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()  # no key was attended


@pytest.mark.kernel
@pytest.mark.parametrize("impl", ["triton", "xla_blockwise"])
def test_gradients_are_bitwise_deterministic(impl):
    case = Case(2, 257, 200, 4, 1, 64, jnp.bfloat16, causal=True, kv_lens=(200, 150))
    first = run_impl(case, impl, seed=3)
    second = run_impl(case, impl, seed=3)
    chex.assert_trees_all_equal(first, second)


@pytest.mark.kernel
def test_causal_skips_tiles_above_the_diagonal():
    """Poisoning keys that no query may see must not change the causal result: they are
    never loaded (a masked load would still be fine, but NaN * 0 would show a read)."""
    q, k, v, _ = Case(1, 64, 256, 2, 2, 32, jnp.float32, causal=True).inputs()
    out = flash_attention(q, k, v, is_causal=True, implementation="triton")
    k_bad = k.at[:, 128:].set(jnp.nan)
    v_bad = v.at[:, 128:].set(jnp.nan)
    out_bad = flash_attention(q, k_bad, v_bad, is_causal=True, implementation="triton")
    chex.assert_trees_all_equal(out, out_bad)


def test_lse_cotangent_flows():
    """d lse / d q through the custom_vjp equals the reference's."""
    case = Case(1, 33, 47, 2, 1, 32, jnp.float32, causal=True)
    q, k, v, _ = case.inputs()

    def loss(impl):
        def f(q):
            _, lse = flash_attention(
                q, k, v, is_causal=True, implementation=impl, return_residual=True
            )
            return jnp.sum(jnp.sin(lse))

        return jax.grad(f)(q)

    np.testing.assert_allclose(loss("xla_blockwise"), loss("xla"), atol=2e-5, rtol=2e-5)
