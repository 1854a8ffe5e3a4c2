"""The launch-config sweep runs end to end on CPU (interpret mode, tiny) and renders."""

from __future__ import annotations

import json

import pytest

from benchmarks import render, sweep
from pallas_flash import configs

KEYS = {
    "run_id",
    "suite",
    "device",
    "jax",
    "commit",
    "impl",
    "pass",
    "batch",
    "seq_q",
    "seq_k",
    "heads",
    "head_dim",
    "dtype",
    "causal",
    "config",
    "default",
    "smem_kib",
    "ms",
    "tflops",
    "check_err",
    "check_ok",
    "error",
}


@pytest.mark.kernel
def test_sweep_tiny_runs_and_renders(tmp_path):
    out = tmp_path / "sweep.jsonl"
    assert sweep.main(["--tiny", "--out", str(out)]) == 0
    *rows, status = [json.loads(line) for line in out.read_text().splitlines()]
    assert status["status"] == "complete" and status["measured"] == status["total"] == 8
    # causal off and on, fwd and bwd, the default and one candidate each
    assert len(rows) == 8 and all(KEYS <= set(r) for r in rows)
    assert sum(r["default"] for r in rows) == 4
    assert all(r["check_ok"] and r["check_err"] < 1e-2 for r in rows)
    # a compiled tiny backward can be faster than the timer resolves (bench.py's rule)
    assert all(r["ms"] > 0 for r in rows if not r["error"])
    assert all(r["error"].startswith("below timing noise") for r in rows if r["error"])
    assert all(r["ms"] > 0 for r in rows if r["pass"] == "fwd")
    fwd = [r for r in rows if r["pass"] == "fwd"]
    assert {tuple(r["config"].values()) for r in fwd} == {(128, 64, 4, 3), (64, 64, 4, 3)}
    table = render.sweep_table(rows + [status])
    assert "| head dim | causal | pass | default config ms |" in table
    assert table.count("| 32 |") == 4 and "| 32 | yes | bwd |" in table


def test_sweep_stops_at_time_budget(tmp_path):
    out = tmp_path / "sweep.jsonl"
    assert sweep.main(["--tiny", "--time-budget", "0", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [rows[0]] and rows[0]["status"] == "time budget spent"
    assert rows[0]["measured"] == 0 and rows[0]["total"] == 8


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_candidates_start_at_the_default_and_it_fits(head_dim):
    for default, space in (
        (configs.default_triton_config(head_dim, "bfloat16"), sweep.fwd_candidates()),
        (configs.default_triton_bwd_config(head_dim, "bfloat16"), sweep.bwd_candidates()),
    ):
        cands = sweep.ordered(space, default)
        assert cands[0] == default and len(set(cands)) == len(cands) == len(space)
        assert sweep.smem_bytes(default, head_dim) <= sweep.SMEM_LIMIT
    # Q once, K and V in 4 stages at head dim 256: 576 KiB, never compiled
    big = configs.TritonConfig(block_q=128, block_kv=128, num_warps=8, num_stages=4)
    assert sweep.smem_bytes(big, 256) == (128 + 8 * 128) * 256 * 2 > sweep.SMEM_LIMIT


def test_sweep_table_speedup():
    def row(ms, default, block_q):
        config = dict(block_q=block_q, block_kv=64, num_warps=8, num_stages=3)
        return dict(
            run_id="r",
            suite="sweep",
            device="H200",
            batch=2,
            seq_q=8192,
            heads=16,
            head_dim=128,
            dtype="bfloat16",
            causal=False,
            candidates=3,
            config=config,
            default=default,
            ms=ms,
            tflops=ms and 2.0 / ms,
            check_ok=ms is not None,
            error=None,
        ) | {"pass": "fwd"}

    rows = [row(2.0, True, 128), row(1.6, False, 64), row(None, False, 32)]
    table = render.sweep_table(rows)
    assert "| 128 | no | fwd | 2.00 (1) | 64x64 w8 s3 | 1.60 (1) | 1.25x |" in table
    assert "3 of 3 candidates measured" in table
