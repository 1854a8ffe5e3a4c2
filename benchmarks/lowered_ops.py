"""Operations in the Mosaic GPU kernels as lowered for sm_90, counted on CPU.

    python -m benchmarks.lowered_ops --head-dim 64 --seq 1024 --causal true \
        --set row_bound_mask=false
    python -m benchmarks.lowered_ops --kernel backward --head-dim 128 --live-ins \
        --base fused=true fa3_order=true --set step_descriptors=true

Lowers the forward (B=1, T=S=seq, 2 heads, bf16), or the backward, for CUDA without a
GPU, once with a config (the default the API picks for the call, with the `--base`
fields replaced) and once with the `--set` fields replaced as well, and prints the
operations of the kernels' Mosaic GPU modules (the custom calls' `module` attribute,
MLIR bytecode at the arith / vector / llvm level) by name, where the two differ. A
proxy for the instructions a change adds or saves before LLVM and ptxas fold constants
and schedule: the SASS (`benchmarks.ptxas --sass`, on the GPU) says what is left.

`--peers` lowers the forward of JAX's Mosaic FA3 and (where the peer wheels import)
tokamax's Mosaic forward with our default row's tiles, non-causal, and prints each
kernel's step by operation beside ours, a star where the counts differ
(`peer_step_ops`): what their steps do that ours does not, before the GPU says what it
costs.

`--live-ins` prints instead, for each kernel's steps (innermost loops of at least
STEP_OPS operations), the values a step reads that are computed outside it, constants
and what folds to them aside, by type, after MLIR's common-subexpression elimination and
loop-invariant code motion (`step_live_ins`): what the compiler will hold in registers
across the steps (LLVM's own CSE and hoisting run on the GPU; MLIR's stand in here).
64-bit ones are wgmma descriptors and addresses: the fused backward in FA3's order holds
32 of them per step (the hoisted descriptors its SASS spilled, docs/mosaic.md), and none with
`step_descriptors`."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir as jax_mlir  # no public context with JAX's dialects
from jax._src.lib.mlir import ir, passmanager
from jax.experimental.mosaic.gpu import dialect as mosaic_gpu_dialect

from benchmarks.impls import config_overrides
from pallas_flash import masks
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.mosaic.bwd_config import MosaicBwdConfig, default_mosaic_bwd_config
from pallas_flash.mosaic.config import WITHOUT_PERSISTENT, MosaicConfig, default_mosaic_config

# A step loop's least size in operations (smaller innermost loops are barrier waits and
# the dQ writer's drains).
STEP_OPS = 500


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


def _parse(module_bytes: bytes, ctx):
    """One kernel module, its ops in their own dialects (Mosaic GPU stores them under
    stable names: its serde pass gives them back)."""
    from jax.experimental.mosaic.gpu import core  # its serde pass: no public name

    return core._run_serde_pass(ir.Module.parse(module_bytes, ctx), serialize=False)


def _context():
    ctx = jax_mlir.make_ir_context()
    mosaic_gpu_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    return ctx


def _walk(op):
    """Every operation nested in `op` (not `op` itself), in program order."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner.operation
                yield from _walk(inner.operation)


_LOOPS = ("scf.for", "scf.while")
_CONSTANTS = ("arith.constant", "llvm.mlir.constant")
# Operations without side effects that LLVM folds when all their operands fold: a value
# made only of these and constants (a splat's lanes, a select between equal constants,
# an undef vector) costs no register, so it is no live-in.
_FOLDABLE = ("arith.", "vector.", "llvm.mlir.undef", "llvm.mlir.poison", "llvm.insertelement",
             "llvm.extractelement", "llvm.bitcast", "llvm.shufflevector")  # fmt: skip


def _folds(op, memo: dict) -> bool:
    """Whether `op`'s results fold to constants (memoised in `memo`)."""
    if op not in memo:
        memo[op] = False  # a cycle (through a block argument) does not fold
        if op.name in _CONSTANTS:
            memo[op] = True
        elif op.name.startswith(_FOLDABLE) and not op.regions:
            owners = [value.owner for value in op.operands]
            memo[op] = all(
                not isinstance(o, ir.Block) and _folds(o.operation, memo) for o in owners
            )
    return memo[op]


def op_counts(module_bytes: bytes) -> collections.Counter:
    """Operations by name in one Mosaic GPU kernel module."""
    with _context() as ctx:
        return collections.Counter(op.name for op in _walk(_parse(module_bytes, ctx).operation))


def _steps(module):
    """(loop, its operations) for each step of a parsed kernel module: its innermost
    loops of at least STEP_OPS operations."""
    for loop in _walk(module.operation):
        if loop.name in _LOOPS:
            body = list(_walk(loop))
            if len(body) >= STEP_OPS and not any(op.name in _LOOPS for op in body):
                yield loop, body


def module_text(module_bytes: bytes) -> str:
    """One kernel module as MLIR text (its inline PTX strings among it)."""
    with _context() as ctx:
        return str(_parse(module_bytes, ctx))


