"""How the Triton kernels should read a boolean mask: the layouts side by side, one run.

    python -m benchmarks.mask_layouts --out F.jsonl [--tiny]

Issue 4 allows a boolean mask 25 % over the unmasked kernel; the forward measured 1.28x
with the mask bit-packed along the keys (`masks-38e3e75.jsonl`). Which part costs was
not known: the bytes, spreading the bits over the tile, or the select on every score.
This times the forward, backward and both with each layout below, each checked against
the float32 reference first, against the unmasked kernel of the same run:

- `bits-rows`: the library's layout (masks.pack_mask_bits along T, axis=-2, 16 query
  rows per int16 word); a tile loads [block_q / 16, block_kv] words and spreads them
  with a broadcast, an AND and a reshape that merges leading axes only.
- `bits-keys`: 16 keys per int16 word (packed along S, axis=-1), spread with a
  broadcast, an AND and a reshape that splits the key axis: the library's layout from
  fa74dc8 until `bits-rows` replaced it, and still its layout for masks constant along T
  (key padding, [B, 1, 1, S]).
- `bits-keys-gather`: the same words, read with one (cached) load per score whose column
  picks its word and bit: no reshape, more load instructions.
- `bytes`: one int8 per (query, key), the layout before fa74dc8 (8x the bytes).

On the H200 at T = 8k (`mask-layouts-a5fdc5b.jsonl`, when the library still read
`bits-keys`) bits along the rows cost 1.16-1.18x the unmasked forward and 1.07-1.10x the
backward, bits along the keys 1.29x and 1.14-1.23x; so the library's layout is now
`bits-rows`.

Each layout is installed by swapping the three functions that define it (the packing in
`vjp.kernel_mask`, the kernels' `mask_inputs` and `load_mask_tile`) while its calls
are traced; `bits-rows` installs the library's own three as they are. Only masks that
vary along both T and S are served by the alternatives (the suite's [B, 1, T, S] masks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_flash import masks, vjp
from pallas_flash.triton import backward, common, forward

W = masks.MASK_WORD_BITS


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    pack: Callable | None  # bool [.., T, S] -> the array the kernels read; None: the library's
    inputs: Callable  # common.mask_inputs's signature
    load: Callable  # common.load_mask_tile's signature -> bool [block_r, block_c]


def _both_full(dims) -> None:
    if not (dims[2] and dims[3]):
        raise NotImplementedError("this layout serves masks that vary along T and S only")


def _keys_pack(mask):
    return masks.pack_mask_bits(mask, axis=-1)


def _keys_inputs(mask, dims, t_pad, s_pad, batch_of, head_of, head_block=None):
    _both_full(dims)
    return common.mask_inputs(mask, dims, t_pad, s_pad, batch_of, head_of, head_block, axis=-1)


def _keys_load(ref, head, r0, c0, block_r, block_c, seq_r, seq_c, dims):
    _both_full(dims)
    return common.load_mask_tile(ref, head, r0, c0, block_r, block_c, seq_r, seq_c, dims, axis=-1)


def _gather_load(ref, head, r0, c0, block_r, block_c, seq_r, seq_c, dims):
    _both_full(dims)
    cols = c0 + jnp.arange(block_c)
    word = cols // W  # [block_c]: each score's word, its bit is cols % W
    valid = (word < -(-seq_c // W))[None, :]
    if seq_r % block_r:
        valid = valid & (r0 + jnp.arange(block_r) < seq_r)[:, None]
    # Index arrays on both axes (interpret mode gathers only when no axis is a slice).
    rows = (r0 + jnp.arange(block_r))[:, None]
    idx = (rows, word[None, :]) if head is None else (jnp.int32(head), rows, word[None, :])
    words = plgpu.load(ref.at[idx], mask=valid, other=0).astype(jnp.int32)  # [block_r, block_c]
    return (words >> (cols % W)[None, :]) & 1 != 0


def _bytes_inputs(mask, dims, t_pad, s_pad, batch_of, head_of, head_block=None):
    return common.broadcast_inputs(mask, dims, t_pad, s_pad, batch_of, head_of, head_block)


def _bytes_load(ref, head, r0, c0, block_r, block_c, seq_r, seq_c, dims):
    return common.load_broadcast_tile(ref, head, r0, c0, block_r, block_c, seq_r, seq_c, dims) != 0


LAYOUTS = {
    "bits-keys": Layout("bits-keys", _keys_pack, _keys_inputs, _keys_load),
    "bits-keys-gather": Layout("bits-keys-gather", _keys_pack, _keys_inputs, _gather_load),
    "bits-rows": Layout("bits-rows", None, common.mask_inputs, common.load_mask_tile),
    "bytes": Layout("bytes", lambda m: m.astype(jnp.int8), _bytes_inputs, _bytes_load),
}


@contextlib.contextmanager
def installed(layout: Layout):
    """The Triton kernels read the mask in `layout` for calls traced inside."""
    library_kernel_mask = vjp.kernel_mask

    def kernel_mask(plan, mask):
        if mask is not None and plan.backend == "triton" and layout.pack is not None:
            return layout.pack(mask)
        return library_kernel_mask(plan, mask)

    swaps = [(vjp, "kernel_mask", kernel_mask)]
    for module in (forward, backward):
        swaps += [(module, "mask_inputs", layout.inputs), (module, "load_mask_tile", layout.load)]
    saved = [(m, name, getattr(m, name)) for m, name, _ in swaps]
    try:
        for m, name, fn in swaps:
            setattr(m, name, fn)
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


def shapes(tiny: bool):
    from benchmarks import suites

    if tiny:  # one causal shape: masked and unmasked tiles, ragged against every tile size
        return [suites.Shape(1, 80, 72, 2, 1, 32, True, "mask", dtype=jnp.float32)]
    base = suites.Shape(2, 8192, 8192, 16, 16, 128, False)  # the masks suite's shape
    return [base.replace(causal=c, mask=m) for c in (False, True) for m in ("mask-full", "mask")]


def main(argv=None) -> int:
    from benchmarks import bench
    from benchmarks.impls import IMPLS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSONL file to append to")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, CPU interpret mode")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--commit", default=None)
    parser.add_argument("--run-id", default=None)
    args = parser.parse_args(argv)
    impl = IMPLS["pallas_flash:triton"]
    env = bench.environment(args.commit)
    run_id = args.run_id or time.strftime("%Y%m%d-%H%M%S")
    passes = ("fwd", "bwd", "fwd+bwd")
    todo = [(None, s.replace(mask="none")) for s in shapes(args.tiny) if s.mask == "mask"]
    todo += [(name, s) for name in args.layouts.split(",") for s in shapes(args.tiny)]
    with contextlib.ExitStack() as files:
        out = files.enter_context(open(args.out, "a")) if args.out else None
        for name, s in todo:
            with installed(LAYOUTS[name]) if name else contextlib.nullcontext():
                timing = bench.TINY_TIMING if args.tiny else None
                rows = bench.run_shape(
                    impl, s, passes, memory=False, run=True, checked={}, timing=timing
                )
                for row in rows:
                    row = dict(run_id=run_id, suite="mask-layouts", **env, layout=name, **row)
                    print(f"{name or 'unmasked':18s} {bench._summary(row)}", flush=True)
                    if out:
                        out.write(json.dumps(row) + "\n")
                        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
