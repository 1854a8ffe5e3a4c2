"""Test setup: the `gpu` marker selects the compiled-kernel run on a real GPU.

On a GPU machine every test marked `kernel` (the shared case table and the kernel
properties) also gets the `gpu` marker, so `pytest -m gpu` runs them compiled; tests
marked `gpu` alone need a GPU and are skipped, with that reason, on a CPU-only machine,
where the `kernel` tests run in Pallas's interpret mode instead.
"""

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if ON_GPU and "kernel" in item.keywords:
            item.add_marker(pytest.mark.gpu)
        elif not ON_GPU and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
