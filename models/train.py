"""Train the GPT or an LRA classifier: `python -m models.train --preset tiny`.

A pure, jitted `train_step(state, batch)`; AdamW with linear warm-up and cosine decay;
global-norm gradient clipping; float32 master weights with bfloat16 compute; periodic
evaluation (loss and bits per byte); JSONL metrics and a PNG loss curve; orbax
checkpoints that resume exactly: the batch of step s is a pure function of (seed, s),
so a resumed run sees the very batches an uninterrupted one would. A non-finite loss
stops the run with a message. `--attention flash|xla|cudnn` changes only attention.

The GPT's tokens are the dataset's (`--dataset shakespeare`: bytes; `shakespeare-gpt2`:
GPT-2's BPE), its vocabulary that of the dataset's meta.json. Bits per byte are the nats
summed over the predicted tokens / ln 2 / the bytes of text those tokens stand for, so
the two tokenizations compare. Training needs no tokenizer library; the sample at the
end needs tiktoken to encode its prompt with a BPE, and is skipped without it.

`--task listops|pathfinder32|pathfinder64|pathx` trains the Long Range Arena classifier
(models/classifier.py) on a prepared LRA task (`python -m models.data prepare TASK`)
through the same loop: `--preset lra` is LRA's Transformer with its recipe (steps, batch,
schedule, weight decay, dropout), `--preset tiny` a CPU smoke test. Dropout keys, like
batches, are pure functions of (seed, step). Validation accuracy is evaluated during
training, test accuracy at the end, with the wall-clock time; `--max-minutes` stops the
run early with a checkpoint (the same command then resumes it).

`--data-parallel D --seq-parallel S` train the GPT on a (D, S) device mesh
(models/sharding.py): the batch split over D along its rows and over S along the
sequence (ring attention), the train state replicated. The loss curve is that of one
device, up to rounding. Checkpoints hold the global state, so a run resumes on any mesh
(and any number of devices). Several hosts: one process per host, each with
`--distributed` and the same flags (see the README).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def make_optimizer(args):
    if args.schedule == "rsqrt":  # LRA's linear_warmup * rsqrt_decay, peaking at lr

        def schedule(step):
            s = jnp.asarray(step, jnp.float32)
            w = float(args.warmup)
            return args.lr * jnp.minimum(1.0, s / w) * jnp.sqrt(w / jnp.maximum(s, w))

    else:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0,
            args.lr,
            warmup_steps=args.warmup,
            decay_steps=max(args.steps, args.warmup + 1),
            end_value=args.lr * args.final_lr,
        )
    tx = optax.adamw(schedule, b1=0.9, b2=args.b2, eps=args.eps, weight_decay=args.weight_decay)
    if args.clip:
        tx = optax.chain(optax.clip_by_global_norm(args.clip), tx)
    return tx, schedule


def _pure(model, tx):
    """(params as a pure dict, merged(params) -> model, the initial train state)."""
    graphdef, template = nnx.split(model)
    params = nnx.to_pure_dict(template)

    def merged(p):
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(graphdef, state)

    return merged, (params, tx.init(params), jnp.zeros((), jnp.int32))


def gpt_config(args, vocab: int = 256) -> gpt.GPTConfig:
    """The preset with the dataset's vocabulary and the --seq-len and --compute-dtype
    overrides."""
    overrides = dict(seq_len=args.seq_len, compute_dtype=args.compute_dtype)
    return dataclasses.replace(
        gpt.PRESETS[args.preset],
        vocab=vocab,
        **{k: v for k, v in overrides.items() if v is not None},
    )


def bits_per_byte(nats_per_token: float, tokens: int, n_bytes: int) -> float:
    """Nats summed over `tokens` predicted tokens / ln 2 / the `n_bytes` bytes of text they
    stand for (byte-level: tokens == n_bytes, and this is nats per token / ln 2)."""
    return nats_per_token / math.log(2) * (tokens / n_bytes)


def build(args, mesh, vocab: data.Vocab):
    """The GPT on `mesh`: the train state replicated on it, and the train and eval steps
    taking batches (inputs, targets) [B, T] split over it (sharding.batch_sharding); each
    step also returns the bytes of text that its targets stand for."""
    cfg = gpt_config(args, vocab.size)
    # Bytes per token id, 0 for the embedding's padding rows (never a target).
    token_bytes = np.zeros(cfg.padded_vocab, np.int32)
    token_bytes[: vocab.size] = vocab.token_bytes()

    def text_bytes(targets):
        return jnp.sum(jnp.asarray(token_bytes)[targets])

    model = gpt.GPT(cfg, args.attention, rngs=nnx.Rngs(args.seed), mesh=mesh)
    tx, schedule = make_optimizer(args)
    merged, state = _pure(model, tx)
    replicated, split = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    state = sharding.place(state, replicated)

    @functools.partial(
        jax.jit, in_shardings=(replicated, split), out_shardings=(replicated, replicated)
    )
    def train_step(state, batch):
        params, opt_state, step = state
        # The mean over the global batch: XLA sums the devices' gradients (all-reduce).
        loss, grads = jax.value_and_grad(lambda p: gpt.next_token_loss(merged(p), *batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, step + 1), dict(
            loss=loss, grad_norm=optax.tree.norm(grads), bytes=text_bytes(batch[1])
        )

    @functools.partial(jax.jit, in_shardings=(replicated, split), out_shardings=replicated)
    def eval_step(params, batch):
        """(mean nats per token, bytes of text predicted)."""
        return gpt.next_token_loss(merged(params), *batch), text_bytes(batch[1])

    # Sampling feeds one sequence at a time: the same parameters in a model off the mesh.
    sample_model, _ = _pure(gpt.GPT(cfg, args.attention, rngs=nnx.Rngs(args.seed)), tx)
    return cfg, state, train_step, eval_step, sample_model, schedule


class GPTJob:
    """The GPT's side of the loop: token windows, loss in bits per byte, a sample at the end."""

    unit, rate_unit = "tokens", "tok/s"

    def __init__(self, args, root):
        self.args = args
        self.train, self.val = (data.load(args.dataset, split, root) for split in ("train", "val"))
        self.vocab = data.Vocab.of(args.dataset, root)
        self.mesh = sharding.make_mesh(args.data_parallel, args.seq_parallel)
        self.cfg, self.state, self.train_step, self.eval_step, self.merged, self.schedule = build(
            args, self.mesh, self.vocab
        )
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

    def place(self, windows):
        """Host windows [B, T + 1] -> (inputs, targets) [B, T], split over the mesh."""
        return sharding.place((windows[:, :-1], windows[:, 1:]), sharding.batch_sharding(self.mesh))

    def batch(self, step):
        """(the batch, a fingerprint of it, the tokens it predicts)."""
        batch = batch_at(self.train, step, self.args.batch, self.cfg.seq_len, self.args.seed)
        fingerprint = int(batch[:, 0].astype(np.int64) @ np.arange(1, len(batch) + 1))
        return self.place(batch), fingerprint, batch.size - len(batch)

    def train_fields(self, loss, m):
        bpb = bits_per_byte(loss, self.tokens, int(m["bytes"]))
        return dict(bpb=bpb), f"loss {loss:.3f} ({bpb:.3f} bpb)"

    def evaluate(self, params):
        a = self.args
        losses, n_bytes = [], 0
        for i in range(a.eval_batches):
            windows = batch_at(self.val, i, a.batch, self.cfg.seq_len, 10_000 + a.seed)
            loss, b = self.eval_step(params, self.place(windows))
            losses.append(float(loss))
            n_bytes += int(b)
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
            self.merged(params),
            prompt,
            self.args.sample,
            jax.random.PRNGKey(1),
            pad=self.vocab.newline,
        )
        text = self.vocab.decode(tokens).decode("utf-8", "replace")
        print("\n--- sample ---\n" + text, flush=True)


