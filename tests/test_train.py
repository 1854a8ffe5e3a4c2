"""The trainer: a tiny GPT trains on CPU, a killed run resumes exactly, and a run sharded
over a (data, seq) mesh of host CPU devices follows the one-device loss curve and resumes
on another mesh. A BPE corpus (a toy ranks file; GPT-2's from openai-whisper's sdist where
prepared) trains without tiktoken and reports bits per byte of text."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import data, jobs, report, sharding, train


@pytest.fixture(scope="module", autouse=True)
def trainer_compile_cache(tmp_path_factory):
    """The trainer subprocesses share JAX's persistent compilation cache: the runs of one
    configuration (uninterrupted, killed, resumed) compile the same programs, and the
    later ones load them (about half of each run's time on CPU). This process's JAX read
    its settings at import, so only the subprocesses see these."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax-cache")))
        env.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        yield


def _corpus(root):
    (root / "toy").mkdir(parents=True)
    text = b"to be or not to be that is the question " * 400
    np.frombuffer(text, np.uint8).tofile(root / "toy" / "train.bin")
    np.frombuffer(text[:4000], np.uint8).tofile(root / "toy" / "val.bin")
    return root


@pytest.fixture
def corpus(tmp_path):
    return _corpus(tmp_path / "data")


def _on_cpus(n: int) -> dict:
    """The environment of a trainer process on n host CPU devices (on any machine)."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    return os.environ | dict(
        JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={n}"
    )


def _train(corpus, out, *extra, check=True, env=None):
    cmd = [
        sys.executable,
        "-m",
        "models.train",
        "--dataset",
        "toy",
        "--data-dir",
        str(corpus),
        "--steps",
        "6",
        "--batch",
        "4",
        "--seq-len",
        "32",
        "--ckpt-every",
        "2",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--sample",
        "0",
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        return proc, [json.loads(line) for line in f]


def test_loss_falls_and_missing_data_names_the_command(corpus, tmp_path):
    _, rows = _train(corpus, tmp_path / "run", "--steps", "15", "--lr", "1e-2")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.6 * losses[0]
    assert (tmp_path / "run" / "loss.png").exists()
    with pytest.raises(data.MissingData, match="python -m models.data prepare nothing"):
        data.load("nothing", "train", tmp_path)


# Float32 compute: the sharded run differs from one device only by the order of float32
# sums (gradient all-reduce, the ring's merge of partial attention results), amplified by a
# few Adam steps. Measured: relative differences of at most 2e-7 in the losses.
SHARDED = ("--compute-dtype", "float32", "--lr", "1e-2", "--warmup", "1")
RTOL = 1e-5


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """(uninterrupted on 1 device; on a data 2 x seq 2 mesh of 4, killed after step 4 with
    a checkpoint at 4; the same run resumed on 1 device), each as (process, rows), and
    the corpus and folder they ran in (pytest -n runs this module on one worker: see
    conftest.py)."""
    tmp = tmp_path_factory.mktemp("sharded")
    corpus = _corpus(tmp / "data")
    whole = _train(corpus, tmp / "one", *SHARDED, env=_on_cpus(1))
    mesh = ("--data-parallel", "2", "--seq-parallel", "2", "--kill-at", "4")
    cut = _train(corpus, tmp / "cut", *SHARDED, *mesh, env=_on_cpus(4), check=False)
    assert cut[0].returncode == 1, cut[0].stdout[-2000:] + cut[0].stderr[-3000:]
    resumed = _train(corpus, tmp / "cut", *SHARDED, env=_on_cpus(1))
    return whole, cut, resumed, corpus, tmp


def test_killed_run_resumes_with_no_lost_or_repeated_batch(sharded_runs):
    """Killed on one device after step 5 (the last checkpoint at 4), resumed there: the
    uninterrupted run on one device of sharded_runs, batch for batch and bit for bit."""
    (_, whole), _, _, corpus, tmp = sharded_runs
    one = _on_cpus(1)
    killed, first = _train(corpus, tmp / "killed", *SHARDED, "--kill-at", "5", check=False, env=one)
    assert killed.returncode == 1 and max(r["step"] for r in first if "loss" in r) == 4
    resumed, rows = _train(corpus, tmp / "killed", *SHARDED, env=one)
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    after = [r for r in rows[len(first) :] if "loss" in r]
    assert [r["step"] for r in after] == [4, 5]  # from the last checkpoint, to the end
    by_step = {r["step"]: r for r in whole if "loss" in r}
    for r in after:  # the very batches, and the very losses, of the uninterrupted run
        assert r["batch_id"] == by_step[r["step"]]["batch_id"]
        assert r["loss"] == by_step[r["step"]]["loss"]
    final = lambda rs: [r for r in rs if r.get("final")][-1]["param_checksum"]  # noqa: E731
    assert final(rows) == final(whole)


def _by_step(rows, key):
    return {r["step"]: r[key] for r in rows if key in r}


def test_data_and_sequence_parallel_match_one_device(sharded_runs):
    (_, one), (proc, four), *_ = sharded_runs
    assert "mesh data 2 x seq 2 (4 of 4 devices)" in proc.stdout
    for key in ("loss", "grad_norm", "val_loss", "batch_id"):
        got, want = _by_step(four, key), _by_step(one, key)
        assert got and set(got) <= set(want), key
        np.testing.assert_allclose(
            [got[s] for s in got], [want[s] for s in got], rtol=RTOL, err_msg=key
        )
    assert sorted(_by_step(four, "loss")) == [0, 1, 2, 3]


def test_checkpoint_of_four_devices_resumes_on_one(sharded_runs):
    (_, one), (_, cut), (proc, rows), *_ = sharded_runs
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    assert "(1 of 1 devices)" in proc.stdout
    after = rows[len(cut) :]
    assert sorted(_by_step(after, "loss")) == [4, 5]
    for key in ("loss", "val_loss", "param_checksum"):
        got, want = _by_step(after, key), _by_step(one, key)
        assert got, key
        np.testing.assert_allclose(
            [got[s] for s in got], [want[s] for s in got], rtol=RTOL, err_msg=key
        )
    assert _by_step(after, "batch_id") == {s: _by_step(one, "batch_id")[s] for s in (4, 5)}


def test_report_sets_runs_side_by_side(sharded_runs):
    """models.report: evaluations per step, drift from the first run, steady rate; the
    killed-and-resumed run's clock restarts, so its rate covers the last stretch only."""
    (_, one), _, (_, resumed), *_ = sharded_runs
    steps = [r for r in resumed if "loss" in r]
    restart = next(i for i in range(1, len(steps)) if steps[i]["step"] == 4)
    assert steps[restart]["train_seconds"] < steps[restart - 1]["train_seconds"]
    rate, steady = report.steady_rate(resumed, skip=0)
    tail = steps[restart:]
    want = (tail[-1]["tokens_seen"] - tail[0]["tokens_seen"]) / (
        tail[-1]["train_seconds"] - tail[0]["train_seconds"]
    )
    assert steady and rate == pytest.approx(want)
    table = report.table([("one", one), ("resumed", resumed)], skip=0).splitlines()
    assert table[0].startswith("| run | val loss @ 3 | val loss @ 6 |")
    assert table[2].startswith(f"| one | {_by_step(one, 'val_loss')[2]:.4f} |")
    assert "| 0.00 % |" in table[3]  # float32: the resumed run is the same curve


