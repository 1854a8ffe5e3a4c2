"""Tile sizes and launch parameters of the Triton-lowered kernels, with the evidence for each.

Configs are frozen (hashable), so they travel as static arguments. A caller may pass
its own; `None` picks the default-config table's row for the head dim and dtype.

Default-config table (Triton-lowered path; head dim is padded to a power of two >= 16):

| head dim (padded) | dtype   | forward: q x kv, warps, stages | backward: q x kv, warps, stages |
|-------------------|---------|--------------------------------|---------------------------------|
| <= 64             | 16-bit  | 128 x 64, 4, 3                 | 64 x 64, 4, 2                   |
| 128               | 16-bit  | 128 x 64, 8, 3                 | 64 x 64, 4, 2                   |
| 256               | 16-bit  | 64 x 64, 8, 2                  | 32 x 32, 4, 1                   |
| any               | float32 | 32 x 32, 4, 1                  | 32 x 32, 4, 1                   |

Evidence: starting points from the FlashAttention-2 Triton tutorial's Hopper settings
(128 x 64 tiles, 8 warps at head dim 128), sized so that Q, K and V tiles with their
pipeline stages fit Hopper's 227 KiB of shared memory (at head dim 256 a 64 x 64 bf16
tile set is 96 KiB per stage). float32 uses small tiles because its IEEE matmuls run
without tensor cores and its tiles are twice as large. Measured numbers are recorded
in benchmarks/results/ and README.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# The Mosaic GPU (Hopper) family's config lives beside its kernel; re-exported here.
from pallas_flash.mosaic.bwd_config import MosaicBwdConfig as MosaicBwdConfig  # noqa: E402
from pallas_flash.mosaic.bwd_config import default_mosaic_bwd_config as default_mosaic_bwd_config  # noqa: E402
from pallas_flash.mosaic.bwd_config import pair_mosaic_bwd_config as pair_mosaic_bwd_config  # noqa: E402
from pallas_flash.mosaic.config import MosaicConfig as MosaicConfig  # noqa: E402
from pallas_flash.mosaic.config import default_mosaic_config as default_mosaic_config  # noqa: E402


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonConfig:
    """Forward kernel: one program per (query tile, batch, head)."""

    block_q: int = 128
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        _check_block("block_q", self.block_q)
        _check_block("block_kv", self.block_kv)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonBwdConfig:
    """Backward kernels: dK/dV per key tile and dQ per query tile, no atomics."""

    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for f in ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq"):
            _check_block(f, getattr(self, f))


def padded_head_dim(head_dim: int) -> int:
    """Triton's dot needs power-of-two tiles of at least 16 along the contraction."""
    return max(16, 1 << (head_dim - 1).bit_length())


def default_triton_config(head_dim: int, dtype) -> TritonConfig:
    hp = padded_head_dim(head_dim)
    if np.dtype(dtype).itemsize >= 4:
        return TritonConfig(block_q=32, block_kv=32, num_warps=4, num_stages=1)
    if hp <= 64:
        return TritonConfig(block_q=128, block_kv=64, num_warps=4, num_stages=3)
    if hp <= 128:
        return TritonConfig(block_q=128, block_kv=64, num_warps=8, num_stages=3)
    return TritonConfig(block_q=64, block_kv=64, num_warps=8, num_stages=2)


def default_triton_bwd_config(head_dim: int, dtype) -> TritonBwdConfig:
    hp = padded_head_dim(head_dim)
    if np.dtype(dtype).itemsize >= 4 or hp > 128:
        return TritonBwdConfig(
            block_q_dkv=32,
            block_kv_dkv=32,
            block_q_dq=32,
            block_kv_dq=32,
            num_warps=4,
            num_stages=1,
        )
    return TritonBwdConfig()


def fit_block(block: int, seq: int) -> int:
    """Shrinks a tile to the sequence (down to 16) so tiny inputs don't waste work."""
    return max(16, min(block, 1 << max(seq - 1, 0).bit_length()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockwiseConfig:
    """The plain-JAX blockwise backend: one scan step per key/value tile.

    Its temporary memory is B * N * T * block_kv float32 scores per step: linear in T.
    """

    block_kv: int = 128

    def __post_init__(self):
        if self.block_kv < 1:
            raise ValueError(f"block_kv={self.block_kv} must be positive")
