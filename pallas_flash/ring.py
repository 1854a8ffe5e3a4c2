"""Context-parallel ring attention: the sequence sharded over one mesh axis.

Ring attention (Liu et al., 2023, "Ring Attention with Blockwise Transformers"), with
the zig-zag layout for causal balance (as in Megatron's context parallelism and
zhuzilin/ring-flash-attention). Each of the P devices of the axis keeps its query
shard; the key/value shards travel round the ring (`lax.ppermute`, device p sends to
p + 1), so at step s device p holds the shard of device p - s. Each step runs our
FlashAttention kernel on (local queries, visiting keys), and the partial results merge
exactly through their logsumexps:

    lse = logsumexp_s lse_s,    o = sum_s exp(lse_s - lse) o_s

The next shard's transfer does not depend on the current step's kernel, so XLA may
overlap the two.

Backward (one custom_vjp round the whole ring, no per-step residuals): it saves the
ring-layout q, k, v shards, the output and the merged lse, and step s's share of the
gradients is exactly what the kernels' backward pass computes from (q, the visiting k
and v, lse, dO, D): it rebuilds P = exp(S - lse) for that shard's keys with the global
lse, and D = rowsum(dO * O) - dlse is global (computed once, in natural order). The
key/value shards go round the ring once more, each with its dK/dV accumulator, which
collects every device's contribution and takes one last hop home; dQ stays.

Memory, per device, in units of its query shard (the bytes of q / P; with MHA and
16-bit inputs a k or v shard is one unit too, with GQA K/N of one). Beyond the inputs,
the outputs and the gradients, the ring holds
  - ring-layout copies of q, k, v (saved for the backward) and, in the backward, of dO:
    up to 4 (arrays in natural order cannot be permuted in place);
  - the visiting k, v shard and the next one in flight: 2 + 2, the double buffer that
    lets each transfer overlap a step's kernels;
  - float32 accumulators (P > 2): the forward's o (2); the backward's dq (2) and the
    visiting shard's dk, dv (4), plus the buffers receiving them as they cross to the
    next device (2 to 4: XLA's CPU sends dK, then dV). They cross after the step's
    kernels, not during them: in flight during them, two whole accumulators would be
    live throughout (8);
  - one step's kernel outputs (up to 3).
A ring of 2 needs no float32 accumulator: each of its sums is final when formed, so
rounding it once to the inputs' dtype is what a float32 accumulator would give. The
compiled forward+backward, with the kernels as the opaque calls they are on a GPU
(`python -m benchmarks.ring --memory ... --opaque`, tests/test_ring.py), allocates
7.6 units on 2 devices (the version before, 12.0; an earlier one measured 12.05 on
2 H200s at T = 1M) and 14.1 on 4 or 8 (11 live at once, the rest the allocator's
packing), against flash_attention's 0.03 on one device; with GQA (K = N/4), 4.6 and
6.6. Accumulating
dK/dV in the inputs' dtype would save 3.5 units at P >= 4 but, at P = 8, makes their
error 1.2-1.5x the float32 ring's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from pallas_flash import api, configs, masks, vjp

IMPLEMENTATIONS = ("triton", "xla_blockwise")
LAYOUTS = ("zigzag", "contiguous")


def ring_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K H"],
    *,
    mesh: Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[Array, " B"] | None = None,
    key_value_seq_lengths: Int[Array, " B"] | None = None,
    layout: Literal["zigzag", "contiguous"] | None = None,
    implementation: Literal["triton", "xla_blockwise"] | None = None,
    return_residual: bool = False,
):
    """`flash_attention` with the sequence axis sharded over the mesh axis `axis_name`.

    The same result as `flash_attention(query, key, value, ...)` on the full arrays
    (up to rounding: the partial outputs are merged in float32), computed by P devices
    (P = mesh.shape[axis_name]) that each hold 1/P of the queries, keys and values and
    pass the keys and values round a ring. Arrays go in and come out in natural
    sequence order (sharded over `axis_name` along the sequence, or to be resharded
    so); the zigzag layout below is reached inside, each device sending its two
    chunks to their zigzag places (and the outputs back): two small transfers, no
    gather of the sequence.

    Layouts: the sequence is cut into P chunks (contiguous: device p holds chunk p) or
    2P chunks (zigzag: device p holds chunks p and 2P-1-p):

        contiguous, P=4:                             zigzag, P=4:
        | 0       | 1       | 2       | 3       |    | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
          dev 0     dev 1     dev 2     dev 3          d0  d1  d2  d3  d3  d2  d1  d0

    Causal attention with the contiguous layout gives device p the work of p + 1/2
    shard pairs, and the ring waits for the last device (P - 1/2); the zigzag layout
    gives every device P/2. For each (query chunk, key chunk) pair the causal mask is
    one of

        earlier key chunk      same chunk         later key chunk
          x x x x              x . . .            . . . .
          x x x x              x x . .            . . . .     <- skipped: never
          x x x x              x x x .            . . . .        computed
          x x x x              x x x x            . . . .

    so a step runs, per device, either the causal kernel on its own shard, or the
    unmasked kernel on the part of the visiting shard that its queries see (zigzag:
    all its queries against the visitor's first chunk, or its second query chunk
    against both of the visitor's chunks; both are half a shard pair of work).

    Args:
      query: [B, T, N, H] bfloat16, float16 or float32; T a multiple of P (contiguous)
        or of 2P (zigzag).
      key: [B, S, K, H], same dtype, N % K == 0 (GQA and MQA need no repeated K/V);
        S likewise a multiple of P or 2P, and S == T when causal.
      value: [B, S, K, H], same dtype and shape as key.
      mesh: the device mesh; other axes than `axis_name` replicate the computation.
      axis_name: the mesh axis the sequence is sharded over (the ring).
      batch_axis: a mesh axis the batch is sharded over (data parallelism): each of its
        groups runs its own ring on its own rows. None: the batch is not sharded (every
        group of the other axes computes the whole batch).
      scale: the softmax scale; default 1 / sqrt(H).
      is_causal: query i attends keys j <= i (jax.nn's top-left alignment).
      query_seq_lengths: int [B], valid query lengths (global positions, as in
        `flash_attention`): rows at or past it give output 0 and logsumexp -inf.
      key_value_seq_lengths: int [B], valid key lengths (global positions).
      layout: "zigzag" or "contiguous"; None picks zigzag when causal (balance) and
        contiguous otherwise (no permutation needed).
      implementation: the per-shard kernel backend, "triton" or "xla_blockwise"; None
        picks "triton" on GPU meshes and "xla_blockwise" elsewhere.
      return_residual: also return the logsumexp, [B, T, N] float32 (differentiable).

    Returns:
      The output [B, T, N, H] in query's dtype, and with `return_residual` also the
      logsumexp [B, T, N] float32.

    Raises:
      TypeError: an argument has the wrong type or dtype.
      ValueError: an argument has the wrong shape or value (named in the message).
      NotImplementedError: the named implementation cannot run on the mesh's devices.
    """
    ring, scale = _validate(
        query,
        key,
        value,
        mesh,
        axis_name,
        batch_axis,
        scale,
        is_causal,
        query_seq_lengths,
        key_value_seq_lengths,
        layout,
        implementation,
        return_residual,
    )
    B, T, _, H = query.shape
    S = key.shape[1]
    q_lens, kv_lens = masks.lengths_or_full(query_seq_lengths, key_value_seq_lengths, B, T, S)
    ring = _with_plans(ring, H, query.dtype, scale)

    seq = P(batch_axis, axis_name)  # the sequence over the ring (the batch over batch_axis)
    rows = P(batch_axis)
    shard_fn = jax.shard_map(
        functools.partial(_ring, ring),
        mesh=mesh,
        in_specs=(seq, seq, seq, rows, rows),
        out_specs=(seq, seq),
        # Pallas calls carry no varying-across-devices types; the ring's data flow is
        # written out by hand (every array here is per device), so nothing is lost.
        check_vma=False,
    )
    o, lse = shard_fn(query, key, value, q_lens, kv_lens)
    return (o, lse) if return_residual else o


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Ring:
    """The static facts of one call: the ring, the layout, and the kernels' plans."""

    axis: str
    size: int  # P, the number of devices on the ring
    layout: str
    causal: bool
    backend: str
    interpret: bool
    cpu: bool  # host devices: 16-bit floats cross the ring as uint16 (see _ppermute)
    full: vjp.Plan | None = None  # no mask (lengths only)
    diagonal: vjp.Plan | None = None  # causal, for a shard against itself


class _Block(NamedTuple):
    """Local query rows [q0, T) against the visiting keys [0, k1) (or the own shard's,
    causal): every block the ring computes is a suffix of rows against a prefix of
    keys. Rows are sliced; keys are cut by their length or sliced (see _keys)."""

    q0: int
    k1: int
    causal: bool = False


class _Steps(NamedTuple):
    """The block each kind of step computes (None: nothing, the pair is fully masked).

    `own`: step 0, a shard against itself; `earlier` / `later`: a visiting shard from
    a device before / after this one on the axis.
    """

    own: _Block
    earlier: _Block | None
    later: _Block | None


def _steps(ring: _Ring, T: int, S: int) -> _Steps:
    full = _Block(0, S)
    if not ring.causal:
        return _Steps(full, full, full)
    own = _Block(0, S, causal=True)
    if ring.layout == "contiguous":  # an earlier shard is all visible, a later one all masked
        return _Steps(own, full, None)
    # zigzag: this device holds chunks (p, 2P-1-p), a visitor from device j holds
    # (j, 2P-1-j). If j < p, chunk j precedes both of ours and chunk 2P-1-j follows
    # both: all queries see the visitor's first half. If j > p, both visiting chunks
    # lie between ours: our second chunk sees all of them, our first none.
    return _Steps(own, _Block(0, S // 2), _Block(T // 2, S))


def _with_plans(ring: _Ring, head_dim: int, dtype, scale: float) -> _Ring:
    """Adds the kernels' plans: default tile configs, as flash_attention picks them."""
    if ring.backend == "triton":
        fwd = configs.default_triton_config(head_dim, dtype)
        bwd = configs.default_triton_bwd_config(head_dim, dtype)
    else:
        fwd = bwd = configs.BlockwiseConfig()
    full = vjp.Plan(
        backend=ring.backend,
        spec=masks.MaskSpec(),
        scale=scale,
        fwd_config=fwd,
        bwd_config=bwd,
        interpret=ring.interpret,
    )
    diagonal = dataclasses.replace(full, spec=masks.MaskSpec(causal=True))
    return dataclasses.replace(ring, full=full, diagonal=diagonal)


def _chunk_perms(size: int):
    """The two ppermutes that take natural order to zigzag order: device d holds chunks
    (2d, 2d+1) and sends the even one with the first, the odd one with the second (each
    device receives one of each: of its chunks p and 2P-1-p, one is even)."""
    home = lambda m: m if m < size else 2 * size - 1 - m  # noqa: E731 - chunk m's device
    return tuple([(d, home(2 * d + odd)) for d in range(size)] for odd in (0, 1))


def _to_ring(ring: _Ring, x):
    """Per device: its natural shard (chunks 2d, 2d+1) -> its ring-layout shard
    (zigzag: chunks p, 2P-1-p; contiguous: unchanged). Along axis 1."""
    if ring.layout == "contiguous":
        return x
    even_perm, odd_perm = _chunk_perms(ring.size)
    first, second = jnp.split(x, 2, axis=1)
    even = _ppermute(ring, first, even_perm)
    odd = _ppermute(ring, second, odd_perm)
    p_even = lax.axis_index(ring.axis) % 2 == 0  # then chunk p is the even one
    return jnp.where(p_even, jnp.concatenate([even, odd], 1), jnp.concatenate([odd, even], 1))


def _from_ring(ring: _Ring, x):
    """The inverse of `_to_ring`."""
    if ring.layout == "contiguous":
        return x
    even_perm, odd_perm = _chunk_perms(ring.size)
    inverse = lambda perm: [(dst, src) for src, dst in perm]  # noqa: E731
    first, second = jnp.split(x, 2, axis=1)  # chunks p and 2P-1-p
    p_even = lax.axis_index(ring.axis) % 2 == 0
    even = _ppermute(ring, jnp.where(p_even, first, second), inverse(even_perm))
    odd = _ppermute(ring, jnp.where(p_even, second, first), inverse(odd_perm))
    return jnp.concatenate([even, odd], axis=1)


def _local_lengths(ring: _Ring, lengths, owner, local: int):
    """Global valid lengths [B] -> valid rows of device `owner`'s shard of `local` rows.

    Within a shard the valid rows are a prefix: zigzag chunk p precedes chunk 2P-1-p, so
    the second chunk has valid rows only if the first is all valid.
    """
    if ring.layout == "contiguous":
        return jnp.clip(lengths - owner * local, 0, local)
    c = local // 2
    first = jnp.clip(lengths - owner * c, 0, c)
    second = jnp.clip(lengths - (2 * ring.size - 1 - owner) * c, 0, c)
    return first + second


def _keys(ring: _Ring, blk: _Block, k, v):
    """The block's keys and values: all of them, cut by the length (the Triton kernels
    skip the masked tiles; no copy), or sliced (the blockwise backend's scan would
    compute every tile)."""
    if ring.backend == "triton":
        return k, v
    return k[:, : blk.k1], v[:, : blk.k1]


def _block_lengths(blk: _Block, q_len, kv_len):
    """Valid rows of the block's queries and keys, from those of the whole shards."""
    return jnp.clip(q_len - blk.q0, 0, None), jnp.minimum(kv_len, blk.k1)


def _pad_rows(x, q0: int, axis: int, fill):
    """A block's per-row result, rows [q0, T), padded in front to all T rows with `fill`."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (q0, 0)
    return jnp.pad(x, pad, constant_values=fill) if q0 else x


def _ppermute(ring: _Ring, x, perm):
    """lax.ppermute over the ring's axis. On CPU, 16-bit floats travel as uint16: XLA's
    CPU backend widens 16-bit float collectives to float32 (two float32 copies of the
    payload, four times its bytes), which would also make the compiled memory measured
    on CPU overstate what the GPU's collectives hold."""
    if ring.cpu and x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = lax.ppermute(lax.bitcast_convert_type(x, jnp.uint16), ring.axis, perm)
        return lax.bitcast_convert_type(bits, x.dtype)
    return lax.ppermute(x, ring.axis, perm)


def _rotate(ring: _Ring, x):
    """Sends a pytree to the next device on the ring (and receives the previous one's)."""
    perm = [(p, (p + 1) % ring.size) for p in range(ring.size)]
    return jax.tree.map(lambda a: _ppermute(ring, a, perm), x)


def _step(ring: _Ring, run, s, T: int, S: int):
    """`run(block)` for step s (0: own shard; s >= 1: the shard of device me - s): its
    partial results, each for all T local rows (`run(None)`: those of no keys)."""
    kinds = _steps(ring, T, S)
    if isinstance(s, int) and s == 0:
        return run(kinds.own)
    if kinds.earlier == kinds.later:
        return run(kinds.earlier)
    # The visitor comes from device me - s; it is earlier on the axis when s <= me.
    # All devices run the same kernels, on different branches of this cond. Only the
    # kernels are inside it: the accumulators are updated after it, in place (XLA
    # copied accumulators that the branches updated, and kept both copies live).
    earlier = s <= lax.axis_index(ring.axis)
    return lax.cond(earlier, lambda: run(kinds.earlier), lambda: run(kinds.later))


def _ring_steps(ring: _Ring, step, first, kv, send=lambda acc: acc):
    """Steps 1 .. P-1 of a ring pass, after step 0 (the own shard) gave `first`.

    `step(s, acc, kv, dtypes)` folds step s (the visiting shard `kv`) into the running
    accumulator `acc` (a pytree) and returns it, written in `dtypes` (a pytree like
    it); `send(acc)` is what crosses between step 0 and step 1. Accumulators are
    float32 while their sums will receive more. Step 0's are single kernel outputs,
    exact in the inputs' dtypes: they cross in them and are widened on arrival. In a
    ring of 2 the sums of step 1 are final, so it never widens. Steps 1 .. P-2 run as
    one loop (one compiled copy of a step); the last is peeled off (it sends no keys on
    and writes the final dtypes). Each step sends the visiting shard on before its
    kernels run, so that the transfer may overlap them: the ring's one double buffer.
    """
    if ring.size == 1:
        return first
    final = jax.tree.map(lambda a: a.dtype, first)
    wide = jax.tree.map(lambda a: jnp.dtype(jnp.float32), first)
    acc, kv = send(first), _rotate(ring, kv)  # a single partial result: exact in its dtype
    if ring.size > 2:
        acc = jax.tree.map(lambda a: a.astype(jnp.float32), acc)

        def body(s, carry):
            acc, kv = carry
            after = _rotate(ring, kv)  # in flight while this step computes
            return step(*_after(s, acc), kv, wide), after

        acc, kv = lax.fori_loop(1, ring.size - 1, body, (acc, kv))
    return step(*_after(ring.size - 1, acc), kv, final)


def _after(s, acc):
    """(s, acc), with the step number available only once acc is: a step's kernels
    (whose lengths derive from s) then run after the previous step has been folded
    in. XLA would otherwise be free to interleave two steps' kernels, whose results
    meet only in a sum, and hold both steps' temporaries at once (with the blockwise
    backend, 7 more shards on 2 devices)."""
    return lax.optimization_barrier((jnp.asarray(s, jnp.int32), acc))


def _add(acc, part, dtype):
    """acc + part, summed in float32 and written in `dtype` (in place in acc)."""
    return (acc.astype(jnp.float32) + part.astype(jnp.float32)).astype(dtype)


def _merge(o, lse, o_s, lse_s):
    """Two partial results of the same rows -> one (float32): o [B, T, N, H], lse [B, N, T]."""
    new = jnp.logaddexp(lse, lse_s)  # -inf where both are: a row with no key yet
    safe = jnp.where(jnp.isneginf(new), 0.0, new)  # then both weights are exp(-inf) = 0

    def weight(x):  # [B, N, T] -> [B, T, N, 1]
        return jnp.swapaxes(jnp.exp(x - safe), 1, 2)[..., None]

    return o.astype(jnp.float32) * weight(lse) + o_s.astype(jnp.float32) * weight(lse_s), new


def _forward(ring: _Ring, q, k, v, q_len, kv_lens):
    """The ring in ring layout: (o [B, T, N, H] in q's dtype, lse [B, N, T] float32)."""
    B, T, N, H = q.shape
    S = k.shape[1]
    me = lax.axis_index(ring.axis)

    def attend(s, acc, kv, dtypes=None):
        """Step s's partial result merged into acc = (o, lse), written in `dtypes`;
        step 0 (acc None) gives the own shard's."""
        k_s, v_s = kv
        kv_len = _local_lengths(ring, kv_lens, (me - s) % ring.size, S)

        def run(blk: _Block | None):
            if blk is None:  # no keys: o = 0, lse = -inf, which merging leaves unseen
                return jnp.zeros_like(q), jnp.full((B, N, T), -jnp.inf)
            plan = ring.diagonal if blk.causal else ring.full
            o_s, lse_s = vjp.kernels(plan)[0](
                q[:, blk.q0 :],
                *_keys(ring, blk, k_s, v_s),
                *_block_lengths(blk, q_len, kv_len),
                *(None,) * 5,
            )
            return _pad_rows(o_s, blk.q0, 1, 0), _pad_rows(lse_s, blk.q0, 2, -jnp.inf)

        o_s, lse_s = _step(ring, run, s, T, S)
        if acc is None:
            return o_s, lse_s
        o, lse = _merge(*acc, o_s, lse_s)
        return o.astype(dtypes[0]), lse

    return _ring_steps(ring, attend, attend(0, None, (k, v)), (k, v))


def _backward(ring: _Ring, q, k, v, lse, do, delta, q_len, kv_lens):
    """The ring's backward pass in ring layout: (dq, dk, dv) in the inputs' dtypes.

    The keys and values go round once more, each shard with its (dK, dV) accumulator,
    which collects every device's share and takes one last hop home; dQ stays.
    `delta` is D = rowsum(dO * O) - dlse [B, N, T], computed once by the caller: the
    kernels use O only through D, so they get O = 0 and dlse = -D (exactly D again),
    and no ring-layout copy of O is needed.
    """
    T, S = q.shape[1], k.shape[1]
    me = lax.axis_index(ring.axis)

    def grads(s, acc, kv, dtypes=None):
        """Step s's share added to acc = (dq, (dk, dv)), written in `dtypes`: dq of this
        device's queries, (dk, dv) of the visiting shard; step 0 (acc None) gives the
        own shard's."""
        k_s, v_s = kv
        kv_len = _local_lengths(ring, kv_lens, (me - s) % ring.size, S)

        def run(blk: _Block | None):
            if blk is None:
                return jnp.zeros_like(q), jnp.zeros_like(k_s), jnp.zeros_like(v_s)
            plan = ring.diagonal if blk.causal else ring.full
            rows = slice(blk.q0, None)
            dq_s, dk_s, dv_s, _ = vjp.kernels(plan)[1](
                q[:, rows],
                *_keys(ring, blk, k_s, v_s),
                jnp.zeros_like(q[:, rows]),  # O enters only through D: see the docstring
                lse[:, :, rows],  # the global logsumexp: P is the global softmax's
                do[:, rows],
                -delta[:, :, rows],
                *_block_lengths(blk, q_len, kv_len),
                *(None,) * 5,
            )
            pad = [(0, 0), (0, S - dk_s.shape[1]), (0, 0), (0, 0)]
            return _pad_rows(dq_s, blk.q0, 1, 0), jnp.pad(dk_s, pad), jnp.pad(dv_s, pad)

        dq_s, dk_s, dv_s = _step(ring, run, s, T, S)
        if acc is None:
            return dq_s, (dk_s, dv_s)
        (dq, (dk, dv)), (dq_t, (dk_t, dv_t)) = acc, dtypes
        return _add(dq, dq_s, dq_t), (_add(dk, dk_s, dk_t), _add(dv, dv_s, dv_t))

    def send(acc):
        """The (dK, dV) accumulator goes on with its shard; dQ stays."""
        dq, dkv = acc
        return dq, _rotate(ring, dkv)

    def step(s, acc, kv, dtypes):
        """This device's share added to the accumulator of the shard here, received from
        the device before, and sent on (after the last step it is complete, one hop
        from home: this send takes it there). It is sent after the kernels, not during
        them: a transfer in flight holds two accumulators (in float32, twice the bytes
        of a key and a value shard each), and it is short next to a step's attention."""
        return send(grads(s, acc, kv, dtypes))

    first = grads(0, None, (k, v))
    dq, (dk, dv) = _ring_steps(ring, step, first, (k, v), send)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, q_lens, kv_lens):
    """Per device, natural-order shards: (o [B, T, N, H], lse [B, T, N]) of its queries
    against the whole ring's keys."""
    return _ring_fwd(ring, q, k, v, q_lens, kv_lens)[0]


def _ring_fwd(ring, q, k, v, q_lens, kv_lens):
    me = lax.axis_index(ring.axis)
    q_len = _local_lengths(ring, q_lens, me, q.shape[1])
    q, k, v = (_to_ring(ring, x) for x in (q, k, v))
    o, lse = _forward(ring, q, k, v, q_len, kv_lens)
    out = _from_ring(ring, o), _from_ring(ring, jnp.swapaxes(lse, 1, 2))
    # Saved in ring layout, but for the output: the backward needs q, k, v there (in a
    # model the caller's natural-order arrays can then be freed after the forward) and
    # o only for D = rowsum(dO * O), which is computed in natural order, where dO is.
    return out, (q, k, v, out[0], lse, q_lens, kv_lens)


def _ring_bwd(ring, residuals, cotangents):
    q, k, v, o, lse, q_lens, kv_lens = residuals
    do, dlse = cotangents
    q_len = _local_lengths(ring, q_lens, lax.axis_index(ring.axis), q.shape[1])
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    delta = jnp.einsum("btnh,btnh->btn", f32(o), f32(do), precision=lax.Precision.HIGHEST)
    do, delta = _to_ring(ring, do), _to_ring(ring, delta - dlse)
    grads = _backward(ring, q, k, v, lse, do, jnp.swapaxes(delta, 1, 2), q_len, kv_lens)
    return (*(_from_ring(ring, g) for g in grads), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _validate(
    query,
    key,
    value,
    mesh,
    axis_name,
    batch_axis,
    scale,
    is_causal,
    q_lens,
    kv_lens,
    layout,
    implementation,
    return_residual,
) -> tuple[_Ring, float]:
    """Checks every argument before tracing; returns the ring's static facts and the scale."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS} or None, got "
            f"{implementation!r} (ring attention merges and differentiates through the "
            "kernels' logsumexp, which the 'xla' reference does not provide)"
        )
    # The arrays, lengths, scale and flags: exactly flash_attention's checks and messages.
    call = api._validate(
        query,
        key,
        value,
        None,
        None,
        scale,
        is_causal,
        "top_left",
        q_lens,
        kv_lens,
        None,
        None,
        implementation,
        return_residual,
    )
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    size = mesh.shape[axis_name]
    if batch_axis is not None:
        if batch_axis not in mesh.axis_names or batch_axis == axis_name:
            raise ValueError(
                f"batch_axis={batch_axis!r} must be another axis of the mesh {mesh.axis_names} "
                f"than axis_name={axis_name!r}"
            )
        if query.shape[0] % mesh.shape[batch_axis]:
            raise ValueError(
                f"the batch {query.shape[0]} must be a multiple of the size "
                f"{mesh.shape[batch_axis]} of batch_axis {batch_axis!r}"
            )
    if layout is None:
        layout = "zigzag" if is_causal else "contiguous"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}")
    T, S = query.shape[1], key.shape[1]
    if is_causal and T != S:
        raise ValueError(
            f"is_causal=True needs as many queries as keys (self-attention), got T={T}, S={S}"
        )
    chunks = 2 * size if layout == "zigzag" else size
    for name, length in (("query", T), ("key/value", S)):
        if length % chunks:
            raise ValueError(
                f"the {name} sequence length {length} must be a multiple of {chunks} for "
                f"layout={layout!r} on mesh axis {axis_name!r} of size {size}"
            )
    platform = mesh.devices.flat[0].platform
    backend = implementation or ("triton" if platform == "gpu" else "xla_blockwise")
    if backend == "triton" and platform not in ("gpu", "cpu"):
        raise NotImplementedError(
            f"'triton' runs on NVIDIA GPUs (and in interpret mode on CPU), not {platform}"
        )
    ring = _Ring(
        axis=axis_name,
        size=size,
        layout=layout,
        causal=bool(is_causal),
        backend=backend,
        interpret=backend == "triton" and platform != "gpu",
        cpu=platform == "cpu",
    )
    return ring, call["scale"]
