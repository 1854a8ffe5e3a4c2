"""The Mosaic kernels compiled for the H200 on this machine, without a GPU
(benchmarks/deviceless.py): what ptxas makes of the default rows.

These need JAX's CUDA plugin, which the CPU suite's environment leaves out, so they run
in their own (`make test-sm90`, part of `make test`; the builds of options that are off
are `extended`, run by `make test-sm90-all`); elsewhere they are skipped, saying so.
Each compiles one forward + backward (B=1, T=S=1024, bf16, heads = 2048 / head dim)
through `python -m benchmarks.ptxas --deviceless`, the tool's own path, and reads
ptxas's report of every kernel.

What they hold the defaults to: ptxas serializes no wgmma in any of them ("Potential
Performance Loss", C7512: on the H200 that alone cost the fused backward half its
speed, docs/mosaic.md, "C7512"), and the forward kernels spill nothing; the default
rows include the fused backward at head dims 64 (non-causal) and 128, whose first build
at 64 ptxas serialized (docs/mosaic.md, "Compiled here, for the H200").
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from benchmarks import deviceless
from pallas_flash.mosaic.config import OVERLAP_REPLACES

M = "pallas_flash:mosaic"
pytestmark = [
    pytest.mark.sm90,
    pytest.mark.skipif(
        deviceless.available() is not None,
        reason=f"compiles for the H200 here: {deviceless.available()}",
    ),
]


def _compiled(
    tmp_path,
    impl: str,
    head_dim: int,
    causal: str = "false,true",
    sass: bool = False,
    seq: int = 1024,
) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "ptxas.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.ptxas", "--deviceless", "--impls", impl]
    cmd += ["--head-dims", str(head_dim), "--causal", causal, "--out", str(out)]
    cmd += ["--seq", str(seq)]
    if sass:  # each kernel's loops, read from its SASS (benchmarks.ptxas.sass_loops)
        cmd += ["--sass", str(tmp_path / "sass")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def _check(rows, head_dim):
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


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_rows_serialize_no_wgmma(tmp_path, head_dim):
    _check(_compiled(tmp_path, M, head_dim), head_dim)


def test_a_serialized_build_is_reported(tmp_path):
    """The check above can fail: the fused default at head dim 64 without step
    descriptors, its fresh accumulators zeroed by moves (held_zero=false), is one ptxas
    serializes (every wgmma its own group) and spills in, as the fused kernel in FA3's
    order was on the H200 before step_descriptors (docs/mosaic.md, "C7512"). With held_zero it
    is not: 36 groups, 80 bytes of spill stores against 2,004 (docs/mosaic.md, "Zeros held
    across the loop")."""
    build = f"{M}/step_descriptors=false/held_zero=false"
    (row,) = _compiled(tmp_path, build, 64, "false")
    (fused,) = [k for k in row["kernels"] if "_bwd_fused" in k["kernel"]]
    assert fused["warnings"] and "Potential Performance Loss" in fused["warnings"][0]
    assert fused["spill_store_bytes"] > 0


def _backward_steps(impl: str, tmp_path, field: str, head_dim: int = 64) -> dict[str, list]:
    """Per backward kernel of the non-causal row of `impl` (by default head dim 64, the
    pair's below), `field` of each of its steps (benchmarks.ptxas.sass_loops:
    fresh_wgmmas, ...; `field` None: the whole loop)."""
    (row,) = _compiled(tmp_path, impl, head_dim, "false", sass=True)
    assert row["error"] is None, row["error"]
    return {
        k["kernel"]: [
            lp if field is None else lp[field]
            for lp in k["loops"]
            if lp["innermost"] and lp["mix"].get("wgmma")
        ]
        for k in row["kernels"]
        if "_bwd_" in k["kernel"]
    }


def test_held_zero_folds_every_fresh_accumulator(tmp_path):
    """pipeline.held_zero: in the pair's every step (the default above head dim 128),
    S^T and dP^T (dK/dV kernel), S and dP (dQ kernel) start from zeros ptxas folds into
    their first wgmmas; with run_scoped's zeros (held_zero=false) it folds only the first
    of the two in the unmasked steps, and zeroes the other's 64 registers by moves."""
    held = _backward_steps(f"{M}/pair", tmp_path / "on", "fresh_wgmmas")
    plain = _backward_steps(f"{M}/pair/held_zero=false", tmp_path / "off", "fresh_wgmmas")
    assert set(held) == set(plain) and len(held) == 2, held
    for kernel, steps in held.items():
        assert steps and all(n == 2 for n in steps), (kernel, steps)
        assert min(plain[kernel]) == 1, (kernel, plain[kernel])


@pytest.mark.extended  # an option that is off: `make test-sm90-all`
def test_probs_before_dp_issues_work_beside_dp(tmp_path):
    """MosaicBwdConfig.probs_before_dp: the pair's steps (the default above head dim
    128) await S and dP together without it (no instruction while a product is pending), and
    with it issue the scores' scaling and some of their exp2 between S's wait and dP's,
    in every step of both kernels (the dQ kernel's unmasked step: its 64 FFMAs and 16
    exp2, docs/mosaic.md, "Scores' exp2 beside dP")."""
    plain = _backward_steps(f"{M}/pair", tmp_path / "off", "beside_pending")
    early = _backward_steps(f"{M}/pair/probs_before_dp=true", tmp_path / "on", "beside_pending")
    assert set(plain) == set(early) and len(plain) == 2, plain
    for kernel, steps in plain.items():
        assert steps and all(n == 0 for n in steps), (kernel, steps)
        assert len(early[kernel]) == len(steps), (kernel, early[kernel])
        assert all(n >= 32 for n in early[kernel]), (kernel, early[kernel])


@pytest.mark.extended  # an option that is off: `make test-sm90-all`
def test_early_lse_reads_the_lse_before_the_scores_wait(tmp_path):
    """MosaicBwdConfig.early_lse at head dim 128 non-causal (the fused default): without
    it each of the fused kernel's steps reads some of the lse from shared memory after
    awaiting S^T, right before the first FFMA that needs it (2-4 loads a step); with it
    none does, and each consumer's unmasked (shortest) step still touches no stack
    (docs/mosaic.md, "Where the consumers wait")."""
    plain = _backward_steps(M, tmp_path / "off", None, head_dim=128)
    early = _backward_steps(f"{M}/early_lse=true", tmp_path / "on", None, head_dim=128)
    assert set(plain) == set(early) and len(plain) == 1, plain  # the fused kernel alone
    for kernel, steps in plain.items():
        assert len(steps) == 6 and all(lp["waited_loads"] >= 2 for lp in steps), steps
        assert len(early[kernel]) == 6, early[kernel]
        assert all(lp["waited_loads"] == 0 for lp in early[kernel]), early[kernel]
        for consumer in (early[kernel][:3], early[kernel][3:]):
            unmasked = min(consumer, key=lambda lp: lp["instructions"])
            assert not unmasked["mix"].get("local"), unmasked


@pytest.mark.extended  # an option that is off: `make test-sm90-all`
def test_qk_behind_pv_issues_a_step_in_one_run(tmp_path):
    """MosaicConfig.qk_behind_pv at head dim 128 (non-causal: the persistent row with its
    conditional rescale): each of the forward's steps issues the next Q K^T and this P V
    in one run of wgmmas (the default's steps issue them in two, each awaited before the
    next is issued), with nothing serialized or spilled, and the Q K^T's zeros folded into
    its first wgmma. Issued behind P V, ptxas zeroed its 64 registers by moves instead:
    127 more instructions in the unmasked step (613 against the default's 488; 486 now)."""
    (row,) = _compiled(tmp_path, f"{M}/qk_behind_pv=true", 128, "false", sass=True)
    assert row["error"] is None, row["error"]
    (fwd,) = [k for k in row["kernels"] if "_fwd_" in k["kernel"]]
    assert fwd["warnings"] == [] and (fwd["spill_store_bytes"], fwd["spill_load_bytes"]) == (0, 0)
    steps = [lp for lp in fwd["loops"] if lp["innermost"] and lp["mix"].get("wgmma")][:3]
    assert len(steps) == 3, fwd["loops"]  # masked, unmasked, masked: the tile loops
    assert all(lp["wgmma_runs"] == 1 and lp["fresh_wgmmas"] == 1 for lp in steps), steps
    assert min(lp["instructions"] for lp in steps) < 500, steps


# The forward's intra-warpgroup overlap (MosaicConfig.intra_overlap), with what it takes
# in place of the default row's other schedule options (OVERLAP_REPLACES: the rows these
# 1024-key builds get are persistent with early Q loads since the 54th session), and
# 128-key tiles (as it was timed). These causal 1024-key rows rescale unconditionally
# (RESCALE_SLACK_OFF_KEYS).
OVERLAP = "/".join(
    [f"{M}/intra_overlap=true", *(f"{k}={str(v).lower()}" for k, v in OVERLAP_REPLACES.items())]
    + ["block_kv=128"]
)


@pytest.mark.extended  # an option that is off: `make test-sm90-all`
@pytest.mark.parametrize("head_dim", [64, 128])
def test_intra_overlap_forward_serializes_no_wgmma(tmp_path, head_dim):
    """The overlapped forward converts tile j's P into the registers tile j - 1's P V
    reads only after that P V is done; converted before (as LLVM placed it in two of its
    three loops), ptxas serialized every wgmma of the kernel (C7513), the build every
    timing of it ran (docs/mosaic.md, "The overlapped forward, unserialized"). Causal
    only (CI's time): that build has the masked loops, where LLVM misplaced it, and the
    unmasked one."""
    for row in _compiled(tmp_path, OVERLAP, head_dim, "true"):
        assert row["error"] is None, row["error"]
        (fwd,) = [k for k in row["kernels"] if "_fwd_" in k["kernel"]]
        assert fwd["warnings"] == [], (row["causal"], fwd["warnings"])
        assert (fwd["spill_store_bytes"], fwd["spill_load_bytes"]) == (0, 0)


def _per_exp2(kernel: dict) -> float:
    """A forward kernel's leanest score-tile step: its instructions per exp2 (one per
    score element a thread holds, whatever the tile's width), over the innermost loops
    that take a tile's exp2s (64 or more)."""
    steps = [lp for lp in kernel["loops"] if lp["innermost"] and lp["mix"].get("mufu", 0) >= 64]
    assert steps, kernel["loops"]
    return min(lp["instructions"] / lp["mix"]["mufu"] for lp in steps)


@pytest.mark.skipif(
    importlib.util.find_spec("tokamax") is None,
    reason="tokamax is not importable here (its wheels: ../shared/peer-wheels, .peers)",
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_step_issues_no_more_than_the_peers(tmp_path, head_dim):
    """tokamax's Mosaic forward, compiled here as on the H200 (deviceless's
    `_tokamax_as_on_h200`), beside ours: our unmasked step issues fewer instructions per
    score element than the peer's (at 8k keys, non-causal, 6.6 / 7.5 for tokamax at head
    dims 64 / 128 against our 5.1 / 7.4: docs/mosaic.md, "The peer's steps, read here"),
    so where our forward trails the peer's clock on the H200 the cause is not its issue
    count."""
    (peer,) = _compiled(tmp_path / "peer", "tokamax:mosaic", head_dim, "false", True, 8192)
    (ours,) = _compiled(tmp_path / "ours", M, head_dim, "false", True, 8192)
    for row in (peer, ours):
        assert row["error"] is None, row["error"]
    (peer_fwd,) = [k for k in peer["kernels"] if k["kernel"].startswith("flash_attention_sm90")]
    (our_fwd,) = [k for k in ours["kernels"] if "_fwd_" in k["kernel"]]
    assert _per_exp2(our_fwd) < _per_exp2(peer_fwd), (our_fwd["loops"], peer_fwd["loops"])
