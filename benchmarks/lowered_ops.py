"""Operations in the Mosaic GPU forward kernel as lowered for sm_90, counted on CPU.

    python -m benchmarks.lowered_ops --head-dim 64 --seq 1024 --causal true \
        --set row_bound_mask=false

Lowers the forward (B=1, T=S=seq, 2 heads, bf16) for CUDA without a GPU, once with the
default config the API picks for the call and once with the `--set` fields replaced, and
prints the operations of the kernel's Mosaic GPU module (the custom call's `module`
attribute, MLIR bytecode at the arith / vector / llvm level) by name, where the two
differ. A proxy for the instructions a change adds or saves before LLVM and ptxas fold
constants and schedule: the SASS (`benchmarks.ptxas --sass`, on the GPU) says what is
left.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir as jax_mlir  # no public context with JAX's dialects
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import dialect as mosaic_gpu_dialect

from benchmarks.impls import config_overrides
from pallas_flash import masks
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.mosaic.config import MosaicConfig, default_mosaic_config


def _kernel_modules(lowered_module) -> list[bytes]:
    """The `module` bytecode of each Mosaic GPU custom call in a lowered program."""
    out = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.name == "stablehlo.custom_call":
                        attrs = inner.attributes
                        if "mhlo.backend_config" in attrs:
                            config = ir.DictAttr(attrs["mhlo.backend_config"])
                            if "module" in config:
                                out.append(bytes(ir.StringAttr(config["module"]).value_bytes))
                    walk(inner)

    walk(lowered_module.operation)
    return out


def op_counts(module_bytes: bytes) -> collections.Counter:
    """Operations by name in one Mosaic GPU kernel module."""
    ctx = jax_mlir.make_ir_context()
    mosaic_gpu_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    counts: collections.Counter = collections.Counter()

    def walk(op):
        counts[op.name] += 1
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    walk(inner.operation)

    with ctx:
        walk(ir.Module.parse(module_bytes).operation)
    return counts


def forward_ops(config: MosaicConfig, spec: masks.MaskSpec, head_dim: int, seq: int):
    """Operation counts of the forward kernel lowered for sm_90 with `config`."""

    def f(q, k, v, q_len, kv_len):
        return mosaic_forward.forward(
            q, k, v, q_len, kv_len, spec=spec, scale=0.1, config=config, interpret=False
        )

    q = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    lowered = jax.jit(f).trace(q, q, q, lens, lens).lower(lowering_platforms=("cuda",))
    (module,) = _kernel_modules(lowered.compiler_ir())
    return op_counts(module)


def parse_fields(items: list[str]) -> dict:
    """FIELD=VALUE pairs (true / false / an int) of MosaicConfig, as the bench's config
    variants take them (impls.config_overrides)."""
    return config_overrides(items, {"fwd": MosaicConfig}, "--set")["fwd"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--causal", choices=("true", "false"), default="true")
    parser.add_argument("--set", nargs="+", default=[], help="FIELD=VALUE of MosaicConfig")
    args = parser.parse_args(argv)
    causal = args.causal == "true"
    base = default_mosaic_config(args.head_dim, args.seq, causal)
    changed = dataclasses.replace(base, **parse_fields(args.set))
    spec = masks.MaskSpec(causal=causal)
    a, b = (forward_ops(c, spec, args.head_dim, args.seq) for c in (base, changed))
    print(f"total: {sum(a.values())} default, {sum(b.values())} with {' '.join(args.set)}")
    for name in sorted(set(a) | set(b), key=lambda n: (b[n] - a[n], n)):
        if a[name] != b[name]:
            print(f"  {name}: {a[name]} -> {b[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
