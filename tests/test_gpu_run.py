"""benchmarks/gpu_run.sh, the one script a device call runs, with a stand-in `python3`
that records its command lines: the steps' parsing, the commands they build, the
second-GPU child and the bundling of results, checked on CPU before device time is spent
on a typo."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tarfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# Logs each call (with the GPU it would run on and its memory fraction) and answers
# --fit-steps with 1234.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "gpu=${CUDA_VISIBLE_DEVICES:-all} mem=${XLA_PYTHON_CLIENT_MEM_FRACTION:-} $*" >> "$CALLS"
case "$*" in *--fit-steps*) echo 1234 ;; esac
exit 0
"""


def _stand_in(tmp_path):
    """(the environment that puts the stand-in python3 first on PATH, the file it records
    its calls in, the $OUT folder)."""
    bin_dir, out, calls = tmp_path / "bin", tmp_path / "out", tmp_path / "calls.txt"
    bin_dir.mkdir()
    out.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        OUT=str(out),
        CALLS=str(calls),
        GPU_RUN_SITE=str(tmp_path / "site"),
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env, calls, out


@pytest.fixture
def gpu_run(tmp_path):
    env, calls, out = _stand_in(tmp_path)

    def run(*steps, prefill: int = 0, **extra_env):
        for i in range(prefill):  # results of earlier steps, as a call leaves them
            (out / f"earlier-{i}.jsonl").write_text("{}\n")
        proc = subprocess.run(
            ["bash", "benchmarks/gpu_run.sh", "abc1234", *steps],
            cwd=REPO,
            env={**env, **extra_env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, calls.read_text().splitlines(), out

    return run


def _one(calls, *parts):
    """The one recorded call that contains every part."""
    hits = [c for c in calls if all(p in c for p in parts)]
    assert len(hits) == 1, (parts, calls)
    return hits[0]


def test_peer_wheels_are_installed_once(gpu_run, tmp_path):
    _, calls, _ = gpu_run("prepare:listops")
    assert any("-m pip install" in c and f"--target {tmp_path / 'site'}" in c for c in calls)
    _, calls, _ = gpu_run("prepare:listops")
    assert sum("-m pip install" in c for c in calls) == 1  # the marker file was left
    assert "-m models.data prepare listops" in calls[-1]


def test_fa_grid_slices_and_sweeps_build_their_commands(gpu_run):
    stdout, calls, _ = gpu_run(
        "fa-grid:64:both:100", "fa-grid:256:true:50", "sweep-mosaic:64,128:fwd", "sweep"
    )
    assert stdout.count("fa-grid rc=0") == 2  # a slice's exit (124: its timeout) is shown
    both = _one(calls, "--suite fa", "--head-dims 64 ")
    assert "--causal" not in both and "--time-budget 100" in both
    assert "-abc1234-fa-64-both " in both and both.endswith("/fa-64-both.jsonl")
    causal = _one(calls, "--suite fa", "--head-dims 256")
    assert "--causal true" in causal and "--time-budget 50" in causal
    sweep = _one(calls, "--family mosaic")
    assert "--head-dims 64,128 --passes fwd" in sweep and "--time-budget 540" in sweep
    assert sweep.endswith("/sweep-mosaic-64-128-fwd.jsonl")
    triton = _one(calls, "--family triton")
    assert "--head-dims" not in triton and triton.endswith("/sweep.jsonl")


def test_lra_steps_pass_flags_and_fit_steps_from_a_probe(gpu_run):
    _, calls, out = gpu_run("lra:listops:6:clip=1,lr=5e-4", "lra:pathfinder32:6:auto")
    listops = _one(calls, "-m models.train --task listops")
    assert "--max-minutes 6 --clip 1 --lr 5e-4 --out runs/listops-clip1-lr5e-4" in listops
    assert "--steps" not in listops  # the preset's own step count
    probe = _one(calls, "--task pathfinder32", "--steps 60")
    assert "--eval-every 0" in probe and probe.endswith("--out runs/pathfinder32-probe")
    fit = _one(calls, "--fit-steps")
    assert fit.endswith("-m models.report --fit-steps 6 runs/pathfinder32-probe")
    train = _one(calls, "--task pathfinder32", "--max-minutes 6")
    assert "--steps 1234" in train and train.endswith("--out runs/pathfinder32")
    assert (out / "pathfinder32-steps.log").read_text().startswith("lra pathfinder32: 1234 steps")


def test_second_gpu_child_runs_its_steps_in_turn(gpu_run):
    _, calls, out = gpu_run(
        "gpu1:lra-compare:pathfinder32:5:flash,xla+prepare:listops",
        "fa-grid:64:false:10",
        "wait",
    )
    child = [c for c in calls if c.startswith("gpu=1 ")]
    assert [("--attention flash" in c, "--attention xla" in c) for c in child if "train" in c] == [
        (True, False),
        (False, True),
    ]
    assert "-m models.data prepare listops" in child[-1]  # after the comparison, in turn
    assert _one(calls, "--suite fa").startswith("gpu=0 ")
    assert (out / "gpu1.txt").exists()


@pytest.mark.parametrize("earlier", [5, 9])
def test_more_than_eight_files_are_bundled(gpu_run, earlier):
    """A device call returns at most 8 files: more leave as one gpu_run-bundle.tgz."""
    stdout, _, out = gpu_run("prepare:listops", prefill=earlier)
    files = sorted(p.name for p in out.iterdir())
    if earlier <= 8:
        assert "bundled" not in stdout and len(files) == earlier
    else:
        assert "bundled into $OUT/gpu_run-bundle.tgz" in stdout and files == ["gpu_run-bundle.tgz"]
        with tarfile.open(out / "gpu_run-bundle.tgz") as tar:
            names = {pathlib.Path(n).name for n in tar.getnames()}
        assert {f"earlier-{i}.jsonl" for i in range(earlier)} <= names


def test_unknown_step_is_reported(gpu_run):
    stdout, calls, _ = gpu_run("no-such-step")
    assert "unknown step no-such-step" in stdout
    assert not [c for c in calls if "pip install" not in c]


def test_lra_seeds_build_one_run_per_seed_after_one_prepare(gpu_run):
    _, calls, _ = gpu_run("lra-seeds:listops:7:3:lr=5e-4")
    assert sum("-m models.data prepare listops" in c for c in calls) == 1  # once, first
    assert "prepare" in calls[1] and "pip install" in calls[0]
    for s in range(3):
        run = _one(calls, "-m models.train", f"--seed {s} ")
        assert "--task listops --preset lra --max-minutes 7 " in run
        assert run.endswith(f"--lr 5e-4 --out runs/listops-lr5e-4-seed{s}")
    assert sum("-m models.train" in c for c in calls) == 3


def test_background_steps_share_this_gpu_and_its_memory(gpu_run, tmp_path):
    """bg:A+B runs A then B on the same GPU beside the foreground; data a step before
    them prepared is not written again (the stand-in prepares nothing, so the test makes
    it); LRA_MEM sets the runs' share."""
    data = tmp_path / "data"
    (data / "listops").mkdir(parents=True)
    (data / "listops" / "meta.json").write_text("{}")
    _, calls, out = gpu_run(
        "prepare:listops",
        "bg:lra-seeds:listops:7:2",
        "bg:lra-seeds:listops:7:2:compute-dtype=float32",
        "quick",
        "wait",
        LRA_MEM="0.4",
        GPU_RUN_DATA=str(data),
    )
    assert sum("-m models.data prepare listops" in c for c in calls) == 1
    trains = [c for c in calls if "-m models.train" in c]
    assert len(trains) == 4
    assert all(c.startswith("gpu=all mem=0.2 ") for c in trains), trains
    assert sum(c.endswith("--out runs/listops-compute-dtypefloat32-seed1") for c in trains) == 1
    assert _one(calls, "--suite quick").startswith("gpu=all mem= ")
    assert (out / "bg.txt").exists()


def test_fa_seqs_narrow_the_grid_steps(gpu_run):
    _, calls, _ = gpu_run("fa-grid:128:true:120", "mosaic-fa:64", FA_SEQS="16384")
    assert "--seqs 16384" in _one(calls, "--suite fa", "--head-dims 128")
    assert "--seqs 16384" in _one(calls, "--suite fa", "--head-dims 64")
    _, calls, _ = gpu_run("fa-grid:128:true:120")
    assert "--seqs" not in _one(calls[-1:], "--suite fa")
    _, calls, _ = gpu_run("mosaic-fa:128:true", FA_SEQS="2048", FA_BATCHES="32")
    assert "--batches 32" in _one(calls, "--suite fa", "--seqs 2048")


def test_masks_ours_takes_its_labels_and_implementations(gpu_run):
    """masks-ours:LABELS keeps those mask labels for our Triton path, or for the
    implementations OURS_IMPLS names (the Mosaic kernels beside cuDNN, call C)."""
    _, calls, _ = gpu_run("masks-ours:none,segments:4")
    line = _one(calls, "--suite masks")
    assert "--impls pallas_flash:triton " in line and "--masks none,segments:4" in line
    _, calls, _ = gpu_run("masks-ours:padding", OURS_IMPLS="pallas_flash:mosaic,jax.nn:cudnn")
    assert "--impls pallas_flash:mosaic,jax.nn:cudnn " in calls[-1]
    assert "--masks padding" in calls[-1] and "--time-budget 240" in calls[-1]


def test_ptxas_step_builds_its_command(gpu_run):
    """The ptxas step: our default and fused Mosaic kernels at head dims 64 and 128, causal
    and not, no SASS, unless PTXAS_IMPLS / PTXAS_HEAD_DIMS / PTXAS_CAUSAL / PTXAS_SASS say
    otherwise."""
    _, calls, _ = gpu_run("ptxas")
    default = _one(calls, "-m benchmarks.ptxas")
    assert "--impls pallas_flash:mosaic,pallas_flash:mosaic-fused --head-dims 64,128" in default
    assert "--causal false,true" in default and "--sass" not in default
    assert default.endswith("/ptxas.jsonl")
    _, calls, _ = gpu_run(
        "ptxas",
        PTXAS_IMPLS="pallas_flash:mosaic/fused=true",
        PTXAS_HEAD_DIMS="128",
        PTXAS_CAUSAL="false",
        PTXAS_SASS="1",
    )
    assert "--impls pallas_flash:mosaic/fused=true --head-dims 128 --causal false " in calls[-1]
    assert "--sass " in calls[-1] and calls[-1].split("--sass ")[1].split()[0].endswith("/sass")


def test_profile_fa_step_takes_its_shape(gpu_run):
    """profile-fa:HEAD_DIMS:SEQS[:CAUSAL]: benchmarks.profile on those fa-grid shapes,
    both causal flags unless one is named."""
    _, calls, _ = gpu_run("profile-fa:64,128:8192")
    line = _one(calls, "-m benchmarks.profile")
    assert "--head-dims 64,128 --seqs 8192 --impls" in line and "--causal" not in line
    _, calls, _ = gpu_run("profile-fa:128:2048,8192:true")
    assert "--head-dims 128 --seqs 2048,8192 --causal true --impls" in calls[-1]


def test_stalls_step_builds_its_command(gpu_run):
    """stalls-fa:HEAD_DIM:SEQ[:CAUSAL]: benchmarks.stall_sites on that fa-grid shape, ours
    and the backward's kernels unless STALLS_* say otherwise, its files under $OUT."""
    _, calls, out = gpu_run("stalls-fa:128:8192")
    line = _one(calls, "-m benchmarks.stall_sites")
    assert "--head-dim 128 --seq 8192 --causal false --impl pallas_flash:mosaic " in line
    assert "--pass fwd+bwd --kernels pallas_flash_mosaic_bwd " in line and "--name" not in line
    assert line.endswith(f"--out-dir {out}")
    _, calls, _ = gpu_run(
        "stalls-fa:64:2048:true",
        STALLS_IMPL="pallas_flash:mosaic/early_lse=true",
        STALLS_PASS="fwd",
        STALLS_KERNELS="pallas_flash_mosaic_fwd",
        STALLS_NAME="x",
    )
    assert (
        "--head-dim 64 --seq 2048 --causal true --impl pallas_flash:mosaic/early_lse=true "
        in calls[-1]
    )
    assert "--pass fwd --kernels pallas_flash_mosaic_fwd --name x " in calls[-1]


def test_mosaic_tests_step_builds_its_command(gpu_run):
    """The compiled Mosaic tests: 8 workers unless MOSAIC_TESTS_WORKERS says otherwise,
    the slowest tests listed, MOSAIC_TESTS_K passed to -k."""
    _, calls, _ = gpu_run("mosaic-tests")
    default = _one(calls, "-m pytest -m gpu tests/test_mosaic.py")
    assert " -n 8 " in default and "--durations=15" in default and " -k " not in default
    _, calls, _ = gpu_run("mosaic-tests", MOSAIC_TESTS_WORKERS="14", MOSAIC_TESTS_K="fused")
    assert " -n 14 " in calls[-1] and calls[-1].endswith("-k fused")


def _option(line: str, flag: str) -> str | None:
    """The value after `flag` in a recorded command line, or None."""
    words = line.split()
    return words[words.index(flag) + 1] if flag in words else None


@pytest.fixture
def next_calls(tmp_path):
    """Runs benchmarks/next_calls.sh COMMIT CALL with the stand-in python3, in a copy of
    the files it reads."""
    tree = tmp_path / "tree"
    for rel in ("benchmarks/gpu_run.sh", "benchmarks/next_calls.sh"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tree / rel)
    (tree / ".peers" / "stub").mkdir(parents=True)
    env, calls, _ = _stand_in(tmp_path)

    def run(call: str):
        calls.write_text("")
        proc = subprocess.run(
            ["bash", "benchmarks/next_calls.sh", "abc1234", call],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return proc, [c for c in calls.read_text().splitlines() if "pip install" not in c], tree

    return run


# The config variants each call times (names after pallas_flash:mosaic/), so that the
# check below cannot pass by parsing none.
_CALL_VARIANTS = {"6": 1, "12": 1, "14": 2, "15": 1}


def _kept(proc) -> list[str]:
    """The files next_calls.sh's `keep` would have kept (the stand-in writes no rows, so
    each is said as missing on stderr), in order."""
    said = proc.stderr.splitlines()
    return [line.split("no rows for ")[1] for line in said if "no rows for " in line]


@pytest.mark.parametrize("call", sorted(_CALL_VARIANTS))
def test_next_calls_run_implementations_that_build(next_calls, call):
    """Each waiting device call (docs/mosaic.md, "Next device calls") runs its steps, and
    every implementation it names is one the harness knows; each Mosaic config variant
    builds its forward and backward configs (fields that exist, combinations the configs
    accept, shared memory and registers that fit) at every head dim, causal flag and
    length the call times, so no device time goes on a variant that cannot run, nor on
    one that is the default's forward there."""
    from benchmarks import impls
    from pallas_flash.mosaic.backward import check_fits
    from pallas_flash.mosaic.bwd_config import default_mosaic_bwd_config
    from pallas_flash.mosaic.config import SMEM_BYTES, default_mosaic_config, padded_head_dim

    proc, calls, tree = next_calls(call)
    assert proc.returncode == 0, proc.stderr
    tools = ("-m benchmarks.bench", "-m benchmarks.profile", "-m benchmarks.stall_sites")
    benches = [c for c in calls if any(tool in c for tool in tools)]
    assert benches, calls
    variants = set()
    for line in benches:
        one = "-m benchmarks.stall_sites" in line  # one shape, one implementation
        dims = _option(line, "--head-dim" if one else "--head-dims") or "128"
        head_dims = [int(h) for h in dims.split(",")]
        causal = {"true": [True], "false": [False]}.get(_option(line, "--causal"), [False, True])
        seqs = [int(s) for s in (_option(line, "--seq" if one else "--seqs") or "8192").split(",")]
        passes = _option(line, "--passes" if not one else "--pass") or "fwd+bwd"
        for name in _option(line, "--impl" if one else "--impls").split(","):
            impls.lookup(name)  # KeyError for a name the harness lacks
            if not name.startswith(impls.VARIANT_BASE + "/"):
                continue
            variants.add(name)
            for h, c, s in ((h, c, s) for h in head_dims for c in causal for s in seqs):
                fwd, bwd = impls.variant_configs(name, h, s, c)
                # beside the default, never the default's own configs of the pass timed
                # (fwd, bwd, or fwd+bwd) under another name
                new_fwd = fwd != default_mosaic_config(h, s, c)
                new_bwd = bwd != default_mosaic_bwd_config(h, c)
                assert {"fwd": new_fwd, "bwd": new_bwd}.get(passes, new_fwd or new_bwd), (
                    name,
                    h,
                    c,
                    s,
                )
                assert fwd.smem_bytes(padded_head_dim(h)) <= SMEM_BYTES, (name, h)
                check_fits(bwd, padded_head_dim(h))
    assert len(variants) == _CALL_VARIANTS[call], variants
    stalls = [c for c in calls if "-m benchmarks.stall_sites" in c]
    assert not stalls and not any("-m pytest" in c for c in calls)
    if call == "6":  # the head-dim-128 causal default beside the one-CTA-per-item row
        (bench,) = benches
        assert _option(bench, "--head-dims") == "128" and _option(bench, "--causal") == "true"
        assert _option(bench, "--passes") == "fwd"
        assert _option(bench, "--seqs") == "2048,4096,8192,16384"
        assert "jax.nn:cudnn" in bench and "tokamax:mosaic" in bench
        kept = _kept(proc)
        assert kept == ["fa-mosaic-128-true-greedy"]
    if call == "14":  # the causal cells on the H200: head dim 128 at 2k-16k, 64 at 4k
        assert [_option(b, "--seqs") for b in benches] == ["2048,4096,8192,16384", "4096"]
        _assert_renews_cells(proc, benches, "true", ["fwd-2k-16k", "4k"])
    if call == "15":  # the non-causal backward's rotated walks, two processes
        assert [_option(b, "--passes") for b in benches] == ["bwd", "bwd"]
        assert {_option(b, "--head-dims") for b in benches} == {"128"}
        assert {_option(b, "--causal") for b in benches} == {"false"}
        assert all("jax.nn:cudnn" in b for b in benches)
        assert _kept(proc) == [
            "fa-mosaic-128-false-bwd-rotated",
            "fa-mosaic-128-false-bwd-rotated-2",
        ]
    if call == "12":  # the persistent grid of clusters at the non-causal persistent rows
        _assert_renews_cells(proc, benches, "false", ["fwd-2k-16k", "fwd-2k-8k"])


def _assert_renews_cells(proc, benches, causal: str, kept: list[str]):
    """A call that renews the H200's forward cells: head dim 128, then 64, at one causal
    setting, each step beside the three peers (a cell counts only from a run of all of
    them), its rows kept as fa-mosaic-HD-CAUSAL-NAME with `kept`'s names in order."""
    assert [_option(b, "--head-dims") for b in benches] == ["128", "64"]
    assert {_option(b, "--causal") for b in benches} == {causal}
    peers = ("jax.nn:cudnn", "tokamax:mosaic", "jax:mosaic_fa3")
    assert all(peer in b for b in benches for peer in peers)
    names = [f"fa-mosaic-{h}-{causal}-{name}" for h, name in zip((128, 64), kept, strict=True)]
    assert _kept(proc) == names


def test_next_calls_refuse_an_unknown_call(next_calls):
    # 4, 7 ran at e6ab66d, 2, 5 at c0674ef, 10 at 5d326d1, 1, 3, 8, 9 at 899d096, 11 at
    # 512a5d0, 13 at 38e59cb
    for call in ("1", "2", "3", "4", "5", "7", "8", "9", "10", "11", "13"):
        proc, calls, _ = next_calls(call)
        assert proc.returncode == 2 and f"no call {call}" in proc.stderr and not calls
