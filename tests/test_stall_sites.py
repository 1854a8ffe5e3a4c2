"""benchmarks.stall_sites: Nsight Compute's source page read, a kernel's steps found and
its warp samples summed over them, on a source page written here in ncu's layout (its
header as the H100 exported it at 0e8a8d2, fewer columns), and on one of those exports."""

from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from benchmarks import stall_sites

REPO = pathlib.Path(__file__).resolve().parents[1]
HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)",'
    '"Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed",'
    '"stall_barrier","stall_long_sb","stall_short_sb","stall_selected",'
    '"stall_barrier (Not Issued)","stall_long_sb (Not Issued)"'
)


def _row(address: int, text: str, executed: int, barrier=0, long_sb=0, short_sb=0, selected=0):
    samples = barrier + long_sb + short_sb + selected
    cells = [f"{address:#x}", f"      {text}", samples, samples - selected, samples, executed]
    cells += [barrier, long_sb, short_sb, selected, barrier, long_sb]
    return ",".join(f'"{c}"' for c in cells)


def _kernel(name: str, base: int) -> list[str]:
    """A prologue (a producer's spin-wait: a 2-instruction loop), a 20-instruction step with
    a wgmma, its wait and an FFMA waiting on a shared load, a branch back to the step, and
    an epilogue's barrier."""
    rows = [f'"Kernel Name","{name}",', HEADER]
    rows.append(_row(base, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R2+URZ], R3", 10, long_sb=5))
    rows.append(_row(base + 0x10, f"@!P1  BRA {base:#x}", 10, long_sb=30))
    step = base + 0x20
    body = ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0"]
    body += ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "LDS.64 R20, [R19+0x400]"]
    body += ["FFMA R24, R24, 0.5, -R20"] + ["MUFU.EX2 R25, R24"] * 15
    waits = {"WARPGROUP": dict(barrier=20), "FFMA": dict(short_sb=12)}
    for i, text in enumerate(body):
        kw = waits.get(stall_sites.opcode(text), dict(selected=1))
        rows.append(_row(step + 0x10 * i, text, 400, **kw))
    back = step + 0x10 * len(body)
    rows.append(_row(back, f"@P0  BRA {step:#x}", 400, selected=2))
    rows.append(_row(back + 0x10, "BAR.SYNC.DEFER_BLOCKING 0x0", 4, barrier=40))
    return rows


def test_a_source_page_is_read_and_summed_over_its_steps():
    kernels = stall_sites.read_source(
        "\n".join(_kernel("k_bwd", 0x1000) + _kernel("k_fwd", 0x9000))
    )
    assert list(kernels) == ["k_bwd", "k_fwd"]
    code = kernels["k_bwd"]
    assert len(code) == 2 + 19 + 2 and code[1]["opcode"] == "BRA" and code[4]["opcode"] == "LDS"
    assert code[0]["reasons"] == {"barrier": 0, "long_sb": 5, "short_sb": 0, "selected": 0}
    assert stall_sites.steps(code) == [(0x1020, 0x1020 + 0x10 * 19)]  # not the spin-wait
    s = stall_sites.summarize(code, top=3)
    # the step: 20 at its wait, 12 at its FFMA, 1 at each of 17 others, 2 at its branch
    assert s["samples"] == 35 + 20 + 12 + 17 + 2 + 40
    (step,) = s["steps"]
    assert (step["instructions"], step["executed"]) == (20, 400)
    assert step["share"] == pytest.approx(round(51 / 126, 4))
    assert step["reasons"] == {
        "barrier": round(20 / 51, 4),
        "selected": round(19 / 51, 4),
        "short_sb": round(12 / 51, 4),
    }
    assert step["opcodes"]["WARPGROUP"] == round(20 / 51, 4)
    assert [x["reason"] for x in step["hot"][:2]] == ["barrier", "short_sb"]
    assert step["hot"][1]["text"].startswith("FFMA")
    assert [x["address"] for x in s["outside"]] == [0x1000 + 0x10 * 22, 0x1010, 0x1000]
    assert s["outside"][0]["share"] == round(40 / 126, 4)


def test_an_export_of_the_device_is_summed():
    """The head-dim-128 non-causal fused backward at 8k (0e8a8d2, an H100): two consumer
    steps of 1,048,576 executions each (2,048 CTAs x 128 steps x 4 warps) hold about a
    third of the samples each, and the hottest instruction of the first is the lse's
    first FFMA, waiting on its shared-memory load (docs/mosaic.md, "Where the consumers
    wait")."""
    path = REPO / "benchmarks/results/mosaic-0e8a8d2/stalls-128-false-8k-sass.csv.gz"
    with gzip.open(path, "rt") as f:
        (code,) = stall_sites.read_source(f.read()).values()
    busy = [s for s in stall_sites.summarize(code)["steps"] if s["share"]]
    assert [s["executed"] for s in busy] == [1048576, 1048576]
    assert all(0.30 < s["share"] < 0.34 for s in busy), busy
    hot = busy[0]["hot"][0]
    assert hot["text"].startswith("FFMA") and hot["reason"] == "short_sb", hot


def test_the_profile_commands_and_the_shape():
    record, export = stall_sites.ncu_commands("ncu", "/o/x", "bwd", ["benchmarks.profile", "a"])
    assert record[:5] == ["ncu", "--clock-control", "none", "--profile-from-start", "off"]
    assert "SourceCounters" in record and "WarpStateStats" in record
    assert record[record.index("-o") + 1] == "/o/x" and record[-2:] == ["benchmarks.profile", "a"]
    assert "regex:bwd" in record
    assert export == [
        "ncu",
        "-i",
        "/o/x.ncu-rep",
        "--page",
        "source",
        "--csv",
        "--print-source",
        "sass",
    ]
    assert stall_sites.fa_index(128, 8192, False) == 4
    with pytest.raises(ValueError, match="no shape at head dim 96"):
        stall_sites.fa_index(96, 8192, False)


def test_a_profile_writes_its_export_and_one_summary_line_a_kernel(tmp_path, capsys):
    """profile() with a stand-in ncu (the record writes the report, the export prints two
    kernels' source page): the gzipped export, the report removed, and one summary line a
    kernel; run again under the same name, the files are replaced, not added to."""
    page = tmp_path / "page.csv"
    page.write_text("\n".join(_kernel("k_a", 0x1000) + _kernel("k_b", 0x2000)) + "\n")
    ncu = tmp_path / "ncu"
    ncu.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = "-i" ] || [ "$1" = "-i" ]; then cat "' + str(page) + '"; exit 0; fi\n'
        'while [ "$1" != "-o" ]; do shift; done; touch "$2.ncu-rep"\n'
    )
    ncu.chmod(0o755)
    argv = ["--head-dim", "128", "--seq", "8192", "--name", "x", "--out-dir", str(tmp_path)]
    for _ in range(2):
        assert stall_sites.main([*argv, "--ncu", str(ncu)]) == 0
    assert not (tmp_path / "x.ncu-rep").exists()
    with gzip.open(tmp_path / "x-sass.csv.gz", "rt") as f:
        assert f.read() == page.read_text()
    lines = (tmp_path / "x-summary.json").read_text().splitlines()
    assert [json.loads(line)["kernel"] for line in lines] == ["k_a", "k_b"]
    assert "k_a: " in capsys.readouterr().out
