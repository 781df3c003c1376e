"""Every measured figure README.md and docs/index.md quote is in the docs table row it links to.

The rules, kept few on purpose:

1. A *figure* is a number with a unit written right after it: a ratio (`1.14x`), a percentage
   (`0.17%`, `+0.77%`), thousands of tokens/s (`39.0k`), bytes (`19.68 GiB`, `3.6 MiB`, `80 GB`),
   or a range of one of these (`80-84%`). Numbers without such a unit (`1000 steps`, `1e9`,
   `0.67B`, `1x128`) are settings, not figures. Code spans and fenced blocks are not read.
2. A *claim link* is a Markdown link to a heading of a docs page whose title names the table rows
   it quotes, by their first cell (bold and code marks dropped), separated by ";", each
   optionally narrowed to one column by its header cell after " > ":
   `[One GPU](docs/benchmarks.md#one-gpu-end-to-end "fp8:hp; bf16 > eager")`. The anchor must
   be the heading's slug both for mkdocs and for GitHub.
3. Each paragraph and each table row is a unit. A figure belongs to the first claim link of its
   unit that ends at or after it (a link whose text holds it, or the next one), else to the unit's
   last claim link; a figure in a unit without a claim link fails.
4. A section runs from its heading to the next heading of the same or a higher level; its rows
   are the rows of every table in it. A figure must occur in a row (or cell) its link names: a
   number of the same unit, written with at least the figure's decimals, that rounded half up to
   them equals the figure, with the figure's sign where the figure writes one; a range needs both
   ends found.

So changing a figure in README.md or docs/index.md, or the number it quotes in a docs table,
fails `test_every_figure_is_in_the_row_its_link_names` unless the named rows hold the new value
elsewhere; the two mutation tests change each figure in turn, on each side, and require that.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import re
import unicodedata
from decimal import ROUND_HALF_UP, Decimal

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLAIM_FILES = ("README.md", "docs/index.md")

_NUMBER = r"\d+(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.+-])([+-]?)({_NUMBER})(?:-({_NUMBER}))?(x|%|k| ?GiB| ?MiB| ?GB)(?!\w)")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)(?:\s+\"([^\"]*)\")?\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
TABLE_RULE = re.compile(r"[|:\- ]+")


@dataclasses.dataclass(frozen=True)
class Figure:
    text: str
    sign: str  # "+", "-" or "" (none written)
    ends: tuple[tuple[int, int], ...]  # spans of its number, or of a range's two numbers
    unit: str
    start: int
    end: int

    def number(self, i: int, text: str) -> str:
        return text[self.ends[i][0] : self.ends[i][1]]


def read_figures(text: str, offset: int = 0) -> list[Figure]:
    """The figures of `text`, with spans shifted by `offset`."""
    figures = []
    for m in FIGURE.finditer(text):
        ends = tuple((s + offset, e + offset) for s, e in (m.span(2), m.span(3)) if s >= 0)
        figures.append(Figure(m[0], m[1], ends, m[4].strip(), m.start() + offset, m.end() + offset))
    return figures


def _blank_code(text: str) -> str:
    """Code spans replaced by spaces, so that offsets stay."""
    return CODE_SPAN.sub(lambda m: " " * len(m[0]), text)


def _lines(text: str) -> list[tuple[int, str]]:
    """(offset, line) of every line outside fenced blocks."""
    lines, offset, fenced = [], 0, False
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((offset, line.rstrip("\n")))
        offset += len(line)
    return lines


def units(text: str) -> list[tuple[int, str]]:
    """(offset, text) of each paragraph (run of non-blank lines) and table row outside fences."""
    found, paragraph = [], []
    for offset, line in [*_lines(text), (len(text), "")]:
        if line.strip() and not line.startswith("|") and not HEADING.match(line):
            paragraph.append((offset, line))
            continue
        if paragraph:
            found.append((paragraph[0][0], "\n".join(line for _, line in paragraph)))
            paragraph = []
        if line.startswith("|"):
            found.append((offset, line))
    return found


def _plain(heading: str) -> str:
    return unicodedata.normalize("NFKD", re.sub(r"[`*]", "", heading)).encode("ascii", "ignore").decode("ascii")


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", _plain(heading)).strip().lower())


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", _plain(heading).strip().lower()).replace(" ", "-")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # its first cell
    start: int  # offset of the line in the page
    line: str
    header: tuple[str, ...]  # its table's header cells

    def cells(self) -> list[tuple[int, str]]:
        """(offset in the line, text) of each cell."""
        bars = [i for i, c in enumerate(self.line) if c == "|"]
        return [(a + 1, self.line[a + 1 : b]) for a, b in itertools.pairwise(bars)]


def _cell_text(text: str) -> str:
    return re.sub(r"[`*]", "", text).strip()


def section_rows(page: str, anchor: str) -> list[Row] | str:
    """The table rows of the section with the anchor; a message if there is no such section."""
    lines = _lines(page)
    for i, (_, line) in enumerate(lines):
        heading = HEADING.match(line)
        if not heading or slug(heading[2]) != anchor:
            continue
        if github_slug(heading[2]) != anchor:
            return f"heading {heading[2]!r} has the anchor #{github_slug(heading[2])} on GitHub"
        rows, header = [], ()
        for offset, row in lines[i + 1 :]:
            deeper = HEADING.match(row)
            if deeper and len(deeper[1]) <= len(heading[1]):
                break
            if not row.startswith("|"):
                continue
            if TABLE_RULE.fullmatch(row) and rows:  # the row above was its table's header
                header = tuple(_cell_text(cell) for _, cell in rows.pop().cells())
            else:
                rows.append(Row(_cell_text(row.split("|")[1]), offset, row, header))
        return rows
    return f"no heading with the anchor #{anchor}"


def _rounds_to(number: str, claimed: str) -> bool:
    decimals = len(claimed.partition(".")[2])
    if len(number.partition(".")[2]) < decimals:
        return False
    return Decimal(number).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP) == Decimal(claimed)


@dataclasses.dataclass(frozen=True)
class Claim:
    file: str
    figure: Figure  # offsets in the file
    page: str  # the docs page, relative to ROOT
    anchor: str
    rows: tuple[str, ...]
    found: tuple[tuple[int, int], ...]  # spans in the page of the table numbers it matched


@dataclasses.dataclass(frozen=True)
class Problem:
    file: str
    start: int | None  # offset of the figure in the file, if it is about one
    message: str


@dataclasses.dataclass(frozen=True)
class _Link:
    start: int  # in the unit's visible text
    end: int
    page: str
    anchor: str
    rows: tuple[str, ...]


def _visible(unit: str, file: str) -> tuple[str, list[int], list[_Link]]:
    """The unit as read (links replaced by their text, code spans blanked), the unit offset of each
    of its characters, and its claim links."""
    text, where, links, last = [], [], [], 0

    def keep(start: int, end: int) -> None:
        text.append(unit[start:end])
        where.extend(range(start, end))

    for m in LINK.finditer(unit):
        keep(last, m.start())
        page, _, anchor = m[2].partition("#")
        page = str(pathlib.PurePosixPath(file).parent / page)
        start = len(where)
        keep(*m.span(1))
        if anchor and m[3] is not None and page.startswith("docs/") and page.endswith(".md"):
            links.append(_Link(start, len(where), page, anchor, tuple(n.strip() for n in m[3].split(";"))))
        last = m.end()
    keep(last, len(unit))
    return _blank_code("".join(text)), where, links


def _find(figure: Figure, claimed: str, link: _Link, page: str) -> tuple[list[str], list[tuple[int, int]]]:
    """Problems with one figure (`claimed`: its text in its file) against its link's rows, and the
    page spans of the table numbers that match it."""
    rows = section_rows(page, link.anchor)
    if isinstance(rows, str):
        return [f"{link.page}: {rows}"], []
    problems, found, ends_found = [], [], set()
    for entry in link.rows:
        name, _, column = (part.strip() for part in entry.partition(" > "))
        named = [r for r in rows if r.name == name and (not column or column in r.header)]
        if not named:
            problems.append(f"{link.page}#{link.anchor} has no table row {entry!r}")
        for row in named:
            cells = [row.cells()[row.header.index(column)]] if column else [(0, row.line)]
            for at, cell in cells:
                for number in read_figures(_blank_code(cell), row.start + at):
                    if number.unit != figure.unit or figure.sign not in ("", number.sign or "+"):
                        continue
                    for i, j in itertools.product(range(len(figure.ends)), range(len(number.ends))):
                        ours = claimed[figure.ends[i][0] - figure.start : figure.ends[i][1] - figure.start]
                        if _rounds_to(number.number(j, page), ours):
                            ends_found.add(i)
                            found.append(number.ends[j])
    if len(ends_found) != len(figure.ends):
        problems.append(f"not in the rows {list(link.rows)} of {link.page}#{link.anchor}")
    return problems, found


def check(texts: dict[str, str]) -> tuple[list[Problem], list[Claim]]:
    """The problems and claims of CLAIM_FILES; files are read from `texts` (path relative to ROOT
    -> text) where it has them, else from disk."""

    def read(path: str) -> str:
        if path not in texts:
            texts[path] = (ROOT / path).read_text()
        return texts[path]

    problems, claims = [], []
    for file in CLAIM_FILES:
        text = read(file)
        for offset, unit in units(text):
            visible, where, links = _visible(unit, file)
            for seen in read_figures(visible):
                figure = dataclasses.replace(
                    seen,
                    ends=tuple((offset + where[s], offset + where[e - 1] + 1) for s, e in seen.ends),
                    start=offset + where[seen.start],
                    end=offset + where[seen.end - 1] + 1,
                )
                link = next((k for k in links if k.end >= seen.end), links[-1] if links else None)
                if link is None:
                    messages = ["no claim link (a link to a docs heading whose title names the rows) in its unit"]
                else:
                    messages, found = _find(figure, text[figure.start : figure.end], link, read(link.page))
                    claims.append(Claim(file, figure, link.page, link.anchor, link.rows, tuple(found)))
                line = text.count("\n", 0, figure.start) + 1
                problems += [Problem(file, figure.start, f"{file}:{line}: {figure.text!r}: {m}") for m in messages]
    return problems, claims


def _bump(number: str, places: int) -> str:
    """number plus one in its `places`-th decimal, written with at least its own decimals."""
    decimals = max(len(number.partition(".")[2]), places)
    return str((Decimal(number) + Decimal(1).scaleb(-places)).quantize(Decimal(1).scaleb(-decimals)))


def _fails(problems: list[Problem], file: str, start: int) -> bool:
    return any(p.file == file and p.start == start for p in problems)


def test_every_figure_is_in_the_row_its_link_names():
    problems, claims = check({})
    assert not problems, "\n".join(p.message for p in problems)
    # README quotes figures in its tables and paragraphs; the check has to have seen them.
    assert sum(c.file == "README.md" for c in claims) >= 30, [c.figure.text for c in claims]


def test_a_changed_claim_fails():
    """Each figure of README.md and docs/index.md, one at a time, plus one in its last digit (the
    last number of a range)."""
    _, claims = check({})
    unnoticed = []
    for claim in claims:
        text = (ROOT / claim.file).read_text()
        start, end = claim.figure.ends[-1]
        number = text[start:end]
        changed = text[:start] + _bump(number, len(number.partition(".")[2])) + text[end:]
        if not _fails(check({claim.file: changed})[0], claim.file, claim.figure.start):
            unnoticed.append(f"{claim.file}: {claim.figure.text} (+1 in its last digit)")
    assert not unnoticed, unnoticed


def test_a_changed_table_figure_fails():
    """Each claim's table numbers, all those it matched at once, plus one in the claim's last
    digit: the claim fails."""
    _, claims = check({})
    unnoticed = []
    for claim in claims:
        assert claim.found, claim
        page = (ROOT / claim.page).read_text()
        start, end = claim.figure.ends[0]
        places = len((ROOT / claim.file).read_text()[start:end].partition(".")[2])
        for start, end in sorted(set(claim.found), reverse=True):
            page = page[:start] + _bump(page[start:end], places) + page[end:]
        if not _fails(check({claim.page: page})[0], claim.file, claim.figure.start):
            unnoticed.append(f"{claim.file}: {claim.figure.text} against {claim.page}#{claim.anchor}")
    assert not unnoticed, unnoticed
