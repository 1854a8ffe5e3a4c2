"""The LRA classifier: padding never leaks into the logits, the trainer trains it on tiny
generated ListOps and Pathfinder data and measures accuracy right, and a killed run
resumes exactly (batches and dropout keys are pure functions of seed and step)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from models import classifier, gpt, jobs, lra, report, train


@pytest.fixture(scope="module")
def lra_root(tmp_path_factory):
    """Tiny LRA tasks from our generators: ListOps of 8..64 tokens, 11 x 11 Pathfinder."""
    root = tmp_path_factory.mktemp("lra")
    for split, n, seed in [("train", 256, 0), ("val", 40, 1), ("test", 40, 2)]:
        for task, (x, y) in [
            ("listops", lra.listops(n, seed, min_len=8, max_len=64)),
            ("pathfinder32", lra.pathfinder(n, seed, size=11)),
        ]:
            (root / task).mkdir(exist_ok=True)
            np.save(root / task / f"{split}_x.npy", x)
            np.save(root / task / f"{split}_y.npy", y)
    return root


def _rows(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _args(task, root, out, *extra):
    return [
        "--task",
        task,
        "--preset",
        "tiny",
        "--data-dir",
        str(root),
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_padded_tokens_do_not_change_the_logits(pool):
    """Our attention, given the valid lengths: evaluation and, for CLS, training (dropout)."""
    cfg = classifier.ClassifierConfig(
        pool=pool, vocab=16, n_classes=10, seq_len=100, dropout=0.1, attention_dropout=0.1
    )
    model = classifier.Classifier(cfg, "flash", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    lengths = np.array([100, 37, 1], np.int32)
    padded = rng.integers(1, 16, (3, 100)).astype(np.uint8)
    padded[np.arange(100)[None] >= lengths[:, None]] = 0
    garbage = np.where(padded == 0, rng.integers(1, 16, padded.shape), padded).astype(np.uint8)
    logits = jax.jit(lambda t, key: model(t, lengths, dropout_key=key))
    for key in (None, jax.random.PRNGKey(3)) if pool == "cls" else (None,):
        a, b = logits(padded, key), logits(garbage, key)
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(a, b)
    # the padding is not ignored by accident: a changed valid token changes the logits
    changed = padded.copy()
    changed[1, 0] = changed[1, 0] % 15 + 1
    assert not np.array_equal(logits(padded, None)[1], logits(changed, None)[1])


def test_one_hot_embedding_matches_the_lookup():
    """The one-hot matmul embedding (the default) gives the lookup's logits exactly, and
    gradients as close to the float32 model's as the lookup's (both differ from it by the
    bfloat16 rounding of the whole network)."""
    rng = np.random.default_rng(0)
    tokens = np.where(rng.random((4, 64)) < 0.9, 0, rng.integers(0, 256, (4, 64))).astype(np.uint8)
    labels = rng.integers(0, 2, 4)
    out = {}
    runs = [("one_hot", "bfloat16"), ("gather", "bfloat16"), ("gather", "float32")]
    for embedding, dtype in runs:
        cfg = classifier.ClassifierConfig(
            vocab=256, seq_len=64, embedding=embedding, compute_dtype=dtype
        )
        merged, params = jobs._pure(classifier.Classifier(cfg, "flash", rngs=nnx.Rngs(0)))

        def loss(p, merged=merged):
            logits = merged(p)(tokens)
            return classifier.loss_and_accuracy(logits, labels)[0].mean(), logits

        out[embedding, dtype] = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    (_, logits), grads = out["one_hot", "bfloat16"]
    (_, lookup_logits), lookup_grads = out["gather", "bfloat16"]
    np.testing.assert_array_equal(logits, lookup_logits)
    exact = jax.tree.leaves(out["gather", "float32"][1])
    for g, lookup, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(lookup_grads), exact):
        err, lookup_err = np.abs(g - ref).max(), np.abs(lookup - ref).max()
        assert np.isfinite(g).all() and err <= 1.25 * lookup_err + 1e-6, (err, lookup_err)
    assert np.abs(np.asarray(grads["embed"]["embedding"])[0]).sum() > 0  # the background row


def test_blocks_are_initialised_as_lra_does():
    """LRA's TransformerBlock: xavier-uniform kernels, q, k and v each as its own layer
    (var 2 / (d + qkv_dim) per block of the fused kernel), no attention biases, MLP
    biases normal(1e-6); the GPT's blocks keep nnx.Linear's defaults."""
    cfg, _ = classifier.PRESETS["listops"]["lra"]
    cfg = classifier.for_task(cfg, "listops", 64)
    block = classifier.Classifier(cfg, "xla", rngs=nnx.Rngs(0)).blocks[0]
    assert block.qkv.bias is None and block.proj.bias is None
    kernel = np.asarray(block.qkv.kernel[...])
    d, q = cfg.d_model, cfg.qkv_dim
    assert kernel.shape == (d, 3 * q)
    for part in np.split(kernel, 3, axis=1):  # each within 5 % of xavier's variance
        assert abs(part.var() / (2 / (d + q)) - 1) < 0.05
    assert abs(np.asarray(block.fc.kernel[...]).var() / (2 / (d + cfg.mlp_dim)) - 1) < 0.05
    bias = np.asarray(block.fc.bias[...])
    assert 0 < np.abs(bias).max() < 1e-5
    gpt_block = gpt.Block(cfg, classifier.ATTENTION["xla"], rngs=nnx.Rngs(0))
    assert gpt_block.qkv.bias is not None and not np.asarray(gpt_block.fc.bias[...]).any()


def test_example_ids_cover_each_epoch_once():
    ids = np.concatenate([jobs.example_ids(10, s, 4, seed=7) for s in range(5)])  # 2 epochs
    assert sorted(ids[:10]) == list(range(10)) and sorted(ids[10:20]) == list(range(10))
    np.testing.assert_array_equal(jobs.example_ids(10, 3, 4, seed=7), ids[12:16])
    assert not np.array_equal(ids[:10], ids[10:20])  # a new order each epoch


def test_accuracy_over_a_split_with_a_partial_last_batch(lra_root, tmp_path, monkeypatch):
    cfg, recipe = classifier.PRESETS["listops"]["tiny"]  # float32: batch shapes round alike
    f32 = (dataclasses.replace(cfg, compute_dtype="float32"), recipe)
    monkeypatch.setitem(classifier.PRESETS["listops"], "tiny", f32)
    args = train.parse(_args("listops", lra_root, tmp_path, "--batch", "16", "--attention", "xla"))
    job = jobs.ClassifierJob(args, lra_root)
    params = job.params
    loss, acc, n = job.accuracy(params, "test")  # 40 examples: batches of 16, 16, 8 (+ 8 fill)
    tokens, lengths, labels = job.splits["test"]
    logits = job.merged(params)(tokens, lengths)
    nll, correct = classifier.loss_and_accuracy(logits, labels)
    assert n == 40
    np.testing.assert_allclose(acc, float(correct.mean()), rtol=1e-6)
    np.testing.assert_allclose(loss, float(nll.mean()), rtol=1e-5)


def test_listops_trains_and_reports_test_accuracy(lra_root, tmp_path, capsys):
    extra = ["--steps", "30", "--batch", "16", "--eval-every", "15", "--ckpt-every", "30"]
    assert train.main(_args("listops", lra_root, tmp_path, *extra)) == 0
    rows = _rows(tmp_path)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 30 and np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.05
    assert [r["step"] for r in rows if "val_acc" in r] == [14, 29]
    test = [r for r in rows if "test_acc" in r][-1]
    assert test["test_examples"] == 40 and 0.0 <= test["test_acc"] <= 1.0
    printed = capsys.readouterr().out
    assert f"test accuracy {100 * test['test_acc']:.2f} %" in printed
    assert (tmp_path / "loss.png").exists()
    # The model of the best validation accuracy (the earliest on ties) is tested too.
    val = [r for r in rows if "val_acc" in r]
    best = max(val, key=lambda r: (r["val_acc"], -r["step"]))
    row = [r for r in rows if "best_test_acc" in r][-1]
    assert (row["best_val_step"], row["best_val_acc"]) == (best["step"], best["val_acc"])
    assert f"at the best validation accuracy ({100 * best['val_acc']:.2f} %" in printed
    if best["step"] == 29:  # the final model itself
        assert row["best_test_acc"] == test["test_acc"]
    else:  # the kept parameters are that step's: retesting them on val gives its accuracy
        args = train.parse(_args("listops", lra_root, tmp_path, *extra))
        job = jobs.ClassifierJob(args, lra_root)
        with np.load(tmp_path / "best_val.npz") as f:
            leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
        kept = jax.tree.unflatten(jax.tree.structure(job.params), leaves)
        assert job.accuracy(kept, "val")[1] == best["val_acc"]
    table = report.table([report.load(tmp_path)])
    assert f"{100 * row['best_test_acc']:.2f} % ({best['step'] + 1})" in table


def test_the_best_validation_model_is_kept_and_tested(lra_root, tmp_path):
    """finish() tests the final model and the one of the best validation accuracy (the
    earliest on ties), read back from disk."""
    job = jobs.ClassifierJob(train.parse(_args("listops", lra_root, tmp_path)), lra_root)
    tmp_path.mkdir(exist_ok=True)
    models = [jax.tree.map(lambda x, d=d: x + d, job.params) for d in (0.0, 1.0, 2.0)]
    val_accs = iter([0.5, 0.7, 0.7])  # a first, a better one, a tie (not kept)
    tested = []

    def accuracy(params, split, max_batches=None):
        if split == "val":
            return 1.0, next(val_accs), 40
        offset = jax.tree.leaves(params)[0] - jax.tree.leaves(models[0])[0]
        tested.append(float(np.mean(offset)))
        return 1.0, 0.25 * len(tested), 40

    job.accuracy = accuracy
    for step, params in enumerate(models):
        job.evaluate(params, step)
    rows = []
    job.finish(models[-1], lambda **row: rows.append(row))
    assert tested == [pytest.approx(2.0), pytest.approx(1.0)]  # the final model, then step 1's
    best = dict(best_val_step=1, best_val_acc=0.7, best_test_loss=1.0, best_test_acc=0.5)
    assert rows[-1] == best


def test_killed_pathfinder_run_resumes_exactly(lra_root, tmp_path):
    """XLA's attention here (faster on CPU); dropout on, so the dropout keys are checked too."""
    extra = ["--steps", "6", "--batch", "8", "--ckpt-every", "2", "--eval-every", "3"]
    extra += ["--attention", "xla"]
    assert train.main(_args("pathfinder32", lra_root, tmp_path / "whole", *extra)) == 0
    cut = _args("pathfinder32", lra_root, tmp_path / "cut", *extra)
    killed = subprocess.run(
        [sys.executable, "-m", "models.train", *cut, "--kill-at", "5"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert killed.returncode == 1, killed.stderr[-3000:]
    first = _rows(tmp_path / "cut")
    assert train.main(cut) == 0
    whole, rows = _rows(tmp_path / "whole"), _rows(tmp_path / "cut")
    after = [r for r in rows[len(first) :] if "loss" in r]
    assert [r["step"] for r in after] == [4, 5]  # from the checkpoint at 4, to the end
    by_step = {r["step"]: r for r in whole if "loss" in r}
    for r in after:  # the same examples, dropout masks and hence losses
        assert r["batch_id"] == by_step[r["step"]]["batch_id"]
        assert r["loss"] == by_step[r["step"]]["loss"]
    final = lambda rs: [r for r in rs if r.get("final")][-1]["param_checksum"]  # noqa: E731
    assert final(rows) == final(whole)
    test_acc = lambda rs: [r for r in rs if "test_acc" in r][-1]["test_acc"]  # noqa: E731
    assert test_acc(rows) == test_acc(whole)
    best = lambda rs: [r for r in rs if "best_test_acc" in r][-1]  # noqa: E731
    assert best(rows) == best(whole)  # the kept model survives the kill


@pytest.mark.parametrize(
    "schedule, points",
    [  # (step, fraction of the peak lr): warm-up 100 steps of 500
        ("linear", [(0, 0.0), (50, 0.5), (100, 1.0), (300, 0.5), (500, 0.0)]),
        ("rsqrt", [(0, 0.0), (50, 0.5), (100, 1.0), (400, 0.5)]),
        ("cosine", [(0, 0.0), (100, 1.0), (300, 0.5), (500, 0.0)]),
    ],
)
def test_schedules_peak_at_the_end_of_warm_up(schedule, points):
    args = dataclasses.replace(
        classifier.PRESETS["listops"]["xiong"][1], steps=500, warmup=100, lr=2e-3, schedule=schedule
    )
    _, lr = train.make_optimizer(args)
    for step, fraction in points:
        assert float(lr(step)) == pytest.approx(fraction * 2e-3, abs=1e-9), (step, fraction)


def test_xiong_preset_is_the_nystromformer_listops_model():
    """The FlashAttention paper's LRA setting: 2 layers, width 64, heads of 32, MLP 128."""
    cfg, recipe = classifier.PRESETS["listops"]["xiong"]
    cfg = classifier.for_task(cfg, "listops", 2000)
    model = classifier.Classifier(cfg, "xla", rngs=nnx.Rngs(0))
    assert len(model.blocks) == 2 and cfg.qkv_dim // cfg.n_head == 32
    assert model.blocks[0].fc.kernel.shape == (64, 128)
    assert (recipe.batch, recipe.steps, recipe.lr, recipe.schedule) == (32, 5000, 1e-4, "linear")


def test_report_reads_seeds_by_their_mean(tmp_path):
    """Runs apart only in their seed: the report's last row is the mean ± sd of their test
    accuracies (and of those at the best validation), with min and max."""
    paths = []
    for seed, (acc, best) in enumerate([(0.36, 0.35), (0.38, 0.37), (0.37, 0.39)]):
        rows = [
            {"step": 0, "loss": 2.3, "acc": 0.1, "examples_seen": 32, "train_seconds": 1.0},
            {"step": 9, "val_loss": 2.0, "val_acc": 0.3},
            {"step": 10, "test_acc": acc, "test_loss": 1.7},
            {"step": 10, "best_test_acc": best, "best_val_step": 9, "best_val_acc": 0.4},
        ]
        paths.append(tmp_path / f"run-seed{seed}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = report.table([report.load(str(p)) for p in paths]).splitlines()[-1]
    cells = [c.strip() for c in last.strip("|").split("|")]
    assert cells[0] == "mean ± sd of 3 runs"
    assert cells[2] == "37.00 ± 1.00 % (min 36.00, max 38.00)"
    assert cells[3] == "37.00 ± 2.00 % (min 35.00, max 39.00)"
