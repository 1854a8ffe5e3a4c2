"""Test setup: the `gpu` marker selects the compiled-kernel run on a real GPU.

On a GPU machine every test marked `kernel` (the shared case table and the kernel
properties) also gets the `gpu` marker, so `pytest -m gpu` runs them compiled; tests
marked `gpu` alone need a GPU and are skipped, with that reason, on a CPU-only machine,
where the `kernel` tests run in Pallas's interpret mode instead.
"""

import os

# Ring attention runs on several devices: on CPU, 8 host devices. The flag must be set
# before JAX initialises its backends, and is appended: the GPU run sets XLA_FLAGS too.
os.environ["XLA_FLAGS"] = " ".join(
    f for f in (os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=8") if f
)

import jax  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if ON_GPU and "kernel" in item.keywords:
            item.add_marker(pytest.mark.gpu)
        elif not ON_GPU and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
