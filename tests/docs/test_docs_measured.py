"""docs/measured.md is what the code gives: scripts/measure.py writes it, these tests hold it current.

Each measurement group is re-measured in its own process (`scripts/measure.py --group G --check`), against
the firmware `make firmware` built; a stale figure fails, naming the figure, the page's text and the
measured one. The fast tests check that the page is exactly the script's rendering of its own figures
(nobody edited it by hand) and that README.md's headline table quotes the page. After a change that
moves a figure, `scripts/measure.py --group G` rewrites that section (docs/testing.md).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.build import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import measure  # noqa: E402

PAGE = measure.PAGE.read_text()
README = measure.README.read_text()

# What each group needs beyond the host (the markers `make check` deselects by). Seconds per group on the
# loaded 2-core CI machine, one run (2026-12-02): routing 106, tiny_lm_engine 56, m7_tiny_lm 49, m7 43,
# random_q8 39, q4 31, budget 17, quantisation 16, riscv 15, tiny_lm 13, runner 11, smart_meter 9 (its
# training cached), quickstart 8, engine 4, tests 4, plan 0.4; the sixteen about 5 minutes on one worker.
_cross, _qemu, _slow = pytest.mark.cross, pytest.mark.qemu, pytest.mark.slow
GROUP_MARKS = {
    "engine": [_cross],
    "plan": [_cross],
    "runner": [_cross, _slow],
    "quickstart": [_cross, _qemu],
    "smart_meter": [_cross, _qemu, _slow],
    "m7": [_cross, _qemu, _slow],
    "m7_tiny_lm": [_cross, _qemu, _slow],
    "riscv": [_cross, _qemu, _slow],
    "aarch64_blocks": [_cross, _qemu, _slow],
    "host_bounds": [_slow],  # valgrind, two library builds: about a minute
    "quantisation": [_slow],
    "random_q8": [_slow],
    "routing": [_slow],
    "q4": [_slow],
    "budget": [_slow],
    "tiny_lm": [_slow],
    "tiny_lm_engine": [_slow],
}


@pytest.mark.parametrize("group", [pytest.param(g, marks=GROUP_MARKS.get(g, [])) for g in measure.GROUPS])
def test_measured_page_is_current(group: str, tmp_path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "measure.py"), "--group", group, "--check",
                        "--json", str(tmp_path / f"{group}.json")], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (f"docs/measured.md is stale for group {group} "
                               f"(scripts/measure.py --group {group} rewrites it):\n" + r.stderr[-4000:])


def test_the_page_is_the_scripts_rendering() -> None:
    """Every group has its section, in order, with the script's title and description, and nothing was
    edited by hand: rendering the page's own figures gives the page back."""
    page = measure.parse_page(PAGE)
    assert list(page) == list(measure.GROUPS)
    assert all(page[g] for g in page), [g for g in page if not page[g]]
    assert measure.render_page(page) == PAGE


def test_readme_headline_quotes_the_page() -> None:
    figures = measure.page_figures(PAGE)
    keys = {k for _, template in measure.HEADLINE for k in measure.QUOTE.findall(template)}
    assert keys <= set(figures), f"headline keys not on docs/measured.md: {sorted(keys - set(figures))}"
    assert measure.headline_block(README) == measure.render_headline(figures), \
        "README.md's headline table is not docs/measured.md's (scripts/measure.py rewrites it)"


def test_a_stale_figure_is_caught_and_rewritten() -> None:
    """A figure that moved, one that is new, one that is gone and a tolerated drift on a trained figure."""
    page = measure.parse_page(PAGE)
    group = "engine"
    shown = page[group]
    text = shown[0].text
    moved = measure.Figure(shown[0].key, f"{int(text.replace(',', '')) + 4:,}", shown[0].what)
    measured = [moved, *shown[1:], measure.Figure("engine.new", "1", "a figure the page lacks")]
    problems = measure.stale(page, group, measured)
    assert len(problems) == 2, problems
    assert f"the page says {text!r}" in problems[0] and "engine.new" in problems[1]
    assert [f.text for f in measure.merged(page, group, measured)] == [moved.text, *(f.text for f in shown[1:]), "1"]
    assert any("measured by no one" in p for p in measure.stale(page, group, shown[1:]))

    trained = measure.Figure("meter.mae.moe", "496", "MAE", 496, rel_tol=0.03)
    within = {"smart_meter": [measure.Figure("meter.mae.moe", "505", "MAE")]}
    assert measure.stale(within, "smart_meter", [trained]) == []
    assert measure.merged(within, "smart_meter", [trained])[0].text == "505"  # the page's text is kept
    beyond = {"smart_meter": [measure.Figure("meter.mae.moe", "520", "MAE")]}
    assert measure.stale(beyond, "smart_meter", [trained])


def test_prose_edits_are_caught() -> None:
    """Only the script writes the page: an edit outside the figures does not survive its rendering."""
    edited = PAGE.replace("| key | figure | what |", "| key | figure | what it is |", 1)
    assert edited != PAGE and measure.render_page(measure.parse_page(edited)) == PAGE
