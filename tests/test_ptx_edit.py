"""benchmarks.ptx_edit: finding a consumer's tile loops in PTX, cutting them, rewriting its
register budget, counting a loop's invariants; and, where ptxas is here, docs/mosaic.md's
finding on the fused backward's committed PTX (results/mosaic-29ce459/ptx-fused.tgz)."""

import pathlib
import tarfile

import pytest

from benchmarks import ptx_edit, ptxas

# Two warpgroups' code as Mosaic GPU lays it out: a producer that lowers its budget, a
# consumer that raises it and runs one guarded tile loop (its latch above its header).
_PTX = """\
.visible .entry toy_kernel()
{
\tsetmaxnreg.dec.sync.aligned.u32 24;
\tbra.uni \t$L__BB0_9;
\tsetmaxnreg.inc.sync.aligned.u32 232;
\tmov.b32 \t%r7, 3;
\t@%p1 bra \t$L__BB0_4;
\tbra.uni \t$L__BB0_2;
$L__BB0_3:
\tadd.s32 \t%r8, %r8, %r7;
$L__BB0_2:
\tld.shared.v2.b32 \t{%r10, %r11}, [%rd5+16];
\tex2.approx.ftz.f32 %r9, %r10;
\tfma.rn.f32 \t%r12, %r9, %r11, %r8;
\t@%p2 bra \t$L__BB0_3;
$L__BB0_4:
\tret;
$L__BB0_9:
\tret;
}"""


def test_finds_cuts_and_prices_a_consumers_tile_loop():
    lines = _PTX.split("\n")
    (region,) = ptx_edit.consumer_regions(lines)
    assert lines[region[0]].strip().startswith("setmaxnreg.inc")
    (loop,) = ptx_edit.tile_loops(lines, region)
    assert lines[loop.start] == "$L__BB0_3:" and "@%p2 bra" in lines[loop.back]
    assert "@%p1 bra" in lines[loop.guard]  # the branch that skips to the exit, $L__BB0_4
    # reads %r7 (set before it) and %rd5 and never writes them (the predicate %p2 is not
    # a general register); %r8 is carried (written in the loop), the loaded pair written
    assert ptx_edit.loop_invariants(lines, loop) == (1, 1)
    cut = ptx_edit.cut_loops(lines, [1])
    assert cut[loop.guard].strip() == "bra.uni \t$L__BB0_4;"
    assert [a == b for a, b in zip(cut, lines)].count(False) == 1
    with pytest.raises(ValueError, match="has 1 tile loops"):
        ptx_edit.cut_loops(lines, [2])
    budget = ptx_edit.set_consumer_registers(lines, 240)
    assert "\tsetmaxnreg.inc.sync.aligned.u32 240;" in budget
    assert "\tsetmaxnreg.dec.sync.aligned.u32 24;" in budget  # the producer's untouched


def test_unhides_a_loops_step_index():
    """--unhide-loop: the opaque copy of the step (an inline-asm mov, no tab after the op)
    dropped, and the offset it fed taken from the loop's plain shift of the step."""
    hidden = _PTX.replace(
        "\tex2.approx.ftz.f32 %r9, %r10;",
        "\tshr.u32 \t%r20, %r8, 31;\n\tmov.b32 %r21, %r8;\n\tshr.u32 \t%r22, %r21, 31;\n"
        "\tex2.approx.ftz.f32 %r9, %r10;",
    ).split("\n")
    out = ptx_edit.unhide_loops(hidden, [1])
    assert "\tmov.b32 \t%r22, %r20;" in out and "\tmov.b32 %r21, %r8;" not in out
    assert "\tshr.u32 \t%r20, %r8, 31;" in out  # the plain shift stays
    with pytest.raises(ValueError, match="one opaque and one plain shift"):
        ptx_edit.unhide_loops(_PTX.split("\n"), [1])


def _wgmma(n, regs):
    acc = ",".join(f"%r{r}" for r in regs)
    return f"\twgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{acc}}}, %rd1, %rd2, 1;"


