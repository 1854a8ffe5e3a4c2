"""The benchmark suites: which shapes, which implementations, which passes."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

ALL_PEERS = ("jax.nn:xla", "jax.nn:cudnn", "tokamax:mosaic", "tokamax:triton", "jax:mosaic_fa3")


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    mask: str = "none"  # "none" or "padding" (random key/value lengths, 50-100 %)
    dtype: object = jnp.bfloat16

    def replace(self, **kw) -> Shape:
        return dataclasses.replace(self, **kw)

    def row(self) -> dict:
        return dict(
            batch=self.batch,
            seq_q=self.seq_q,
            seq_k=self.seq_k,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            causal=self.causal,
            mask=self.mask,
        )

    def family(self) -> tuple:
        """Shapes that share a correctness check (it runs at a reduced length)."""
        return (self.heads, self.kv_heads, self.head_dim, self.causal, self.mask, self.dtype)


@dataclasses.dataclass(frozen=True)
class Suite:
    shapes: tuple[Shape, ...]
    tiny_shapes: tuple[Shape, ...]
    impls: tuple[str, ...]
    passes: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")
    memory: bool = False


def _fa_shapes():
    """FlashAttention-2/3's grid: 16k tokens per batch, hidden 2048 (8 heads at dim 256)."""
    out = []
    for head_dim in (128, 64, 256):  # the headline head dim first
        heads = 8 if head_dim == 256 else 2048 // head_dim
        for causal in (False, True):
            for seq in (512, 1024, 2048, 4096, 8192, 16384):
                out.append(Shape(16384 // seq, seq, seq, heads, heads, head_dim, causal))
    return tuple(out)


def _memory_shapes():
    """Issue 3's memory sweep: B=1, N=16, H=128, causal, T = 1k .. 1M."""
    return tuple(Shape(1, t, t, 16, 16, 128, True) for t in (1 << p for p in range(10, 21, 2)))


def _paper_shapes():
    """The FlashAttention paper's runtime/memory table: seq 128 .. 64k, with and without
    padding masks and dropout (head dim 64, 12 heads, 32k tokens per batch down to 1)."""
    out = []
    for mask in ("none", "padding", "dropout:0.1"):
        for p in range(7, 17):
            seq = 1 << p
            out.append(Shape(max(1, 32768 // seq), seq, seq, 12, 12, 64, False, mask))
    return tuple(out)


def _mask_shapes():
    """Issue 4's overhead check at T = 8k (B=2, N=16, H=128): each masking argument at
    full visibility (pure overhead: one segment, full lengths, a window wider than T, an
    all-True mask) and in a realistic form, against the unmasked kernel, same run."""
    labels = (
        "none",
        "segments:1",
        "segments:4",
        "padding-full",
        "padding",
        f"window:{8192}",
        "window:1024",
        "mask-full",
        "mask",
    )
    return tuple(
        Shape(2, 8192, 8192, 16, 16, 128, causal, label)
        for causal in (False, True)
        for label in labels
    )


def _sparse_shapes():
    """Block-sparse scaling at T = 16k (head dim 64 and 128) and a 1k sliding window
    against causal at T = 32k."""
    out = []
    for head_dim in (128, 64):
        heads = 2048 // head_dim
        for label in ("none", "sparse:1.0", "sparse:0.5", "sparse:0.25", "sparse:0.125"):
            out.append(Shape(1, 16384, 16384, heads, heads, head_dim, False, label))
    out.append(Shape(1, 32768, 32768, 16, 16, 128, True, "none"))
    out.append(Shape(1, 32768, 32768, 16, 16, 128, True, "window:1024"))
    return tuple(out)


def _lra_shapes():
    """The attention calls of the LRA presets (models/classifier.py), non-causal with
    their padding: ListOps (batch 32, length 2000 padded by the examples' lengths, 8 heads
    of 64), Pathfinder-32 (batch 512, 1024 pixels, 4 heads of 16) and Pathfinder-64
    (batch 256, 4096 pixels, 4 heads of 8): small head dims, many (batch, head) pairs."""
    return (
        Shape(32, 2000, 2000, 8, 8, 64, False, "padding"),
        Shape(512, 1024, 1024, 4, 4, 16, False),
        Shape(256, 4096, 4096, 4, 4, 8, False),
    )


TINY = (
    Shape(1, 96, 96, 2, 1, 32, True),
    Shape(2, 40, 72, 2, 2, 16, False, "padding"),
)

SUITES = {
    "fa": Suite(_fa_shapes(), TINY, ("pallas_flash:triton", "pallas_flash:mosaic", *ALL_PEERS)),
    "memory": Suite(
        _memory_shapes(),
        tuple(s.replace(batch=1) for s in TINY),
        (
            "pallas_flash:triton",
            "pallas_flash:xla_blockwise",
            "jax.nn:xla",
            "jax.nn:cudnn",
            "tokamax:mosaic",
            "tokamax:triton",
        ),
        passes=("fwd+bwd",),
        memory=True,
    ),
    "paper": Suite(
        _paper_shapes(),
        TINY,
        ("pallas_flash:triton", "jax.nn:xla", "jax.nn:cudnn", "tokamax:mosaic"),
    ),
    "masks": Suite(
        _mask_shapes(),
        (Shape(1, 64, 64, 2, 2, 16, True, "segments:2"), Shape(1, 64, 64, 2, 2, 16, False, "mask")),
        ("pallas_flash:triton", "jax.nn:cudnn"),
    ),
    "sparse": Suite(
        _sparse_shapes(),
        (
            Shape(1, 256, 256, 2, 2, 16, False, "sparse:0.5"),
            Shape(1, 256, 256, 2, 2, 16, True, "window:32"),
        ),
        ("pallas_flash:triton",),
    ),
    "lra": Suite(_lra_shapes(), TINY, ("pallas_flash:triton", "jax.nn:xla", "jax.nn:cudnn")),
    "quick": Suite(
        (
            Shape(4, 4096, 4096, 16, 16, 128, False),
            Shape(4, 4096, 4096, 16, 16, 128, True),
            Shape(16, 1024, 1024, 32, 8, 64, True, "padding"),
        ),
        TINY,
        ("pallas_flash:triton", "pallas_flash:xla_blockwise", "jax.nn:xla", "jax.nn:cudnn"),
    ),
}
