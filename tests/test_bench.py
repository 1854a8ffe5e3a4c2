"""The benchmark harness runs end to end on CPU (interpret mode, tiny shapes) and renders."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax.numpy as jnp
import pytest

from benchmarks import anchors, bench, ptxas, render
from pallas_flash import masks
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


def test_flops_convention():
    s = bench.suites.Shape(2, 1024, 1024, 16, 16, 128, causal=False)
    assert bench.attention_flops(s) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.attention_flops(s.replace(causal=True)) == bench.attention_flops(s) / 2


def test_hbm_parses_ncu_csv_and_counts_compulsory_bytes():
    from benchmarks import hbm

    text = "\n".join(
        [
            "==PROF== Connected to process 1",
            '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"',
            '"0","fwd","dram__bytes_read.sum","byte","1,000"',
            '"0","fwd","dram__bytes_write.sum","byte","250"',
            '"1","bwd","dram__bytes_read.sum","byte","2,000"',
            '"1","bwd","dram__bytes_write.sum","byte","500"',
        ]
    )
    totals = hbm.parse_ncu_csv(text)
    assert totals == {"dram__bytes_read.sum": 3000.0, "dram__bytes_write.sum": 750.0, "kernels": 2}
    # ANCHORS.md: 1.61 GB at the paper's shape in fp16
    assert round(hbm.compulsory_bytes(**hbm.SHAPE) / 1e9, 2) == 1.61


def test_profile_parses_ncu_csv_per_kernel():
    from benchmarks import profile

    text = "\n".join(
        [
            "==PROF== Connected to process 1",
            '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"',
            '"0","pallas_flash_fwd","gpu__time_duration.sum","ns","2,500"',
            '"0","pallas_flash_fwd","launch__registers_per_thread","register","168"',
            '"1","fusion_3","gpu__time_duration.sum","ns","40"',
        ]
    )
    kernels = profile.parse_ncu_kernels(text)
    assert "sections" not in kernels[0]
    with_sections = "\n".join(
        [
            '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"',
            '"0","fwd","","gpu__time_duration.sum","ns","1,000"',
            '"0","fwd","SpeedOfLight","Compute (SM) Throughput","%","81.5"',
            '"0","fwd","WarpStateStats","Stall Reason","","barrier"',
        ]
    )
    (fwd,) = profile.parse_ncu_kernels(with_sections)
    assert fwd["gpu__time_duration.sum"] == 1000.0
    assert fwd["sections"] == {
        "SpeedOfLight / Compute (SM) Throughput [%]": 81.5,
        "WarpStateStats / Stall Reason": "barrier",
    }
    assert [k["kernel"] for k in kernels] == ["pallas_flash_fwd", "fusion_3"]
    assert kernels[0]["gpu__time_duration.sum"] == 2500.0
    assert kernels[0]["launch__registers_per_thread"] == 168.0
    assert "launch__registers_per_thread" not in kernels[1]


def test_ptxas_report_parses_per_kernel():
    from benchmarks import ptxas

    text = "\n".join(
        [
            "ptxas info    : 0 bytes gmem",
            "ptxas info    : Compiling entry function 'pallas_flash_mosaic_bwd_fused' for 'sm_90a'",
            "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions "
            "are serialized due to the presence of Extern calls in the function "
            "'pallas_flash_mosaic_bwd_fused'",
            "ptxas info    : Function properties for pallas_flash_mosaic_bwd_fused",
            "    8 bytes stack frame, 96 bytes spill stores, 112 bytes spill loads",
            "ptxas info    : Used 168 registers, used 1 barriers, 384 bytes cmem[0]",
            "ptxas info    : Compiling entry function 'pallas_flash_mosaic_bwd_dq' for 'sm_90a'",
            "ptxas info    : Used 128 registers, 384 bytes cmem[0]",
        ]
    )
    fused, dq = ptxas.parse_ptxas(text)
    warning = fused.pop("warnings")
    assert fused == dict(
        kernel="pallas_flash_mosaic_bwd_fused",
        registers=168,
        stack_bytes=8,
        spill_store_bytes=96,
        spill_load_bytes=112,
    )
    assert len(warning) == 1 and "(C7515)" in warning[0] and "serialized" in warning[0]
    assert dq["kernel"] == "pallas_flash_mosaic_bwd_dq" and dq["registers"] == 128
    assert dq["warnings"] == []
    assert dq["spill_store_bytes"] is None  # no properties line: unknown, not 0
    assert ptxas.parse_ptxas("Used 10 registers") == []  # nothing before an entry
    # A module compiled after another: its warning comes before its own entry line.
    loss = (
        "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions "
        "are serialized due to insufficient register resources for the function 'bwd'"
    )
    text = "\n".join(
        [
            "ptxas info    : Compiling entry function 'fwd' for 'sm_90a'",
            "ptxas info    : Used 168 registers",
            loss,
            "ptxas info    : Compiling entry function 'bwd' for 'sm_90a'",
            "ptxas info    : Used 128 registers",
        ]
    )
    fwd, bwd = ptxas.parse_ptxas(text)
    assert fwd["warnings"] == [] and bwd["warnings"] == [loss]
    # SASS: local stores and loads by the register budget set last before them.
    sass = "\n".join(
        [
            "//--------------------- .text.bwd --------------------------",
            '        .section        .text.bwd,"ax",@progbits',
            ".text.bwd:",
            "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
            "        /*0010*/                   STL [R1+0x8], R2 ;",
            "        /*0020*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ;",
            "        /*0030*/               @P0 STL.64 [R1], R4 ;",
            "        /*0040*/                   LDL R4, [R1] ;",
            "        /*0050*/                   USETMAXREG.TRY_ALLOC.CTAPOOL P1, 0xe8 ;",
            "        /*0060*/                   LDL.64 R6, [R1+0x10] ;",
            "        /*0070*/                   STS [R3], R2 ;",
            ".text.fwd:",
            "        /*0000*/                   LDS R2, [R3] ;",
        ]
    )
    assert ptxas.spill_regions(sass) == {
        "bwd": {
            "start STL": 1,
            "DEALLOC.CTAPOOL 24 STL": 1,
            "DEALLOC.CTAPOOL 24 LDL": 1,
            "TRY_ALLOC.CTAPOOL 232 LDL": 1,
        },
        "fwd": {},
    }
    # SASS loops: a step loop of 17 instructions with a spin-wait inside (too short to
    # count on its own), by class.
    body = ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", "MUFU.EX2 R3, R3"]
    body += ["FFMA R4, R4, R5, -R6", "FMNMX R7, R7, R8, !PT", "IMAD R9, R9, 0x2, R1"] * 3
    body += ["LDS R10, [R11]", "STL [R1], R2", "ISETP.GE.AND P0, PT, R9, R12, PT"]
    lines = [".text.k:", "        /*0000*/                   S2R R0, SR_TID.X ;", ".L_x_1:"]
    lines += [
        f"        /*{16 * (i + 1):04x}*/                   {op} ;" for i, op in enumerate(body)
    ]
    lines += [
        ".L_x_2:",
        "        /*0130*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R4+URZ], R5 ;",
        "        /*0140*/               @!P1 BRA `(.L_x_2) ;",
        "        /*0150*/                @P0 BRA `(.L_x_1) ;",
        "        /*0160*/                   EXIT ;",
    ]
    (loop,) = ptxas.sass_loops("\n".join(lines))["k"]
    assert (loop["start"], loop["end"], loop["instructions"]) == (0x10, 0x150, 17)
    assert loop["mix"] == dict(wgmma=1, mufu=1, float=6, int=4, shared=1, local=1, sync=1, other=2)
    assert loop["innermost"]
    # An outer loop around it (a work-item loop): both listed, only the step innermost.
    outer = [lines[0], ".L_x_0:", *lines[1:-1]]
    outer += ["        /*0170*/                @P2 BRA `(.L_x_0) ;", "        /*0180*/ EXIT ;"]
    loops = ptxas.sass_loops("\n".join(outer))["k"]
    assert [(lp["start"], lp["end"], lp["innermost"]) for lp in loops] == [
        (0x0, 0x170, False),
        (0x10, 0x150, True),
    ]
    assert ptxas.shape(64, True).heads == 32


def test_ptxas_wgmma_groups_tell_serialized_from_grouped():
    """wgmma_groups: a 64 x 64 x 32 matmul issued as one group (two HGMMAs, one gsb0)
    against the same matmul serialized (each HGMMA closes its group and is awaited)."""
    from benchmarks import ptxas

    def fn(name, body):
        head = [f"//--------------------- .text.{name} ---", f".text.{name}:"]
        return head + [
            f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(body)
        ]

    hgmma = "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24"
    grouped = ["WARPGROUP.ARRIVE", hgmma, hgmma + ", gsb0", "FFMA R4, R4, R5, R6",
               "WARPGROUP.DEPBAR.LE gsb0, 0x0"]  # fmt: skip
    serial = ["WARPGROUP.ARRIVE", hgmma + ", gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0"] * 2
    sass = "\n".join(fn("pair", grouped) + fn("fused", serial) + fn("copy", ["EXIT"]))
    assert ptxas.wgmma_groups(sass) == {
        "pair": dict(wgmmas=2, groups=1),
        "fused": dict(wgmmas=2, groups=2),
    }


_TINY_PTX = """// Generated by LLVM NVPTX Back-End

