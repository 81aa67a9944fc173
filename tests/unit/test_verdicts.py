"""Every verdict the project's prose draws comes from a test: a grid's paired t-test at 5% after Holm's correction over
its family (every validation-loss test drawn from the same runs: adaptive_ds/tools/grid_family.py), as the grid's
report holds it.

A verdict word (better, worse, beats, best, behind, leads, wins, loses, ahead) in BENCHMARKS.md outside its generated
sections, README.md, CHANGELOG.md, docs/ and the comments and docstrings of the modules that state the defaults is
either quoted (describing the rule), or follows a figure `d ± s` of its sentence (or table row) that is a validation
loss a grid section holds with that verdict, or one of the non-comparative uses listed below. Wherever a figure is
followed by a verdict ('d ± s tie', 'd ± s, a tie', 'd ± s worse'), the verdict is the section's for that figure. The
Conclusions of BENCHMARKS.md keep a quality row only where its grid paired at least five seeds."""

import ast
import io
import json
import re
import tokenize

import pytest
from helpers.common import ROOT

from adaptive_ds.tools.report import section_stem

BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()
SECTION = re.compile(r"^<!-- ([\w:.+-]+) -->\n(.*?)\n<!-- /\1 -->$", flags=re.S | re.M)
SECTIONS = dict(SECTION.findall(BENCHMARKS))
# The nine verdict words and their other forms ("beat", "won", "lost to", "worst", "outperforms", "trails"), each
# with the verdict it states about the sentence's subject ("lose" and "lost" only with "to": a run loses steps, a
# node is lost).
FORMS = {"better": r"better", "worse": r"worse|worst", "beats": r"beat|beats|beating|beaten",
         "best": r"best", "behind": r"behind|trails|trailing", "leads": r"leads|leading|led",
         "wins": r"wins?|winning|winners?|won|outperform(?:s|ed|ing)?", "loses": r"loses|(?:lose|lost|losing) to",
         "ahead": r"ahead"}
WORDS = tuple(FORMS)
WORD = re.compile(rf"\b({'|'.join(FORMS.values())})\b", flags=re.I)
_BETTER = ("better", "beats", "best", "leads", "wins", "ahead")


def _means(word: str) -> str:
    """The verdict a verdict word's form states: 'better' or 'worse'."""
    form = next(name for name, pattern in FORMS.items() if re.fullmatch(pattern, word, flags=re.I))
    return "better" if form in _BETTER else "worse"