class ClassifierJob:
    """An LRA task's side of the loop: examples, accuracy, the test split at the end."""

    unit, rate_unit = "examples", "ex/s"

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
        self.cfg = classifier.for_task(cfg, args.task, self.splits["train"][0].shape[1])
        model = classifier.Classifier(self.cfg, args.attention, rngs=nnx.Rngs(args.seed))
        tx, self.schedule = make_optimizer(args)
        merged, self.state = _pure(model, tx)
        self.merged = merged
        dropout_key = jax.random.PRNGKey(args.seed + 1)

        @jax.jit
        def train_step(state, batch):
            params, opt_state, step = state
            tokens, lengths, labels = batch
            key = jax.random.fold_in(dropout_key, step)  # a pure function of (seed, step)

            def loss_fn(p):
                logits = merged(p)(tokens, lengths, dropout_key=key)
                nll, correct = classifier.loss_and_accuracy(logits, labels)
                return nll.mean(), correct.mean()

            (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state, step + 1), dict(
                loss=loss, acc=acc, grad_norm=optax.tree.norm(grads)
            )

        @jax.jit
        def eval_step(params, tokens, lengths, labels, weights):
            nll, correct = classifier.loss_and_accuracy(merged(params)(tokens, lengths), labels)
            return (nll * weights).sum(), (correct * weights).sum()

        self.train_step, self.eval_step = train_step, eval_step

    def title(self, n_params):
        a, c = self.args, self.cfg
        return (
            f"LRA {a.task} ({a.preset}): {n_params / 1e6:.2f}M parameters, {c.n_layer} layers, "
            f"length {c.seq_len}, {len(self.splits['train'][0]):,} training examples, "
            f"attention {a.attention}, {jax.devices()[0].platform}"
        )

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

    def evaluate(self, params):
        loss, acc, n = self.accuracy(params, "val", self.args.eval_batches)
        text = f"val loss {loss:.3f}, accuracy {100 * acc:.2f} % ({n} examples)"
        return dict(val_loss=loss, val_acc=acc), text

    def finish(self, params, log):
        t = time.perf_counter()
        loss, acc, n = self.accuracy(params, "test")
        log(test_loss=loss, test_acc=acc, test_examples=n, test_seconds=time.perf_counter() - t)
        print(
            f"\ntest accuracy {100 * acc:.2f} % ({n:,} examples), test loss {loss:.3f}", flush=True
        )


