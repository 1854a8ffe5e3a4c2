"""The code's pointers into the docs lead somewhere: a comment or docstring that says
(docs/mosaic.md, "Half shares") or (README, "Correctness, compiled") names a heading or
a paragraph that opens with those words in that file. Sections move between the README
and docs/ as they grow; a pointer left behind fails here rather than misleading a reader."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = {"README": ROOT / "README.md", "docs/mosaic.md": ROOT / "docs" / "mosaic.md"}
SOURCES = sorted(
    p for d in ("pallas_flash", "benchmarks", "tests", "models") for p in (ROOT / d).rglob("*.py")
)
# A pointer: the file, an optional comma, then the section's opening words in quotes. The
# words may run over a line break of the comment that holds them.
POINTER = re.compile(r"\b(README|docs/mosaic\.md),? \"([^\"]{3,120})\"")


def _flat(text: str) -> str:
    """Comment markers and line breaks folded into single spaces."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def _openings(path: pathlib.Path) -> list[str]:
    """Each heading's text and each paragraph's first words (bold or not), flattened."""
    paragraphs = re.split(r"\n\s*\n", path.read_text())
    return [re.sub(r"^(#+ |\*\*)", "", _flat(p.strip())) for p in paragraphs]


def pointers() -> list[tuple[str, str, str]]:
    """(source file, docs file, section words) of every pointer in the code."""
    found = []
    for source in SOURCES:
        for m in POINTER.finditer(_flat(source.read_text())):
            found.append((str(source.relative_to(ROOT)), m.group(1), m.group(2)))
    return found


def test_the_code_points_into_the_docs():
    """The check below has something to check: the code's pointers into docs/mosaic.md
    (about forty in the Mosaic modules, their tools and tests) are found."""
    assert sum(doc == "docs/mosaic.md" for _, doc, _ in pointers()) >= 20


@pytest.mark.parametrize("source,doc,words", pointers(), ids=lambda x: str(x)[:40])
def test_pointer_names_a_section(source, doc, words):
    openings = _openings(DOCS[doc])
    assert any(o.startswith(words) for o in openings), (
        f'{source} points to {doc}, "{words}", and no heading or paragraph there opens so'
    )


def test_a_pointer_to_nowhere_fails(tmp_path):
    """The matching itself: a section's true opening words are found, words from its
    middle are not."""
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n**Half shares: no C7512.** The fused\nkernel's share.\n")
    openings = _openings(doc)
    assert any(o.startswith("Half shares") for o in openings)
    assert any(o.startswith("Title") for o in openings)
    assert not any(o.startswith("The fused kernel's share") for o in openings)
