"""The forward kernel's online softmax (FlashAttention-2, Sec. 3.1; forward.py) and its
exp2: scores in base 2 with log2(e) folded into the scale, so a probability costs one
FMA and one exp2; and an exp2 by a cubic on the FMA units (`exp2_poly`) for some of a
tile's columns, to take load off the SFU's exp2 (FlashAttention-4's trick;
`MosaicConfig.poly_exp2_cols`, off: slower on the H200, config.py says by how much)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, nvvm, vector

from pallas_flash.mosaic.pipeline import ROW

# exp2_poly: 2^f on [-0.5, 0.5] by a cubic, fitted for the least largest relative error
# (7.5e-5 exactly, below 8e-5 evaluated in float32; bfloat16's half ulp, P's rounding for
# P V, is 2^-9 = 2.0e-3), and
# 1.5 * 2^23 + 127, whose float32 sum with x in [-127, 128] rounds x to the nearest integer
# j and holds j + 127, 2^j's biased exponent, in its low mantissa bits.
_EXP2_POLY = (0.9999275803565979, 0.6932610869407654, 0.24261736869812012, 0.055174168199300766)


_EXP2_ROUND = 12582912.0 + 127.0


def _ptx_f32(v: float) -> str:  # a float32 constant as PTX spells it
    return f"0f{int(np.float32(v).view(np.uint32)):08X}"


# The same arithmetic for one float32 register, as PTX: written out so that no compiler
# folds the rounding's (x + R) - R back into x, as XLA does with the jnp form.
_EXP2_POLY_PTX = (
    "{ .reg .f32 x, t, f, p; .reg .b32 e;\n"
    f"max.NaN.f32 x, $1, {_ptx_f32(-127.0)};\n"
    f"add.rn.f32 t, x, {_ptx_f32(_EXP2_ROUND)};\n"
    f"sub.rn.f32 f, t, {_ptx_f32(_EXP2_ROUND)};\n"
    "sub.rn.f32 f, x, f;\n"
    f"fma.rn.f32 p, f, {_ptx_f32(_EXP2_POLY[3])}, {_ptx_f32(_EXP2_POLY[2])};\n"
    f"fma.rn.f32 p, p, f, {_ptx_f32(_EXP2_POLY[1])};\n"
    f"fma.rn.f32 p, p, f, {_ptx_f32(_EXP2_POLY[0])};\n"
    "shl.b32 e, t, 23;\n"
    "mul.rn.f32 $0, p, e; }"
)


def exp2_poly(x, *, ptx: bool = False):
    """2^x in float32 on the FMA and integer units, none of it on the SM's multi-function
    unit (MUFU, 16 exp2 a clock per SM; FlashAttention-4's offload, Zadouri et al. 2025):
    x = j + f with j = round(x), 2^f by a cubic (relative error below 8e-5), 2^j
    from j + 127 shifted into a float's exponent. Nine operations (clamp, three adds,
    three FMAs, shift, multiply). x < -126.5, -inf included, gives exactly 0 (2^j's
    exponent field is then 0; ex2.approx.ftz flushes results below 2^-126 as well),
    and NaN stays NaN (NaN * 2^j).

    `ptx`: in a compiled kernel, `x` [rows, cols] in the wgmma layout, as inline PTX per
    register (_EXP2_POLY_PTX); else jnp, with lax.round for the rounding (GPU interpret
    mode, and tests)."""
    if ptx:
        layout = plgpu.Layout.WGMMA

        @plgpu.inline_mgpu(
            arg_types=(layout,),
            return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=layout),
        )
        def emit(_ctx, xs):
            def one(v):  # one float32 register
                return mgpu_utils.inline_ptx(_EXP2_POLY_PTX, v, result_types=xs.mlir_dtype)

            return xs._pointwise(mgpu.FragmentedArray._lift_fast_instr(one))

        return emit(x)
    x = jnp.maximum(x, -127.0)
    j = lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)
    f = x - j  # in [-0.5, 0.5]
    c0, c1, c2, c3 = _EXP2_POLY
    p = ((c3 * f + c2) * f + c1) * f + c0
    scale = lax.bitcast_convert_type((j.astype(jnp.int32) + 127) << 23, jnp.float32)
    return p * scale


def warp_any(flags):
    """Whether any row of the executing warp has its flag set ([rows] bool in the wgmma
    row layout, each thread holding its rows'): a per-warp value, the same in the 32
    threads of a warp (vote.sync.any), for a branch that whole warps take or skip."""

    @plgpu.inline_mgpu(
        arg_types=(ROW,), return_type=plgpu.ShapeDtypeStruct((), jnp.bool_, plgpu.Layout.WG_SPLAT)
    )
    def vote(_ctx, rows):
        bits = []
        for reg in rows.registers.flat:  # this thread's rows, a vector of i1 or an i1 each
            if isinstance(reg.type, ir.VectorType):
                n = ir.VectorType(reg.type).shape[0]
                bits += [
                    vector.extract(reg, dynamic_position=[], static_position=[k]) for k in range(n)
                ]
            else:
                bits.append(reg)
        mine = functools.reduce(arith.ori, bits)
        everyone = arith.constant(ir.IntegerType.get_signless(32), 0xFFFFFFFF)
        return mgpu.FragmentedArray.splat(
            nvvm.vote_sync(everyone, mine, "any"), (), is_signed=False
        )

    return vote(flags)


def online_softmax(
    s, m_i, l_i, c: float, keep, poly_cols: int = 0, ptx: bool = False, slack=None, row_sum=True
):
    """One online-softmax step on raw scores `s` [block_q, block_kv] (float32).

    `c` is scale * log2(e); `keep` is the element mask or None; the first `poly_cols`
    columns' exp2 go through exp2_poly (MosaicConfig.poly_exp2_cols; `ptx`: compiled).
    `slack` (MosaicConfig.rescale_slack): m_i is the max the rows are scaled by, raised
    to the tile's max only where a row's grew by more than `slack` (compiled: all rows of
    any warp that has such a row); else it stays, and p is at most 2^slack. Returns the
    probabilities p (base 2, not normalised), the new m_i and l_i, alpha, which rescales
    what was accumulated so far, and whether to rescale (None: always; a [rows] mask,
    where alpha is 1 off it; or, compiled, the warp's flag). With `row_sum` False, l_i
    is returned as it came: the caller sums p on the tensor cores
    (MosaicConfig.row_sum_wgmma).
    """

    def rows(x):  # [block_q] -> [block_q, block_kv]
        return lax.broadcast_in_dim(x, s.shape, [0])

    if c <= 0:  # max does not commute with a non-positive scale: scale first
        s, c = s * c, 1.0
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    # With c > 0, max(s) * c = max(s * c), and s * c - m below is one FMA per element.
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1) * c)
    rescaled = None
    if slack is not None:
        # -inf - -inf is NaN, so a row that has seen only masked keys has not grown; the
        # first key it sees takes it from -inf, which has.
        rescaled = m_new - m_i > slack
        if ptx:
            rescaled = warp_any(rescaled)
            m_new = jnp.where(lax.broadcast_in_dim(rescaled, m_new.shape, ()), m_new, m_i)
        else:
            m_new = jnp.where(rescaled, m_new, m_i)
    m_use = m_new
    if keep is not None:
        # A row that has seen only masked keys has max -inf; subtracting it would give
        # exp2(-inf + inf) = NaN. Use 0 instead: its p and alpha are then 0.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    x = (s if c == 1.0 else s * c) - rows(m_use)  # [block_q, block_kv]
    if poly_cols >= x.shape[1]:
        p = exp2_poly(x, ptx=ptx)
    elif poly_cols:  # (slices and concatenation of the tile only rename its registers)
        head = exp2_poly(x[:, :poly_cols], ptx=ptx)
        p = jnp.concatenate([head, jnp.exp2(x[:, poly_cols:])], axis=1)
    else:
        p = jnp.exp2(x)
    if row_sum:
        l_i = l_i * alpha + jnp.sum(p, axis=1)
    return p, m_new, l_i, alpha, rescaled