def parse(argv):
    tasks = ["gpt", *classifier.TASKS]
    presets = sorted({*gpt.PRESETS, *(p for t in classifier.PRESETS.values() for p in t)})
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="gpt", choices=tasks)
    p.add_argument("--preset", default=None, choices=presets, help="gpt: tiny; LRA tasks: lra")
    p.add_argument("--attention", default="flash", choices=sorted(gpt.ATTENTION))
    p.add_argument("--dataset", default="shakespeare", help="gpt: the prepared corpus")
    p.add_argument("--data-dir", default=None, help="where prepared datasets live")
    p.add_argument("--seq-len", type=int, default=None, help="gpt: override the preset's context")
    p.add_argument(
        "--compute-dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="override the preset's (bfloat16); the weights are float32 either way",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="D",
        help="gpt: split each batch's rows over D devices (--batch is the global batch)",
    )
    p.add_argument(
        "--seq-parallel",
        type=int,
        default=1,
        metavar="S",
        help="gpt: split each sequence over S devices (ring attention; --attention flash)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="several hosts: call jax.distributed.initialize() first (one process per host; "
        "the coordinator from JAX_COORDINATOR_ADDRESS, --num-processes and --process-id, or "
        "detected under SLURM / Open MPI)",
    )
    p.add_argument("--num-processes", type=int, default=None, help="with --distributed")
    p.add_argument("--process-id", type=int, default=None, help="with --distributed")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--sample", type=int, default=200, help="gpt: tokens to generate at the end")
    p.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help="LRA tasks: override the preset's (cudnn has none: pass 0 with it)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop after this much wall-clock time, with a checkpoint the same command resumes",
    )
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="testing: exit abruptly after this step, as a killed run would",
    )
    # Defaults from the recipe: GPT_RECIPE for gpt, the preset's for an LRA task.
    for field, kind in [
        ("steps", int),
        ("batch", int),
        ("lr", float),
        ("warmup", int),
        ("clip", float),
        ("weight_decay", float),
        ("eval_every", int),
        ("eval_batches", int),
        ("ckpt_every", int),
    ]:
        p.add_argument(
            "--" + field.replace("_", "-"),
            type=kind,
            default=None,
            help=f"default {getattr(GPT_RECIPE, field)} (gpt) or the LRA preset's",
        )
    args = p.parse_args(argv)
    if args.task == "gpt":
        args.preset = args.preset or "tiny"
        choices, recipe = gpt.PRESETS, GPT_RECIPE
    else:
        args.preset = args.preset or "lra"
        choices = classifier.PRESETS[args.task]
        recipe = choices.get(args.preset, (None, None))[1]
    if args.preset not in choices:
        p.error(f"--preset {args.preset} is not one of {args.task}'s: {sorted(choices)}")
    for field in dataclasses.fields(recipe):
        if getattr(args, field.name, None) is None:
            setattr(args, field.name, getattr(recipe, field.name))
    for flag, size in (
        ("--data-parallel", args.data_parallel),
        ("--seq-parallel", args.seq_parallel),
    ):
        if size < 1:
            p.error(f"{flag} {size} must be at least 1")
        if size > 1 and args.task != "gpt":
            p.error(f"{flag} {size}: only the GPT (--task gpt) is trained sharded")
    if args.seq_parallel > 1 and args.attention != "flash":
        p.error(
            f"--seq-parallel {args.seq_parallel} runs ring attention over our kernels: use "
            f"--attention flash, not {args.attention}"
        )
    if args.task == "gpt":
        problem = sharding.check(
            batch=args.batch,
            seq_len=gpt_config(args).seq_len,
            data=args.data_parallel,
            seq=args.seq_parallel,
        )
        if problem:
            p.error(problem + ("" if args.seq_len else f" (--preset {args.preset}'s context)"))
    return args


