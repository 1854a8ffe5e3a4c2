"""Tile and pipeline config of the Mosaic GPU (Hopper) forward kernel, with its evidence.

Frozen (hashable), so it travels as a static argument, like configs.TritonConfig.

Default-config table (16-bit inputs; head dim padded up to a multiple of 64):

| head dim (padded) | rows per warpgroup x block_kv | stages | shared memory (bytes) |
|-------------------|-------------------------------|--------|-----------------------|
| 64                | 64 x 128                      | 2      | 85,080                |
| 128               | 64 x 128                      | 2      | 167,000               |
| 192, 256          | 64 x 64                       | 2      | 150,616, 199,768      |

(Shared memory as Mosaic GPU's lowering reports it, with P in registers.)

Evidence: not yet measured by us. Starting points from JAX's own Mosaic FA3
(`jax/experimental/pallas/ops/gpu/attention_mgpu.py`), whose benchmark keeps 64 query
rows per warpgroup and two K/V stages and takes the first block_kv of 256, 128, 64 that
fits in Hopper's 227 KiB of shared memory (256 at head dim 64, 128 at 128, 64 at 256).
At head dim 64 we start at 128 as well, which keeps the float32 score tile at 64
registers per thread. The tile sweep on the H200 should replace this note with numbers.
"""

from __future__ import annotations

import dataclasses

# Hopper's shared memory per block (sm_90: 227 KiB usable of 228 KiB).
SMEM_BYTES = 227 * 1024
# Consumer warpgroups per CTA: each owns block_q query rows; a third one loads K/V.
NUM_CONSUMERS = 2
# What Mosaic GPU adds: scratch for cross-warp reductions (CompilerParams'
# reduction_scratch_bytes) and alignment (the estimate below is then within 1 KiB
# above what Mosaic GPU's lowering reports, checked at head dims 64 to 256).
_MOSAIC_OVERHEAD = 128 * 4 * 4 + 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
    """Forward kernel: one CTA per (query head, NUM_CONSUMERS * block_q rows, batch).

    block_q: query rows per consumer warpgroup (wgmma's M is 64 per instruction).
    block_kv: keys per K/V tile, the wgmma N of Q K^T and the K of P V.
    num_stages: K/V tiles in flight in the shared-memory ring.
    schedule_barrier: FA3's ping-pong: the two consumer warpgroups take turns at the
      tensor cores, so one's softmax overlaps the other's matmuls.
    p_in_registers: P V takes P from registers (FA3's choice); False stages P through
      shared memory, the only form GPU interpret mode can run (see forward.py).
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    schedule_barrier: bool = True
    p_in_registers: bool = True

    def __post_init__(self):
        if self.block_q % 64 or self.block_q < 64:
            raise ValueError(f"{self.block_q=} must be a positive multiple of 64")
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"{self.block_kv=} must be 64, 128, 192 or 256")
        if self.num_stages < 1:
            raise ValueError(f"{self.num_stages=} must be >= 1")

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory the forward kernel allocates at this (padded) head dim (an upper
        bound: Mosaic GPU reports up to 1 KiB less)."""
        q_o = NUM_CONSUMERS * self.block_q * head_dim * itemsize
        kv = 2 * self.num_stages * self.block_kv * head_dim * itemsize
        p = 0 if self.p_in_registers else NUM_CONSUMERS * self.block_q * self.block_kv * itemsize
        lse = NUM_CONSUMERS * self.block_q * 4
        barriers = 8 * (4 * self.num_stages + NUM_CONSUMERS + 1)
        return q_o + kv + p + lse + barriers + _MOSAIC_OVERHEAD


def padded_head_dim(head_dim: int) -> int:
    """wgmma tiles and the 128-byte swizzle want head dims in multiples of 64."""
    return -(-head_dim // 64) * 64


def default_mosaic_config(head_dim: int) -> MosaicConfig:
    """The default table's row for this head dim (16-bit inputs only)."""
    hp = padded_head_dim(head_dim)
    if hp <= 128:
        return MosaicConfig(block_q=64, block_kv=128, num_stages=2)
    return MosaicConfig(block_q=64, block_kv=64, num_stages=2)
