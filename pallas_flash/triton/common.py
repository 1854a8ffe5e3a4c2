"""Pieces shared by the Triton-lowered forward and backward kernels."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b with float32 accumulation; float32 operands use exact (IEEE) products.

    Triton's default for float32 operands is TF32, about 1e-3 relative error; the
    float32 path promises float32 accuracy, so it asks for HIGHEST.
    """
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _view(ref, start, block: int, head):
    if head is None:  # ref is [seq_padded, head_dim_padded]
        return ref.at[pl.ds(start, block), :]
    return ref.at[pl.ds(start, block), head, :]  # ref is [seq_padded, heads, hd_padded]


def load_tile(ref, start, block: int, seq: int, head_dim: int, head=None):
    """Loads rows [start, start + block) of a [seq_padded, (heads,) head_dim_padded] ref.

    Rows at or past `seq` and columns at or past `head_dim` read as 0: never garbage,
    since a NaN in a masked-out V row would still poison P @ V (0 * NaN = NaN).
    The masks are emitted only when the shapes make them necessary.
    """
    hp = ref.shape[-1]
    mask = None
    if seq % block:
        mask = (start + jnp.arange(block) < seq)[:, None]
    if head_dim != hp:
        cols = (jnp.arange(hp) < head_dim)[None, :]
        mask = cols if mask is None else mask & cols
    view = _view(ref, start, block, head)
    if mask is None:
        return plgpu.load(view)
    return plgpu.load(view, mask=mask, other=0.0)


def store_tile(ref, start, value, seq: int, head_dim: int, head=None):
    """Stores a [block, head_dim_padded] tile at rows [start, ...), skipping padding."""
    block, hp = value.shape
    mask = None
    if seq % block:
        mask = (start + jnp.arange(block) < seq)[:, None]
    if head_dim != hp:
        cols = (jnp.arange(hp) < head_dim)[None, :]
        mask = cols if mask is None else mask & cols
    plgpu.store(_view(ref, start, block, head), value.astype(ref.dtype), mask=mask)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