def step_live_ins(module_bytes: bytes) -> list[collections.Counter]:
    """For each step of one kernel module (an innermost loop of at least STEP_OPS
    operations), after MLIR's CSE and loop-invariant code motion (duplicates merged, as
    LLVM merges them; 32 of the fused step's 54 integer live-ins were copies): the values
    it reads that are computed outside it, counted by type; constants, and values that
    fold to constants (`_folds`), aside."""
    with _context() as ctx:
        module = _parse(module_bytes, ctx)
        pm = passmanager.PassManager.parse(
            "builtin.module(cse,loop-invariant-code-motion,cse)", ctx
        )
        pm.run(module.operation)
        out = []
        for loop, body in _steps(module):
            inside = {loop, *body}
            types, memo = {}, {}
            for op in body:
                for value in op.operands:
                    owner = value.owner
                    if isinstance(owner, ir.Block):  # a block argument: its region's op
                        owner = owner.owner
                    owner = owner.operation
                    if owner not in inside and not _folds(owner, memo):
                        types[value] = str(value.type)
            out.append(collections.Counter(types.values()))
        return out


def _modules(fn, *shapes) -> list[bytes]:
    lowered = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    return _kernel_modules(lowered.compiler_ir())


def _lower(fn, spec: masks.MaskSpec, q, kv, *extra):
    """fn(q, k, v, *extra, q_len, kv_len, *segment ids) lowered for CUDA: ragged lengths
    [B], and the query and key ids [B, T] / [B, S] where `spec` has segments."""
    lens = jax.ShapeDtypeStruct((q.shape[0],), jnp.int32)
    ids = [jax.ShapeDtypeStruct(x.shape[:2], jnp.int32) for x in (q, kv)] if spec.segments else []
    return (
        jax.jit(fn).trace(q, kv, kv, *extra, lens, lens, *ids).lower(lowering_platforms=("cuda",))
    )


def lower_forward(config: MosaicConfig, spec: masks.MaskSpec, q, kv):
    """The forward lowered for sm_90 on CPU (a jax.stages.Lowered), for q [B, T, N, H] and
    k, v [B, S, K, H] given as ShapeDtypeStructs."""

    def f(q, k, v, q_len, kv_len, *ids):
        return mosaic_forward.forward(
            q, k, v, q_len, kv_len, ids or None, spec=spec, scale=0.1, config=config,
            interpret=False,
        )  # fmt: skip

    return _lower(f, spec, q, kv)


def lower_backward(config: MosaicBwdConfig, spec: masks.MaskSpec, q, kv):
    """The backward (dq, dk, dv) lowered for sm_90 on CPU, as `lower_forward`."""

    def f(q, k, v, o, lse, do, q_len, kv_len, *ids):
        return mosaic_backward.backward(
            q, k, v, o, lse, do, None, q_len, kv_len, ids or None, spec=spec, scale=0.1,
            config=config,
        )[:3]  # fmt: skip

    lse = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    return _lower(f, spec, q, kv, q, lse, q)


def forward_modules(config: MosaicConfig, spec: masks.MaskSpec, head_dim: int, seq: int):
    """The forward kernel's module, lowered for sm_90 with `config`."""
    q = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16)
    return _kernel_modules(lower_forward(config, spec, q, q).compiler_ir())


def backward_modules(config: MosaicBwdConfig, spec: masks.MaskSpec, head_dim: int, seq: int):
    """The backward kernels' modules (dK/dV and dQ, or the fused one) for sm_90."""
    q = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16)
    return _kernel_modules(lower_backward(config, spec, q, q).compiler_ir())


def step_ops(module_bytes: bytes) -> list[collections.Counter]:
    """Operations by name in each step of one kernel module (`_steps`)."""
    with _context() as ctx:
        module = _parse(module_bytes, ctx)
        return [collections.Counter(op.name for op in body) for _, body in _steps(module)]