def test_report_fits_steps_to_minutes(sharded_runs, tmp_path, capsys):
    """--fit-steps: the steps that MINUTES hold at the steady rate, 85 % of the time kept
    for steps; a run without a steady rate is an error, not a guess."""
    (_, one), *_ = sharded_runs
    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in one))
    rate, _ = report.steady_rate(one, skip=2)
    per_step = next(r for r in one if "loss" in r)["tokens_seen"]
    want = int(rate * 2 * 60 * 0.85 / per_step)
    assert report.fit_steps(one, 2, skip=2) == want > 0
    assert report.main(["--fit-steps", "2", "--skip", "2", str(path)]) == 0
    assert capsys.readouterr().out.strip() == str(want)
    with pytest.raises(ValueError, match="no steady rate"):
        report.fit_steps(one, 2, skip=10_000)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--data-parallel", "3"], "--batch 4 must be a multiple of --data-parallel 3"),
        (["--seq-parallel", "3"], r"--seq-len 32 must be a multiple of 2 x --seq-parallel = 6"),
        (["--seq-parallel", "0"], "--seq-parallel 0 must be at least 1"),
        (["--seq-parallel", "2", "--attention", "xla"], "use --attention flash, not xla"),
        (["--task", "listops", "--data-parallel", "2"], "--data-parallel 2: only the GPT"),
        (["--embedding", "gather"], "--embedding is for the LRA tasks, not --task gpt"),
        (["--attention-dropout", "0"], "--attention-dropout is for the LRA tasks"),
    ],
)
def test_bad_mesh_flags_name_the_flag(flags, message, capsys):
    argv = ["--dataset", "toy", "--batch", "4", "--seq-len", "32", *flags]
    with pytest.raises(SystemExit):
        train.parse(argv)
    assert re.search(message, capsys.readouterr().err)


