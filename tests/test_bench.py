"""The benchmark harness runs end to end on CPU (interpret mode, tiny shapes) and renders."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import jax.numpy as jnp
import pytest

from benchmarks import anchors, bench, render
from pallas_flash.mosaic import bwd_config
from pallas_flash.mosaic import config as mosaic_config

KEYS = {
    "run_id",
    "device",
    "jax",
    "cudnn",
    "commit",
    "impl",
    "pass",
    "batch",
    "seq_q",
    "seq_k",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "causal",
    "mask",
    "ms",
    "tflops",
    "temp_bytes",
    "peak_bytes",
    "error",
}


@pytest.mark.kernel
def test_quick_suite_tiny_runs_and_renders(tmp_path):
    out = tmp_path / "quick.jsonl"
    impls = "pallas_flash:triton,pallas_flash:xla_blockwise,jax.nn:xla,tokamax:mosaic"
    assert bench.main(["--suite", "quick", "--tiny", "--impls", impls, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(KEYS <= set(r) for r in rows)
    assert len({r["run_id"] for r in rows}) == 1
    ours = [r for r in rows if r["impl"] == "pallas_flash:triton"]
    # our kernels passed the pre-timing check against the reference and were timed
    assert ours and all(r["check_err"] < 1e-2 for r in ours)
    assert all(r["ms"] > 0 for r in ours if r["pass"] == "fwd")
    # a peer that cannot run here is recorded with its error, not dropped
    assert any(r["impl"] == "tokamax:mosaic" and r["error"] for r in rows) or any(
        r["impl"] == "tokamax:mosaic" and r["ms"] for r in rows
    )
    table = render.speed_tables(rows)
    assert "pallas_flash:triton" in table and "ratio to best peer" in table
    assert render.plots(rows, str(tmp_path))


def test_memory_suite_tiny_records_bytes(tmp_path):
    out = tmp_path / "mem.jsonl"
    impls = "pallas_flash:xla_blockwise,jax.nn:xla"
    assert bench.main(["--suite", "memory", "--tiny", "--impls", impls, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["temp_bytes"] is not None and not r["error"] for r in rows)
    assert "xla_blockwise" in render.memory_table(rows)


@pytest.mark.kernel
@pytest.mark.parametrize("suite", ["masks", pytest.param("sparse", marks=pytest.mark.extended)])
def test_masking_suites_tiny_run(tmp_path, suite):
    """Every masking label builds its arguments and our kernel runs it; peers lacking an
    argument are recorded as failed, naming it."""
    out = tmp_path / f"{suite}.jsonl"
    assert bench.main(["--suite", suite, "--tiny", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ours = [r for r in rows if r["impl"] == "pallas_flash:triton"]
    # A compiled tiny shape can run faster than the timer resolves: its backward row
    # (fwd+bwd minus fwd) is then recorded as below noise. Any other error fails.
    noise = "below timing noise"
    assert ours and not any(r["error"] and not r["error"].startswith(noise) for r in ours)
    assert all(r["check_err"] < 1e-2 for r in ours)
    assert all(r["ms"] > 0 for r in ours if r["pass"] == "fwd")


def test_time_fn_warms_up_for_the_seconds_asked():
    """The warm-up runs until both its call count and its seconds are spent (the GPU's
    clocks after a compile), then the timed rounds."""
    calls = []

    def f(x):
        calls.append(time.perf_counter())
        time.sleep(0.01)
        return x

    seconds = bench.time_fn(f, (jnp.zeros(()),), warmup=2, warmup_s=0.1, rounds=3, calls=2)
    # >= 0.1 s of 10 ms calls (about 10), then one probe call and 3 rounds of 2.
    warm = len(calls) - 1 - 3 * 2
    assert warm >= 9, warm
    assert calls[warm - 1] - calls[0] >= 0.08
    assert 0.009 < seconds < 0.05
    calls.clear()
    bench.time_fn(f, (jnp.zeros(()),), warmup=2, warmup_s=0.0, rounds=1, calls=1)
    assert len(calls) == 2 + 1 + 1


def test_time_interleaved_takes_rounds_in_turn():
    """Round 1 of each, round 2 of each, ...: a drift over the process falls on all alike.
    One that raises gets its exception as its result and leaves the turn; the rest go on."""
    order = []

    class Fake:
        def __init__(self, name, seconds, fail_on=None):
            self.name, self.seconds, self.fail_on, self.n = name, seconds, fail_on, 0

        def round(self):
            order.append(self.name)
            self.n += 1
            if self.n == self.fail_on:
                raise RuntimeError("boom")

        def median(self):
            return self.seconds

    out = bench.time_interleaved(
        {"a": Fake("a", 1.0), "b": Fake("b", 2.0, fail_on=2), "c": Fake("c", 3.0)}, rounds=3
    )
    assert order == ["a", "b", "c", "a", "b", "c", "a", "c"]
    assert out["a"] == 1.0 and out["c"] == 3.0
    assert isinstance(out["b"], RuntimeError)


def test_a_peer_without_a_backward_is_timed_on_its_forward():
    """JAX's Mosaic FA3 raises on a causal gradient: its forward is still timed (it is a
    peer's forward), its backward rows carry the reason, and a forward that fails too
    fails every pass."""
    import jax

    from benchmarks.impls import Impl, reference_fn

    ref = reference_fn(unscaled=False)

    @jax.custom_vjp
    def attend(q, k, v):
        return ref(q, k, v, causal=True)

    def no_grad(*_):
        raise NotImplementedError("no causal backward here")

    attend.defvjp(lambda q, k, v: (attend(q, k, v), None), no_grad)
    fwd_only = Impl("fwd-only", lambda q, k, v, *, causal: attend(q, k, v))
    s = bench.suites.Shape(1, 64, 64, 2, 2, 32, causal=True)
    passes = ("fwd", "bwd", "fwd+bwd")
    rows = {
        r["pass"]: r
        for r in bench.run_shape(
            fwd_only, s, passes, memory=False, run=True, checked={}, timing=bench.TINY_TIMING
        )
    }
    assert rows["fwd"]["error"] is None and rows["fwd"]["ms"] > 0
    assert rows["fwd"]["check_ok"] and rows["fwd"]["check_worst"] == "o"
    for p in ("bwd", "fwd+bwd"):
        assert rows[p]["ms"] is None and "no causal backward here" in rows[p]["error"]
    # asked for its backward alone, or for its memory, it has nothing to give
    (only_bwd,) = bench.run_shape(
        fwd_only, s, ("fwd+bwd",), memory=False, run=True, checked={}, timing=bench.TINY_TIMING
    )
    assert "no causal backward here" in only_bwd["error"]

    def broken(q, k, v, *, causal):
        raise ValueError("forward broken too")

    rows = list(
        bench.run_shape(Impl("broken", broken), s, passes, memory=False, run=True, checked={})
    )
    assert len(rows) == 3 and all("forward broken too" in r["error"] for r in rows)


def test_a_forward_only_run_compiles_no_backward():
    """With the forward alone timed, the check compares O alone and neither the
    implementation's backward nor the reference's is built; with the backward timed,
    both are (so this test can fail)."""
    import jax

    from benchmarks.impls import Impl, reference_fn

    traced = []

    def ref(q, k, v):  # in the inputs' dtype, as an implementation's output is
        return reference_fn(unscaled=False)(q, k, v, causal=False).astype(q.dtype)

    @jax.custom_vjp
    def attend(q, k, v):
        return ref(q, k, v)

    def attend_bwd(residuals, g):
        traced.append("bwd")
        return jax.vjp(ref, *residuals)[1](g)

    attend.defvjp(lambda q, k, v: (attend(q, k, v), (q, k, v)), attend_bwd)
    impl = Impl("counted", lambda q, k, v, *, causal: attend(q, k, v))
    s = bench.suites.Shape(1, 64, 64, 2, 2, 32, causal=False)
    run = dict(memory=False, run=True, checked={}, timing=bench.TINY_TIMING)
    (row,) = bench.run_shape(impl, s, ("fwd",), **run)
    assert row["error"] is None and row["check_ok"] and row["check_worst"] == "o"
    assert traced == []
    fwd_row, bwd_row = bench.run_shape(impl, s, ("fwd", "bwd"), **run)
    assert fwd_row["error"] is None and traced
    # the backward is timed as fwd+bwd minus fwd, which on a tiny shape and a busy CPU can
    # fall within the noise (a result the harness names, not a failure of this check)
    assert bwd_row["error"] in (None, "below timing noise: fwd+bwd <= fwd"), bwd_row["error"]


def test_flops_convention():
    s = bench.suites.Shape(2, 1024, 1024, 16, 16, 128, causal=False)
    assert bench.attention_flops(s) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.attention_flops(s.replace(causal=True)) == bench.attention_flops(s) / 2


def _row(suite, mask, p, ms, causal=False, head_dim=128):
    return dict(
        suite=suite,
        impl="pallas_flash:triton",
        mask=mask,
        pass_=p,
        causal=causal,
        head_dim=head_dim,
        batch=2,
        seq_q=8192,
        heads=16,
        ms=ms,
        error=None,
    ) | {"pass": p}


def test_masks_sparse_and_hbm_tables():
    rows = [_row("masks", "none", p, 10.0) for p in render.PASSES]
    rows += [_row("masks", "segments:1", p, 10.5) for p in render.PASSES]
    assert "| segments:1 | 1.05x | 1.05x | 1.05x |" in render.masks_table(rows)
    rows = [_row("sparse", "none", "fwd+bwd", 20.0)]
    rows += [_row("sparse", f"sparse:{d}", "fwd+bwd", 22.0 * float(d)) for d in render.DENSITIES]
    assert "| 128 | 20.00 | 1.10x | 1.10x | 1.10x | 1.10x |" in render.sparse_table(rows)
    hbm = dict(
        impl="pallas_flash:triton",
        batch=64,
        seq=1024,
        heads=16,
        head_dim=64,
        dtype="float16",
        compulsory_bytes=1.61e9,
        read_bytes=1.5e9,
        write_bytes=0.5e9,
        total_bytes=2.0e9,
        over_compulsory=2.0 / 1.61,
        error=None,
    )
    assert "| pallas_flash:triton | 1.50 | 0.50 | 2.00 | 1.24x |" in render.hbm_table([hbm])


@pytest.mark.extended
@pytest.mark.kernel
def test_mask_layouts_experiment_runs_and_checks_each_layout(tmp_path):
    """benchmarks.mask_layouts: every alternative mask layout matches the reference
    (interpret mode) and writes its rows, so the GPU comparison cannot rot."""
    from benchmarks import mask_layouts

    out = tmp_path / "layouts.jsonl"
    assert mask_layouts.main(["--tiny", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    layouts = {r["layout"] for r in rows}
    assert layouts == {None, *mask_layouts.LAYOUTS}
    for r in rows:
        assert r["error"] is None or r["error"].startswith("below timing noise"), r
        assert r["check_ok"], (r["layout"], r["check_err"], r["check_worst"])
    table = render.mask_layouts_table(rows)
    assert all(f"| {name} |" in table for name in mask_layouts.LAYOUTS), table


def test_anchors_compare_a_run_with_the_peers_measured_numbers():
    """benchmarks.anchors: run / anchor per point, grouped by run; a point off by more
    than the tolerance is flagged; ours, masked rows and failed rows have no anchor."""
    base = dict(suite="fa", mask="none", error=None, head_dim=64, causal=True)
    rows = [
        dict(
            base, run_id="a", impl="jax.nn:cudnn", seq_q=1024, tflops=290 * 1.05, **{"pass": "fwd"}
        ),
        dict(
            base, run_id="a", impl="jax.nn:cudnn", seq_q=2048, tflops=295 * 0.8, **{"pass": "bwd"}
        ),
        dict(
            base, run_id="a", impl="pallas_flash:triton", seq_q=1024, tflops=1.0, **{"pass": "fwd"}
        ),
        dict(base, run_id="a", impl="jax:mosaic_fa3", seq_q=1024, tflops=1.0, **{"pass": "bwd"}),
        dict(
            base,
            run_id="a",
            impl="jax.nn:cudnn",
            seq_q=512,
            tflops=1.0,
            mask="padding",
            **{"pass": "fwd"},
        ),
        dict(
            base,
            run_id="a",
            impl="jax.nn:cudnn",
            seq_q=512,
            tflops=None,
            error="x",
            **{"pass": "fwd"},
        ),
    ]
    got = anchors.compare(rows)
    assert got.keys() == {
        ("a", "jax.nn:cudnn", 64, True, "fwd"),
        ("a", "jax.nn:cudnn", 64, True, "bwd"),
    }
    assert got[("a", "jax.nn:cudnn", 64, True, "fwd")] == [(1024, pytest.approx(1.05))]
    lines = anchors.table(rows).splitlines()
    assert "| 0.80 " not in lines[2] and "| - 1.05 - - - - | 5.0 % | yes | a |" in lines[3]
    assert "| - - 0.80 - - - | 20.0 % | **no** | a |" in lines[2]
    assert lines[-1] == "1 of 2 points within 10 % of the anchors."


def test_summary_sets_ours_against_the_best_peer_and_cudnn():
    """render.summary_table: ratio ranges below and from seq 2k, against the best peer of
    each length and against cuDNN, and ours at its fastest as a share of the matmul rate."""
    base = dict(suite="fa", mask="none", error=None, head_dim=128, causal=False, run_id="r")
    base["matmul_tflops"] = 800.0
    speeds = {
        "pallas_flash:mosaic": {1024: 300, 2048: 400, 4096: 500},
        "jax.nn:cudnn": {1024: 250, 2048: 500, 4096: 400},
        "tokamax:mosaic": {1024: 400, 2048: 100, 4096: 625},
    }
    rows = [
        dict(base, impl=i, seq_q=t, tflops=v, **{"pass": "fwd"})
        for i, by in speeds.items()
        for t, v in by.items()
    ]
    rows.append(
        dict(base, impl="jax.nn:xla", seq_q=4096, tflops=None, error="oom", **{"pass": "fwd"})
    )
    lines = render.summary_table(rows).splitlines()
    assert (
        lines[-1]
        == "| 128 | no | fwd | 1k-4k | 0.75x | 0.80x | 1.20x | 0.80-1.25x | 500 (62 %) | r |"
    )


def test_latest_table_takes_each_point_from_the_newest_full_run():
    """render.latest_table: per point, the newest run with ours and the peers it needs
    (a forward run without tokamax is passed over; the backward needs only cuDNN)."""
    base = dict(suite="fa", mask="none", error=None, head_dim=64, causal=True)

    def rows(run_id, p, seq, speeds):
        return [
            dict(base, run_id=run_id, impl=i, seq_q=seq, tflops=v, **{"pass": p})
            for i, v in speeds.items()
        ]

    old = "20261201-000000-aaa"
    new = "20261202-000000-bbb"
    full = {"pallas_flash:mosaic": 300, "jax.nn:cudnn": 400, "tokamax:mosaic": 250}
    table = render.latest_table(
        rows(old, "fwd", 1024, full)
        + rows(new, "fwd", 1024, {"pallas_flash:mosaic": 500, "jax.nn:cudnn": 400})
        + rows(old, "bwd", 1024, {"pallas_flash:mosaic": 100, "jax.nn:cudnn": 200})
        + rows(new, "bwd", 1024, {"pallas_flash:mosaic": 300, "jax.nn:cudnn": 200})
        + rows(new, "fwd", 2048, {"pallas_flash:mosaic-fused": 1, **full})
        + [dict(base, run_id=new, impl="pallas_flash:mosaic", seq_q=4096, tflops=None,
                error="oom", **{"pass": "bwd"})]
    )  # fmt: skip
    lines = table.splitlines()
    assert "| 64 | yes | bwd | 1.50x b | - |" in lines  # 2k untimed; 4k failed: no column
    assert "| 64 | yes | fwd | 0.75x a | 0.75x b |" in lines
    assert lines[-2:] == [f"a: {old}", f"b: {new}"]
    timed = rows(new, "bwd", 1024, {"pallas_flash:mosaic": 300, "jax.nn:cudnn": 200})
    for r in timed:
        r["preroll_s"] = 0.2  # the run's rounds each followed 0.2 s of untimed calls
    assert render.latest_table(timed).splitlines()[-1] == f"a: {new} (pre-roll 0.2 s)"
    assert render.latest_table(rows(new, "fwd", 1024, {"jax.nn:cudnn": 1})) == ""


def test_latest_table_gives_the_cells_per_clock_too():
    """The second table divides each side's TFLOP/s by its own mean SM clock: ours at 500
    TFLOP/s and 1600 MHz against a peer at 480 and 1760 is 1.04x, 1.15x per clock. A
    cell where either row lacks a clock, or whose commit's clocks are not NVML's
    (UNREAD_CLOCKS), has no per-clock cell."""
    base = dict(suite="fa", mask="none", error=None, head_dim=128, causal=False)
    speeds = {"pallas_flash:mosaic": (500, 1600), "jax.nn:cudnn": (480, 1760)}
    speeds["tokamax:mosaic"] = (400, 1700)

    def rows(seq, p="fwd", commit="abc", clocks=True):
        return [
            dict(base, run_id="20261207-000000-" + commit, commit=commit, impl=i, seq_q=seq,
                 tflops=t, **({"sm_mhz": mhz} if clocks else {}), **{"pass": p})
            for i, (t, mhz) in speeds.items()
        ]  # fmt: skip

    table = render.latest_table(rows(2048) + rows(4096, clocks=False) + rows(2048, "bwd"))
    clock = table.split("per clock")[1].splitlines()
    assert "| 128 | no | fwd | 1.04x a | 1.04x a |" in table.splitlines()
    assert "| 128 | no | fwd | 1.15x (1600 / 1760) |" in clock  # 4k: no clocks, no column
    assert "| 128 | no | bwd | 1.15x (1600 / 1760) |" in clock  # against cuDNN
    unread = render.latest_table(rows(2048, commit=next(iter(render.UNREAD_CLOCKS))))
    assert "1.04x a" in unread and "per clock" not in unread


def test_latest_table_counts_the_h200_only():
    """A newer run on another GPU (the device tool may lend an H100) does not replace the
    H200's cell; rows that name no device count."""
    base = dict(suite="fa", mask="none", error=None, head_dim=128, causal=False, seq_q=8192)
    rows = [
        dict(base, run_id=run_id, device=device, impl=impl, tflops=t, **{"pass": "bwd"})
        for run_id, device, speeds in (
            ("20261205-140000-aaa", "NVIDIA H200", (400, 500)),
            ("20261205-150000-bbb", "NVIDIA H100 80GB HBM3", (500, 500)),
        )
        for impl, t in zip(("pallas_flash:mosaic", "jax.nn:cudnn"), speeds)
    ]
    lines = render.latest_table(rows).splitlines()
    assert "| 128 | no | bwd | 0.80x a |" in lines and lines[-1] == "a: 20261205-140000-aaa"
    assert "1.00x" in render.latest_table([dict(r, device="") for r in rows[2:]])
    for r in rows[2:]:
        del r["device"]
    assert render.latest_table(rows).splitlines()[-1] == "a: 20261205-150000-bbb"


