"""The trainer's jobs, one per task family: the data it reads, the model it builds, its loss
and its evaluation metrics. models/train.py runs either through the same loop.

GPTJob: the GPT's tokens are the dataset's (`--dataset shakespeare`: bytes;
`shakespeare-gpt2`: GPT-2's BPE), its vocabulary that of the dataset's meta.json. Bits per
byte are the nats summed over the predicted tokens / ln 2 / the bytes of text those tokens
stand for, so the two tokenizations compare. Training needs no tokenizer library; the
sample at the end needs tiktoken to encode its prompt with a BPE, and is skipped without it.

ClassifierJob: the Long Range Arena classifier (models/classifier.py) on a prepared LRA
task. Dropout keys, like batches, are pure functions of (seed, step). Validation accuracy
is evaluated during training, test accuracy at the end, with the wall-clock time.

What the loop asks of a job:
  params                        the initial parameters, a pure dict
  loss(params, batch, step)     (mean loss, metrics), traced inside the jitted train step
  shardings                     (the state's, the batch's) on the job's mesh, or None
  batch(step)                   (the batch, a fingerprint of it, the units it counts)
  train_fields, evaluate        the metrics of a train step, of an evaluation: (row, text)
  finish(params, log)           what runs after the last step
  title(n_params), unit, rate_unit
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import classifier, data, gpt, sharding

GPT_RECIPE = classifier.Recipe(
    steps=300,
    batch=16,
    lr=3e-3,
    warmup=30,
    final_lr=0.1,
    weight_decay=0.1,
    b2=0.95,
    eps=1e-8,
    clip=1.0,
    eval_every=100,
    eval_batches=4,
    ckpt_every=100,
)


def batch_at(tokens: np.ndarray, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """The batch of step `step`: `batch` windows of seq + 1 bytes, drawn from (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    return np.stack([np.asarray(tokens[s : s + seq + 1]) for s in starts])


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def example_ids(n: int, step: int, batch: int, seed: int) -> np.ndarray:
    """The examples of step `step`: positions step * batch ... of a stream of epochs, each
    a permutation of the n examples drawn from (seed, epoch); so every example is seen once
    per epoch, and the batch is a pure function of (seed, step)."""
    epochs, within = np.divmod(step * batch + np.arange(batch), n)
    return np.array([_epoch_order(n, seed, int(e))[i] for e, i in zip(epochs, within)])


def _pure(model: nnx.Module):
    """(merged(params) -> the model with those params, its params as a pure dict)."""
    graphdef, template = nnx.split(model)

    def merged(p):
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(graphdef, state)

    return merged, nnx.to_pure_dict(template)


def gpt_config(args, vocab: int = 256) -> gpt.GPTConfig:
    """The preset with the dataset's vocabulary and the --seq-len, --compute-dtype and
    --remat overrides."""
    overrides = dict(seq_len=args.seq_len, compute_dtype=args.compute_dtype)
    if args.remat:
        overrides["remat"] = True
    return dataclasses.replace(
        gpt.PRESETS[args.preset],
        vocab=vocab,
        **{k: v for k, v in overrides.items() if v is not None},
    )


def bits_per_byte(nats_per_token: float, tokens: int, n_bytes: int) -> float:
    """Nats summed over `tokens` predicted tokens / ln 2 / the `n_bytes` bytes of text they
    stand for (byte-level: tokens == n_bytes, and this is nats per token / ln 2)."""
    return nats_per_token / math.log(2) * (tokens / n_bytes)


class GPTJob:
    """The GPT's side of the loop: token windows, loss in bits per byte, a sample at the end.

    On a (data, seq) mesh: the state replicated on it, the batches (inputs, targets) [B, T]
    split over it (sharding.batch_sharding)."""

    unit, rate_unit = "tokens", "tok/s"

    def __init__(self, args, root):
        self.args = args
        self.train, self.val = (data.load(args.dataset, split, root) for split in ("train", "val"))
        self.vocab = data.Vocab.of(args.dataset, root)
        self.mesh = sharding.make_mesh(args.data_parallel, args.seq_parallel)
        self.cfg = gpt_config(args, self.vocab.size)
        self._check_lengths()
        # Bytes per token id, 0 for the embedding's padding rows (never a target).
        self.token_bytes = np.zeros(self.cfg.padded_vocab, np.int32)
        self.token_bytes[: self.vocab.size] = self.vocab.token_bytes()
        model = gpt.GPT(self.cfg, args.attention, rngs=nnx.Rngs(args.seed), mesh=self.mesh)
        self.merged, self.params = _pure(model)
        replicated = sharding.replicated(self.mesh)
        self.shardings = (replicated, sharding.batch_sharding(self.mesh))
        # Evaluation: the training loss (and bytes of text), with no gradient.
        self.eval_step = jax.jit(
            lambda params, batch: self.loss(params, batch, step=None),
            in_shardings=self.shardings,
            out_shardings=replicated,
        )
        # Sampling feeds one sequence at a time: the same parameters in a model off the mesh.
        self.merged_off_mesh, _ = _pure(gpt.GPT(self.cfg, args.attention, rngs=nnx.Rngs(args.seed)))
        self.tokens = args.batch * self.cfg.seq_len  # predicted per batch

    def title(self, n_params):
        d, s = self.mesh.shape[sharding.DATA], self.mesh.shape[sharding.SEQ]
        return (
            f"GPT {self.args.preset}: {n_params / 1e6:.2f}M parameters, context "
            f"{self.cfg.seq_len}, {self.vocab.tokenizer} tokens (vocabulary {self.cfg.vocab}), "
            f"attention {self.args.attention}, {self.cfg.compute_dtype}, "
            f"{jax.devices()[0].platform} mesh data {d} x seq {s} "
            f"({d * s} of {jax.device_count()} devices)"
        )

    def _text_bytes(self, targets):
        """The bytes of text that `targets` stand for."""
        return jnp.sum(jnp.asarray(self.token_bytes)[targets])

    def loss(self, params, batch, step):
        """(mean nats per token, the bytes of text its targets stand for); no randomness,
        so `step` goes unused."""
        loss = gpt.next_token_loss(self.merged(params), *batch)
        return loss, dict(bytes=self._text_bytes(batch[1]))

    def place(self, windows):
        """Host windows [B, T + 1] -> (inputs, targets) [B, T], split over the mesh."""
        return sharding.place((windows[:, :-1], windows[:, 1:]), self.shardings[1])

    def batch(self, step):
        """(the batch, a fingerprint of it, the tokens it predicts)."""
        batch = batch_at(self.train, step, self.args.batch, self.cfg.seq_len, self.args.seed)
        fingerprint = int(batch[:, 0].astype(np.int64) @ np.arange(1, len(batch) + 1))
        return self.place(batch), fingerprint, batch.size - len(batch)

    def train_fields(self, loss, m):
        bpb = bits_per_byte(loss, self.tokens, int(m["bytes"]))
        return dict(bpb=bpb), f"loss {loss:.3f} ({bpb:.3f} bpb)"

    def _check_lengths(self):
        """A window is seq_len + 1 tokens: a split shorter than that has none to draw (the
        validation split only matters when there is evaluation)."""
        need = self.cfg.seq_len + 1
        splits = [("train", self.train)] + ([("val", self.val)] if self.args.eval_every else [])
        for name, tokens in splits:
            if len(tokens) < need:
                hint = " or --eval-every 0 (no evaluation)" if name == "val" else ""
                raise SystemExit(
                    f"the {self.args.dataset} {name} split has {len(tokens):,} tokens, fewer "
                    f"than one window of --seq-len {self.cfg.seq_len:,} + 1: use a shorter "
                    f"--seq-len{hint}"
                )

    def evaluate(self, params, step):
        del step  # the curve is the GPT's result; only the classifier keeps its best model
        a = self.args
        losses, n_bytes = [], 0
        for i in range(a.eval_batches):
            windows = batch_at(self.val, i, a.batch, self.cfg.seq_len, 10_000 + a.seed)
            loss, m = self.eval_step(params, self.place(windows))
            losses.append(float(loss))
            n_bytes += int(m["bytes"])
        vl = float(np.mean(losses))  # nats per token: every batch predicts self.tokens
        bpb = bits_per_byte(vl, self.tokens * a.eval_batches, n_bytes)
        return dict(val_loss=vl, val_bpb=bpb), f"val loss {vl:.3f} ({bpb:.3f} bpb)"

    def finish(self, params, log):
        if not self.args.sample:
            return
        try:
            prompt = self.vocab.encode("ROMEO:\n")
        except ImportError as e:  # tiktoken, for a BPE: training never needs it
            print(f"\n--- no sample: {e} ---", flush=True)
            return
        # One sequence: on this process's first device, off the mesh.
        params = jax.device_put(jax.device_get(params), jax.local_devices()[0])
        tokens = gpt.generate(
            self.merged_off_mesh(params),
            prompt,
            self.args.sample,
            jax.random.PRNGKey(1),
            pad=self.vocab.newline,
        )
        text = self.vocab.decode(tokens).decode("utf-8", "replace")
        print("\n--- sample ---\n" + text, flush=True)


class ClassifierJob:
    """An LRA task's side of the loop: examples, accuracy, the test split at the end. One
    device: no mesh."""

    unit, rate_unit = "examples", "ex/s"
    shardings = None

    def __init__(self, args, root):
        self.args = args
        self.splits = {}
        for split in ("train", "val", "test"):
            x, y = data.load_lra(args.task, split, root)
            self.splits[split] = (*classifier.inputs(args.task, x), y.astype(np.int32))
        cfg, _ = classifier.PRESETS[args.task][args.preset]
        if args.attention_dropout is not None:
            cfg = dataclasses.replace(cfg, attention_dropout=args.attention_dropout)
        if args.compute_dtype is not None:
            cfg = dataclasses.replace(cfg, compute_dtype=args.compute_dtype)
        if args.embedding is not None:
            cfg = dataclasses.replace(cfg, embedding=args.embedding)
        self.cfg = classifier.for_task(cfg, args.task, self.splits["train"][0].shape[1])
        model = classifier.Classifier(self.cfg, args.attention, rngs=nnx.Rngs(args.seed))
        self.merged, self.params = _pure(model)
        self.dropout_key = jax.random.PRNGKey(args.seed + 1)
        self.eval_step = jax.jit(self._eval_sums)

    def title(self, n_params):
        a, c = self.args, self.cfg
        return (
            f"LRA {a.task} ({a.preset}): {n_params / 1e6:.2f}M parameters, {c.n_layer} layers, "
            f"length {c.seq_len}, {len(self.splits['train'][0]):,} training examples, "
            f"attention {a.attention}, {jax.devices()[0].platform}"
        )

    def loss(self, params, batch, step):
        """(mean cross-entropy, the accuracy), with dropout."""
        tokens, lengths, labels = batch
        key = jax.random.fold_in(self.dropout_key, step)  # a pure function of (seed, step)
        logits = self.merged(params)(tokens, lengths, dropout_key=key)
        nll, correct = classifier.loss_and_accuracy(logits, labels)
        return nll.mean(), dict(acc=correct.mean())

    def _eval_sums(self, params, tokens, lengths, labels, weights):
        """(summed cross-entropy, summed hits), each example weighted."""
        nll, correct = classifier.loss_and_accuracy(self.merged(params)(tokens, lengths), labels)
        return (nll * weights).sum(), (correct * weights).sum()

    def batch(self, step):
        """(the batch, a fingerprint of it, its examples)."""
        tokens, lengths, labels = self.splits["train"]
        ids = example_ids(len(tokens), step, self.args.batch, self.args.seed)
        fingerprint = int(ids.astype(np.int64) @ np.arange(1, len(ids) + 1))
        return (tokens[ids], lengths[ids], labels[ids]), fingerprint, len(ids)

    def train_fields(self, loss, m):
        acc = float(m["acc"])
        return dict(acc=acc), f"loss {loss:.3f} acc {100 * acc:.1f} %"

    def accuracy(self, params, split, max_batches=None):
        """(mean loss, accuracy, examples) over a split, in batches of --batch; the last
        batch is filled up with weight-0 copies of its first example (one compiled shape)."""
        tokens, lengths, labels = self.splits[split]
        B = self.args.batch
        n = len(tokens) if max_batches is None else min(len(tokens), max_batches * B)
        loss = correct = 0.0
        for i in range(0, n, B):
            ids = np.arange(i, min(i + B, n))
            weights = np.ones(B, np.float32)
            weights[len(ids) :] = 0.0
            ids = np.concatenate([ids, np.full(B - len(ids), ids[0])])
            nll, hits = self.eval_step(params, tokens[ids], lengths[ids], labels[ids], weights)
            loss, correct = loss + float(nll), correct + float(hits)
        return loss / n, correct / n, n

    def evaluate(self, params, step):
        """Validation loss and accuracy; the parameters are kept (on disk, so a resumed run
        knows them) when the accuracy is the best so far, for finish()'s second test."""
        loss, acc, n = self.accuracy(params, "val", self.args.eval_batches)
        text = f"val loss {loss:.3f}, accuracy {100 * acc:.2f} % ({n} examples)"
        best = self._best()
        if best is None or acc > best["val_acc"]:
            leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
            np.savez(self._best_path.with_suffix(".npz"), *leaves)
            self._best_path.write_text(json.dumps(dict(step=step, val_acc=acc)) + "\n")
        return dict(val_loss=loss, val_acc=acc), text

    @property
    def _best_path(self) -> pathlib.Path:
        return pathlib.Path(self.args.out) / "best_val.json"

    def _best(self) -> dict | None:
        """{step, val_acc} of the best validation accuracy so far, or None."""
        if not self._best_path.exists():
            return None
        return json.loads(self._best_path.read_text())

    def finish(self, params, log):
        """Test accuracy of the final model and, as LRA results are usually reported, of
        the model at the best validation accuracy (the earliest, on ties)."""
        t = time.perf_counter()
        loss, acc, n = self.accuracy(params, "test")
        log(test_loss=loss, test_acc=acc, test_examples=n, test_seconds=time.perf_counter() - t)
        print(
            f"\ntest accuracy {100 * acc:.2f} % ({n:,} examples), test loss {loss:.3f}", flush=True
        )
        best = self._best()
        if best is None:
            return
        with np.load(self._best_path.with_suffix(".npz")) as f:
            leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
        best_params = jax.tree.unflatten(jax.tree.structure(params), leaves)
        loss, acc, _ = self.accuracy(best_params, "test")
        log(
            best_val_step=best["step"],
            best_val_acc=best["val_acc"],
            best_test_loss=loss,
            best_test_acc=acc,
        )
        print(
            f"test accuracy at the best validation accuracy ({100 * best['val_acc']:.2f} %, "
            f"step {best['step'] + 1}): {100 * acc:.2f} %",
            flush=True,
        )
