"""How to cite: CITATION.cff names the software and the paper; README's BibTeX is whole."""

import pathlib
import re


ROOT = pathlib.Path(__file__).resolve().parents[1]
AUTHORS = (
    "Douillard Donchev Rush Kale Charles Garrett Teston Lacey McIlroy Shen Ramé "
    "Szlam Ranzato Barham"
).split()


def test_citation_cff_names_software_and_paper():
    text = (ROOT / "CITATION.cff").read_text(encoding="utf-8")
    top = {m.group(1) for m in re.finditer(r"^([a-z-]+):", text, flags=re.M)}
    assert {"cff-version", "message", "title", "authors", "preferred-citation"} <= top
    assert re.search(r'^cff-version: "?1\.2\.0"?$', text, flags=re.M)
    assert re.search(r'^title: "?sdiloco"?$', text, flags=re.M)
    assert re.search(r'^license: "?Apache-2\.0"?$', text, flags=re.M)
    paper = text.split("\npreferred-citation:", 1)[1]
    assert "2501.18512" in paper and "Towards a Distributed Free Lunch" in paper
    names = re.findall(r'family-names: "?([^"\n]+)"?', paper)
    assert names == AUTHORS
    assert "\t" not in text  # YAML forbids tabs for indentation


def test_readme_cites_paper_and_implementation_in_balanced_bibtex():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "## Citing" in readme
    citing = readme.split("## Citing", 1)[1]
    blocks = re.findall(r"```bibtex\n(.*?)```", citing, flags=re.S)
    assert len(blocks) == 1
    entries = re.findall(r"@(\w+)\{([^,]+),", blocks[0])
    assert [kind for kind, _ in entries] == ["article", "software"]
    assert "2501.18512" in blocks[0]
    for author in AUTHORS:
        assert author.replace("é", "{\\'e}") in blocks[0], author
    depth = 0
    for ch in blocks[0].replace("\\{", "").replace("\\}", ""):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0
