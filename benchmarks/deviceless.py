"""Compiling for the H200 on a machine without a GPU (what ptxas makes of our kernels).

    make venv-sm90     # .venv-sm90: the project with JAX's CUDA plugin (no CUDA libraries)
    .venv-sm90/bin/python -m benchmarks.ptxas --deviceless --impls pallas_flash:mosaic

XLA compiles for a GPU it is not attached to when it is given that GPU's description:
JAX's CUDA plugin makes a compile-only device from `h200_target.txtpb` (`h200`), and a
program whose inputs are placed on that device is compiled as on the H200 itself:
Mosaic GPU lowers each kernel to PTX and assembles it with the plugin's ptxas for
sm_90a, so MOSAIC_GPU_DUMP_PTXAS (registers, spills, serialized wgmmas), _PTX and
_SASS print what they print on the device, and nothing runs. On the fused backward of
2b60086 (share_halves and writer_warp, head dim 128) it reports the H200's numbers to
the byte: 64 / 140 bytes of spill stores / loads non-causal, 276 / 356 causal
(`results/mosaic-2b60086/ptxas-halves.jsonl`, compiled there).

The API picks the compiled Mosaic kernels only where JAX's default backend is a GPU
(elsewhere it runs them in GPU interpret mode); `as_on_h200` makes it pick them here, for
tracing a program that `h200` then compiles.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pathlib
import types

# The environment of a process that compiles for the H200 here: CPU as JAX's backend
# (the plugin then neither looks for a GPU nor checks the CUDA libraries' versions, and
# still makes the compile-only device), and no version check either way (cuDNN, cuBLAS:
# compiling needs none of them, and this machine has none). JAX reads both when it
# loads its plugins: a child process gets them from its parent (benchmarks.ptxas,
# `make test-sm90`); for this one, the version check is skipped if JAX has not yet.
ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402

TARGET = pathlib.Path(__file__).with_name("h200_target.txtpb")
PLUGIN = "jax_plugins.xla_cuda13"


def available() -> str | None:
    """None if this Python can compile for the H200, else why not."""
    try:
        found = importlib.util.find_spec(PLUGIN) is not None
    except ModuleNotFoundError:  # not even the namespace package jax_plugins
        found = False
    if not found:
        return f"no {PLUGIN} (JAX's CUDA plugin) in this Python: `make venv-sm90` makes one"
    return None


@functools.cache
def h200() -> jax.Device:
    """A compile-only H200 (compute capability 9.0, 132 SMs): inputs placed on it make
    jax.jit compile for it, here."""
    from jax.experimental import topologies

    if (reason := available()) is not None:
        raise RuntimeError(reason)
    topology = topologies.get_topology_desc(
        "", "cuda", topology="1x1x1", target_config=TARGET.read_text()
    )
    return topology.devices[0]


def on_h200(tree):
    """ShapeDtypeStructs of the arrays (or structs) in `tree`, placed on `h200()`."""
    sharding = jax.sharding.SingleDeviceSharding(h200())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


@contextlib.contextmanager
def as_on_h200():
    """The API's dispatch as on the H200: `implementation="mosaic"` (and None) take the
    compiled Mosaic kernels rather than GPU interpret mode; and, where tokamax is
    importable, tokamax's `implementation="mosaic"` takes its sm_90 Mosaic GPU kernels
    (`_tokamax_as_on_h200`). Only for tracing."""
    from pallas_flash import api
    from pallas_flash.mosaic import support

    saved = api._platform, support.device_unsupported
    api._platform, support.device_unsupported = (lambda: "gpu"), (lambda: None)
    try:
        with _tokamax_as_on_h200():
            yield
    finally:
        api._platform, support.device_unsupported = saved


# What tokamax asks of JAX's default device when it picks and launches its Mosaic GPU
# attention: the device kind (its "mosaic" is the GPU kernel on an NVIDIA device) and
# the SM count (its persistent grid has one CTA per SM): the H200's, h200_target.txtpb.
_TOKAMAX_H200 = types.SimpleNamespace(device_kind="NVIDIA H200", core_count=132)


@contextlib.contextmanager
def _tokamax_as_on_h200():
    """tokamax 0.0.17 (the peer the benchmarks time, ../shared/peer-wheels) traced as on
    the H200 while JAX's default device is the CPU: its API's and its persistent
    kernel's default device read as an H200, its compute-capability checks as sm_90,
    and its own option for compiling on another machine (`cross_compile`) on. So
    `python -m benchmarks.ptxas --deviceless --impls tokamax:mosaic` shows what ptxas
    makes of the peer's kernels beside ours (docs/mosaic.md, "The peer's steps, read
    here"). Nothing changes where tokamax is not importable."""
    try:
        from tokamax._src import config, gpu_utils, mosaic_gpu
        from tokamax._src.ops.attention import api as attention_api
    except ImportError:
        yield
        return
    backend = types.SimpleNamespace(get_default_device=lambda: _TOKAMAX_H200)
    patches = [
        (gpu_utils, "is_sm80", lambda *_, **__: False),
        (gpu_utils, "is_sm90", lambda *_, **__: True),
        (gpu_utils, "is_sm100", lambda *_, **__: False),
        (gpu_utils, "has_mosaic_gpu_support", lambda *_, **__: True),
        (mosaic_gpu, "backend", backend),
        (attention_api, "backend", backend),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        with config.cross_compile(True):
            yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def compile_on_h200(fn, *args):
    """jax.jit(fn) compiled for the H200 for arguments shaped like `args` (arrays or
    structs; pytrees): a jax.stages.Compiled, which cannot run here."""
    with as_on_h200():
        return jax.jit(fn).trace(*on_h200(args)).lower().compile()