def test_more_devices_than_there_are_names_the_flags(corpus, tmp_path):
    n = jax.device_count()
    with pytest.raises(sharding.MeshError, match=f"--seq-parallel 2 = {2 * n} devices, but only"):
        sharding.make_mesh(n, 2)
    argv = ["--dataset", "toy", "--data-dir", str(corpus), "--batch", str(2 * n)]
    argv += ["--seq-len", "32", "--data-parallel", str(2 * n), "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match=rf"--data-parallel {2 * n} x --seq-parallel 1"):
        train.main(argv)


# A BPE in tiktoken's format: the 256 bytes, then merges ranked in the order they apply.
TOY_MERGES = [b" t", b"to", b" to", b"be", b" be", b"or", b" or", b"no", b"not", b" not"]
TOY_MERGES += [b"th", b"at", b"that", b" that", b"is", b" is", b"he", b"the", b" the", b"\xc3\xa9"]
TOY_TEXT = "to be or not to be that is the question, café " * 300


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory):
    """A data root with `toy-bpe`: TOY_TEXT in the toy BPE (vocabulary 256 + 20 + 1)."""
    pytest.importorskip("tiktoken", reason="preparing a BPE corpus needs tiktoken")
    root = tmp_path_factory.mktemp("bpe") / "data"
    pieces = [bytes([i]) for i in range(256)] + TOY_MERGES
    ranks = b"".join(base64.b64encode(p) + b" %d\n" % i for i, p in enumerate(pieces))
    meta = data.prepare_text(root / "toy-bpe", TOY_TEXT.encode(), "toy-bpe", ranks)
    assert meta["vocab"] == 277 and meta["dtype"] == "uint16"
    assert meta["train_bytes"] + meta["val_bytes"] == len(TOY_TEXT.encode())
    assert meta["train_tokens"] < 0.6 * meta["train_bytes"]  # the merges apply
    return root


def _bytes_of(tokens, windows):
    """The bytes of text that the targets of `windows` [B, T + 1] stand for."""
    return int(tokens[windows[:, 1:]].sum())