.version 8.0
.target sm_90a
.address_size 64

.visible .entry tiny_store(.param .u64 out)
{
  .reg .b32 %r<2>;
  .reg .b64 %rd<3>;
  ld.param.u64 %rd1, [out];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u32 %r1, %tid.x;
  st.global.u32 [%rd2], %r1;
  ret;
}
"""


@pytest.mark.skipif(
    ptxas.cuda_tool("ptxas") is None,
    reason="no ptxas here (the development machines have CUDA 13.0's in /usr/local/bin)",
)
def test_ptxas_assembles_kept_ptx_here(tmp_path, capsys):
    """--assemble: PTX kept by --ptx (here a tiny module, with ptxas's report after it as
    in a dump) goes through the local ptxas; its kernels come back parsed, and PTX that
    ptxas rejects is an error naming ptxas, not an empty report."""
    dump = tmp_path / "k.ptxdump"
    dump.write_text(_TINY_PTX + "ptxas info    : trailing report lines are not PTX\n")
    assert ptxas.main(["--assemble", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "tiny_store" in out and "spills 0 B stored" in out
    (kern,) = ptxas.assemble(ptxas.ptx_modules(dump.read_text()))
    assert kern["kernel"] == "tiny_store" and kern["registers"] >= 1
    assert kern["spill_store_bytes"] == 0 and kern["warnings"] == []
    with pytest.raises(RuntimeError, match="ptxas failed on module 0"):
        ptxas.assemble([_TINY_PTX.replace("st.global.u32", "st.global.bogus")])
    (tmp_path / "empty.ptxdump").write_text("no modules here\n")
    with pytest.raises(SystemExit):
        ptxas.main(["--assemble", str(tmp_path / "empty.ptxdump")])


def test_ptxas_stack_traffic_of_a_step(tmp_path, capsys):
    """A step's stack traffic: a 64-bit reload bound for R2UR (a descriptor held across
    the loop), a spill and its reload within the step, and a reload read by an IMAD."""
    from benchmarks import ptxas

    body = [
        "LDL.64 R20, [R1+0x48]",
        "STL [R1+0xf8], R0",
        "FFMA R4, R4, R5, -R6",
        "R2UR UR4, R20",  # R20's next reader: into the uniform registers
        "LDL.LU R0, [R1+0xf8]",
        "LDL R21, [R1+0x50]",
        "IMAD R2, R21, 0x8, R0",  # R21's next reader: arithmetic
        "R2UR UR5, R21",
    ]
    body += ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24"] * 8
    lines = [".text.k:", ".L_x_1:"]
    lines += [f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(body)]
    lines += [f"        /*{16 * len(body):04x}*/                @P0 BRA `(.L_x_1) ;"]
    (loop,) = ptxas.sass_loops("\n".join(lines))["k"]
    assert loop["local_traffic"] == dict(loads=3, stores=1, to_uniform=1, fixed_slots=2)
    path = tmp_path / "k.sass"
    path.write_text("\n".join(lines))
    assert ptxas.main(["--read", str(path)]) == 0
    assert "'to_uniform': 1, 'fixed_slots': 2" in capsys.readouterr().out


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
    # (the default row's Q and dO in registers are the plain dQ kernel's: a fused variant
    # names them off, or the config says why not)
    with pytest.raises(ValueError, match="q_do_in_registers is the plain dQ kernel's"):
        impls.lookup("pallas_flash:mosaic/fused=true").fn(q, k, k, causal=True)
    impls.lookup("pallas_flash:mosaic/fused=true/q_do_in_registers=false").fn(q, k, k, causal=True)
    assert seen["backward_config"].fused and seen["config"].block_kv == 256
    assert seen["config"] == mosaic_config.default_mosaic_config(64, 4096, True)
    seen.clear()  # and at the call's causal flag (head dim 128: persistent unless causal)
    q = jnp.zeros((1, 8, 2, 128), jnp.bfloat16)
    for causal in (False, True):
        impls.lookup("pallas_flash:mosaic/num_stages=2").fn(q, q, q, causal=causal)
        assert seen["config"].persistent is not causal
    seen.clear()  # a field both configs have is set in both
    impls.lookup("pallas_flash:mosaic/row_bound_mask=false").fn(q, q, q, causal=True)
    assert not seen["config"].row_bound_mask and not seen["backward_config"].row_bound_mask
    seen.clear()  # the backward default at the call's causal flag (head dim 128: fused
    for causal in (False, True):  # unless causal), and `pair` names the pair there
        impls.lookup("pallas_flash:mosaic/num_stages=2").fn(q, q, q, causal=causal)
        assert seen["backward_config"] == bwd_config.default_mosaic_bwd_config(128, causal)
        assert seen["backward_config"].fused is not causal
        impls.lookup("pallas_flash:mosaic/pair/block_q_dkv=128").fn(q, q, q, causal=causal)
        pair = bwd_config.pair_mosaic_bwd_config(128)
        assert seen["backward_config"] == dataclasses.replace(pair, block_q_dkv=128)
    with pytest.raises(ValueError, match="'pair' is not FIELD=VALUE"):  # first item only
        impls.lookup("pallas_flash:mosaic/num_stages=2/pair")
    with pytest.raises(SystemExit):  # the CLI names the bad field before running anything
        bench.main(["--suite", "quick", "--impls", "pallas_flash:mosaic/num_stages=x"])


def test_ptxas_sass_from_dumped_ptx(tmp_path, monkeypatch):
    """Where Mosaic GPU prints no SASS, the PTX it printed is cut into modules and run
    through ptxas and nvdisasm found here (fakes on PATH that record their arguments)."""
    from benchmarks import ptxas

    module = "//\n// Generated by LLVM NVPTX Back-End\n.version 8.7\n"
    module += ".visible .entry k()\n{\n ret;\n}\n"
    report = "ptxas info    : Used 168 registers\n"
    text = "noise\n" + module + report + module.replace("k()", "j()")
    modules = ptxas.ptx_modules(text)
    assert [m.count(".entry") for m in modules] == [1, 1]
    assert modules[0].startswith("// Generated") and modules[0].rstrip().endswith("}")
    assert "ptxas info" not in modules[0] and "j()" in modules[1]
    assert ptxas.ptx_modules("ptxas info    : Used 1 registers") == []

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    (bin_dir / "ptxas").write_text(
        f'#!/bin/sh\necho ptxas "$@" >> {log}\nwhile [ "$1" != -o ]; do shift; done\n'
        'grep -o "entry [a-z]*" "$3" > "$2"\n'
    )
    (bin_dir / "nvdisasm").write_text(
        f'#!/bin/sh\necho nvdisasm "$@" >> {log}\n'
        'sed "s/entry \\(.*\\)/.text.\\1:\\n        \\/*0000*\\/ EXIT ;/" "$3"\n'
    )
    for tool in ("ptxas", "nvdisasm"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert ptxas.cuda_tool("nvdisasm") == str(bin_dir / "nvdisasm")
    sass, source = ptxas.sass_of_ptx(modules)
    assert source == f"{bin_dir}/ptxas + {bin_dir}/nvdisasm"
    assert list(ptxas._sass_functions(sass)) == ["k", "j"]
    calls = log.read_text().splitlines()
    assert calls[0].startswith("ptxas --opt-level 3 --gpu-name sm_90a -o ")
    assert calls[1].startswith("nvdisasm -ndf -c ")

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.setattr(ptxas.sys, "path", [str(tmp_path)])
    assert ptxas.sass_of_ptx(modules) == ("", "not found: ptxas, nvdisasm")
    assert ptxas.sass_of_ptx([]) == ("", "no PTX in the output")


def test_lowered_ops_counts_the_mask_formulations(capsys):
    """The forward lowered for sm_90 on CPU: with per-row bounds, a masked tile has one
    compare per element pair and no and (causal, no window), where tile_mask has two and
    an and; the CLI prints the counts that differ and checks --set's names."""
    from benchmarks import lowered_ops

    spec = masks.MaskSpec(causal=True)
    config = mosaic_config.default_mosaic_config(64, 256, True)
    assert config.row_bound_mask  # the default since 5a15452
    base = lowered_ops.forward_ops(dataclasses.replace(config, row_bound_mask=False), spec, 64, 256)
    rows = lowered_ops.forward_ops(config, spec, 64, 256)
    assert rows["arith.cmpi"] < base["arith.cmpi"]
    assert rows["arith.andi"] < base["arith.andi"]
    assert lowered_ops.main(["--seq", "256", "--set", "row_bound_mask=false"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("total: ") and "arith.cmpi" in out
    with pytest.raises(ValueError, match="not FIELD=VALUE"):
        lowered_ops.parse_fields(["row_mask=true"])


def test_lowered_digest_sees_the_kernel_not_where_its_code_sits(capsys):
    """The same build digests the same after other lowerings in the process (a kernel's
    dump name counts them); the program's text is hashed without the kernel's bytecode
    and its hash, where the source locations ride (the kernels' own text is hashed
    without them); one changed field changes the digest; the CLI prints a line a build."""
    from benchmarks import lowered_digest

    spec = masks.MaskSpec(causal=True)
    config = mosaic_config.default_mosaic_config(64, 256, True)
    first = lowered_digest.forward_digest(config, spec, 64, 256)
    other = dataclasses.replace(config, row_bound_mask=False)
    assert lowered_digest.forward_digest(other, spec, 64, 256) != first
    text = "loc(#loc1)\n" + 'module = "\\22bytes\\22" kernel_hash = "\\00\\01"'
    assert lowered_digest._MODULE_ATTR.sub(r"\1", text) == "loc(#loc1)\nmodule kernel_hash"
    assert lowered_digest.forward_digest(config, spec, 64, 256) == first
    assert lowered_digest.main(["--quick", "--only", "fwd h64 s256 causal"]) == 0
    assert capsys.readouterr().out == f"fwd h64 s256 causal: {first}\n"


def test_lowered_ops_sets_our_forward_step_beside_a_peers(capsys):
    """--peers: JAX's Mosaic FA3 lowers on CPU (its CUDA version check stood in for) with
    our row's tiles; its step waits on four mbarriers (K, V and two for the ping-pong),
    ours on two since its turns went to named barriers (named_turns, the default since
    5aa4c1c); the CLI prints each operation's counts, starred where they differ."""
    from benchmarks import lowered_ops

    steps = lowered_ops.peer_step_ops(64, 1024)
    ours, fa3 = steps["pallas_flash:mosaic"], steps["jax:mosaic_fa3"]
    assert (ours["nvvm.mbarrier.try_wait.parity"], fa3["nvvm.mbarrier.try_wait.parity"]) == (2, 4)
    assert ours["nvvm.shfl.sync"] == fa3["nvvm.shfl.sync"] > 0  # the row max and sum
    assert lowered_ops.main(["--peers", "--head-dim", "64", "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("forward step at head dim 64") and "jax:mosaic_fa3: " in out
    assert "  nvvm.mbarrier.try_wait.parity: 2 | 4 *\n" in out  # they differ: a star
    assert "  nvvm.shfl.sync: 8 | 8\n" in out


@pytest.mark.extended
def test_lowered_ops_step_live_ins(capsys):
    """After MLIR's loop-invariant code motion the fused backward's steps read 64-bit
    values made before the loop (the wgmma descriptors of its resident tiles), and
    none with step_descriptors; the forward's steps still do (its K/V ring slots vary,
    but its Q tile stays). What folds to a constant is not counted."""
    from benchmarks import lowered_ops

    spec = masks.MaskSpec(causal=True)
    fused = bwd_config.MosaicBwdConfig(fused=True, fa3_order=True)
    for step_descriptors, want in ((False, True), (True, False)):
        config = dataclasses.replace(fused, step_descriptors=step_descriptors)
        (module,) = lowered_ops.backward_modules(config, spec, 128, 256)
        steps = lowered_ops.step_live_ins(module)
        assert len(steps) == 6  # three step variants (masked before, full, after) x 2
        assert all((step["i64"] > 0) is want for step in steps), steps
        # Lanes of constant splats fold away: no float32 value is held for the steps.
        assert not any(step["f32"] or step["vector<2xf32>"] for step in steps), steps
    config = mosaic_config.default_mosaic_config(128, 256, True)
    (module,) = lowered_ops.forward_modules(config, spec, 128, 256)
    assert all(step["i64"] > 0 for step in lowered_ops.step_live_ins(module))
    args = ["--kernel", "backward", "--seq", "256", "--live-ins", "--set", "step_descriptors=true"]
    assert lowered_ops.main(args) == 0
    out = capsys.readouterr().out
    assert "with step_descriptors=true:\n  kernel 0 step: 0 x i64" in out


def test_gpu_clock_reads_nvml_and_averages_over_spans():
    """read_once fills the three NVML readings (power in mW to W); `during` averages the
    samples inside the spans only, and a sampler without NVML has none."""
    from benchmarks import gpu_clock

    class FakeNvml:
        def nvmlDeviceGetClockInfo(self, handle, kind, ref):
            ref._obj.value = 1755 if kind == gpu_clock._NVML_CLOCK_SM else 0
            return 0

        def nvmlDeviceGetPowerUsage(self, handle, ref):
            ref._obj.value = 690500
            return 0

        def nvmlDeviceGetTemperature(self, handle, sensor, ref):
            ref._obj.value = 52
            return 0

    assert gpu_clock.read_once((FakeNvml(), None)) == [1755.0, 690.5, 52.0]
    failing = FakeNvml()
    failing.nvmlDeviceGetPowerUsage = lambda handle, ref: 999  # an NVML error code
    assert gpu_clock.read_once((failing, None)) is None

    s = gpu_clock.Sampler.__new__(gpu_clock.Sampler)
    s.samples = [(1.0, [1500.0, 600.0, 50.0]), (2.0, [1700.0, 700.0, 52.0]), (9.0, [1980, 0, 0])]
    assert s.during([(0.5, 2.5)]) == {"sm_mhz": 1600.0, "power_w": 650.0, "temp_c": 51.0}
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


def test_ncu_command_filters_kernels_and_a_timeout_kills_the_profiled_child(tmp_path):
    """`--kernels` reaches ncu as a name filter; past the timeout the profiled child dies
    with its launcher (a fake ncu that starts a sleeping grandchild and waits on it)."""
    import subprocess
    import time

    from benchmarks import hbm

    cmd = hbm.ncu_command("ncu", ["m"], ["SpeedOfLight"], "bwd|bprop")
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:bwd|bprop"
    assert "--kernel-name" not in hbm.ncu_command("ncu", ["m"])
    assert "--print-details" not in cmd  # the sections' headline metrics only, unless asked
    details = hbm.ncu_command("ncu", ["m"], ["WarpStateStats"], details=True)
    assert details[details.index("--print-details") + 1] == "all"
    assert "--print-details" not in hbm.ncu_command("ncu", ["m"], details=True)  # no sections
    pid_file = tmp_path / "child.pid"
    fake = tmp_path / "ncu"
    fake.write_text(f"#!/bin/sh\nsleep 60 & echo $! > {pid_file}\nwait\n")
    fake.chmod(0o755)
    with pytest.raises(subprocess.TimeoutExpired):
        hbm.run_under_ncu(str(fake), ["m"], ["x"], timeout=1.0)
    child = int(pid_file.read_text())
    stat = f"/proc/{child}/stat"
    for _ in range(50):  # gone, or a zombie that no init has reaped yet
        try:
            with open(stat) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the profiled child {child} outlived the timeout")


def test_ncu_child_allocates_as_it_goes(tmp_path):
    """The profiled child runs without XLA's autotuner and without the preallocated
    pool (ncu saves and restores device memory between a kernel's replays); a fake ncu
    prints what it was given."""
    from benchmarks import hbm

    fake = tmp_path / "ncu"
    fake.write_text('#!/bin/sh\necho "$XLA_PYTHON_CLIENT_PREALLOCATE|$XLA_FLAGS"\n')
    fake.chmod(0o755)
    out = hbm.run_under_ncu(str(fake), ["m"], ["x"], timeout=10.0).stdout
    assert out.strip() == "false|--xla_gpu_autotune_level=0"


def test_profile_with_details_keeps_ncu_csv(tmp_path):
    """`--details` reaches ncu as `--print-details all`, and each row keeps the CSV ncu
    wrote, rows the parser does not read included (a fake ncu that records its
    arguments and prints a section's body row)."""
    import json

    from benchmarks import profile

    args_file = tmp_path / "args"
    fake = tmp_path / "ncu"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {args_file}\n'
        'echo \'"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\'\n'
        'echo \'"0","k","","gpu__time_duration.sum","ns","1,000"\'\n'
        'echo \'"0","k","WarpStateStats","Stall Barrier","","3.5"\'\n'
        "echo 'not csv'\n"
    )
    fake.chmod(0o755)
    out = tmp_path / "p.jsonl"
    argv = ["--suite", "fa", "--head-dims", "128", "--seqs", "8192", "--causal", "false"]
    argv += ["--impls", "x", "--sections", "WarpStateStats", "--details", "--kernels", "bwd"]
    assert profile.main(argv + ["--ncu", str(fake), "--out", str(out)]) == 0
    called = args_file.read_text().split()
    assert called[called.index("--print-details") + 1] == "all"
    assert called[called.index("--kernel-name") + 1] == "regex:bwd"
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert row["error"] is None
    assert row["kernels"][0]["sections"] == {"WarpStateStats / Stall Barrier": 3.5}
    assert row["ncu_csv"].count("\n") == 2 and "not csv" not in row["ncu_csv"]
