"""The trainer: a tiny GPT trains on CPU, and a killed run resumes exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from models import data


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "data"
    (root / "toy").mkdir(parents=True)
    text = b"to be or not to be that is the question " * 400
    np.frombuffer(text, np.uint8).tofile(root / "toy" / "train.bin")
    np.frombuffer(text[:4000], np.uint8).tofile(root / "toy" / "val.bin")
    return root


def _train(corpus, out, *extra, check=True):
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
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        return proc, [json.loads(line) for line in f]


def test_killed_run_resumes_with_no_lost_or_repeated_batch(corpus, tmp_path):
    _, whole = _train(corpus, tmp_path / "whole")
    killed, first = _train(corpus, tmp_path / "cut", "--kill-at", "5", check=False)
    assert killed.returncode == 1 and max(r["step"] for r in first if "loss" in r) == 4
    resumed, rows = _train(corpus, tmp_path / "cut")
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    after = [r for r in rows[len(first) :] if "loss" in r]
    assert [r["step"] for r in after] == [4, 5]  # from the last checkpoint, to the end
    by_step = {r["step"]: r for r in whole if "loss" in r}
    for r in after:  # the very batches, and the very losses, of the uninterrupted run
        assert r["batch_id"] == by_step[r["step"]]["batch_id"]
        assert r["loss"] == by_step[r["step"]]["loss"]
    final = lambda rs: [r for r in rs if r.get("final")][-1]["param_checksum"]  # noqa: E731
    assert final(rows) == final(whole)


def test_loss_falls_and_missing_data_names_the_command(corpus, tmp_path):
    _, rows = _train(corpus, tmp_path / "run", "--steps", "30", "--lr", "1e-2")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.6 * losses[0]
    assert (tmp_path / "run" / "loss.png").exists()
    with pytest.raises(data.MissingData, match="python -m models.data prepare nothing"):
        data.load("nothing", "train", tmp_path)
