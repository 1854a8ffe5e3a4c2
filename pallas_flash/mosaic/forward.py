"""FlashAttention forward pass for Hopper (sm_90) in Mosaic GPU Pallas, FlashAttention-3 style.

The loop is FlashAttention-2's (Dao, 2023, Sec. 3.1): a query tile stays on chip while
the key/value tiles stream past it, with the running row maximum `m_i`, row sum `l_i`
and unnormalised output `acc` in float32 registers. The schedule is FlashAttention-3's
(Shah et al., 2024, Sec. 3.1, producer-consumer asynchrony):

* Warp specialisation. A CTA has three warpgroups. The producer (warpgroup 2) only
  issues TMA copies of K and V tiles into a ring of `num_stages` shared-memory slots.
  The two consumers (warpgroups 0 and 1) each own `block_q` query rows, whose Q tile
  stays in shared memory, and run Q K^T and P V as wgmma. Per slot and tensor, a
  "ready" barrier (completed by the TMA's byte count) says the tile has landed, and a
  "free" barrier (one arrival per consumer) says the producer may overwrite it. With
  `MosaicConfig.consumers=3` (FA3's choice at head dim 64) there are three consumers
  (warpgroups 0-2, 160 registers each) and the producer is warpgroup 3.
* Ping-pong scheduling. A barrier between the two consumers makes them take turns at
  the tensor cores, so that one's softmax overlaps the other's matmuls.
* Intra-warpgroup pipelining (`MosaicConfig.intra_overlap`, off: slower on the H200): a
  consumer issues tile j's Q K^T with tile j - 1's P V and runs tile j's softmax while
  that P V is in flight (FA3, Sec. 3.2).

Scores go to base 2 with log2(e) folded into the softmax scale: exp(x) = exp2(x log2 e),
so each probability costs one FMA and one exp2, and `m_i` is kept in base-2 units.
The kernel returns O and the logsumexp in natural-log units (float32), -inf on rows
that see no key, the contract of triton/forward.py, so the Triton backward can use it.

Masking. Both consumers of a CTA walk the same key/value tiles: those that
`masks.kv_tile_range` gives for the CTA's consumers * block_q rows. Skipped tiles (above the
causal diagonal, outside a local window, past kv_len) are never loaded; tiles every row
sees in full run unmasked; boundary tiles apply `masks.tile_mask`. Walking the CTA's
range rather than each warpgroup's own costs at most one extra masked tile per
warpgroup on the causal diagonal and keeps the barrier protocol simple: every consumer
arrives exactly once on every free barrier phase and the ping-pong barrier alternates.
Segment ids narrow the CTA's range in XLA beforehand (`masks.segment_tile_ranges`: tiles
between packed documents are skipped); in boundary tiles the ids compare element by
element: the rows' ids travel with Q, each key tile's with K (one more TMA copy on
their barriers), loaded in the row and column layouts of the score tile.

Lengths. The wrapper pads T to whole CTAs and S to whole key tiles with zeros (and the
head dim to a multiple of 64); padded keys are masked through kv_len, padded query rows
are cut from the result.

GPU interpret mode (CPU) runs this same kernel, with its barriers, TMA copies and
wgmma simulated, except for one step: the interpreter's wgmma reads both operands from
shared memory and cannot accumulate in place (`pl.run_state` over an accumulator does
not lower on CPU: "MLIR translation rule for primitive 'wgmma' not found for platform
cpu"), so there P is staged through shared memory and P V lands in a fresh accumulator
that is added to `acc` (`MosaicConfig.p_in_registers=False`, which a GPU can run too).
Nor has it global semaphores (`pl.get_global`), so a split last round's pieces are merged
by XLA after the kernel there (`tail_fixup=False`), not by the kernel.

The kernel's body is mosaic/fwd_kernel.py; `forward` below checks the call, pads the
inputs, builds the grid and the shared-memory scratch, and calls it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.logits import Logits
from pallas_flash.mosaic import split_tail
from pallas_flash.mosaic.config import (
    SMEM_BYTES,
    MosaicConfig,
    padded_head_dim,
)
from pallas_flash.mosaic.fwd_kernel import fwd_kernel, walks_own_keys
from pallas_flash.mosaic.pipeline import (
    greedy_items_order,
    head_rounds_order,
    kv_tile_ranges,
    nominal_key_tiles,
    order_rows,
    pad_to,
    pair_cluster,
    sm_count,
    swizzled,
)
from pallas_flash.mosaic.support import unsupported

# Persistent CTAs in GPU interpret mode: few, so that each walks several work items.
_PERSISTENT_CTAS = 3


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_len: jax.Array,
    kv_len: jax.Array,
    segments: tuple[jax.Array, jax.Array] | None = None,
    seeds: jax.Array | None = None,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    layout: jax.Array | None = None,
    *,
    spec: masks.MaskSpec,
    scale: float,
    config: MosaicConfig,
    interpret: bool | plgpu.InterpretGPUParams = False,
    dropout_rate: float = 0.0,
    logits: Logits = Logits(),
) -> tuple[jax.Array, jax.Array]:
    """Returns O [B, T, N, H] in q's dtype and the logsumexp [B, N, T] float32 (natural
    log, -inf on rows that see no key), as triton/forward.py's `forward`.

    `q_len` / `kv_len` are int32 [B] valid lengths. `interpret`: True (or an
    `InterpretGPUParams`) runs GPU interpret mode on CPU, with P staged through shared
    memory. Raises NotImplementedError for what the kernel lacks (see `unsupported`)
    and ValueError when the config does not fit in shared memory.
    """
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    masks.check_shapes(q, k, q_len, kv_len, segments)
    reason = unsupported(
        q.dtype,
        H,
        spec,
        segments=segments is not None,
        dropout=dropout_rate > 0 or seeds is not None,
        bias=bias is not None,
        mask=mask is not None,
        softcap=logits.softcap is not None,
    )
    if reason is None and layout is not None:
        reason = "block_sparse not supported by the Mosaic kernel yet"
    if reason is not None:
        raise NotImplementedError(reason)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    if interpret is not False:  # the interpreter's wgmma reads A from shared memory only
        # (nor does it run inline PTX: the turns take the mbarrier there; they order work,
        # not data, so the numbers are the same)
        # Three consumers' turns go round on named barriers alone: there, no ping-pong.
        # Nor has it global semaphores: tail_fixup's merge in the kernel becomes XLA's
        # after it (the same values up to float32 rounding).
        config = dataclasses.replace(
            config,
            tail_fixup=False,
            p_in_registers=False,
            q_register_cols=0,
            named_turns=False,
            named_releases=False,
            schedule_barrier=config.schedule_barrier and config.consumers == 2,
        )
    hp = padded_head_dim(H)
    if config.q_register_cols > hp:
        raise ValueError(
            f"q_register_cols={config.q_register_cols} exceeds the head dim ({hp} padded)"
        )
    if config.early_q_load and not config.o_apart(hp, q.dtype.itemsize):
        raise ValueError(
            f"early_q_load needs O out of Q's buffer, and at head dim {hp} O has no "
            "shared-memory buffer of its own: set o_from_registers too"
        )
    if config.smem_bytes(hp) > SMEM_BYTES:
        raise ValueError(
            f"{config} needs {config.smem_bytes(hp)} bytes of shared memory at head dim "
            f"{hp}, more than the {SMEM_BYTES} of a Hopper SM: lower block_kv or num_stages"
        )

    consumers = config.consumers
    rows = consumers * config.block_q  # query rows per CTA
    # The key tiles are walked per range row: a CTA's rows, or a cluster's (kv_multicast).
    range_rows = rows * (2 if config.kv_multicast else 1)
    t_pad = -(-T // range_rows) * range_rows
    s_pad = -(-S // config.block_kv) * config.block_kv
    num_q_tiles = t_pad // rows
    q, k, v = pad_to(q, t_pad, hp), pad_to(k, s_pad, hp), pad_to(v, s_pad, hp)
    if segments is not None:
        segments = tuple(x.astype(jnp.int32) for x in segments)
    ranges = kv_tile_ranges(spec, q_len, kv_len, segments, t_pad, range_rows, config.block_kv)
    seg_inputs = ()
    if segments is not None:
        q_seg, kv_seg = segments
        seg_inputs = (
            jnp.pad(q_seg, [(0, 0), (0, t_pad - T)], mode="edge"),
            jnp.pad(kv_seg, [(0, 0), (0, s_pad - S)], mode="edge"),
        )
    if walks_own_keys(config, spec):  # beside each pair's range, its tiles': [B, pairs, 12]
        # (the query ids padded to t_pad: a pair's second tile may start past T)
        tile_segs = None if segments is None else (seg_inputs[0], segments[1])
        own = kv_tile_ranges(spec, q_len, kv_len, tile_segs, t_pad, rows, config.block_kv)
        ranges = jnp.concatenate([ranges, own.reshape(B, t_pad // range_rows, 8)], axis=-1)

    transforms = swizzled(q.dtype.itemsize)
    stages = config.num_stages
    free_barrier, cluster = pair_cluster(config.kv_multicast)
    scratch = dict(
        qo_smem=plgpu.SMEM((consumers, config.block_q, hp), q.dtype, transforms=transforms),
        k_smem=plgpu.SMEM((stages, config.block_kv, hp), q.dtype, transforms=transforms),
        v_smem=plgpu.SMEM((stages, config.block_kv, hp), q.dtype, transforms=transforms),
        p_smem=None
        if config.p_in_registers
        else plgpu.SMEM(
            (
                consumers,
                *((2,) if config.intra_overlap else ()),
                config.block_q,
                config.block_kv,
            ),
            q.dtype,
            transforms=transforms,
        ),
        lse_smem=plgpu.SMEM((consumers, config.block_q), jnp.float32),
        # row_sum_wgmma: ones [8, 256], whose first 64 columns are read transposed as
        # P's right operand.
        ones_smem=plgpu.SMEM((consumers, *config.ones_tile), q.dtype, transforms=transforms)
        if config.row_sum_wgmma
        else None,
        q_seg_smem=plgpu.SMEM((consumers, config.block_q), jnp.int32) if seg_inputs else None,
        kv_seg_smem=plgpu.SMEM((stages, config.block_kv), jnp.int32) if seg_inputs else None,
        # With segment ids, their copies complete the Q and K barriers too.
        q_ready=plgpu.Barrier(num_arrivals=1 + bool(seg_inputs), num_barriers=consumers),
        k_ready=plgpu.Barrier(num_arrivals=1 + bool(seg_inputs), num_barriers=stages),
        v_ready=plgpu.Barrier(num_barriers=stages),
        k_free=free_barrier(num_arrivals=consumers, num_barriers=stages),
        v_free=free_barrier(num_arrivals=consumers, num_barriers=stages),
        turns=plgpu.Barrier(num_arrivals=consumers) if config.schedule_barrier else None,
        o_smem=plgpu.SMEM((consumers, config.block_q, hp), q.dtype, transforms=transforms)
        if config.o_buffer(hp, q.dtype.itemsize)
        else None,
    )
    # An item is a query tile, or with kv_multicast a cluster's pair of them (its keys a
    # range row's): `units` per (batch, head).
    units = t_pad // range_rows
    num_items = N * units * B
    if config.persistent:  # one CTA per SM at most (the kernel fills an SM's registers)
        ctas = _PERSISTENT_CTAS if interpret is not False else sm_count()
        if config.kv_multicast and interpret is False:  # the grid counts clusters of two
            ctas //= 2  # (interpret mode: _PERSISTENT_CTAS clusters, several items each)
        num_ctas = min(num_items, ctas)
        grid, grid_names = (num_ctas,), ("cta",)
    else:
        num_ctas = num_items  # (kv_multicast: the q_tiles axis counts clusters of two)
        grid, grid_names = (N, units, B), ("heads", "q_tiles", "batch")
    # split_tail: the last round's items in pieces over every CTA (split_tail.py); each
    # piece's O and logsumexp go out apart, [CTA, piece, rows(, H)], merged below.
    tail = None
    if config.split_tail:  # persistent (MosaicConfig checks it); None when rounds are whole
        tail = split_tail.plan(num_items, num_ctas, s_pad // config.block_kv)
    # head_rounds: which item each CTA walks when, from a table (causal; without the mask
    # the persistent order is head order already).
    order_inputs = ()
    if config.head_rounds and spec.causal:  # persistent (MosaicConfig checks it)
        if config.greedy_items:  # a list schedule: per-CTA counts, then the items
            costs = nominal_key_tiles(spec, T, S, units, range_rows, config.block_kv)
            table = jnp.asarray(greedy_items_order(costs, N, B, num_ctas))
        elif config.order_ranges:  # each item's key range and lengths in its row
            order = head_rounds_order(B * N, units, num_ctas)
            table = order_rows(order, ranges, q_len, kv_len, N, units)
        else:
            table = jnp.asarray(head_rounds_order(B * N, units, num_ctas))
        order_inputs = (table,)
    tail_inputs, tail_outputs = (), ()
    fixup = tail is not None and config.tail_fixup
    if tail is not None:
        tail_inputs = (jnp.asarray(tail.pieces),)
        # The pieces' O and logsumexp: each CTA's (XLA merges them), or with tail_fixup
        # each split item's pieces but its first (the first merges them in the kernel).
        # kv_multicast: a row per tile of each item or cluster (fwd_kernel's `own`)
        tiles = 2 if config.kv_multicast else 1
        shape = (
            (len(tail.items) * tiles, max(tail.parts.shape[1] - 1, 1), rows)
            if fixup
            else (num_ctas * tiles, split_tail.PIECES_PER_CTA, rows)
        )
        tail_outputs = (
            jax.ShapeDtypeStruct((*shape, hp), jnp.float32),
            jax.ShapeDtypeStruct(shape, jnp.float32),
        )
    kernel = functools.partial(
        fwd_kernel,
        spec=spec,
        scale=scale,
        config=config,
        num_q_tiles=num_q_tiles,
        group=N // K,
        heads=N,
        batch=B,
        num_ctas=num_ctas,
        compiled=interpret is False,
        tail_rounds=None if tail is None else tail.rounds,
        fixup_items=len(tail.items) * tiles if fixup else 0,
        head_rounds=bool(order_inputs),
    )
    o, lse, *pieces = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((B, t_pad, N, hp), q.dtype),
            jax.ShapeDtypeStruct((B, N, t_pad), jnp.float32),
            *tail_outputs,
        ),
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=None if interpret is False else interpret,
        kernel_name="pallas_flash_mosaic_fwd",
        **cluster,
    )(
        q_len.astype(jnp.int32),
        kv_len.astype(jnp.int32),
        ranges,
        q,
        k,
        v,
        *seg_inputs,
        *tail_inputs,
        *order_inputs,
    )
    if tail is not None and not fixup:
        coords = split_tail.item_coords(tail.items, N, B, units, spec.causal)
        if config.kv_multicast:  # the items are pairs of tiles, the pieces a tile's
            tail, coords = split_tail.per_tile(tail, coords)
        o, lse = split_tail.combine(o, lse, *pieces, tail, coords, rows)
    return o[:, :T, :, :H], lse[:, :, :T]