def main(argv=None) -> int:  # noqa: C901 - a training loop reads best in one piece
    args = parse(argv)
    if args.distributed:  # before anything touches a device
        jax.distributed.initialize(num_processes=args.num_processes, process_id=args.process_id)

    import orbax.checkpoint as ocp

    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(args.data_dir) if args.data_dir else None
    try:
        job = (GPTJob if args.task == "gpt" else ClassifierJob)(args, root)
    except (sharding.MeshError, data.MissingData) as e:  # too few devices; data to prepare
        raise SystemExit(f"error: {e}") from None
    state = job.state
    ckpt = ocp.CheckpointManager(out / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if ckpt.latest_step() is not None:
        start = ckpt.latest_step()
        # The checkpoint holds global arrays; they are read into the shardings of `state`,
        # this run's (its mesh may differ from the saving run's, in shape and devices).
        state = ckpt.restore(start, args=ocp.args.StandardRestore(state))
        print(f"resumed from {out / 'ckpt'} at step {start}", flush=True)
    # Every process runs the loop; the first one writes the metrics and the plot.
    lead = jax.process_index() == 0
    metrics = open(out / "metrics.jsonl" if lead else os.devnull, "a")  # noqa: SIM115

    def log(**row):
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()

    n_params = sum(x.size for x in jax.tree.leaves(state[0]))
    print(job.title(n_params), flush=True)
    t0, seen, eval_seconds, last = time.perf_counter(), 0, 0.0, start
    upcoming = job.batch(start) if start < args.steps else None
    for step in range(start, args.steps):
        batch, batch_id, count = upcoming
        state, m = job.train_step(state, batch)
        if step + 1 < args.steps:  # the next batch is made while the device runs this one
            upcoming = job.batch(step + 1)
        loss = float(m["loss"])
        if not math.isfinite(loss):
            raise SystemExit(
                f"loss is {loss} at step {step}: stopping. Lower --lr or check the data."
            )
        last = step + 1
        seen += count
        rate = seen / (time.perf_counter() - t0)
        fields, text = job.train_fields(loss, m)
        log(
            step=step,
            loss=loss,
            **fields,
            lr=float(job.schedule(step)),
            grad_norm=float(m["grad_norm"]),
            **{f"{job.unit}_per_s": rate},
            batch_id=batch_id,
        )
        done = (step + 1) / args.steps
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        print(
            f"\r[{bar}] step {step + 1}/{args.steps} {text} {rate:,.0f} {job.rate_unit}",
            end="",
            flush=True,
        )
        out_of_time = (
            args.max_minutes is not None and time.perf_counter() - t0 > 60 * args.max_minutes
        )
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps or out_of_time:
            t = time.perf_counter()
            fields, text = job.evaluate(state[0])
            eval_seconds += time.perf_counter() - t
            log(step=step, **fields)
            print(f"\n  eval at step {step + 1}: {text}", flush=True)
        if (step + 1) % args.ckpt_every == 0:
            ckpt.save(step + 1, args=ocp.args.StandardSave(state))
            ckpt.wait_until_finished()
        if args.kill_at is not None and step + 1 == args.kill_at:
            metrics.close()
            os._exit(1)  # no final save: what a killed process leaves behind
        if out_of_time:
            print(
                f"\n--max-minutes {args.max_minutes} reached at step {step + 1} of "
                f"{args.steps}: saved; the same command resumes the run",
                flush=True,
            )
            break
    seconds = time.perf_counter() - t0
    checksum = sum(
        float(jnp.sum(jnp.abs(x.astype(jnp.float64 if jax.config.x64_enabled else jnp.float32))))
        for x in jax.tree.leaves(state[0])
    )
    log(
        step=last,
        final=True,
        param_checksum=checksum,
        steps_run=last - start,
        seconds=seconds,
        eval_seconds=eval_seconds,
    )
    print(
        f"\nsteps {start}..{last} took {seconds:.1f} s ({seconds - eval_seconds:.1f} s training "
        f"with compilation, {eval_seconds:.1f} s evaluation)",
        flush=True,
    )
    if ckpt.latest_step() != last:
        ckpt.save(last, args=ocp.args.StandardSave(state), force=True)
        ckpt.wait_until_finished()
    job.finish(state[0], lambda **row: log(step=last, **row))
    metrics.close()
    if lead:
        _plot(out)
    return 0


def _plot(out: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    gpt_run = any("bpb" in r for r in rows)
    key, label = ("bpb", "bits per byte") if gpt_run else ("loss", "cross-entropy (nats)")
    train = [(r["step"], r[key]) for r in rows if key in r]
    val = [(r["step"], r["val_" + key]) for r in rows if "val_" + key in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train), lw=0.8, label="train")
    if val:
        ax.plot(*zip(*val), marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.legend()
    acc = [(r["step"], 100 * r["val_acc"]) for r in rows if "val_acc" in r]
    if acc:
        right = ax.twinx()
        right.plot(*zip(*acc), color="C2", marker=".", label="validation accuracy")
        right.set_ylabel("validation accuracy (%)")
        right.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
