"""What the Mosaic GPU (Hopper) kernels serve: the static facts of a call they take
(`unsupported`, asked by the dispatcher in api.py before it picks them, and by the
backward for its own) and the device they need (`device_unsupported`). A call they do not
serve falls back to the Triton kernels under `implementation=None`, and fails loudly when
the caller named "mosaic"."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash import masks

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported(
    dtype,
    head_dim: int,
    spec: masks.MaskSpec,
    *,
    segments: bool = False,
    dropout: bool = False,
    bias: bool = False,
    mask: bool = False,
    softcap: bool = False,
) -> str | None:
    """Why this kernel cannot serve a call with these static facts, or None if it can."""
    if jnp.dtype(dtype) not in _DTYPES:
        return f"the Mosaic kernel takes bfloat16 or float16, not {jnp.dtype(dtype)}"
    if head_dim > 256:
        return f"the Mosaic kernel takes head dims up to 256, not {head_dim}"
    lacks = [
        name
        for name, present in (
            ("dropout", dropout),
            ("bias", bias),
            ("mask", mask),
            ("logits_soft_cap", softcap),
            ("block_sparse", spec.block_sparse),
        )
        if present
    ]
    if lacks:
        return f"{', '.join(lacks)} not supported by the Mosaic kernel yet"
    return None


def device_unsupported() -> str | None:
    """Why the compiled kernel cannot run on this machine's first device, or None."""
    if jax.default_backend() != "gpu":
        return f"the Mosaic kernel needs a Hopper GPU, not {jax.default_backend()}"
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc != "9.0":
        return f"the Mosaic kernel uses wgmma, which needs compute capability 9.0, not {cc}"
    return None