@pytest.mark.extended  # the trainer's BPE path beside the main byte-level one
def test_bpe_trains_without_tiktoken_in_bits_per_byte(bpe_corpus, tmp_path):
    """As on the GPU machine: no tiktoken. Training and evaluation run, bits per byte are
    nats / ln 2 / bytes of the targets, and the sample (its prompt needs tiktoken) is skipped."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "tiktoken.py").write_text("raise ImportError('no tiktoken here')\n")
    path = [str(blocked), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = os.environ | dict(PYTHONPATH=os.pathsep.join(path))
    flags = ("--dataset", "toy-bpe", "--steps", "3", "--sample", "5", "--attention", "xla")
    proc, rows = _train(bpe_corpus, tmp_path / "run", *flags, env=env)
    assert "toy-bpe tokens (vocabulary 277)" in proc.stdout
    assert "no sample: BPE encoding needs tiktoken" in proc.stdout
    vocab = data.Vocab.of("toy-bpe", bpe_corpus)
    token_bytes = vocab.token_bytes()
    train_split, val_split = (data.load("toy-bpe", s, bpe_corpus) for s in ("train", "val"))
    steps = [r for r in rows if "bpb" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:  # _train: --batch 4 --seq-len 32, seed 0
        n_bytes = _bytes_of(token_bytes, jobs.batch_at(train_split, r["step"], 4, 32, 0))
        assert n_bytes > 4 * 32
        assert r["bpb"] == pytest.approx(r["loss"] * 4 * 32 / math.log(2) / n_bytes, rel=1e-12)
    (val,) = [r for r in rows if "val_bpb" in r]
    n_bytes = _bytes_of(token_bytes, jobs.batch_at(val_split, 0, 4, 32, 10_000))
    assert val["val_bpb"] == pytest.approx(val["val_loss"] * 128 / math.log(2) / n_bytes)


def test_uniform_model_gives_log2_vocab_times_tokens_per_byte(bpe_corpus, capsys):
    """A GPT whose logits are all 0 predicts uniformly over the 277 tokens (the embedding's
    43 padding rows get -inf): log2(277) bits per token, tokens / bytes of them per byte."""
    argv = ["--dataset", "toy-bpe", "--data-dir", str(bpe_corpus), "--attention", "xla"]
    args = train.parse(argv + ["--batch", "4", "--seq-len", "32", "--eval-batches", "2"])
    job = jobs.GPTJob(args, bpe_corpus)
    assert (job.cfg.vocab, job.cfg.padded_vocab) == (277, 320)
    params = jax.tree.map(lambda x: x, job.params)
    params["embed"]["embedding"] = jnp.zeros_like(params["embed"]["embedding"])  # tied: logits 0
    fields, _ = job.evaluate(params, 0)
    token_bytes = job.vocab.token_bytes()
    val_split = data.load("toy-bpe", "val", bpe_corpus)
    n_bytes = sum(
        _bytes_of(token_bytes, jobs.batch_at(val_split, i, 4, 32, 10_000)) for i in range(2)
    )
    assert fields["val_loss"] == pytest.approx(math.log(277), rel=1e-6)
    assert fields["val_bpb"] == pytest.approx(math.log2(277) * 2 * 4 * 32 / n_bytes, rel=1e-6)
    job.args.sample = 4  # with tiktoken: the prompt is encoded, the sample decoded
    job.finish(params, lambda **row: None)
    assert "--- sample ---\nROMEO:\n" in capsys.readouterr().out


def test_missing_bpe_data_names_the_command(tmp_path):
    with pytest.raises(data.MissingData, match="python -m models.data prepare shakespeare-gpt2`"):
        data.load("shakespeare-gpt2", "train", tmp_path)
    argv = ["--dataset", "shakespeare-gpt2", "--data-dir", str(tmp_path), "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="run `python -m models.data prepare shakespeare-gpt2`"):
        train.main(argv)
    (tmp_path / "toy-bpe").mkdir()
    (tmp_path / "toy-bpe" / "meta.json").write_text(json.dumps(dict(tokenizer="gpt2")))
    with pytest.raises(data.MissingData, match="ranks.tiktoken does not exist: run `python -m"):
        data.Vocab.of("toy-bpe", tmp_path)
    # Both tokenizers split at the same byte, never inside a UTF-8 character.
    assert data.split_point(b"a" * 8 + "\u00e9".encode() + b"b") == 8


GPT2 = data.DATA / "shakespeare-gpt2"


@pytest.mark.skipif(
    not (GPT2 / "ranks.tiktoken").exists(),
    reason="GPT-2's ranks come with `python -m models.data prepare shakespeare-gpt2` "
    "(openai-whisper's sdist through pip: network)",
)
def test_gpt2_ranks_from_whisper_are_gpt2s():
    pytest.importorskip("tiktoken", reason="encoding needs tiktoken")
    raw = (GPT2 / "ranks.tiktoken").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == data.GPT2_RANKS["sha256"]
    vocab = data.Vocab.of("shakespeare-gpt2")
    assert (vocab.size, vocab.newline, vocab.pieces[50256]) == (50257, 198, b"")
    # GPT-2's ids, as tiktoken's own tests state them for its "gpt2" encoding.
    assert vocab.encode("hello world") == [31373, 995]
    assert vocab.encode("Hello world") == [15496, 995]
    enc = data.bpe_encoding(data.read_ranks(raw))
    assert enc.encode("hello <|endoftext|>", allowed_special="all") == [31373, 220, 50256]
    assert vocab.decode([31373, 995]) == b"hello world"
    meta = data.meta("shakespeare-gpt2")
    for split in ("train", "val"):  # every byte of the split, and no other, in its tokens
        tokens = data.load("shakespeare-gpt2", split)
        assert tokens.dtype == np.uint16 and len(tokens) == meta[f"{split}_tokens"]
        assert vocab.token_bytes()[tokens].sum() == meta[f"{split}_bytes"]


@pytest.mark.extended  # a reporting flag of the trainer
def test_memory_report_compiles_without_training(corpus, tmp_path, capsys):
    """--memory-report: the step's bytes per device for the run's shapes, and no training
    (no checkpoint, no metrics); temporaries grow with the context."""
    temps = []
    for seq in (64, 256):
        out = tmp_path / f"mem{seq}"
        argv = ["--dataset", "toy", "--data-dir", str(corpus), "--preset", "tiny"]
        argv += ["--batch", "2", "--seq-len", str(seq), "--out", str(out), "--memory-report"]
        assert train.main(argv) == 0
        report = json.loads((out / "memory.json").read_text())
        assert report["total_bytes"] == sum(
            report[k] for k in ("argument_bytes", "output_bytes", "temp_bytes")
        )
        assert report["fits"] is None  # a CPU names no byte limit
        assert not (out / "ckpt").exists() and not (out / "metrics.jsonl").exists()
        temps.append(report["temp_bytes"])
    assert temps[1] > temps[0] > 0
    assert "train step per device:" in capsys.readouterr().out


def test_remat_gives_the_same_gradients_with_less_memory():
    """--remat recomputes each block in the backward pass: the same loss and gradients
    (float32), and fewer temporary bytes for the same step."""
    from flax import nnx

    from models import gpt

    cfg = gpt.GPTConfig(seq_len=256, n_layer=2, n_head=2, d_model=64, compute_dtype="float32")
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 257), 0, 256)
    results = []
    for remat in (False, True):
        model = gpt.GPT(dataclasses.replace(cfg, remat=remat), "xla", rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        grad = jax.jit(jax.value_and_grad(lambda p: gpt.loss_fn(nnx.merge(graphdef, p), tokens)))
        temp = grad.lower(params).compile().memory_analysis().temp_size_in_bytes
        results.append((grad(params), temp))
    (loss, grads), temp = results[0]
    (loss_r, grads_r), temp_r = results[1]
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert temp_r < temp


def test_context_longer_than_the_validation_split(corpus, tmp_path, capsys):
    """A window of --seq-len + 1 tokens must fit a split: the validation split's shortfall
    names --eval-every 0, which trains with no evaluation at all (long-context runs)."""
    argv = ["--dataset", "toy", "--data-dir", str(corpus), "--batch", "1", "--seq-len", "4096"]
    argv += ["--steps", "1", "--sample", "0"]
    with pytest.raises(SystemExit, match=r"val split has 4,000 tokens.*--eval-every 0"):
        train.main([*argv, "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match=r"train split has 16,000 tokens"):
        train.main([*argv, "--seq-len", "20000", "--out", str(tmp_path / "b")])
    assert train.main([*argv, "--eval-every", "0", "--out", str(tmp_path / "c")]) in (0, None)
    rows = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [0]
    assert not any("val_loss" in r for r in rows)