FIGURE = re.compile(r"(?<![\w.])([+-]\d+\.\d+ ± \d+\.\d+)")
# a figure and the verdict written right after it: "+0.0234 ± 0.0024 worse", "-0.0968 ± 0.0339, a tie"
FIGURE_VERDICT = re.compile(FIGURE.pattern + r"(?:,\s*a)?\s+(tie|better|worse)\b")
# The Conclusions keep the rows of grids that paired at least this many seeds; the other grids are exploratory.
HEADLINE_SEEDS = 5
# Text and the modules whose comments and docstrings state what the defaults are and why.
PAGES = ["README.md", "CHANGELOG.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
MODULES = ["adaptive_ds/presets.py", "adaptive_ds/models/configuration.py", "adaptive_ds/models/defaults.py"]

# Uses of a verdict word that compare nothing measured, each with why (a phrase that no longer occurs fails).
NOT_COMPARATIVE = [
    ("BENCHMARKS.md", "the report behind section", "which file a section comes from"),
    ("CHANGELOG.md", "The measured evidence behind a changed default", "what stands behind: a location"),
    ("docs/architectures.md", "needs no look-ahead", "a routing rule's look-ahead"),
    ("docs/controller.md", "validation loss not better by `min_improvement`", "the plateau rule's condition"),
    ("docs/data.md", "each preparing up to 4 steps ahead", "a data loader's prefetch"),
    ("docs/data.md", "too large to tokenize ahead", "tokenizing before training"),
    ("docs/training.md", "A restart loses the steps since the last checkpoint", "what a restart costs"),
    ("docs/architectures.md", "earlier tokens win", "which token DeepSpeed's capacity rule keeps"),
    ("adaptive_ds/presets.py", "win over both", "which setting takes precedence"),
]


def _blank(text: str, pattern: str, flags: int = re.S | re.M) -> str:
    return re.sub(pattern, lambda m: "\n" * m.group(0).count("\n"), text, flags=flags)


def _prose(text: str) -> str:
    """A page without its generated sections and fenced code."""
    return _blank(_blank(text, SECTION.pattern), r"^```.*?^```")


def _comments_and_docstrings(source: str) -> str:
    """A module's comments (each run of comment lines a paragraph) and docstrings, as text."""
    lines: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines[tok.start[0]] = tok.string.lstrip("#").strip()
    runs, last = [], -1
    for number in sorted(lines):
        runs.append(("\n" if number == last + 1 else "\n\n") + lines[number])
        last = number
    docstrings = [ast.get_docstring(node) or "" for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return "".join(runs) + "\n\n" + "\n\n".join(docstrings)


def _units(text: str) -> list[str]:
    """The sentences of `text` (a paragraph's lines joined, a list item or a heading starting afresh) and its table
    rows, each one unit."""
    units, paragraph = [], []

    def flush():
        joined = " ".join(paragraph)
        units.extend(s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z*(\[`'\"])", joined) if s)
        paragraph.clear()

    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("|") or re.match(r"(?:[-*]|\d+\.)\s|#", line):
            flush()
        if line.startswith("|"):
            units.append(line)
        elif line:
            paragraph.append(line)
    flush()
    return units


def _cells(sections: dict[str, str]) -> dict[str, list[dict]]:
    """Each grid section's judged validation losses, from its report: the figure as the section writes it, the
    verdict and the seeds paired, with the report's seeds."""
    cells = {}
    for key in (k for k in sections if k.startswith("grid:")):
        report = json.loads((ROOT / "benchmarks" / f"{section_stem(key)}.json").read_text())
        judged = [*(c["validation_loss"] for c in report["comparisons"].values()),
                  *(p["validation_loss"] for p in report.get("pairs") or [] if not p.get("missing"))]
        cells[key] = [{"figure": f"{d['difference']:+.4f} ± {d['sd']:.4f}", "verdict": d["verdict"], "n": d["n"],
                       "seeds": len(report["seeds"])} for d in judged if d.get("p") is not None]
    return cells


CELLS = _cells(SECTIONS)


def _cited(unit: str, cells: dict[str, list[dict]]) -> list[str]:
    """The grid sections a unit cites by key (every grid section where it cites none)."""
    keys = [key for key in cells if re.search(rf"(?<![\w:-]){re.escape(key)}(?![\w:-])", unit)]
    return keys or list(cells)


def _backs(figure: str, verdict: str, keys: list[str], cells: dict[str, list[dict]]) -> str | None:
    """Why `figure` does not carry `verdict` in the sections `keys`, or None where it does."""
    found = [c for key in keys for c in cells[key] if c["figure"] == figure]
    if not found:
        return f"{figure} is no judged validation loss of {keys if len(keys) < 4 else 'any grid section'}"
    if {c["verdict"] for c in found} != {verdict}:
        return f"{figure} is {sorted({c['verdict'] for c in found})} in its section, not {verdict}"
    return None


def _allowed(unit: str, start: int, where: str) -> bool:
    for path, phrase, _ in NOT_COMPARATIVE:
        if path == where:
            for found in re.finditer(re.escape(phrase), unit):
                if found.start() <= start < found.end():
                    return True
    return False


def _problems(text: str, where: str, cells: dict[str, list[dict]] = CELLS) -> list[str]:
    """Each verdict word of `text` that is neither quoted, nor backed by the figure before it, nor allowed; and each
    figure followed by a verdict that is not its section's."""
    problems = []
    for unit in _units(text):
        keys, judged, spent = _cited(unit, cells), set(), set()
        for match in FIGURE_VERDICT.finditer(unit):
            judged.add(match.start(2))
            spent.add(match.start(1))
            if why := _backs(match.group(1), match.group(2), keys, cells):
                problems.append(f"{where}: {why}: {unit[:100]}")
        for match in WORD.finditer(unit):
            word, start = match.group(1).lower(), match.start()
            before, after = unit[start - 1:start], unit[match.end():match.end() + 1]
            quoted = before and before in "'\"`" and after == before
            if start in judged or quoted or _allowed(unit, start, where):
                continue
            figures = list(FIGURE.finditer(unit[:start]))
            if figures and figures[-1].start() in spent:  # one figure backs one word: the next needs its own
                why = "its figure already backs an earlier verdict word"
            else:
                why = (_backs(figures[-1].group(1), _means(word), keys, cells) if figures
                       else "no figure d ± s before it")
                spent.update([figures[-1].start()] if figures else [])
            if why:
                problems.append(f"{where}: '{match.group(1)}': {why}: {unit[:100]}")
    return problems


def _texts() -> dict[str, str]:
    texts = {"BENCHMARKS.md": _prose(BENCHMARKS)}
    texts.update({path: _prose((ROOT / path).read_text()) for path in PAGES})
    texts.update({path: _comments_and_docstrings((ROOT / path).read_text()) for path in MODULES})
    return texts


def test_every_verdict_word_comes_from_a_test():
    problems = [p for where, text in _texts().items() for p in _problems(text, where)]
    assert problems == [], ("cite the validation loss whose test gives the verdict, right before the word, or state "
                            "the figures without one")


def test_every_allowed_use_still_occurs():
    texts = {where: " ".join(_units(text)) for where, text in _texts().items()}
    stale = [(path, phrase) for path, phrase, _ in NOT_COMPARATIVE if phrase not in texts[path]]
    assert stale == [], "remove these from NOT_COMPARATIVE"


TWO_M = "grid:debug:embedded-hard:2m-vs-iso-dense"


@pytest.mark.parametrize("text", [
    "MoD beats dense at equal FLOPs.",  # no figure
    f"MoD is better than dense (-0.0620 ± 0.0110, section `{TWO_M}`).",  # the figure after the word
    "At equal seconds mod is -0.0727 ± 0.0063 better.",  # a train loss: descriptive, no test
    "On 500k tokens MoD is -0.0968 ± 0.0339 better than dense on its FLOPs.",  # a tie there
    f"At 2M MoD is below dense on its FLOPs: -0.0620 ± 0.0110 better (section `{TWO_M}`).",  # a tie there
    "| mod | 2M | -0.0620 ± 0.0110 better | [`grid:debug:embedded-hard:2m-vs-iso-dense`](#x) |",
    "Dense from scratch ties dense continued (-0.0199 ± 0.0006, a tie; `grid:debug:embedded-hard:continuation`).",
    "The hybrid is behind mod alone on the same FLOPs (1.6936 ± 0.0144 against 1.6750 ± 0.0093).",
    "MoD beat dense.", "MoD won at 2M.", "Dense lost to MoD.", "The hybrid is the worst model.",
    "MoD outperforms dense.", "The hybrid trails dense.",  # other forms of the words
    "Upcycled MoE is +0.0234 ± 0.0024 worse (section `grid:debug:embedded-hard:qwen-continuation`); on the other "
    "base it is worse too.",  # one figure, two words
])
def test_an_unbacked_or_contradicted_verdict_is_named(text):
    assert len(_problems(text, "synthetic")) == 1, text


@pytest.mark.parametrize("text", [
    f"At 2M tokens MoD is below dense on its FLOPs: -0.0620 ± 0.0110, a tie (section `{TWO_M}`).",
    "Dense from scratch is -0.0199 ± 0.0006 better than dense continued (`grid:debug:embedded-hard:continuation`).",
    "A verdict is 'better' or 'worse' only where the test says so.",
    "| mod | 500k | -0.0968 ± 0.0339 tie | [`grid:debug:embedded-hard:active-flops-vs-iso-dense`](#x) |",
    "Upcycled MoE ends above dense continued, +0.0234 ± 0.0024 worse.",
])
def test_a_backed_or_quoted_verdict_passes(text):
    assert _problems(text, "synthetic") == []


def test_a_section_cited_by_key_decides_which_figure_is_meant():
    """+0.0257 ± 0.0074 is mod:paper at equal tokens in two grids, a tie in both; cited with another section's
    key, the figure is not found."""
    assert _problems("mod:paper at equal tokens: +0.0257 ± 0.0074, a tie.", "synthetic") == []
    cited = "mod:paper at equal tokens: +0.0257 ± 0.0074, a tie (section `grid:debug:embedded-hard:wall-clock`)."
    assert len(_problems(cited, "synthetic")) == 1


def _conclusion_rows(text: str) -> list[str]:
    conclusions = text.split("\n## Conclusions\n")[1].split("\n## ")[0]
    return [line for line in conclusions.splitlines() if line.startswith("| ") and "](#" in line]


def _headline_problems(text: str, cells: dict[str, list[dict]] = CELLS) -> list[str]:
    """Quality rows of the Conclusions whose grid paired fewer than HEADLINE_SEEDS seeds (its report's seeds and the
    row's comparison both count), or whose seeds column is not the comparison's."""
    problems = []
    for row in _conclusion_rows(text):
        keys = [key for key in cells if f"[`{key}`]" in row]
        for figure in FIGURE.findall(row) if keys else []:
            found = [c for key in keys for c in cells[key] if c["figure"] == figure]
            if not found or min(min(c["n"], c["seeds"]) for c in found) < HEADLINE_SEEDS:
                problems.append(f"{figure} of {keys}: fewer than {HEADLINE_SEEDS} seeds (exploratory): {row[:80]}")
            elif (shown := re.search(r"\| (\d+) paired \|", row)) and int(shown.group(1)) != found[0]["n"]:
                problems.append(f"{figure} of {keys}: {found[0]['n']} paired, not {shown.group(1)}: {row[:80]}")
    return problems


def test_each_conclusion_rows_verdict_is_its_sections():
    rows = [row for row in _conclusion_rows(BENCHMARKS) if FIGURE_VERDICT.search(row)]
    assert rows and _problems("\n".join(rows), "BENCHMARKS.md") == []


def test_the_conclusions_quality_rows_have_at_least_five_seeds():
    assert _headline_problems(BENCHMARKS) == []


def _conclusions_with(row: str) -> str:
    return f"# B\n\n## Conclusions\n\n| a | b | section |\n|---|---|---|\n{row}\n\n## Evidence\n"


def test_a_flipped_verdict_or_a_three_seed_row_in_the_conclusions_fails():
    key = "grid:debug:embedded-hard:2m-hybrid-paper-vs-iso-dense"
    row = f"| hybrid:paper | 2M | +0.0161 ± 0.0033 tie | [`{key}`](#x) |"
    assert _problems(row, "BENCHMARKS.md") == []
    assert len(_problems(row.replace("tie", "worse"), "BENCHMARKS.md")) == 1
    three = json.loads((ROOT / "benchmarks" / f"{section_stem(key)}.json").read_text())["seeds"]
    assert len(three) == 3 and len(_headline_problems(_conclusions_with(row))) == 1
    five = {key: [dict(c, n=5, seeds=5) for c in CELLS[key]]}
    assert _headline_problems(_conclusions_with(row), five) == []
    assert len(_headline_problems(_conclusions_with(row.replace(" | [", " | 3 paired | [")), five)) == 1
