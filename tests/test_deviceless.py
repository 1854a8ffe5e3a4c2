"""The Mosaic kernels compiled for the H200 on this machine, without a GPU
(benchmarks/deviceless.py): what ptxas makes of the default rows.

These need JAX's CUDA plugin, which the CPU suite's environment leaves out, so they run
in their own (`make test-sm90`, part of `make test`); elsewhere they are skipped, saying
so. Each compiles one forward + backward (B=1, T=S=1024, bf16, heads = 2048 / head dim)
through `python -m benchmarks.ptxas --deviceless`, the tool's own path, and reads
ptxas's report of every kernel.

What they hold the defaults to: ptxas serializes no wgmma in any of them ("Potential
Performance Loss", C7512: on the H200 that alone cost the fused backward half its
speed, README "C7512"), and the forward kernels spill nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import deviceless

pytestmark = [
    pytest.mark.sm90,
    pytest.mark.skipif(
        deviceless.available() is not None,
        reason=f"compiles for the H200 here: {deviceless.available()}",
    ),
]


def _compiled(tmp_path, impl: str, head_dim: int) -> list[dict]:
    out = tmp_path / "ptxas.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.ptxas", "--deviceless", "--impls", impl]
    cmd += ["--head-dims", str(head_dim), "--causal", "false,true", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_rows_serialize_no_wgmma(tmp_path, head_dim):
    rows = _compiled(tmp_path, "pallas_flash:mosaic", head_dim)
    assert [row["causal"] for row in rows] == [False, True]
    for row in rows:
        assert row["error"] is None, row["error"]
        names = [k["kernel"] for k in row["kernels"]]
        # the forward and the backward's kernels (the pair, or the fused one)
        assert any("_fwd_" in n for n in names) and any("_bwd_" in n for n in names), names
        for kern in row["kernels"]:
            where = f"h{head_dim} causal={row['causal']} {kern['kernel']}"
            assert kern["registers"] is not None, where
            assert kern["warnings"] == [], where
            if "_fwd_" in kern["kernel"]:
                assert (kern["spill_store_bytes"], kern["spill_load_bytes"]) == (0, 0), where
