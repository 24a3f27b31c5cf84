"""Draw the ratio tables of bench/RESULTS.md as charts, one SVG a table, for the docs.

    python bench/charts.py                  # bench/RESULTS.md -> docs/img/bench/*.svg
    python bench/charts.py --check          # exit 1 if the charts on disk are not these

A table is drawn when it has a ratio column: a column whose header compares two times
or rates (``× fastst``, ``× raw``, ``time / fastst``, ``speed vs peer``...) or whose
every cell is a ratio (``1.05x``). Each ratio column is one panel of horizontal bars,
one a row, with a line at 1: fastst's rows, its peers' and the reference rows (the raw
limit, the link, NumPy in memory) each in a colour of their own. The charts are named
after the table's heading (``1a-open-get-every-tensor-...svg``). Needs matplotlib
(bench/requirements.txt); parsing alone does not.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import re
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
OUT = ROOT / "docs" / "img" / "bench"

# Columns that describe a row rather than measure it, although their cells are numbers.
DESCRIPTIVE_HEADERS = {"batch"}
RATIO_HEADER = re.compile(r"×|\s/\s|\bvs\b")
RATIO_CELL = re.compile(r"^\d[\d,]*(?:\.\d+)?\s*[×x]$")
NUMBER = re.compile(r"^[\d.,]+")
MISSING = {"", "—", "-"}

COLOURS = {"fastst": "#1f6fb4", "peer": "#e8892b", "reference": "#8c8c8c"}
# What the ratio columns RESULTS.md defines mean, for the axis (others show their header).
AXIS_TITLES = {
    "× fastst": "× fastst: time / fastst's time (above 1: slower than fastst)",
    "× raw": "× raw: time / the raw limit's time",
    "time / fastst": "time / fastst's time (above 1: slower than fastst)",
}


@dataclass
class Table:
    heading: str
    header: List[str]
    rows: List[List[str]]
    name: str = ""
    ratio_columns: List[int] = field(default_factory=list)
    label_columns: List[int] = field(default_factory=list)


def plain(cell: str) -> str:
    """A cell's text without Markdown emphasis or code marks."""
    return cell.replace("**", "").replace("`", "").strip()


def cells(line: str) -> List[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables_in(text: str) -> Iterator[Table]:
    """Every Markdown table of `text`, with the heading it stands under."""
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$",
                                                                      lines[i + 1]):
            header = cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            yield Table(heading, header, rows)
            continue
        i += 1


def ratio(cell: str) -> Optional[float]:
    """The number a ratio cell holds (``6074×``, ``1.05x``, ``**0.64**``), or None."""
    text = plain(cell)
    if text in MISSING:
        return None
    found = NUMBER.match(text)
    return float(found.group().replace(",", "")) if found else None


def is_ratio_column(table: Table, column: int) -> bool:
    values = [plain(row[column]) for row in table.rows if plain(row[column]) not in MISSING]
    if not values:
        return False
    if RATIO_HEADER.search(table.header[column]):
        return all(NUMBER.match(value) for value in values)
    return all(RATIO_CELL.match(value) for value in values)


def is_measure_column(table: Table, column: int) -> bool:
    if table.header[column].lower() in DESCRIPTIVE_HEADERS:
        return False
    values = [plain(row[column]) for row in table.rows if plain(row[column]) not in MISSING]
    return bool(values) and all(NUMBER.match(value) for value in values)


def slug(text: str, longest: int = 60) -> str:
    """A file name from a heading: its words, lowercase, joined by hyphens, cut after
    the last whole word that fits in `longest` characters."""
    words = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return words if len(words) <= longest else words[:longest + 1].rsplit("-", 1)[0]


def ratio_tables(text: str) -> List[Table]:
    """The tables of `text` that have a ratio column, each named after its heading
    (a second table under the same heading gets ``-2``)."""
    found: List[Table] = []
    taken: Dict[str, int] = {}
    for table in tables_in(text):
        if any(len(row) != len(table.header) for row in table.rows):
            continue
        table.ratio_columns = [c for c in range(1, len(table.header))
                               if is_ratio_column(table, c)]
        if not table.ratio_columns:
            continue
        first_measure = next(c for c in range(1, len(table.header))
                             if is_measure_column(table, c) or c in table.ratio_columns)
        table.label_columns = list(range(first_measure))
        base = slug(table.heading)
        taken[base] = taken.get(base, 0) + 1
        table.name = base if taken[base] == 1 else f"{base}-{taken[base]}"
        found.append(table)
    return found


def kind_of(label: str) -> str:
    text = label.lower()
    if text.startswith(("raw", "ref")) or any(
            mark in text for mark in ("limit", "(the link)", "in memory", "no gpu")):
        return "reference"
    return "fastst" if "fastst" in text else "peer"


def row_label(table: Table, row: Sequence[str]) -> str:
    return " · ".join(plain(row[c]) for c in table.label_columns if plain(row[c]) not in MISSING)