@contextlib.contextmanager
def _fa3_without_cuda_runtime():
    """JAX's Mosaic FA3 asks the CUDA runtime's version before it traces (a ptxas bug of
    12.8); on a machine without CUDA that module is None. Lowering needs no runtime."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    class _Cuda13:
        @staticmethod
        def cuda_runtime_get_version():
            return 13000

    saved = attention_mgpu.cuda_versions
    attention_mgpu.cuda_versions = saved or _Cuda13
    try:
        yield attention_mgpu
    finally:
        attention_mgpu.cuda_versions = saved


def peer_forward_modules(head_dim: int, seq: int) -> dict[str, list[bytes]]:
    """Forward kernel modules lowered for sm_90, non-causal, B=1, 2 heads: ours (the
    default row's tiles, one CTA per tile), JAX's Mosaic FA3 and, where the peer wheels
    import, tokamax's Mosaic forward, both with our row's block_q, block_kv and stages."""
    row = default_mosaic_config(head_dim, seq, False)
    ours = dataclasses.replace(row, persistent=False, **WITHOUT_PERSISTENT)
    out = {"pallas_flash:mosaic": forward_modules(ours, masks.MaskSpec(), head_dim, seq)}
    with _fa3_without_cuda_runtime() as fa3:
        tuning = fa3.TuningConfig(
            block_q=ours.block_q, block_kv=ours.block_kv, max_concurrent_steps=ours.num_stages
        )
        q16 = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.float16)  # its tiles are f16
        out["jax:mosaic_fa3"] = _modules(
            lambda q, k, v: fa3.attention(q, k, v, tuning), q16, q16, q16
        )
    try:
        from tokamax._src.ops.attention import pallas_mosaic_gpu_kernel_sm90 as tk
    except ImportError:  # the peer wheels are not on this machine
        return out
    config = tk.Config(
        block_q=ours.block_q, block_kv=ours.block_kv, num_stages=ours.num_stages, persistent=False
    )

    def tokamax_fwd(q, k, v):
        return tk.flash_attention_kernel(
            q, k, v, None, None, None, None, is_causal=False, logits_soft_cap=None,
            logits_scale=0.1, out_dtype=jnp.dtype(jnp.bfloat16), normalize_output=True,
            return_residuals=False, use_stable_softmax=True, rescale_threshold=1.0,
            config=config,
        )[0]  # fmt: skip

    q = jax.ShapeDtypeStruct((seq, 2, head_dim), jnp.bfloat16)
    out["tokamax:mosaic"] = _modules(tokamax_fwd, q, q, q)
    return out


def peer_step_ops(head_dim: int, seq: int) -> dict[str, collections.Counter]:
    """Each forward's step by operation (`peer_forward_modules`): for ours the smallest
    step loop (the one without masks; the others mask the key tail), for a peer its one."""
    out = {}
    for name, mods in peer_forward_modules(head_dim, seq).items():
        steps = [step for m in mods for step in step_ops(m)]
        if not steps:  # JAX's Mosaic FA3 unrolls a loop of one tile: no step loop left
            raise ValueError(f"{name} has no step loop at seq {seq}: take a longer seq")
        out[name] = min(steps, key=lambda c: sum(c.values()))
    return out


def forward_ops(config: MosaicConfig, spec: masks.MaskSpec, head_dim: int, seq: int):
    """Operation counts of the forward kernel lowered for sm_90 with `config`."""
    (module,) = forward_modules(config, spec, head_dim, seq)
    return op_counts(module)


def parse_fields(items: list[str], cls: type = MosaicConfig) -> dict:
    """FIELD=VALUE pairs (true / false / none / an int) of `cls`, as the bench's config
    variants take them (impls.config_overrides)."""
    return config_overrides(items, {"config": cls}, "--set")["config"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=("forward", "backward"), default="forward")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--causal", choices=("true", "false"), default="true")
    parser.add_argument("--base", nargs="+", default=[], help="FIELD=VALUE: the baseline")
    parser.add_argument("--set", nargs="+", default=[], help="FIELD=VALUE: the change")
    parser.add_argument("--live-ins", action="store_true", help="each step's live-ins")
    parser.add_argument("--peers", action="store_true", help="our forward step against peers'")
    args = parser.parse_args(argv)
    if args.peers:
        steps = peer_step_ops(args.head_dim, args.seq)
        names = list(steps)
        print(f"forward step at head dim {args.head_dim}, operations:")
        print("  " + " | ".join(f"{n}: {sum(steps[n].values())}" for n in names))
        for op in sorted(set().union(*steps.values())):  # a star where the counts differ
            counts = [steps[n][op] for n in names]
            star = " *" if len(set(counts)) > 1 else ""
            print(f"  {op}: " + " | ".join(map(str, counts)) + star)
        return 0
    causal = args.causal == "true"
    spec = masks.MaskSpec(causal=causal)
    if args.kernel == "forward":
        cls, lower = MosaicConfig, forward_modules
        default = default_mosaic_config(args.head_dim, args.seq, causal)
    else:
        cls, lower = MosaicBwdConfig, backward_modules
        default = default_mosaic_bwd_config(args.head_dim, causal)
    base = dataclasses.replace(default, **parse_fields(args.base, cls))
    changed = dataclasses.replace(base, **parse_fields(args.set, cls))
    modules = [lower(c, spec, args.head_dim, args.seq) for c in (base, changed)]
    if args.live_ins:
        for label, mods in zip(("base", "with " + " ".join(args.set)), modules):
            print(f"{label}:")
            for i, module in enumerate(mods):
                for step in step_live_ins(module):
                    print(f"  kernel {i} step: {step.get('i64', 0)} x i64, {dict(step)}")
        return 0
    a, b = (sum(map(op_counts, mods), collections.Counter()) for mods in modules)
    print(f"total: {sum(a.values())} base, {sum(b.values())} with {' '.join(args.set)}")
    for name in sorted(set(a) | set(b), key=lambda n: (b[n] - a[n], n)):
        if a[name] != b[name]:
            print(f"  {name}: {a[name]} -> {b[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
