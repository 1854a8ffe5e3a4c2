"""HBM traffic of one forward + backward, measured with Nsight Compute (DRAM bytes).

    python -m benchmarks.hbm --out benchmarks/results/hbm.jsonl          # on the GPU

The FlashAttention paper's microbenchmark shape (GPT-2 medium attention: batch 64,
seq 1024, 16 heads, head dim 64, fp16). For each implementation a child process
compiles and warms up one jitted forward + backward, then runs it once between
cudaProfilerStart/Stop; the parent runs that child under
`ncu --clock-control none --profile-from-start off` collecting
dram__bytes_read.sum and dram__bytes_write.sum for every kernel, and sums them.
XLA's autotuner is turned off in the child (XLA crashes under ncu otherwise; see
../shared/ANCHORS.md), which changes speed, not bytes moved by the chosen kernels.
The compulsory traffic is what any implementation must move: the forward reads q, k, v
and writes o; the backward reads q, k, v, o, dO and writes dq, dk, dv.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import signal
import subprocess
import sys

SHAPE = dict(batch=64, seq=1024, heads=16, head_dim=64)
IMPLS = ("pallas_flash:triton", "jax.nn:xla", "jax.nn:cudnn")
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")


def compulsory_bytes(batch: int, seq: int, heads: int, head_dim: int, itemsize: int = 2):
    """12 tensors of [B, T, N, H]: 4 in the forward, 8 in the backward."""
    return 12 * batch * seq * heads * head_dim * itemsize


def parse_ncu_csv(text: str) -> dict[str, float]:
    """Sums each metric over all profiled kernels of `ncu --csv --print-units base`."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    totals = dict.fromkeys(METRICS, 0.0)
    kernels = set()
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        name = row.get("Metric Name")
        if name in totals:
            totals[name] += float(row["Metric Value"].replace(",", ""))
            kernels.add(row.get("ID"))
    totals["kernels"] = len(kernels)
    return totals


def child(impl_name: str) -> None:
    """Compile and warm up, then run one forward + backward inside the profiler range."""
    import jax
    import jax.numpy as jnp

    from benchmarks.impls import IMPLS as ALL

    impl = ALL[impl_name]
    B, T, N, H = (SHAPE[k] for k in ("batch", "seq", "heads", "head_dim"))
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, T, N, H), jnp.float16) for kk in ks)

    @jax.jit
    def step(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: impl.fn(q, k, v, causal=False), q, k, v)
        return vjp(do)

    jax.block_until_ready(step(q, k, v, do))
    start, stop = _profiler()
    start()
    jax.block_until_ready(step(q, k, v, do))
    stop()


def ncu_command(
    ncu: str, metrics, sections=(), kernels: str | None = None, details: bool = False
) -> list[str]:
    """The Nsight Compute command line of `run_under_ncu`; `kernels`, a regular
    expression, keeps the kernels whose names match it (each section replays every
    profiled kernel, so profiling XLA's small kernels too can outlast a call).
    `details`: the sections' bodies too (`--print-details all`: the warp stall reasons
    of WarpStateStats, the pipe utilisation of ComputeWorkloadAnalysis), where the CSV
    otherwise holds their headline metrics only."""
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv"]
    cmd += ["--print-units", "base", "--metrics", ",".join(metrics)]
    for section in sections:
        cmd += ["--section", section]
    if details and sections:
        cmd += ["--print-details", "all"]
    if kernels:
        cmd += ["--kernel-name", f"regex:{kernels}"]
    return cmd + [sys.executable, "-m"]


def run_under_ncu(
    ncu: str,
    metrics,
    child_args: list[str],
    timeout: float,
    sections=(),
    kernels=None,
    details: bool = False,
):
    """Runs `python -m <child_args>` under Nsight Compute, collecting `metrics` (and every
    metric of the named `sections`, with their bodies if `details`) for every kernel (or
    those `kernels` matches, see `ncu_command`) between the child's
    cudaProfilerStart/Stop (see `_profiler`), as CSV in base units. The clocks stay as
    they are (`--clock-control none`), and XLA's autotuner is off in the child (XLA
    crashes under ncu otherwise; see ../shared/ANCHORS.md). The child allocates as it
    goes rather than taking 75 % of the GPU up front: ncu replays a kernel once per
    pass its sections need and saves and restores device memory between passes, and
    JAX's preallocated pool (about 100 GiB on the H200) is the likely reason profiles
    with several sections outlasted their timeouts (the pair's at 2b60086, the fused
    kernel's at c1517e4; not yet measured without it). Past `timeout` the whole
    process group is killed, the profiled child with ncu (run_ncu)."""
    cmd = ncu_command(ncu, metrics, sections, kernels, details) + child_args
    return run_ncu(cmd, timeout)


def run_ncu(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs an Nsight Compute command line whose child is a JAX program, in the child
    environment run_under_ncu describes (XLA's autotuner off, no preallocated pool).
    Past `timeout` the whole process group is killed, the profiled child with ncu: a
    child left running holds the GPU, and every later profile in the call then fails to
    find it."""
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_gpu_autotune_level=0",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _profiler():
    try:
        import cupy

        return cupy.cuda.runtime.profilerStart, cupy.cuda.runtime.profilerStop
    except ImportError:  # fall back to the CUDA runtime itself
        import ctypes

        for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
            try:
                rt = ctypes.CDLL(name)
                return rt.cudaProfilerStart, rt.cudaProfilerStop
            except OSError:
                continue
        raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--ncu", default="ncu")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per implementation")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    need = compulsory_bytes(**SHAPE)
    for name in args.impls.split(","):
        row = dict(impl=name, **SHAPE, dtype="float16", compulsory_bytes=need, error=None)
        try:
            proc = run_under_ncu(
                args.ncu, METRICS, ["benchmarks.hbm", "--child", name], args.timeout
            )
            totals = parse_ncu_csv(proc.stdout)
            if proc.returncode or not totals["kernels"]:
                raise RuntimeError(f"ncu exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
            read, write = totals["dram__bytes_read.sum"], totals["dram__bytes_write.sum"]
            row.update(
                read_bytes=read,
                write_bytes=write,
                total_bytes=read + write,
                kernels=totals["kernels"],
                over_compulsory=(read + write) / need,
            )
            print(
                f"{name:24s} read {read / 1e9:6.2f} GB  write {write / 1e9:6.2f} GB  "
                f"total {(read + write) / 1e9:6.2f} GB  ({(read + write) / need:.2f}x "
                f"compulsory {need / 1e9:.2f} GB, {totals['kernels']} kernels)",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - recorded, as in the harness
            row["error"] = f"{type(e).__name__}: {e}"[:400]
            print(f"{name:24s} ERROR {row['error']}", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
