"""A citation of a docs/ section by name points at a heading that exists.

The project cites its own docs as `docs/bench.md, "RHT block size"` (or without the comma, with
the path in backticks and the name in parentheses, with escaped quotes inside a Python string,
wrapped across comment lines, or chained: `"A" and "B"`).  A cited name is found when it is a
heading of that file, or the start of one up to a word boundary ("Break-even link rate" for
"Break-even link rate: THC-PS against DDP's all-reduce").  Names in quotes after a docs path
are the only form checked; `docs/x.md §3` and unquoted names are not."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", "dist", "node_modules", "__pycache__"}

_PATH = r"(docs/[\w./-]+?\.md)"
_NAME = r'\\?"([^"\\]{1,200}?)\\?"'
CITATION = re.compile(_PATH + r"`?(?:,?\s+\(?|\s*\()" + _NAME)
CHAINED = re.compile(r"\s*(?:,\s*and\s+|,\s*|and\s+)" + _NAME)
COMMENT_LEADER = re.compile(r"\n[ \t]*#:?[ \t]?")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def _norm(text: str) -> str:
    return " ".join(text.replace("`", "").replace("*", "").split())


def headings(md: str) -> list[str]:
    """The headings of a markdown text, outside fenced code, backticks and emphasis removed."""
    found, fenced = [], False
    for line in md.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            found.append(_norm(m.group(1)))
    return found


def names_a_heading(name: str, heads: list[str]) -> bool:
    return any(h == name or (h.startswith(name) and not h[len(name)].isalnum()) for h in heads)


def citations(text: str, is_python: bool = False) -> list[tuple[str, str]]:
    """(docs path, section name) for every quoted section name cited after a docs path."""
    if is_python:
        text = COMMENT_LEADER.sub("\n", text)        # a citation wrapped across comment lines
    found = []
    for m in CITATION.finditer(text):
        path, end = m.group(1), m.end()
        found.append((path, _norm(m.group(2))))
        while chained := CHAINED.match(text, end):
            found.append((path, _norm(chained.group(1))))
            end = chained.end()
    return found


def citing_files(root: Path) -> list[Path]:
    """README.md, CHANGELOG.md, every docs/ page and every .py file under root but this one."""
    files = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").rglob("*.md"))]
    files += sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts))
    return [p for p in files if p.is_file() and p.resolve() != Path(__file__).resolve()]   # not our examples


def broken_citations(root: Path) -> tuple[list[str], int]:
    """Every citation whose file or heading does not exist, and how many citations were checked."""
    problems, checked, cache = [], 0, {}
    for f in citing_files(root):
        for path, name in citations(f.read_text(encoding="utf-8"), is_python=f.suffix == ".py"):
            checked += 1
            target = root / path
            if path not in cache:
                cache[path] = headings(target.read_text(encoding="utf-8")) if target.is_file() else None
            where = f"{f.relative_to(root)} cites {path}, \"{name}\""
            if cache[path] is None:
                problems.append(f"{where}: no such file")
            elif not names_a_heading(name, cache[path]):
                problems.append(f"{where}: no heading of that name")
    return problems, checked


def test_every_cited_docs_section_exists():
    problems, checked = broken_citations(ROOT)
    assert checked >= 40, f"only {checked} citations found: has the citation form changed?"
    assert not problems, "\n".join(problems)


def test_the_readme_citations_of_the_bench_doc_are_checked():
    cited = {name for path, name in citations((ROOT / "README.md").read_text()) if path == "docs/bench.md"}
    assert cited == {"Break-even link rate", "Retransmission timer", "RHT block size", "Concurrent jobs",
                     "A 2^24 round against its CPU floor", "Where a round's CPU goes", "Defaults that win",
                     "Loss recovery", "Result lanes as narrow as n·g"}, cited


def test_every_citation_form_is_read():
    text = ('see docs/bench.md, "RHT block size"; docs/design.md "Result fan-out" and\n'
            '`docs/bench.md` ("Concurrent jobs"), docs/bench.md, "A 2^24 round against its CPU\n'
            'floor" and "A busy host"; ["docs/a.md", "docs/b.md"] and docs/p4.md §3 are not citations')
    assert citations(text) == [("docs/bench.md", "RHT block size"), ("docs/design.md", "Result fan-out"),
                               ("docs/bench.md", "Concurrent jobs"),
                               ("docs/bench.md", "A 2^24 round against its CPU floor"),
                               ("docs/bench.md", "A busy host")]
    py = ('x = 1  # the block (docs/bench.md, "RHT block\n    # size").\n'
          'help=("2^k coordinates; docs/bench.md \\"RHT block size\\")")\n')
    assert citations(py, is_python=True) == [("docs/bench.md", "RHT block size")] * 2


def test_a_heading_is_named_whole_or_by_its_start_up_to_a_word_boundary():
    heads = headings("# T\n## Break-even link rate: THC-PS against DDP's all-reduce\n"
                     "```\n## not a heading\n```\n### `Worker transport` (worker/transport.py)\n")
    assert heads == ["T", "Break-even link rate: THC-PS against DDP's all-reduce",
                     "Worker transport (worker/transport.py)"]
    assert names_a_heading("Break-even link rate", heads)
    assert names_a_heading("Worker transport", heads)
    assert not names_a_heading("Break-even link", heads[:1])
    assert not names_a_heading("Break-even link r", heads)        # not at a word boundary
    assert not names_a_heading("not a heading", heads)            # inside a code fence
    assert not names_a_heading("A faster host", heads)


def test_a_stale_citation_is_reported_with_where_it_is(tmp_path):
    """The reproduction: README cited "A faster host" of docs/bench.md, a bold paragraph, not a heading."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "bench.md").write_text("# Benchmarks\n\n## A busy host: load\n\n"
                                                "**A faster host, four sittings.**  text\n")
    (tmp_path / "README.md").write_text('rounds (docs/bench.md, "A faster\nhost"); docs/bench.md "A busy host"\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text('# see docs/gone.md, "Anything"\n')
    problems, checked = broken_citations(tmp_path)
    assert checked == 3
    assert problems == ['README.md cites docs/bench.md, "A faster host": no heading of that name',
                        'pkg/m.py cites docs/gone.md, "Anything": no such file']
