"""Every citation of a design note resolves, and no file cites the old external specs.

Code, tests, benchmarks, notebooks and READMEs cite the notes in `docs/` as
`docs/<note>.md §<section>` (lists such as `docs/paper.md §1.8, §7.7` cite each
section). Each cited note must exist and hold a heading that starts with that section
number (`## §2 ...`, `### §1.12 ...`). The design documents that used to live outside
the repository must no longer be cited.
"""

import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Spelled in pieces so that this file does not match its own check.
FORBIDDEN = ("PAPER" + ".md", "SPEC" + ".md", "SPEC" + " §", "shared" + "/spec")

_SECTION = r"\d+(?:\.\d+)*"
# `docs/<note>.md §N` anywhere; inside docs/ also a Markdown link `](<note>.md) §N`.
_CITATION = re.compile(
    rf"(?:docs/|\]\()(?P<note>[\w-]+)\.md[`)]?\s*§\s*(?P<section>{_SECTION})"
)
_MORE = re.compile(rf"\s*(?:,|;|and|or)\s*§\s*(?P<section>{_SECTION})")
_HEADING = re.compile(rf"^#{{1,6}}\s+§(?P<section>{_SECTION})(?=\s|$)", re.M)
_LINK = re.compile(r"\]\((?P<target>[\w./-]+\.md)\)")


def citations(text: str) -> list[tuple[str, str]]:
    """The (note, section) pairs cited in `text`, lists of sections included."""
    out = []
    for match in _CITATION.finditer(text):
        out.append((match["note"], match["section"]))
        end = match.end()
        while more := _MORE.match(text, end):
            out.append((match["note"], more["section"]))
            end = more.end()
    return out


def sections(note: str) -> set[str] | None:
    """The section numbers of `docs/<note>.md`'s headings, or None if it is missing."""
    path = DOCS / f"{note}.md"
    if not path.is_file():
        return None
    return {m["section"] for m in _HEADING.finditer(path.read_text(encoding="utf-8"))}


def unresolved(cited: list[tuple[str, str]]) -> list[str]:
    """The citations among `cited` whose note or heading does not exist."""
    bad = []
    for note, section in cited:
        found = sections(note)
        if found is None:
            bad.append(f"docs/{note}.md (no such note) §{section}")
        elif section not in found:
            bad.append(f"docs/{note}.md §{section} (no such heading)")
    return bad


def scanned_files() -> list[pathlib.Path]:
    """The files whose citations are checked (not this one: it holds made-up ones)."""
    patterns = [
        "sdiloco/**/*.py",
        "tests/**/*.py",
        "benchmarks/**/*.py",
        "benchmarks/**/*.md",
        "notebooks/*.py",
        "docs/*.md",
    ]
    files = {p for pattern in patterns for p in ROOT.glob(pattern)}
    files |= {ROOT / "README.md", ROOT / "paper_figures" / "README.md"}
    this = pathlib.Path(__file__).resolve()
    return sorted(p for p in files if p.is_file() and p.resolve() != this)


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_notes_exist():
    notes = ("contract", "paper", "decisions", "simulator", "implementation")
    for note in ("README", *notes, "performance"):
        assert (DOCS / f"{note}.md").is_file(), note
    assert sections("contract") >= {"1", "2", "3", "4", "5"}


def test_every_citation_resolves():
    bad, count = [], 0
    for path in scanned_files():
        cited = citations(path.read_text(encoding="utf-8"))
        count += len(cited)
        bad += [f"{_rel(path)}: {b}" for b in unresolved(cited)]
    assert not bad, "\n".join(bad)
    assert count >= 30, f"only {count} citations found: is the scan broken?"


def test_links_between_notes_resolve():
    bad = []
    for path in sorted(DOCS.glob("*.md")):
        for match in _LINK.finditer(path.read_text(encoding="utf-8")):
            if not (path.parent / match["target"]).is_file():
                bad.append(f"{_rel(path)} -> {match['target']}")
    assert not bad, "\n".join(bad)


def test_no_file_cites_the_external_specs():
    bad = []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8")
        bad += [f"{_rel(path)}: {word!r}" for word in FORBIDDEN if word in text]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "see docs/paper.md §1.8, §7.7 and §9.",
            [("paper", "1.8"), ("paper", "7.7"), ("paper", "9")],
        ),
        ("(docs/contract.md §1, step 3)", [("contract", "1")]),
        ("`../docs/paper.md` §3 and §4", [("paper", "3"), ("paper", "4")]),
        ("[paper.md](paper.md) §1.12;", [("paper", "1.12")]),
        (
            "docs/contract.md §1; docs/paper.md §1.4",
            [("contract", "1"), ("paper", "1.4")],
        ),
        ("paper §2.5 and docs/paper.md without a section", []),
    ],
)
def test_citation_parsing(text, expected):
    assert citations(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "docs/paper.md §99.9",  # no such heading
        "docs/contract.md §6",  # the contract has §1-§5
        "docs/paper.md §1.1, §1.99",  # the second item of a list
        "docs/no_such_note.md §1",  # no such note
    ],
)
def test_a_made_up_citation_fails(text):
    cited = citations(text)
    assert cited, "the made-up citation was not even parsed"
    assert unresolved(cited)


def test_a_real_citation_passes():
    assert not unresolved(citations("docs/paper.md §1.13.2, docs/contract.md §5"))


def test_forbidden_words_are_detected():
    text = "as in " + "SPEC" + " §2 and " + "PAPER" + ".md §1.4"
    assert [w for w in FORBIDDEN if w in text] == [FORBIDDEN[0], FORBIDDEN[2]]
