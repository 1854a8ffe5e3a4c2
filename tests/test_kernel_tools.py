"""The tools that look inside the kernels, on CPU: Nsight Compute's CSV as the HBM-traffic
and per-kernel profiles read it (benchmarks.hbm, benchmarks.profile, and the profiled
child's command), ptxas's reports, SASS and kept PTX (benchmarks.ptxas), and the Mosaic
kernels' lowered operations and digests (benchmarks.lowered_ops,
benchmarks.lowered_digest). The harness and its suites: tests/test_bench.py."""

from __future__ import annotations

import dataclasses
import os

import pytest

from benchmarks import ptxas
from pallas_flash import masks
from pallas_flash.mosaic import bwd_config
from pallas_flash.mosaic import config as mosaic_config


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
    # A fresh accumulator's first wgmma, its zeros folded: it reads no accumulator.
    body[1] = "HGMMA.64x64x16.F32.BF16 R56, gdesc[UR8], RZ, !UPT"
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
    assert loop["mix"] == dict(wgmma=2, float=6, int=4, shared=1, local=1, sync=1, other=2)
    assert loop["innermost"] and loop["fresh_wgmmas"] == 1
    assert loop["beside_pending"] == 0  # no wgmma wait in it
    # A wait that leaves a group pending, three instructions, then the wait for it (the
    # exp2 beside dP); a wait for all of them counts nothing after it.
    step = ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    step += ["FFMA R4, R4, R5, -R6", "MUFU.EX2 R3, R3", "FFMA R4, R4, R5, -R6"]
    step += ["WARPGROUP.DEPBAR.LE gsb0, 0x0", *["IMAD R9, R9, 0x2, R1"] * 10]
    step += ["ISETP.GE.AND P0, PT, R9, R12, PT", "@P0 BRA `(.L_x_1)"]
    text = [".text.k:", ".L_x_1:"]
    text += [
        f"        /*{16 * (i + 1):04x}*/                   {op} ;" for i, op in enumerate(step)
    ]
    (loop,) = ptxas.sass_loops("\n".join(text))["k"]
    assert (loop["instructions"], loop["beside_pending"]) == (18, 3)
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


def test_ptxas_summary_of_a_written_row(tmp_path, capsys):
    """--summary reads back what --out wrote with --sass: spills, serialization, groups,
    and only the steps with wgmmas (innermost loops), as total (int, float, local)."""
    import json

    from benchmarks import ptxas

    step = dict(innermost=True, instructions=438, mix=dict(int=161, float=144, wgmma=36))
    outer = dict(innermost=False, instructions=4000, mix=dict(int=2000, wgmma=216))
    wait = dict(innermost=True, instructions=56, mix=dict(int=39, sync=4))
    kernel = dict(
        kernel="pallas_flash_mosaic_bwd_fused_mosaic_gpu_kernel",
        spill_store_bytes=8,
        spill_load_bytes=12,
        warnings=["ptxas info : (C7512) Potential Performance Loss: ..."],
        wgmma_groups=dict(wgmmas=144, groups=144),
        loops=[outer, wait, step],
    )
    row = dict(impl="pallas_flash:mosaic", head_dim=64, causal=False, error=None)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(dict(row, kernels=[kernel])) + "\n")
    assert ptxas.main(["--summary", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("== pallas_flash:mosaic h64 causal=False")
    assert out[1] == (
        "  pallas_flash_mosaic_bwd_fused: spills 8 / 12 B, serialized yes, wgmmas 144 in 144 groups"
    )
    assert out[2] == "    steps: 438 (161, 144, 0)"


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
    5aa4c1c); its shuffles are the row max's alone, FA3's the max's and the sum's (the
    non-causal head-dim-64 row sums on the tensor cores, row_sum_wgmma); the CLI prints
    each operation's counts, starred where they differ."""
    from benchmarks import lowered_ops

    steps = lowered_ops.peer_step_ops(64, 1024)
    ours, fa3 = steps["pallas_flash:mosaic"], steps["jax:mosaic_fa3"]
    assert (ours["nvvm.mbarrier.try_wait.parity"], fa3["nvvm.mbarrier.try_wait.parity"]) == (2, 4)
    assert 2 * ours["nvvm.shfl.sync"] == fa3["nvvm.shfl.sync"] > 0  # max; max and sum
    assert lowered_ops.main(["--peers", "--head-dim", "64", "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("forward step at head dim 64") and "jax:mosaic_fa3: " in out
    assert "  nvvm.mbarrier.try_wait.parity: 2 | 4 *\n" in out  # they differ: a star
    assert "  nvvm.shfl.sync: 4 | 8 *\n" in out


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
        for held_zero in (False, True):
            config = dataclasses.replace(
                fused, step_descriptors=step_descriptors, held_zero=held_zero
            )
            (module,) = lowered_ops.backward_modules(config, spec, 128, 256)
            steps = lowered_ops.step_live_ins(module)
            assert len(steps) == 6  # three step variants (masked before, full, after) x 2
            assert all((step["i64"] > 0) is want for step in steps), steps
            # Lanes of constant splats fold away: the float32 values held for the steps
            # are held_zero's scalar zero (pipeline.held_zero), made before the loop, and
            # none without it.
            assert all(step["vector<2xf32>"] == 0 for step in steps), steps
            assert all(0 < step["f32"] <= 2 if held_zero else not step["f32"] for step in steps)
    config = mosaic_config.default_mosaic_config(128, 256, True)
    (module,) = lowered_ops.forward_modules(config, spec, 128, 256)
    assert all(step["i64"] > 0 for step in lowered_ops.step_live_ins(module))
    args = ["--kernel", "backward", "--seq", "256", "--live-ins", "--set", "step_descriptors=true"]
    assert lowered_ops.main(args) == 0
    out = capsys.readouterr().out
    assert "with step_descriptors=true:\n  kernel 0 step: 0 x i64" in out


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


def test_lowered_digest_builds_refused_flips_with_their_companions():
    """A flip the default row refuses for an option it carries (the overlapped forward,
    the fused step's rows orientation) is built with what it takes in their place, so
    the digest lowers that option's code; a flip with no such companions stays refused."""
    from benchmarks import lowered_digest
    from pallas_flash.mosaic.bwd_config import fused_full_bwd_config
    from pallas_flash.mosaic.config import MosaicConfig, default_mosaic_config

    fwd = dict(lowered_digest.flips(default_mosaic_config(128, 2048, True)))
    (overlap,) = [c for label, c in fwd.items() if label.startswith("intra_overlap=True with")]
    assert isinstance(overlap, MosaicConfig) and overlap.intra_overlap
    assert not overlap.early_k_wait and overlap.rescale_slack == 8  # the overlap takes it
    bwd = dict(lowered_digest.flips(fused_full_bwd_config(128)))
    (rows,) = [c for label, c in bwd.items() if label.startswith("query_rows=True with")]
    assert rows.query_rows and not rows.fa3_order and not rows.share_halves
    assert isinstance(bwd["share_probs=True"], ValueError)  # needs split_dkv: no companion
