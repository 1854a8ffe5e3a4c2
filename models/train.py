"""Train the GPT or an LRA classifier: `python -m models.train --preset tiny`.

This module is the loop; models/jobs.py holds what differs between the two (the data, the
model, the loss and the evaluation metrics). A pure, jitted `train_step(state, batch)`;
AdamW with linear warm-up and cosine decay; global-norm gradient clipping; float32 master
weights with bfloat16 compute; periodic evaluation; JSONL metrics and a PNG loss curve;
orbax checkpoints that resume exactly: the batch of step s is a pure function of (seed, s),
so a resumed run sees the very batches an uninterrupted one would. A non-finite loss
stops the run with a message. `--attention flash|xla|cudnn` changes only attention.

`--task gpt` (the default) trains the GPT on a prepared corpus (`--dataset shakespeare`:
bytes; `shakespeare-gpt2`: GPT-2's BPE) and reports bits per byte.
`--task listops|pathfinder32|pathfinder64|pathx` trains the Long Range Arena classifier
(models/classifier.py) on a prepared LRA task (`python -m models.data prepare TASK`)
through the same loop: `--preset lra` is LRA's Transformer with its recipe (steps, batch,
schedule, weight decay, dropout), `--preset tiny` a CPU smoke test. `--max-minutes` stops
the run early with a checkpoint (the same command then resumes it).

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
import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax

from models import classifier, data, gpt, jobs, sharding


def make_optimizer(args):
    """(AdamW with the recipe's schedule and clipping, the schedule: step -> learning rate)."""
    if args.schedule == "rsqrt":  # LRA's linear_warmup * rsqrt_decay, peaking at lr

        def schedule(step):
            s = jnp.asarray(step, jnp.float32)
            w = float(args.warmup)
            return args.lr * jnp.minimum(1.0, s / w) * jnp.sqrt(w / jnp.maximum(s, w))

    elif args.schedule == "linear":  # linear warm-up to lr, then linear decay to the end
        schedule = optax.join_schedules(
            [
                optax.linear_schedule(0.0, args.lr, args.warmup),
                optax.linear_schedule(
                    args.lr, args.lr * args.final_lr, max(args.steps - args.warmup, 1)
                ),
            ],
            [args.warmup],
        )
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


def make_train_step(loss_fn, tx, shardings=None):
    """The pure, jitted `train_step(state, batch) -> (state, metrics)`: one step of `tx` on
    `loss_fn(params, batch, step) -> (loss, metrics)`. With `shardings` (the state's, the
    batch's), the state stays replicated and the batch split over a mesh."""

    def train_step(state, batch):
        params, opt_state, step = state
        # On a mesh the loss is the mean over the global batch: XLA sums the devices'
        # gradients (all-reduce).
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, metrics), grads = grad_fn(params, batch, step)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return (optax.apply_updates(params, updates), opt_state, step + 1), metrics

    if shardings is None:
        return jax.jit(train_step)
    state, batch = shardings
    return jax.jit(train_step, in_shardings=(state, batch), out_shardings=(state, state))


