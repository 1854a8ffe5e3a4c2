"""Train the byte-level GPT: `python -m models.train --preset tiny --attention flash`.

A pure, jitted `train_step(state, batch)`; AdamW with linear warm-up and cosine decay;
global-norm gradient clipping; float32 master weights with bfloat16 compute; periodic
evaluation (loss and bits per byte); JSONL metrics and a PNG loss curve; orbax
checkpoints that resume exactly: the batch of step s is a pure function of (seed, s),
so a resumed run sees the very batches an uninterrupted one would. A non-finite loss
stops the run with a message. `--attention flash|xla|cudnn` changes only attention.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from models import data, gpt


def batch_at(tokens: np.ndarray, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """The batch of step `step`: `batch` windows of seq + 1 bytes, drawn from (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    return np.stack([np.asarray(tokens[s : s + seq + 1]) for s in starts])


def make_optimizer(args):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        args.lr,
        warmup_steps=args.warmup,
        decay_steps=max(args.steps, args.warmup + 1),
        end_value=args.lr * 0.1,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(args.clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1),
    )
    return tx, schedule


def build(args):
    cfg = dataclasses.replace(
        gpt.PRESETS[args.preset], **({"seq_len": args.seq_len} if args.seq_len else {})
    )
    model = gpt.GPT(cfg, args.attention, rngs=nnx.Rngs(args.seed))
    graphdef, template = nnx.split(model)
    params = template.to_pure_dict()
    tx, schedule = make_optimizer(args)

    def merged(p):
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(graphdef, state)

    @jax.jit
    def train_step(state, batch):
        params, opt_state, step = state
        loss, grads = jax.value_and_grad(lambda p: gpt.loss_fn(merged(p), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, step + 1), dict(
            loss=loss, grad_norm=optax.global_norm(grads)
        )

    @jax.jit
    def eval_step(params, batch):
        return gpt.loss_fn(merged(params), batch)

    state = (params, tx.init(params), jnp.zeros((), jnp.int32))
    return cfg, state, train_step, eval_step, merged, schedule


def main(argv=None) -> int:  # noqa: C901 - a training loop reads best in one piece
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=sorted(gpt.PRESETS))
    p.add_argument("--attention", default="flash", choices=sorted(gpt.ATTENTION))
    p.add_argument("--dataset", default="shakespeare")
    p.add_argument("--data-dir", default=None, help="where prepared datasets live")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's context")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--sample", type=int, default=200, help="bytes to generate at the end")
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="testing: exit abruptly after this step, as a killed run would",
    )
    args = p.parse_args(argv)

    import orbax.checkpoint as ocp

    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(args.data_dir) if args.data_dir else None
    train, val = (data.load(args.dataset, split, root) for split in ("train", "val"))
    cfg, state, train_step, eval_step, merged, schedule = build(args)
    ckpt = ocp.CheckpointManager(out / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if ckpt.latest_step() is not None:
        start = ckpt.latest_step()
        state = ckpt.restore(start, args=ocp.args.StandardRestore(state))
        print(f"resumed from {out / 'ckpt'} at step {start}", flush=True)
    metrics = open(out / "metrics.jsonl", "a")  # noqa: SIM115 - appended all run long

    def log(**row):
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()

    n_params = sum(x.size for x in jax.tree.leaves(state[0]))
    print(
        f"GPT {args.preset}: {n_params / 1e6:.2f}M parameters, context {cfg.seq_len}, "
        f"attention {args.attention}, {jax.devices()[0].platform}",
        flush=True,
    )
    t0, tokens_seen = time.perf_counter(), 0
    for step in range(start, args.steps):
        batch = batch_at(train, step, args.batch, cfg.seq_len, args.seed)
        state, m = train_step(state, batch)
        loss = float(m["loss"])
        if not math.isfinite(loss):
            raise SystemExit(
                f"loss is {loss} at step {step}: stopping. Lower --lr or check the data."
            )
        tokens_seen += batch.size - len(batch)
        rate = tokens_seen / (time.perf_counter() - t0)
        log(
            step=step,
            loss=loss,
            bpb=loss / math.log(2),
            lr=float(schedule(step)),
            grad_norm=float(m["grad_norm"]),
            tokens_per_s=rate,
            batch_id=int(batch[:, 0].astype(np.int64) @ np.arange(1, len(batch) + 1)),
        )
        done = (step + 1) / args.steps
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        print(
            f"\r[{bar}] step {step + 1}/{args.steps} loss {loss:.3f} "
            f"({loss / math.log(2):.3f} bpb) {rate:,.0f} tok/s",
            end="",
            flush=True,
        )
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            vl = np.mean(
                [
                    float(
                        eval_step(
                            state[0], batch_at(val, i, args.batch, cfg.seq_len, 10_000 + args.seed)
                        )
                    )
                    for i in range(args.eval_batches)
                ]
            )
            log(step=step, val_loss=float(vl), val_bpb=float(vl) / math.log(2))
            print(
                f"\n  eval at step {step + 1}: val loss {vl:.3f} ({vl / math.log(2):.3f} bpb)",
                flush=True,
            )
        if (step + 1) % args.ckpt_every == 0:
            ckpt.save(step + 1, args=ocp.args.StandardSave(state))
            ckpt.wait_until_finished()
        if args.kill_at is not None and step + 1 == args.kill_at:
            metrics.close()
            os._exit(1)  # no final save: what a killed process leaves behind
    checksum = sum(
        float(jnp.sum(jnp.abs(x.astype(jnp.float64 if jax.config.x64_enabled else jnp.float32))))
        for x in jax.tree.leaves(state[0])
    )
    log(step=args.steps, final=True, param_checksum=checksum)
    if ckpt.latest_step() != args.steps:
        ckpt.save(args.steps, args=ocp.args.StandardSave(state), force=True)
        ckpt.wait_until_finished()
    metrics.close()
    _plot(out)
    if args.sample:
        prompt = np.frombuffer(b"ROMEO:\n", np.uint8)
        text = gpt.generate(merged(state[0]), prompt, args.sample, jax.random.PRNGKey(1))
        print("\n--- sample ---\n" + bytes(text).decode("utf-8", "replace"), flush=True)
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
    train = [(r["step"], r["bpb"]) for r in rows if "bpb" in r]
    val = [(r["step"], r["val_bpb"]) for r in rows if "val_bpb" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train), lw=0.8, label="train")
    if val:
        ax.plot(*zip(*val), marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
