"""Test setup: the `gpu` marker selects the compiled-kernel run on a real GPU.

On a GPU machine every test marked `kernel` (the shared case table and the kernel
properties) also gets the `gpu` marker, so `pytest -m gpu` runs them compiled; tests
marked `gpu` alone need a GPU and are skipped, with that reason, on a CPU-only machine,
where the `kernel` tests run in Pallas's interpret mode instead.

Cases marked `full_table` are the rest of a table that interpret mode on CPU runs only
a covering subset of (each factor value at least once): on a GPU they are marked `gpu`
too, so `pytest -m gpu` runs the whole table compiled; on CPU they are skipped, saying so.
"""

import importlib.metadata
import os


def _gpu_plugin_installed() -> bool:
    """Whether JAX may find a GPU here: a CUDA or ROCm plugin is installed. Asked before
    JAX starts its backends, which is too late to change XLA_FLAGS."""
    names = (d.metadata["Name"] or "" for d in importlib.metadata.distributions())
    return any(n.lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm")) for n in names)


# Ring attention runs on several devices: on CPU, 8 host devices. The flag must be set
# before JAX initialises its backends, and is appended: the GPU run sets XLA_FLAGS too.
# On a CPU-only machine, XLA's LLVM backend also optimizes at -O1, not -O2: interpret
# mode's tests are many compiles of programs that then run once on tiny shapes, and
# compiling takes most of their time (-O1 cuts it by about a third; the trainer
# subprocesses inherit the flag). Not -O0: there the float32 reference's gradients with
# a bias turn inf (tests/test_numerics.py's bias cases fail). Never on a GPU machine,
# where the flag would reach the compiled kernels too.
os.environ["XLA_FLAGS"] = " ".join(
    f
    for f in (
        os.environ.get("XLA_FLAGS"),
        "--xla_force_host_platform_device_count=8",
        None if _gpu_plugin_installed() else "--xla_backend_optimization_level=1",
    )
    if f
)

import jax  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    skip_subset = pytest.mark.skip(
        reason="the rest of a table that CPU interpret mode covers with a subset; "
        "the whole table runs compiled on a GPU (`pytest -m gpu` on the H200)"
    )
    for item in items:
        if ON_GPU and ("kernel" in item.keywords or "full_table" in item.keywords):
            item.add_marker(pytest.mark.gpu)
        elif not ON_GPU and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        elif not ON_GPU and "full_table" in item.keywords:
            item.add_marker(skip_subset)


# pytest -n: the work units xdist hands to a worker whole, beyond single tests. A module
# whose tests share module-scoped fixtures (trained runs, generated data) runs on one
# worker, which builds them once; the triton and blockwise tests of a case of the shared
# table run together, computing the case's reference once (tests/util.py).
WHOLE_MODULES = ("tests/test_train.py", "tests/test_classifier.py")


def work_unit(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    if path in WHOLE_MODULES:
        return path
    if path == "tests/test_numerics.py" and "_matches_reference[" in name:
        return "reference of " + name.split("[", 1)[1]
    return nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # (xdist's own xdist_group marks would do, but they rename test ids through an
    # attribute that pytest 9 no longer reads.)
    from xdist.scheduler import LoadScopeScheduling

    # _split_scope is xdist's private hook (3.8): if a release renames it, the override
    # below would be dead and scheduling fall back to one module per worker, slowly and
    # silently. Say so instead.
    if not hasattr(LoadScopeScheduling, "_split_scope"):
        raise pytest.UsageError(
            "tests/conftest.py overrides xdist's LoadScopeScheduling._split_scope, which "
            "this pytest-xdist lacks: update work_unit's scheduler"
        )

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Scheduling(config, log)