def initial_state(params, tx, shardings=None):
    """(params, optimizer state, step 0): the train state, placed as `shardings` say."""
    state = (params, tx.init(params), jnp.zeros((), jnp.int32))
    return state if shardings is None else sharding.place(state, shardings[0])


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
    p.add_argument(
        "--remat",
        action="store_true",
        help="gpt: recompute each block in the backward pass instead of storing its "
        "activations (long contexts: far less memory per token, about a third more compute)",
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
        "--memory-report",
        action="store_true",
        help="compile the train step for this run's shapes and mesh, print its memory per "
        "device (arguments, outputs, temporaries) and exit without training: will a "
        "context fit, on this many devices?",
    )
    p.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help="LRA tasks: override the preset's (cudnn has none: pass 0 with it)",
    )
    p.add_argument(
        "--embedding",
        choices=["one_hot", "gather"],
        default=None,
        help="LRA tasks: the token embedding as a one-hot matmul (default) or a lookup",
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
    # Defaults from the recipe: jobs.GPT_RECIPE for gpt, the preset's for an LRA task.
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
            help=f"default {getattr(jobs.GPT_RECIPE, field)} (gpt) or the LRA preset's",
        )
    args = p.parse_args(argv)
    if args.task == "gpt":
        args.preset = args.preset or "tiny"
        choices, recipe = gpt.PRESETS, jobs.GPT_RECIPE
    else:
        args.preset = args.preset or "lra"
        choices = classifier.PRESETS[args.task]
        recipe = choices.get(args.preset, (None, None))[1]
    if args.preset not in choices:
        p.error(f"--preset {args.preset} is not one of {args.task}'s: {sorted(choices)}")
    for field in dataclasses.fields(recipe):
        if getattr(args, field.name, None) is None:
            setattr(args, field.name, getattr(recipe, field.name))
    if args.eval_every < 0:
        p.error(f"--eval-every {args.eval_every} must be 0 (no evaluation) or more")
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
    for flag, value in (
        ("--embedding", args.embedding),
        ("--attention-dropout", args.attention_dropout),
    ):
        if value is not None and args.task == "gpt":
            p.error(f"{flag} is for the LRA tasks, not --task gpt")
    if args.task == "gpt":
        problem = sharding.check(
            batch=args.batch,
            seq_len=jobs.gpt_config(args).seq_len,
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
        job = (jobs.GPTJob if args.task == "gpt" else jobs.ClassifierJob)(args, root)
    except (sharding.MeshError, data.MissingData) as e:  # too few devices; data to prepare
        raise SystemExit(f"error: {e}") from None
    tx, schedule = make_optimizer(args)
    train_step = make_train_step(job.loss, tx, job.shardings)
    state = initial_state(job.params, tx, job.shardings)
    if args.memory_report:
        return _memory_report(train_step, state, job.batch(0)[0], out)
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
        state, m = train_step(state, batch)
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
            lr=float(schedule(step)),
            grad_norm=float(m["grad_norm"]),
            **{f"{job.unit}_per_s": rate, f"{job.unit}_seen": seen},
            # Seconds of training so far (compilation in, evaluation out): differences
            # between steps give the steady rate (python -m models.report).
            train_seconds=time.perf_counter() - t0 - eval_seconds,
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
        # --eval-every 0: no evaluation at all (a context longer than the validation split).
        if args.eval_every and (
            (step + 1) % args.eval_every == 0 or step + 1 == args.steps or out_of_time
        ):
            t = time.perf_counter()
            fields, text = job.evaluate(state[0], step)
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
        peak_bytes=(peak := _peak_bytes()),
    )
    print(
        f"\nsteps {start}..{last} took {seconds:.1f} s ({seconds - eval_seconds:.1f} s training "
        f"with compilation, {eval_seconds:.1f} s evaluation)"
        + (f"; peak memory per device {max(peak) / 1e9:.1f} GB" if peak else ""),
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


def _peak_bytes() -> list[int] | None:
    """The most memory each local device's allocator has held in this process (measured,
    where --memory-report gives the compiler's figure); None where it is not kept (CPU)."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    if not all("peak_bytes_in_use" in s for s in stats):
        return None
    return [s["peak_bytes_in_use"] for s in stats]


def _memory_report(train_step, state, batch, out: pathlib.Path) -> int:
    """--memory-report: the compiled step's bytes per device (XLA's own accounting; the
    device's allocator adds a little), printed and written to out/memory.json."""
    m = train_step.lower(state, batch).compile().memory_analysis()
    report = dict(
        devices=jax.device_count(),
        device=jax.devices()[0].device_kind,
        argument_bytes=m.argument_size_in_bytes,
        output_bytes=m.output_size_in_bytes,
        temp_bytes=m.temp_size_in_bytes,
        total_bytes=m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes,
    )
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")  # None on CPU
    report["device_bytes"] = limit
    report["fits"] = None if limit is None else report["total_bytes"] <= limit
    (out / "memory.json").write_text(json.dumps(report) + "\n")
    fits = ""
    if limit is not None:
        fits = f" of {limit / 1e9:.1f} GB ({'fits' if report['fits'] else 'does not fit'})"
    print(
        f"train step per device: {report['total_bytes'] / 1e9:.2f} GB{fits}: arguments "
        f"{m.argument_size_in_bytes / 1e9:.2f}, outputs {m.output_size_in_bytes / 1e9:.2f}, "
        f"temporaries {m.temp_size_in_bytes / 1e9:.2f}",
        flush=True,
    )
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
