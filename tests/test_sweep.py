"""The launch-config sweep runs end to end on CPU (interpret mode, tiny) and renders,
for the Triton kernels and the Mosaic GPU kernels (in Pallas's GPU interpret mode)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks import render, sweep
from pallas_flash import configs
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic.bwd_config import fused_mosaic_bwd_config
from pallas_flash.mosaic.config import SMEM_BYTES

KEYS = {
    "run_id",
    "suite",
    "device",
    "jax",
    "commit",
    "impl",
    "family",
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
    assert {r["family"] for r in rows} == {status["family"]} == {"triton"}
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
    assert "sweep of the Triton kernels" in table
    assert table.count("| 32 |") == 4 and "| 32 | yes | bwd |" in table


@pytest.mark.extended
@pytest.mark.kernel
@pytest.mark.mosaic  # on a GPU, not in the `tests` step: a barrier bug hangs, not fails
def test_sweep_tiny_mosaic_runs_and_renders(tmp_path):
    out = tmp_path / "sweep.jsonl"
    assert sweep.main(["--tiny", "--family", "mosaic", "--out", str(out)]) == 0
    *rows, status = [json.loads(line) for line in out.read_text().splitlines()]
    assert status["status"] == "complete" and status["measured"] == status["total"] == 8
    assert len(rows) == 8 and all(KEYS <= set(r) for r in rows)
    assert {r["family"] for r in rows} == {status["family"]} == {"mosaic"}
    assert {r["impl"] for r in rows} == {"pallas_flash:mosaic"}
    assert sum(r["default"] for r in rows) == 4
    assert all(r["check_ok"] and r["check_err"] < 1e-2 for r in rows)
    assert all(r["ms"] > 0 for r in rows if not r["error"])
    assert all(r["error"].startswith("below timing noise") for r in rows if r["error"])
    # the default and its nearest candidate, as interpret mode runs them (P in shared memory);
    # the default is the API's at the tiny shape and mask (persistent; non-causal 256-key
    # tiles, causal 128-key tiles in head order). The nearest candidate is the grid's point
    # at the default's own axes, without the options the row adds beyond them.
    beyond = {
        False: {"split_tail", "tail_fixup", "row_sum_wgmma"},
        True: {"head_rounds", "early_q_load"},
    }
    for causal in (False, True):
        default_fwd = sweep.interpretable(configs.default_mosaic_config(64, 128, causal))
        assert default_fwd.persistent
        assert default_fwd.block_kv == (128 if causal else 256)
        fwd = [r for r in rows if r["pass"] == "fwd" and r["causal"] == causal]
        (default,) = [r["config"] for r in fwd if r["default"]]
        assert default == dataclasses.asdict(default_fwd)
        (other,) = [r["config"] for r in fwd if not r["default"]]
        changed = {k for k, v in other.items() if v != getattr(default_fwd, k)}
        assert changed == beyond[causal] and not other["p_in_registers"], changed
    bwd = [r for r in rows if r["pass"] == "bwd"]
    for r in bwd:  # the fused kernel at head dim 64, as compiled (the backward stages it)
        default_bwd = configs.default_mosaic_bwd_config(64, r["causal"])
        assert sweep.interpretable(default_bwd) == default_bwd
        assert (r["config"] == dataclasses.asdict(default_bwd)) == r["default"]
    table = render.sweep_table(rows + [status])
    assert "sweep of the Mosaic GPU kernels" in table and "Triton" not in table
    assert table.count("| 64 |") == 4 and "| 64 | yes | bwd |" in table


@pytest.mark.parametrize("family", ["triton", "mosaic"])
def test_sweep_stops_at_time_budget(tmp_path, family):
    out = tmp_path / "sweep.jsonl"
    argv = ["--tiny", "--family", family, "--time-budget", "0", "--out", str(out)]
    assert sweep.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [rows[0]] and rows[0]["status"] == "time budget spent"
    assert rows[0]["measured"] == 0 and rows[0]["total"] == 8
    assert rows[0]["family"] == family


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


DKV_FIELDS = (
    "block_q_dkv",
    "block_kv_dkv",
    "num_stages_dkv",
    "consumers_dkv",
    "split_dkv",
)
DQ_FIELDS = ("block_q_dq", "block_kv_dq", "num_stages_dq", "consumers_dq")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mosaic_candidates_start_at_the_default_and_it_fits(head_dim):
    fwd_default = configs.default_mosaic_config(head_dim)
    fwd = sweep.ordered(sweep.candidates("mosaic", "fwd", head_dim), fwd_default)
    # tiles, stages, ping-pong, then the schedules: the two flags' four combinations, each
    # on a persistent grid or not, or intra_overlap alone
    assert fwd[0] == fwd_default and len(set(fwd)) == len(fwd) == 2 * 4 * 3 * 2 * (2 * 2 * 2 + 1)
    assert all(c.p_in_registers for c in fwd)
    assert sum(a != b for a, b in zip(sweep._axes(fwd[1]), sweep._axes(fwd_default))) == 1

    default = configs.pair_mosaic_bwd_config(head_dim)
    every = sweep.ordered(sweep.candidates("mosaic", "bwd", head_dim), default)
    assert every[0] == default and len(set(every)) == len(every)
    # The fused kernel's candidates: every dK/dV combination that fits it, none above
    # head dim 128 (its accumulators do not fit beside a dQ share there).
    fused = [c for c in every if c.fused]
    for c in fused:
        mosaic_backward.check_fits(c, head_dim)
        assert not c.split_dkv
        assert all(getattr(c, f) == getattr(default, f) for f in DQ_FIELDS)
    if head_dim <= 128:
        # (the fused kernel has no dQ kernel: its dQ fields are the default's, unused)
        same_dq = {f: getattr(default, f) for f in DQ_FIELDS}
        assert dataclasses.replace(fused_mosaic_bwd_config(head_dim), **same_dq) in fused
    else:
        assert not fused
    bwd = [c for c in every if not c.fused]
    changes = []
    for c in bwd:
        changed = {f for f in DKV_FIELDS + DQ_FIELDS if getattr(c, f) != getattr(default, f)}
        # one kernel's part at a time, in at most two fields: neighbours, then pairs
        assert changed <= set(DKV_FIELDS) or changed <= set(DQ_FIELDS)
        changes.append(len(changed))
    assert changes == sorted(changes) and changes[0] == 0 and max(changes) == 2
    assert changes.count(1) >= 8  # each of the 8 two-valued fields, at least once each way
    split = {c.split_dkv for c in bwd}
    assert split == ({False, True} if head_dim >= 192 else {False})

    for c in (fwd_default, default):
        assert sweep.smem_bytes(c, head_dim) <= SMEM_BYTES
    # the configs' own estimates, at the head dim padded to a multiple of 64
    assert sweep.smem_bytes(default, 80) == max(
        default.smem_bytes_dkv(128), default.smem_bytes_dq(128)
    )


def test_mosaic_over_shared_memory_is_a_row_never_compiled():
    # K and V in 2 stages of 128 keys at head dim 256: 256 KiB, over Hopper's 227 KiB
    big = configs.MosaicConfig(block_q=64, block_kv=128, num_stages=2)
    assert sweep.smem_bytes(big, 256) == big.smem_bytes(256) > SMEM_BYTES
    shape = sweep.TINY_SHAPES["mosaic"].replace(head_dim=256)
    group = sweep.Group(shape, "fwd", [configs.default_mosaic_config(256), big], "mosaic")
    row = sweep.measure(group, 1, inputs=None, fwd_time=None, timing={})  # nothing runs
    assert row["error"].endswith("> 227 KiB: not compiled") and row["ms"] is None
    assert row["family"] == "mosaic" and row["smem_kib"] == big.smem_bytes(256) // 1024


def _sweep_row(pass_, config, ms, default, **kw):
    """One sweep row as benchmarks.sweep writes it (head dim 128, seq 8k)."""
    return dict(
        run_id="r",
        suite="sweep",
        device="H200",
        batch=2,
        seq_q=8192,
        heads=16,
        head_dim=128,
        dtype="bfloat16",
        config=config,
        default=default,
        ms=ms,
        tflops=ms and 2.0 / ms,
        check_ok=ms is not None,
        error=None,
        **kw,
    ) | {"pass": pass_}


def test_sweep_table_speedup():
    def row(ms, default, block_q):
        config = dict(block_q=block_q, block_kv=64, num_warps=8, num_stages=3)
        return _sweep_row("fwd", config, ms, default, causal=False, candidates=3)

    rows = [row(2.0, True, 128), row(1.6, False, 64), row(None, False, 32)]
    table = render.sweep_table(rows)
    assert "| 128 | no | fwd | 2.00 (1) | 64x64 w8 s3 | 1.60 (1) | 1.25x |" in table
    assert "3 of 3 candidates measured" in table


def test_sweep_table_one_per_family():
    def row(family, config, ms, default):
        config = dataclasses.asdict(config)
        return _sweep_row("bwd", config, ms, default, family=family, causal=True, candidates=2)

    split = configs.MosaicBwdConfig(split_dkv=True, consumers_dq=1, num_stages_dq=3)
    rows = [
        row("triton", configs.TritonBwdConfig(), 4.0, True),
        row("triton", configs.TritonBwdConfig(num_warps=8), 3.0, False),
        row("mosaic", configs.MosaicBwdConfig(), 2.0, True),
        row("mosaic", split, 1.0, False),
    ]
    table = render.sweep_table(rows)
    tables = {t.split(" kernels")[0]: t for t in table.split("Launch-config sweep of the ")[1:]}
    triton, mosaic = tables.pop("Triton"), tables.pop("Mosaic GPU")
    assert not tables
    assert "| 128 | yes | bwd | 4.00 (0) | dkv 64x64 dq 64x64 w8 s2 | 3.00 (1) | 1.33x |" in triton
    assert (
        "| 128 | yes | bwd | 2.00 (1) | dkv 1x64 q64 s2 split dq 1x64 kv64 s3 | 1.00 (2) | 2.00x |"
        in mosaic
    )


def test_mosaic_forward_label_names_its_schedule_flags():
    """A sweep's best Mosaic forward differs from the default by a schedule flag at times
    (the early K wait): the label must say which, or two rows read alike."""
    default = dataclasses.asdict(configs.MosaicConfig())
    assert render.config_label(default) == "64x128 s2 row-mask"
    default["row_bound_mask"] = False
    assert render.config_label(default) == "64x128 s2"
    flags = dict(default, rescale_before_turn=True, early_k_wait=True)
    assert render.config_label(flags) == "64x128 s2 rescale-early k-wait-early"
    overlap = dict(default, intra_overlap=True, schedule_barrier=False)
    assert render.config_label(overlap) == "64x128 s2 no-pingpong overlap"
    named = dict(default, named_turns=True, named_releases=True)
    assert render.config_label(named) == "64x128 s2 named-turns named-releases"
    early = dict(default, persistent=True, o_from_registers=True, early_q_load=True)
    assert render.config_label(early) == "64x128 s2 persistent o-regs q-early"
    slack = dict(default, rescale_slack=8.0)
    assert render.config_label(slack) == "64x128 s2 slack8"
    assert render.config_label(dict(slack, consumers=3)) == "64x128 s2 slack8 3wg"
    old_row = {k: v for k, v in default.items() if k != "early_k_wait"}  # before the flag
    assert render.config_label(old_row) == "64x128 s2"


def test_mosaic_backward_label_names_its_flags():
    """The backward's flags (fused, FA3's order, the row-bound mask, per-step
    descriptors, the queries on the rows) show in its label, and rows written before a
    flag existed still read."""
    default = dataclasses.asdict(configs.MosaicBwdConfig())
    assert render.config_label(default) == "dkv 2x64 q64 s2 dq 2x64 kv64 s2"
    fused = dict(default, fused=True, fa3_order=True, step_descriptors=True)
    assert render.config_label(fused) == "dkv 2x64 q64 s2 dq 2x64 kv64 s2 fused fa3-order step-desc"
    pingpong = dict(default, dq_pingpong=True)
    assert render.config_label(pingpong) == "dkv 2x64 q64 s2 dq 2x64 kv64 s2 dq-pingpong"
    turned = dict(default, fused=True, query_rows=True)
    assert render.config_label(turned) == "dkv 2x64 q64 s2 dq 2x64 kv64 s2 fused query-rows"
    halves = dict(fused, share_halves=True, writer_warp=True)
    label = "dkv 2x64 q64 s2 dq 2x64 kv64 s2 fused fa3-order step-desc share-halves writer-warp"
    assert render.config_label(halves) == label
    chained = dict(default, fused=True, chained_share=True)
    assert render.config_label(chained) == "dkv 2x64 q64 s2 dq 2x64 kv64 s2 fused chained-share"
    adds = dict(halves, rotated_adds=True, split_writer=True)
    assert render.config_label(adds) == label + " rotated-adds split-writer"
    rows = dict(default, row_bound_mask=True, operands_in_registers=False)
    assert render.config_label(rows) == "dkv 2x64 q64 s2 dq 2x64 kv64 s2 ops-smem row-mask"
    new_flags = (
        "row_bound_mask",
        "step_descriptors",
        "query_rows",
        "share_halves",
        "writer_warp",
        "chained_share",
    )
    old = {k: v for k, v in default.items() if k not in new_flags}
    assert render.config_label(old) == "dkv 2x64 q64 s2 dq 2x64 kv64 s2"