def note_of(table: Table, row: Sequence[str]) -> str:
    """What a row's notes column says went wrong (wrong data, an error), if anything."""
    for column, name in enumerate(table.header):
        if name.lower() == "notes" and ("WRONG" in row[column] or "Error" in row[column]):
            return "wrong data" if "WRONG" in row[column] else "failed"
    return ""


def value_label(table: Table, row: Sequence[str], column: int) -> str:
    """The text a chart writes beside a row's bar, or in its place."""
    note = note_of(table, row)
    value = ratio(row[column])
    if value is None or value <= 0:
        return note or "not measured"
    return plain(row[column]) + (f" ({note})" if note else "")


def draw(table: Table) -> bytes:
    """The SVG of one table's chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "fastst",
                         "font.size": 9, "axes.spines.top": False,
                         "axes.spines.right": False})
    labels = ["\n".join(textwrap.wrap(row_label(table, row), 40)) or "?" for row in table.rows]
    kinds = [kind_of(row_label(table, row)) for row in table.rows]
    panels = len(table.ratio_columns)
    height = 0.9 + 0.36 * len(table.rows) + 0.12 * sum(label.count("\n") for label in labels)
    # one width for every chart, so that all show their text at one size on the page
    figure, axes = plt.subplots(1, panels, figsize=(8.0, height), sharey=True, squeeze=False)
    positions = list(range(len(table.rows)))[::-1]
    for ax, column in zip(axes[0], table.ratio_columns):
        values = [ratio(row[column]) for row in table.rows]
        present = [v for v in values if v is not None and v > 0]
        logarithmic = bool(present) and max(present) / min(present) > 30
        for y, value, kind, row in zip(positions, values, kinds, table.rows):
            note = note_of(table, row)
            label = value_label(table, row, column)
            if value is None or value <= 0:
                ax.text(1, y, f"  {label}", va="center", fontsize=8,
                        color="#b22222" if note else "#666666")
                continue
            ax.barh(y, value, color=COLOURS[kind], height=0.62,
                    hatch="//" if note else None, edgecolor="#b22222" if note else "white")
            ax.text(value, y, f" {label}", va="center", fontsize=8)
        if logarithmic:
            ax.set_xscale("log")
            ax.set_xlim(min(present) / 1.6, max(present) * 6)
        else:
            ax.set_xlim(0, max(present + [1.0]) * 1.3)
        ax.axvline(1, color="#333333", linewidth=0.8)
        title = AXIS_TITLES.get(plain(table.header[column]), plain(table.header[column]))
        ax.set_xlabel("\n".join(textwrap.wrap(title, 44 if panels > 1 else 80)) + (", log scale" if logarithmic else ""))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_yticks(positions)
        ax.set_yticklabels(labels)
        ax.tick_params(axis="y", length=0)
    figure.suptitle("\n".join(textwrap.wrap(plain(table.heading), 90)), fontsize=10, x=0.01,
                    ha="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[kind]) for kind in COLOURS
               if kind in kinds]
    figure.legend(handles, [kind for kind in COLOURS if kind in kinds], loc="lower right",
                  fontsize=8, frameon=False, ncol=3)
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    out = io.BytesIO()
    figure.savefig(out, format="svg", metadata={"Date": None})
    plt.close(figure)
    return out.getvalue()


def gallery(tables: Sequence[Table], folder: str = "img/bench") -> str:
    """Markdown for the benchmarks page: each chart, linked to its table's heading."""
    return "\n\n".join(f"[![{plain(table.heading)}]({folder}/{table.name}.svg)]"
                         f"(#{anchor(table.heading)})" for table in tables) + "\n"


def anchor(heading: str) -> str:
    """The id MkDocs gives a heading: Python-Markdown's, from the heading as rendered
    (``__metadata__`` is bold "metadata" there)."""
    import markdown

    html = markdown.markdown(f"# {heading}", extensions=["toc"])
    return re.search(r'id="([^"]*)"', html).group(1)


def render(results: pathlib.Path = RESULTS, out: pathlib.Path = OUT) -> Dict[str, bytes]:
    """Every chart of `results`, by file name."""
    return {f"{table.name}.svg": draw(table) for table in ratio_tables(results.read_text())}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the charts on disk differ")
    parser.add_argument("--gallery", action="store_true",
                        help="print the Markdown that shows the charts on docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.gallery:
        print(gallery(ratio_tables(args.results.read_text())), end="")
        return 0
    charts = render(args.results, args.out)
    on_disk = {path.name: path.read_bytes() for path in args.out.glob("*.svg")}
    if args.check:
        stale = sorted(set(charts) ^ set(on_disk) |
                       {name for name in charts if on_disk.get(name) != charts[name]})
        for name in stale:
            print(f"{args.out / name}: not what {args.results} gives", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in set(on_disk) - set(charts):
        (args.out / name).unlink()
    for name, svg in charts.items():
        (args.out / name).write_bytes(svg)
    print(f"{len(charts)} charts in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