def test_finds_the_fused_steps_share_and_cuts_it():
    """--share: in each step's S^T, dP^T (64 wide), dV (128), share (64), dK (128), the
    share's wgmmas are found, dropped or halved, and its lost accumulators read as the
    register they were zeroed from."""
    step = [
        _wgmma(64, range(10, 14)),  # S^T (4 accumulators stand for 32)
        _wgmma(64, range(14, 18)),  # dP^T
        _wgmma(128, range(20, 28)),  # dV
        *[f"\tmov.b32 \t%r{r}, %r9;" for r in range(30, 34)],  # the share zeroed
        _wgmma(64, range(30, 34)),  # share
        _wgmma(128, range(40, 48)),  # dK
        "\tst.shared.v4.f32 [%rd3], {%r30, %r31, %r32, %r33};",  # the share handed over
    ]
    lines = ["\tsetmaxnreg.inc.sync.aligned.u32 232;", *step, *step]
    region = (0, len(lines))
    assert ptx_edit.share_wgmmas(lines, region) == [8, 8 + len(step)]
    dropped = ptx_edit.cut_share(lines, "drop")
    assert dropped[8] == "" and "{%r9, %r9, %r9, %r9}" in dropped[10]
    halved = ptx_edit.cut_share(lines, "half")
    assert "m64n32k16.f32.bf16.bf16 {%r30,%r31}" in halved[8]
    assert "{%r30, %r31, %r9, %r9}" in halved[10]
    assert halved[2] == lines[2] and halved[4] == lines[4]  # S^T and dV untouched
    with pytest.raises(ValueError, match="no share wgmmas"):
        ptx_edit.cut_share(lines[:3], "drop")


def test_picks_one_module_by_its_entry_name():
    other = _PTX.replace("toy_kernel", "other_kernel")
    assert ptx_edit.pick_module([_PTX, other], "toy") == _PTX
    with pytest.raises(ValueError, match="0 modules match; entries: .'toy_kernel', 'other"):
        ptx_edit.pick_module([_PTX, other], "fused")


_RESULTS = pathlib.Path(__file__).parent.parent / "benchmarks/results"
needs_ptxas = pytest.mark.skipif(
    ptxas.cuda_tool("ptxas") is None,
    reason="no ptxas here (the development machines have CUDA 13.0's in /usr/local/bin)",
)


def _fused_report(tmp_path, capsys, archive: str, *base: str):
    """report(*edits): ptxas's report of the committed fused backward's causal head-dim-128
    PTX in `archive` (under benchmarks/results), edited by `base` and then `edits`."""
    with tarfile.open(_RESULTS / archive) as tar:
        tar.extractall(tmp_path, filter="data")
    (dump,) = tmp_path.glob("ptx/*h128-true.ptxdump")

    def report(*edits):
        ptx_edit.main([str(dump), "--kernel", "fused", *base, *edits])
        return capsys.readouterr().out

    return report


@needs_ptxas
def test_first_loop_is_what_serializes_the_fused_backward(tmp_path, capsys):
    """The fused backward at 29ce459 (head dim 128, causal): ptxas serializes its wgmmas
    (C7512); with the first tile loop cut from each consumer it does not, and with the
    third cut instead it still does (docs/mosaic.md, "Where the fused kernel's C7512 comes
    from")."""
    report = _fused_report(tmp_path, capsys, "mosaic-29ce459/ptx-fused.tgz")
    assert "C7512" in report()
    cut_first = report("--cut-loop", "1")
    assert "C7512" not in cut_first and "spills 40 B stored" in cut_first
    assert "C7512" in report("--cut-loop", "3")


@needs_ptxas
def test_hiding_the_first_loops_step_alone_still_serializes(tmp_path, capsys):
    """da32c91's fused backward (every loop's step index hidden from LLVM), with loops 2
    and 3 given their plain offsets back: what hiding only the first loop's step would
    make. ptxas still serializes its wgmmas, and with the unmasked loop cut it does not
    (docs/mosaic.md, "Where the fused kernel's C7512 comes from")."""
    first_only = ("--unhide-loop", "2", "--unhide-loop", "3")
    report = _fused_report(tmp_path, capsys, "mosaic-da32c91/ptx-fused-opaque.tgz", *first_only)
    assert "C7512" in report()
    assert "C7512" not in report("--cut-loop", "2")


@needs_ptxas
def test_the_dq_share_is_what_the_consumers_lack(tmp_path, capsys):
    """da32c91's fused backward (causal, head dim 128; descriptors rebuilt in every loop):
    with no dQ share in the consumers' registers ptxas neither spills nor serializes at
    their 232 registers; with half of it (16 accumulators) it serializes at 232 and is
    clean at 240, the budget of three warpgroups (docs/mosaic.md, "Where the fused kernel's C7512
    comes from")."""
    report = _fused_report(tmp_path, capsys, "mosaic-da32c91/ptx-fused-opaque.tgz")
    clean = "spills 0 B stored"
    dropped = report("--share", "drop")
    assert clean in dropped and "C7512" not in dropped
    assert "C7512" in report("--share", "half")
    halved_240 = report("--share", "half", "--consumer-registers", "240")
    assert clean in halved_240 and "C7512" not in halved_240
