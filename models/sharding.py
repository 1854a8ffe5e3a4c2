"""Data and sequence parallelism for the trainer: one mesh of axes ("data", "seq").

`--data-parallel D --seq-parallel S` make a (D, S) mesh of the first D * S devices, "seq"
the inner axis (neighbouring devices, on one host where S fits in it). The train state
(parameters and optimizer state) is replicated on every device: simple, and exact for
models that fit one device. A batch of tokens [B, T] is split over "data" along B and
over "seq" along T. The model is written for the global arrays: jit partitions every
position-wise layer (embedding, norms, MLP, loss) by the batch's sharding, positions are
global (`arange(T)` of the whole sequence), and the gradients of the replicated
parameters are all-reduced by XLA. Only attention looks across positions: it runs in a
shard_map over "data" (each device's batch rows), and with S > 1 as ring attention over
"seq" (pallas_flash.ring_attention, zigzag layout), which needs T to be a multiple of 2S.

A batch of step s is a pure function of (seed, s) on every process (models/jobs.py), so
each process cuts its own devices' shards out of the same host batch, and a run resumed
on another mesh sees the same data.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_flash

DATA, SEQ = "data", "seq"


class MeshError(ValueError):
    """The mesh flags ask for what the devices cannot give; the message names the flags."""


def make_mesh(data: int = 1, seq: int = 1) -> Mesh:
    """The (data, seq) mesh over the first data * seq devices.

    Raises:
      MeshError: a size below 1, more devices than there are, or (several processes) a
        mesh that leaves some process's devices out; the message names the flags.
    """
    for flag, size in (("--data-parallel", data), ("--seq-parallel", seq)):
        if size < 1:
            raise MeshError(f"{flag} {size} must be at least 1")
    devices, n = jax.devices(), data * seq
    if n > len(devices):
        raise MeshError(
            f"--data-parallel {data} x --seq-parallel {seq} = {n} devices, but only "
            f"{len(devices)} are available ({devices[0].platform})"
        )
    if jax.process_count() > 1 and n != len(devices):
        raise MeshError(
            f"--data-parallel {data} x --seq-parallel {seq} = {n} devices: with "
            f"{jax.process_count()} processes the mesh must use all {len(devices)} devices"
        )
    return Mesh(np.array(devices[:n]).reshape(data, seq), (DATA, SEQ))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, T, ...]: B over "data", T over "seq"."""
    return NamedSharding(mesh, P(DATA, SEQ))


def place(tree, sharding: NamedSharding):
    """Host values (the same on every process) -> global arrays with `sharding`; each
    process fills only its own devices' shards (multi-host safe, unlike device_put)."""

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: np.asarray(x[idx]))

    return jax.tree.map(one, tree)


def attention(mesh: Mesh, single: Callable) -> Callable:
    """Causal self-attention over the mesh: `single(q, k, v)` (one device's attention) per
    device of "data" when S = 1; ring attention over "seq", each "data" group with its own
    rows (`batch_axis`), when S > 1.

    Both are shard_maps over "data": a kernel (a Pallas or cuDNN custom call) is opaque
    to XLA's partitioner, which would gather the batch onto every device.
    """
    if mesh.shape[SEQ] > 1:  # the ring runs its own shard_map, over "data" and "seq"

        def ring(q, k, v):
            return pallas_flash.ring_attention(
                q, k, v, mesh=mesh, axis_name=SEQ, batch_axis=DATA, is_causal=True
            )

        return ring
    # check_vma=False: Pallas calls carry no varying-across-devices types (as in the ring).
    return jax.shard_map(
        single,
        mesh=mesh,
        in_specs=P(DATA),
        out_specs=P(DATA),
        axis_names={DATA},
        check_vma=False,
    )


def check(*, batch: int, seq_len: int, data: int, seq: int) -> str | None:
    """The first reason the global batch [batch, seq_len] cannot be split over the mesh
    (naming the flag to change), or None."""
    if batch % data:
        return f"--batch {batch} must be a multiple of --data-parallel {data}"
    if seq > 1 and seq_len % (2 * seq):
        return (
            f"--seq-len {seq_len} must be a multiple of 2 x --seq-parallel = {2 * seq}: the "
            f"zigzag ring cuts the sequence into 2 chunks per device"
        )
    return None