def test_latest_table_passes_over_reverted_defaults():
    """Where REVERTED_DEFAULTS says a commit's default was reverted, its rows of ours do
    not count there (the point falls back to an older run); elsewhere they do."""
    base = dict(suite="fa", mask="none", error=None, head_dim=64, causal=False)

    def rows(run_id, commit, seq, ours):
        speeds = {"pallas_flash:mosaic": ours, "jax.nn:cudnn": 100, "tokamax:mosaic": 50}
        return [
            dict(base, run_id=run_id, commit=commit, impl=i, seq_q=seq, seq_k=seq, tflops=v,
                 **{"pass": "fwd"})
            for i, v in speeds.items()
        ]  # fmt: skip

    old, new = "20261204-150000-29ce459", "20261204-160455-99c36a7"
    table = render.latest_table(
        rows(old, "29ce459", 8192, 110) + rows(new, "99c36a7", 8192, 90)
        + rows(old, "29ce459", 4096, 110) + rows(new, "99c36a7", 4096, 120)
    )  # fmt: skip
    assert "| 64 | no | fwd | 1.20x b | 1.10x a |" in table.splitlines()


def test_latest_table_names_runs_past_z_in_letters():
    """The 27th run is `aa`, not the character after `z` (`{`, and `|` splits a cell)."""
    base = dict(suite="fa", mask="none", error=None, head_dim=64, causal=False, seq_q=1024)
    rows = [
        dict(base, run_id=f"20261201-{i:06d}-c", impl=impl, tflops=100.0 + i, **{"pass": "bwd"})
        for i in range(28)
        for impl in ("pallas_flash:mosaic", "jax.nn:cudnn")
    ]
    # one cell a run: each run times a length of its own
    for i, row in enumerate(rows):
        row["seq_q"] = 1024 * (1 + i // 2)
    lines = render.latest_table(rows).splitlines()
    assert lines[-3:] == [
        f"z: 20261201-{25:06d}-c",
        f"aa: 20261201-{26:06d}-c",
        f"ab: 20261201-{27:06d}-c",
    ]
    assert "1.00x ab |" in lines[4]


def test_seqs_keep_only_those_query_lengths(tmp_path, capsys):
    """--seqs narrows a suite to some lengths (a point a time budget cut); a filter that
    leaves nothing is an error naming the suite, not an empty run."""
    out = tmp_path / "fa.jsonl"
    argv = ["--suite", "fa", "--tiny", "--impls", "pallas_flash:xla_blockwise", "--out", str(out)]
    assert bench.main([*argv, "--seqs", "40"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and {r["seq_q"] for r in rows} == {40}
    with pytest.raises(SystemExit):
        bench.main([*argv, "--seqs", "12345"])
    assert "no fa shape is left" in capsys.readouterr().err


def test_heads_replace_the_head_counts_and_render_passes_them_over(tmp_path, capsys):
    """--heads runs each kept shape once per head count (a probe of the launch's waves);
    the tables' loader passes over fa rows off the grid's head count, so a probe never
    takes a grid point's cell; a count below 1 is an error naming the flag."""
    out = tmp_path / "fa.jsonl"
    argv = ["--suite", "fa", "--tiny", "--impls", "pallas_flash:xla_blockwise", "--out", str(out)]
    assert bench.main([*argv, "--seqs", "40", "--passes", "fwd", "--heads", "3,5"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({(r["heads"], r["kv_heads"]) for r in rows}) == [(3, 3), (5, 5)]
    grid = dict(rows[0], heads=2048 // rows[0]["head_dim"], suite="fa", batch=4, seq_q=4096)
    (tmp_path / "grid.jsonl").write_text(json.dumps(grid) + "\n")
    assert render.load([out, tmp_path / "grid.jsonl"]) == [grid]
    with pytest.raises(SystemExit):
        bench.main([*argv, "--heads", "0"])
    assert "--heads '0'" in capsys.readouterr().err


def test_batches_replace_the_batch_and_render_passes_them_over(tmp_path, capsys):
    """--batches runs each kept shape once per batch size (a probe of the backward's
    band_pairs at more tokens a batch); the tables' loader passes over fa rows off the
    grid's 16k tokens a batch; a size below 1 is an error naming the flag."""
    out = tmp_path / "fa.jsonl"
    argv = ["--suite", "fa", "--tiny", "--impls", "pallas_flash:xla_blockwise", "--out", str(out)]
    assert bench.main([*argv, "--seqs", "40", "--passes", "fwd", "--batches", "1,3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({r["batch"] for r in rows}) == [1, 3] and {r["seq_q"] for r in rows} == {40}
    on_grid = dict(rows[0], heads=2048 // rows[0]["head_dim"], batch=4, seq_q=4096, seq_k=4096)
    off_grid = dict(on_grid, batch=16)  # 64k tokens
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (on_grid, off_grid)))
    assert render.load([tmp_path / "rows.jsonl"]) == [on_grid]
    with pytest.raises(SystemExit):
        bench.main([*argv, "--batches", "2,0"])
    assert "--batches '2,0'" in capsys.readouterr().err


def test_passes_keep_only_those_passes(tmp_path, capsys, monkeypatch):
    """--passes fwd times the forward alone: one row a shape, and the fwd+bwd call is
    never built (a forward-only variant's backward costs device time and says nothing);
    a pass the suite lacks is an error naming the ones it has."""
    built = []
    real_timed = bench.Timed

    def spy(f, args, *rest, **kw):
        built.append(len(args))  # fwd takes (q, k, v, arrays); fwd+bwd adds dO
        return real_timed(f, args, *rest, **kw)

    monkeypatch.setattr(bench, "Timed", spy)
    out = tmp_path / "fa.jsonl"
    argv = ["--suite", "fa", "--tiny", "--impls", "pallas_flash:xla_blockwise", "--out", str(out)]
    assert bench.main([*argv, "--seqs", "40", "--passes", "fwd"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and {r["pass"] for r in rows} == {"fwd"}
    assert all(r["error"] is None and r["tflops"] > 0 for r in rows)
    assert built and set(built) == {4}
    with pytest.raises(SystemExit):
        bench.main([*argv, "--passes", "fwd,backward"])
    assert "--passes 'fwd,backward': each must be one of" in capsys.readouterr().err


def test_isolated_processes_get_every_filter():
    """--isolate runs one process per implementation: each gets the same shape filters
    and budget (a dropped --causal once ran the whole grid per process)."""
    args = bench.argparse.Namespace(
        suite="memory",
        max_run_seq=262144,
        out="m.jsonl",
        commit="abc",
        head_dims="128",
        masks=None,
        causal="true",
        seqs="1024,4096",
        passes="fwd",
        time_budget=30.0,
        preroll_s=0.25,
        tiny=False,
    )
    got = bench._forward_args(args, "jax.nn:cudnn", "run1")
    pairs = dict(zip(got[::2], got[1::2]))
    assert pairs["--impls"] == "jax.nn:cudnn" and pairs["--causal"] == "true"
    assert pairs["--seqs"] == "1024,4096" and pairs["--time-budget"] == "30.0"
    assert pairs["--preroll-s"] == "0.25" and pairs["--passes"] == "fwd"
    assert "--masks" not in pairs and "--tiny" not in got


def test_timed_preroll_runs_untimed_calls_before_each_round():
    """A pre-roll of 3x one call's time: each round makes 3 untimed calls, then its own,
    and records one host span for the timed part."""
    calls = []

    def f(x):
        calls.append(time.perf_counter())
        time.sleep(0.01)
        return x

    t = bench.Timed(f, (jnp.zeros(2),), calls=2, preroll_s=0.03)
    t.warm(warmup=1, warmup_s=0.0)
    assert t.preroll in (2, 3)  # 0.03 s over one call's ~0.01 s (sleep overshoots)
    before = len(calls)
    t.round()
    assert len(calls) - before == t.preroll + t.calls
    ((start, end),) = t.spans  # one round, one span: a later reading than its start
    assert end > start and len(t.times) == 1
    plain = bench.Timed(f, (jnp.zeros(2),), calls=2)
    plain.warm(warmup=1, warmup_s=0.0)
    before = len(calls)
    plain.round()
    assert plain.preroll == 0 and len(calls) - before == plain.calls


def test_mosaic_config_variants_are_named_by_their_fields(monkeypatch):
    from benchmarks import impls

    v = impls.lookup("pallas_flash:mosaic/block_q_dkv=64/num_stages_dkv=2/early_k_wait=false")
    assert v.ours and v.name.endswith("early_k_wait=false")
    seen = {}

    def fake(q, k, v, **kw):
        seen.update(kw)
        return q

    monkeypatch.setattr(impls.pallas_flash, "flash_attention", fake)
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    v.fn(q, q, q, causal=True)
    default = mosaic_config.default_mosaic_config(64, 8, True)
    assert seen["config"] == dataclasses.replace(default, early_k_wait=False)
    assert seen["config"].block_kv == 128  # 8 keys, causal: the short-length default
    assert (seen["backward_config"].block_q_dkv, seen["backward_config"].num_stages_dkv) == (64, 2)
    assert impls.lookup("jax.nn:cudnn") is impls.IMPLS["jax.nn:cudnn"]
    with pytest.raises(KeyError):
        impls.lookup("pallas_flash:nope")
    with pytest.raises(ValueError, match="block_size=64"):
        impls.lookup("pallas_flash:mosaic/block_size=64")
    with pytest.raises(ValueError, match="not true, false, none or an int"):
        impls.lookup("pallas_flash:mosaic/fused=yes")
    # none unsets an optional field: the head-dim-128 row without its conditional rescale
    plain = impls.lookup("pallas_flash:mosaic/rescale_slack=none")
    q128 = jnp.zeros((1, 4096, 2, 128), jnp.bfloat16)
    plain.fn(q128, q128, q128, causal=False)
    assert mosaic_config.default_mosaic_config(128, 4096, False).rescale_slack == 8
    assert seen["config"].rescale_slack is None
    seen.clear()  # the forward default at the call's key length (causal: 128-key tiles up
    k = jnp.zeros((1, 4096, 2, 64), jnp.bfloat16)  # to 2048 keys)
    # (the pair's Q and dO in registers are the plain dQ kernel's: a fused variant of it
    # names them off, or the config says why not)
    with pytest.raises(ValueError, match="q_do_in_registers is the plain dQ kernel's"):
        impls.lookup("pallas_flash:mosaic/pair/fused=true").fn(q, k, k, causal=True)
    impls.lookup("pallas_flash:mosaic/pair/fused=true/q_do_in_registers=false").fn(
        q, k, k, causal=True
    )
    assert seen["backward_config"].fused and seen["config"].block_kv == 256
    assert seen["config"] == mosaic_config.default_mosaic_config(64, 4096, True)
    seen.clear()  # and at the call's causal flag (head dim 128, 8 keys: persistent, in
    q = jnp.zeros((1, 8, 2, 128), jnp.bfloat16)  # head order when causal; 4k: not causal)
    for causal in (False, True):
        impls.lookup("pallas_flash:mosaic/num_stages=2").fn(q, q, q, causal=causal)
        assert seen["config"].persistent and seen["config"].head_rounds is causal
    listed = mosaic_config.default_mosaic_config(128, 4096, True)  # the list schedule's
    assert listed.persistent and listed.greedy_items and listed.early_q_load  # row, to 8k
    assert not mosaic_config.default_mosaic_config(128, 16384, True).persistent
    seen.clear()  # a field both configs have is set in both
    impls.lookup("pallas_flash:mosaic/row_bound_mask=false").fn(q, q, q, causal=True)
    assert not seen["config"].row_bound_mask and not seen["backward_config"].row_bound_mask
    # The backward default at the call's causal flag (head dims 64 and 128: fused either
    # way, causal in bands of heads, at 64 launched from the last span down), and `pair`
    # names the pair there.
    seen.clear()
    q64 = q[..., :64]
    for causal in (False, True):
        impls.lookup("pallas_flash:mosaic/num_stages=2").fn(q64, q64, q64, causal=causal)
        assert seen["backward_config"] == bwd_config.default_mosaic_bwd_config(64, causal)
        assert seen["backward_config"].fused
        assert seen["backward_config"].span_band == (4 if causal else 1)
        assert seen["backward_config"].high_spans_first == causal
        impls.lookup("pallas_flash:mosaic/num_stages=2").fn(q, q, q, causal=causal)
        assert seen["backward_config"] == bwd_config.default_mosaic_bwd_config(128, causal)
        assert seen["backward_config"].fused and not seen["backward_config"].high_spans_first
        impls.lookup("pallas_flash:mosaic/pair/block_q_dkv=128").fn(q, q, q, causal=causal)
        pair = bwd_config.pair_mosaic_bwd_config(128)
        assert seen["backward_config"] == dataclasses.replace(pair, block_q_dkv=128)
        # and `fused` the fused default's row, causal too
        impls.lookup("pallas_flash:mosaic/fused/split_writer=false").fn(q, q, q, causal=causal)
        fused = bwd_config.fused_full_bwd_config(128)
        assert seen["backward_config"] == dataclasses.replace(fused, split_writer=False)
    with pytest.raises(ValueError, match="'pair' is not FIELD=VALUE"):  # first item only
        impls.lookup("pallas_flash:mosaic/num_stages=2/pair")
    with pytest.raises(SystemExit):  # the CLI names the bad field before running anything
        bench.main(["--suite", "quick", "--impls", "pallas_flash:mosaic/num_stages=x"])


def test_gpu_clock_reads_nvml_and_averages_over_spans():
    """read_once fills the four NVML readings (power in mW to W; the instantaneous draw
    from the field values, as the value type says, NaN where the field fails); `during`
    averages the samples inside the spans only, leaves out a field NVML never gave, and a
    sampler without NVML has none."""
    from benchmarks import gpu_clock

    class FakeNvml:
        field_return, value_type = 0, 1  # NVML_SUCCESS, an unsigned int

        def nvmlDeviceGetClockInfo(self, handle, kind, ref):
            ref._obj.value = 1755 if kind == gpu_clock._NVML_CLOCK_SM else 0
            return 0

        def nvmlDeviceGetPowerUsage(self, handle, ref):
            ref._obj.value = 690500
            return 0

        def nvmlDeviceGetTemperature(self, handle, sensor, ref):
            ref._obj.value = 52
            return 0

        def nvmlDeviceGetFieldValues(self, handle, count, ref):
            field = ref._obj
            assert count == 1 and field.fieldId == 186  # NVML_FI_DEV_POWER_INSTANT
            field.nvmlReturn, field.valueType = self.field_return, self.value_type
            field.value.uiVal = 702250
            return 0

    assert gpu_clock.read_once((FakeNvml(), None)) == [1755.0, 690.5, 52.0, 702.25]
    as_long = FakeNvml()
    as_long.value_type = 3  # an unsigned long long: the union's same low bytes
    assert gpu_clock.read_once((as_long, None))[3] == 702.25
    no_field = FakeNvml()
    no_field.field_return = 3  # NVML_ERROR_NOT_SUPPORTED for this field
    assert math.isnan(gpu_clock.read_once((no_field, None))[3])
    failing = FakeNvml()
    failing.nvmlDeviceGetPowerUsage = lambda handle, ref: 999  # an NVML error code
    assert gpu_clock.read_once((failing, None)) is None

    s = gpu_clock.Sampler.__new__(gpu_clock.Sampler)
    nan = float("nan")
    s.samples = [
        (1.0, [1500.0, 600.0, 50.0, 640.0]),
        (2.0, [1700.0, 700.0, 52.0, nan]),
        (9.0, [1980, 0, 0, 0]),
    ]
    assert s.during([(0.5, 2.5)]) == {
        "sm_mhz": 1600.0,
        "power_w": 650.0,
        "temp_c": 51.0,
        "power_now_w": 640.0,
    }
    s.samples = [(1.0, [1500.0, 600.0, 50.0, nan])]
    assert s.during([(0.5, 2.5)]) == {"sm_mhz": 1500.0, "power_w": 600.0, "temp_c": 50.0}
    assert s.during([(3.0, 4.0)]) == {}


def test_sustained_phases_time_per_call():
    """benchmarks.sustained: `queued` times rounds of 20 calls behind one sync (seconds a
    call), `synced` and `isolated` one synced call each (isolated after a pause)."""
    from benchmarks import sustained

    calls = []

    def f(x):
        calls.append(x)
        time.sleep(0.002)
        return x

    args = (jnp.zeros(2),)
    queued = sustained.phase_times(f, args, "queued", 2)
    assert len(queued) == 2 and len(calls) == 40
    assert all(0.002 <= t < 0.05 for t in queued)
    start = time.perf_counter()
    isolated = sustained.phase_times(f, args, "isolated", 2)
    assert len(calls) == 42 and time.perf_counter() - start >= 0.1  # two 50 ms pauses
    assert all(0.002 <= t < 0.05 for t in isolated)  # the pause is not in the time
    assert len(sustained.phase_times(f, args, "synced", 3)) == 3 and len(calls) == 45
