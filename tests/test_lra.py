"""Our LRA generators: ListOps evaluates right and respects the lengths; Pathfinder is
balanced, deterministic and marks path ends."""

from __future__ import annotations

import numpy as np
import pytest

from models import data, lra


def test_listops_operators():
    assert lra.evaluate(("[MAX", [4, 3, ("[MIN", [2, 3]), 1, 0, ("[MED", [1, 5, 8, 9, 2])])) == 5
    assert lra.evaluate(("[SM", [7, 8, ("[MIN", [9, 4])])) == 9
    assert lra.tokens(("[MIN", [2, ("[SM", [5, 6])])) == ["[MIN", "2", "[SM", "5", "6", "]", "]"]


def test_listops_lengths_labels_and_determinism():
    ids, labels = lra.listops(12, seed=4)
    lengths = (ids > 0).sum(1)
    assert ((lengths >= 500) & (lengths <= 2000)).all()
    assert labels.max() < 10 and ids.max() < len(lra.VOCAB)
    again, _ = lra.listops(12, seed=4)
    np.testing.assert_array_equal(ids, again)


def test_pathfinder_balanced_and_marked():
    images, labels = lra.pathfinder(64, seed=1, size=32)
    assert images.shape == (64, 32, 32) and images.dtype == np.uint8
    assert labels.sum() == 32  # balanced
    assert ((images == 255).sum((1, 2)) >= 9).all()  # two 3x3 markers (may overlap paths)
    np.testing.assert_array_equal(images, lra.pathfinder(64, seed=1, size=32)[0])


@pytest.mark.parametrize("task", ["listops", "pathfinder32"])
def test_prepare_and_load(tmp_path, task):
    data.prepare_lra(task, tmp_path / task, scale=0.001, workers=2)
    x, y = data.load_lra(task, "train", tmp_path)
    assert len(x) == len(y) == 96
    with pytest.raises(data.MissingData, match="python -m models.data prepare listops"):
        data.load_lra("listops", "train", tmp_path / "nowhere")


def test_outer_operator_baseline():
    """MIN's result is most often 0 and MAX's 9 (over up to 10 arguments, nested), and
    reading the operator alone beats the 10-class chance of 10 %."""
    got = lra.outer_operator_baseline(n=150, seed=3)
    assert got["predict"]["[MIN"] == 0 and got["predict"]["[MAX"] == 9
    assert 0.2 < got["accuracy"] < 0.5
    assert abs(sum(got["outermost"].values()) - 1.0) < 1e-9


def test_outer_operator_baseline_on_splits():
    """Fitted on train (MIN's most frequent label there is 0, MAX's 9), scored on each
    split by the first token alone."""
    mn, mx = lra.TOKEN["[MIN"], lra.TOKEN["[MAX"]
    ids = lambda firsts: np.array([[t, 5, 7] for t in firsts])  # noqa: E731
    train = (ids([mn, mn, mn, mx, mx]), np.array([0, 0, 3, 9, 9]))
    test = (ids([mn, mx, mx, mn]), np.array([0, 9, 1, 2]))
    got = lra.outer_operator_baseline_on_splits({"train": train, "test": test})
    assert got == {"train": 0.8, "test": 0.5}
