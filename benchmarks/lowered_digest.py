"""Digests of the Mosaic GPU kernels as lowered for sm_90 on CPU, one line per build.

    python -m benchmarks.lowered_digest > before.txt   # then change the code
    python -m benchmarks.lowered_digest > after.txt && diff before.txt after.txt

For a change that should leave every kernel as it was (moving code between modules,
renaming, a refactor of the Python that builds a kernel): each line is a build (forward
or backward, head dim, mask, config) and a hash of what it lowers to, so an empty diff
says that no build's program changed. A build is a default row of the config tables,
or such a row with one boolean field flipped (every field, so that the code behind each
option is lowered); a flip the config or the kernel refuses hashes its error instead.

What is hashed: each kernel's Mosaic GPU module as MLIR text (`lowered_ops.module_text`,
without source locations, which name the file and line a kernel's code sits at), and
the program around the kernels with those modules left out (their bytecode carries the
locations), and the name a kernel is dumped under (a count of the kernels lowered
before it in the process). GQA, T != S off the tiles and ragged lengths, as the lowering tests take
them; `--quick` lowers the default rows only (about a minute on two cores)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re

import jax
import jax.numpy as jnp

from benchmarks.lowered_ops import _kernel_modules, lower_backward, lower_forward, module_text
from pallas_flash import masks
from pallas_flash.mosaic.bwd_config import (
    MosaicBwdConfig,
    default_mosaic_bwd_config,
    fused_full_bwd_config,
    fused_mosaic_bwd_config,
    pair_mosaic_bwd_config,
)
from pallas_flash.mosaic.config import (
    OVERLAP_REPLACES,
    WITHOUT_PERSISTENT,
    MosaicConfig,
    default_mosaic_config,
)

HEAD_DIMS = (64, 128, 256)
SPECS = {
    "plain": masks.MaskSpec(),
    "causal": masks.MaskSpec(causal=True),
    "segments": masks.MaskSpec(causal=True, segments=True),
    "window": masks.MaskSpec(local_window=(100, 20)),
}
# The backend_config's `module = "..."` strings in the program's text (MLIR bytecode) and
# `kernel_hash = "..."` (a hash of that bytecode): both carry the source locations.
_MODULE_ATTR = re.compile(r'(module|kernel_hash) = "(?:[^"\\]|\\.)*"')
# A kernel module's dump name counts the kernels this process has lowered so far.
_DUMP_NAME = re.compile(r'mosaic_gpu.dump_basename = "[^"]*"')


def _digest(lowered) -> str:
    """A hash of a lowered program's text and of its kernels' modules."""
    digest = hashlib.sha256(_MODULE_ATTR.sub(r"\1", lowered.as_text()).encode())
    for module in _kernel_modules(lowered.compiler_ir()):
        digest.update(_DUMP_NAME.sub("", module_text(module)).encode())
    return digest.hexdigest()[:16]


def _shapes(head_dim: int, seq: int):
    """GQA (4 query heads on 2), T != S and neither a whole number of tiles."""
    q = jax.ShapeDtypeStruct((2, seq + 44, 4, head_dim), jnp.bfloat16)
    return q, jax.ShapeDtypeStruct((2, seq + 1, 2, head_dim), jnp.bfloat16)


def forward_digest(config: MosaicConfig, spec: masks.MaskSpec, head_dim: int, seq: int) -> str:
    return _digest(lower_forward(config, spec, *_shapes(head_dim, seq)))


def backward_digest(config: MosaicBwdConfig, spec: masks.MaskSpec, head_dim: int, seq: int) -> str:
    return _digest(lower_backward(config, spec, *_shapes(head_dim, seq)))


# Flips a default row refuses for the options it carries, and what each takes in their
# place, so that the code behind the flip is lowered too (its label names them).
COMPANIONS = {
    ("intra_overlap", True): OVERLAP_REPLACES,
    ("persistent", False): WITHOUT_PERSISTENT,
    ("schedule_barrier", False): dict(named_turns=False),
    ("early_q_load", True): dict(persistent=True, o_from_registers=True),
    ("query_rows", True): dict(fa3_order=False, share_halves=False),
    ("chained_share", True): dict(share_halves=False, split_writer=False),
    ("probs_before_dp", True): dict(fa3_order=False),
}


def flips(config) -> list[tuple[str, object]]:
    """(label, config) for `config` and for it with each boolean field flipped, or the
    error the flip raises as its config; a refused flip with COMPANIONS is built with
    them (and labelled so)."""
    out = [("default", config)]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not isinstance(value, bool):
            continue
        label, flip = f"{field.name}={not value}", {field.name: not value}
        try:
            out.append((label, dataclasses.replace(config, **flip)))
        except ValueError as e:
            extra = COMPANIONS.get((field.name, not value))
            if extra is None:
                out.append((label, e))
                continue
            names = ", ".join(f"{k}={v}" for k, v in extra.items())
            try:
                out.append((f"{label} with {names}", dataclasses.replace(config, **flip, **extra)))
            except ValueError as e2:
                out.append((f"{label} with {names}", e2))
    return out


def builds(quick: bool):
    """(name, thunk) for every build: its digest, or its error's, when called."""
    for hd in HEAD_DIMS:
        for seq in (256, 2048):
            for label, spec in SPECS.items():
                causal = spec.causal
                fwd = default_mosaic_config(hd, seq, causal)
                yield f"fwd h{hd} s{seq} {label}", (forward_digest, fwd, spec, hd, seq)
                bwd = default_mosaic_bwd_config(hd, causal)
                yield f"bwd h{hd} s{seq} {label}", (backward_digest, bwd, spec, hd, seq)
        if quick:
            continue
        spec = SPECS["causal"]
        for label, config in flips(default_mosaic_config(hd, 2048, True)):
            yield f"fwd h{hd} causal {label}", (forward_digest, config, spec, hd, 2048)
        bases = {"pair": pair_mosaic_bwd_config(hd)}
        if hd <= 128:
            bases["fused"] = fused_mosaic_bwd_config(hd)
        if hd == 128:
            bases["fused-full"] = fused_full_bwd_config(hd)
        for base, row in bases.items():
            for label, config in flips(row):
                yield f"bwd h{hd} causal {base} {label}", (backward_digest, config, spec, hd, 512)


def _run(job) -> str:
    fn, config, *args = job
    if isinstance(config, Exception):
        return f"refused: {type(config).__name__}: {config}"
    try:
        return fn(config, *args)
    except Exception as e:  # a build the kernel refuses: its error is its digest
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the default rows only")
    parser.add_argument("--only", default="", help="builds whose name contains this")
    args = parser.parse_args(argv)
    for name, job in builds(args.quick):
        if args.only in name:
            print(f"{name}: {_run(job)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
