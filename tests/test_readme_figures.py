"""README.md's figures are what the code gives: scripts/measure.py measures them, these tests compare.

Each measurement group runs once, in its own process (`scripts/measure.py --group G`), against the
firmware `make firmware` built; a disagreement names the figure, the README's text and the measured
one. `make measure` prints the figures, `scripts/measure.py --write-readme` puts them into README.md.
Every other number in README.md must be accounted for in measure.NOT_MEASURED (a design constant, or a
wall-clock timing labelled as such), so a new figure cannot slip in unmeasured.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.build import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import measure  # noqa: E402

README = (ROOT / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.cross
@pytest.mark.qemu
@pytest.mark.parametrize("group", measure.GROUPS)
def test_readme_figures_match_the_code(group: str, tmp_path: Path) -> None:
    out = tmp_path / f"{group}.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "measure.py"), "--group", group, "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = {k: measure.Figure(**v) for k, v in json.loads(out.read_text()).items()}
    assert figures and all(measure.group_of(k) == group for k in figures), sorted(figures)
    problems = measure.disagreements(README, figures) + [
        f"{k}: shown in README.md, not measured" for k in measure.unknown_keys(README, figures, [group])]
    assert not problems, "README.md disagrees with scripts/measure.py (run it with --write-readme):\n" + \
        "\n".join(problems)


def test_every_readme_number_is_measured_or_explained() -> None:
    shown = measure.readme_figures(README)
    assert len(shown) >= 40, "the README's figures are no longer marked"
    assert not [k for k in shown if measure.group_of(k) is None], "a marked key no group measures"
    assert measure.unaccounted_numbers(README) == []
    assert measure.unused_not_measured(README) == [], "stale NOT_MEASURED entries"


def test_a_drifted_figure_is_caught_and_rewritten() -> None:
    """The comparison fails on a changed figure, in prose and in a code block, and --write-readme's
    rewrite puts the measured text back."""
    figures = {k: measure.Figure(k, texts[0], "as shown") for k, texts in measure.readme_figures(README).items()}
    assert measure.disagreements(README, figures) == []
    arena = figures["quickstart.arena.host"].text  # e.g. 21,400: in the table
    raw = figures["quickstart.arena.host.raw"].text  # 21400: in the MicroPython transcript
    drifted = README.replace(f"<!--m:quickstart.arena.host-->{arena}<!--/m-->",
                             "<!--m:quickstart.arena.host-->21,376<!--/m-->", 1)
    drifted = drifted.replace(f"arena_size={raw}>", "arena_size=21376>", 1)
    assert drifted.count("21,376") == 1 and drifted.count("arena_size=21376>") == 1
    problems = measure.disagreements(drifted, figures)
    assert len(problems) == 2 and all("quickstart.arena.host" in p for p in problems), problems
    assert measure.rewrite(drifted, figures) == README
    assert measure.unaccounted_numbers(README.replace("Debian 12", "Debian 12 with 4 GB")) != []
