"""The app in a real browser: headless Debian chromium driven by Playwright.

Serves the app with the real embedded engine on a free port, types a prompt, presses Send and
checks what a visitor sees: the reply, coloured token spans, the plotly charts (acceptance by
position and the block's tree among them), a click on a block's bar picking the tree shown, a
stepped block and the "How it works" tab with its tree picture. Screenshots go to artifacts/
(git-ignored) for a human look.

Needs /usr/bin/chromium (`apt-get install chromium`; scripts/setup.sh --test does it as root)
and the `playwright` package (no `playwright install`: the system browser is used).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import serve_app

from dflash_core.engine import Engine
from dflash_core.verify_length import PassCosts, VerifyCost

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no network calls from a test

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PROMPT = "Write a Python function that adds two numbers."
MAX_NEW = 16  # enough for several blocks, little enough for a few seconds on CPU
TIMEOUT_MS = 240_000  # a ceiling for a loaded 2-core machine, not a performance claim

if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)) and not shutil.which("chromium"):
    pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(app_engine: Any) -> Iterator[str]:
    with serve_app(app_engine) as url:
        yield url


@pytest.fixture(scope="module")
def page(url: str) -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        executable = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1500, "height": 1300})
            pg.set_default_timeout(TIMEOUT_MS)
            pg.goto(url)
            yield pg
        finally:
            browser.close()


def set_number(page: Any, label: str, value: int) -> None:
    box = page.locator(f'input[aria-label="number input for {label}"]')
    box.fill(str(value))
    box.press("Enter")  # gradio reads the slider's number box on change/blur


def test_send_shows_coloured_tokens_charts_and_a_finished_reply(page: Any) -> None:
    page.wait_for_selector("#prompt textarea")
    set_number(page, "block size", 4)
    set_number(page, "max new tokens", MAX_NEW)
    page.locator("#prompt textarea").fill(PROMPT)
    page.get_by_role("button", name="Send", exact=True).click()
    page.wait_for_function("document.querySelector('#stats-line')?.innerText.includes('finished:')",
                           timeout=TIMEOUT_MS)

    stats = page.locator("#stats-line").inner_text()
    assert "finished: length" in stats and f"{MAX_NEW} tokens" in stats
    bot = page.locator("#chatbot")
    assert PROMPT in bot.inner_text()
    assert page.locator("#chatbot .message, #chatbot [data-testid='bot']").count() >= 1

    tokens = page.locator("#spec-view .spec-tokens .tok")
    classes = tokens.evaluate_all("els => els.map(e => e.className)")
    kinds = {k for c in classes for k in ("tok-accepted", "tok-target", "tok-rejected") if k in c.split()}
    # Every block ends in a target token, and some draft is shown (accepted, or struck out where a
    # block checked more than it kept: how many a tree checks follows the pass costs, so a short
    # reply's blocks may keep all they checked; test_render.py checks the struck-out spans).
    assert "tok-target" in kinds and kinds & {"tok-accepted", "tok-rejected"}
    assert all(any(k in c.split() for k in ("tok-accepted", "tok-target", "tok-rejected")) for c in classes)
    # The legend shows all three colours, and the style sheet really colours them differently.
    legend = page.locator("#spec-view .spec-legend .tok")
    assert legend.count() == 3
    colours = legend.evaluate_all(
        "els => els.map(e => getComputedStyle(e).backgroundColor + ' ' + getComputedStyle(e).color)")
    assert len(set(colours)) == 3
    rejected = page.locator("#spec-view .spec-legend .tok-rejected").first
    assert "line-through" in rejected.evaluate("e => getComputedStyle(e).textDecorationLine")

    charts = ["#heatmap", "#speed", "#acceptance", "#position-chart", "#tree-view"]
    page.wait_for_function(f"{charts!r}.every(c => document.querySelector(c + ' .js-plotly-plot'))",
                           timeout=TIMEOUT_MS)
    titles = {c: title(page, c) for c in charts}
    assert "Denoising · block" in titles["#heatmap"] and "DFlash" in titles["#speed"]
    assert "Acceptance per block" in titles["#acceptance"]
    assert "Acceptance by position" in titles["#position-chart"] and "τ =" in titles["#position-chart"]
    # One bar per draft position 1..B-1 (block size 4), read from the plotted figure itself.
    assert page.evaluate("document.querySelector('#position-chart .js-plotly-plot').data[0].x") == [1, 2, 3]

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser.png"), full_page=True)
    assert (ARTIFACTS / "browser.png").stat().st_size > 10_000
    page.locator("#position-chart").screenshot(path=str(ARTIFACTS / "browser_position.png"))


def title(page: Any, chart: str) -> str:
    return page.locator(f"{chart} .gtitle").first.text_content() or ""  # SVG: no innerText


def tree_nodes(page: Any) -> int:
    """Node markers drawn in the tree picture (the anchor and the probability labels' blank markers too)."""
    return page.locator("#tree-view .scatterlayer .trace .points path").count()


def test_the_tree_of_the_latest_block_and_of_a_clicked_one(page: Any) -> None:
    # Runs after the streamed reply: the tree shows its latest block; a bar click shows another.
    page.wait_for_function("!document.querySelector('#tree-block input[type=number]')?.disabled",
                           timeout=TIMEOUT_MS)
    latest = int(page.locator("#tree-block input[type=number]").input_value())
    assert title(page, "#tree-view").startswith(f"Block {latest} · a tree of")  # greedy on a CPU: trees
    assert tree_nodes(page) >= 3  # the anchor, at least one candidate, the target's own token
    legend = page.locator("#tree-view .legendtext").all_text_contents()
    assert "the target's own token" in legend and "drafter's top-k" in legend
    page.locator("#tree-view").screenshot(path=str(ARTIFACTS / "browser_tree.png"))

    # The "target token" bars (one token high, so never empty), x = block 1, 2, ...
    bars = page.locator("#acceptance .barlayer .trace").nth(1).locator(".point path")
    assert bars.count() >= 2
    bars.first.click(force=True)  # plotly picks the point under the mouse, whatever element is on top
    page.wait_for_function("document.querySelector('#tree-view .gtitle')?.textContent.startsWith('Block 1 ')",
                           timeout=TIMEOUT_MS)
    assert page.locator("#tree-block input[type=number]").input_value() == "1"
    page.locator("#tree-view").screenshot(path=str(ARTIFACTS / "browser_tree_picked.png"))


def test_next_block_and_how_it_works(page: Any) -> None:
    # Runs after the streamed reply on the same page: step a second prompt one block at a time.
    page.locator("#prompt textarea").fill("What is 2 + 2?")
    step = page.locator("#next-block")
    step.click()
    page.wait_for_function("document.querySelector('#step-panel')?.innerText.includes('for one target forward')",
                           timeout=TIMEOUT_MS)
    panel = page.locator("#step-panel")
    assert "Block 1" in panel.inner_text()
    assert panel.locator(".step-table td.verdict").count() >= 3  # one verdict cell per drafted position
    step.click()
    page.wait_for_function("document.querySelector('#step-panel')?.innerText.includes('Block 2')",
                           timeout=TIMEOUT_MS)
    assert "step mode: block 2 done" in page.locator("#stats-line").inner_text()
    page.wait_for_function("document.querySelector('#tree-view .gtitle')?.textContent.startsWith('Block 2 ')",
                           timeout=TIMEOUT_MS)  # the stepped block's candidates
    ARTIFACTS.mkdir(exist_ok=True)
    panel.screenshot(path=str(ARTIFACTS / "browser_step.png"))

    page.get_by_role("tab", name="How it works").click()
    teach = page.locator("#teach")
    teach.get_by_text("Your last reply, block by block").wait_for()
    text = teach.inner_text()
    assert "In block 1 the drafter proposed" in text and "committed for one target forward" in text
    assert "τ (tau)" in text and "identical" in text
    assert teach.locator(".tok-target").count() >= 1  # token chips survive the Markdown sanitiser
    # The tree, told on one of this reply's own tree blocks, with its picture.
    told = teach.locator("#teach-reply").inner_text()
    assert "A tree, on your block" in told and "candidates in one forward pass" in told
    block = told.split("A tree, on your block ", 1)[1].split()[0]
    page.wait_for_function(f"document.querySelector('#teach-tree .gtitle')?.textContent.startsWith('Block {block} ')",
                           timeout=TIMEOUT_MS)
    assert teach.locator("#teach-tree .scatterlayer .trace .points path").count() >= 3
    page.screenshot(path=str(ARTIFACTS / "browser_how.png"), full_page=True)
    teach.locator("#teach-tree").screenshot(path=str(ARTIFACTS / "browser_how_tree.png"))


# Every box's corners, for the overlap check below (SVG text has no layout of its own to ask).
LABEL_BOXES = """sel => [...document.querySelectorAll(sel)].filter(t => t.textContent.trim()).map(t => {
    const r = t.getBoundingClientRect(); return [t.textContent, r.left, r.top, r.right, r.bottom];
})"""


def test_a_tree_of_thirty_candidates_stays_readable(page: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pass that costs the same at any size: every tree takes its full 2B-1 = 31 candidates.
    flat = VerifyCost((1, 64), (60.0, 60.0))
    monkeypatch.setattr(Engine, "pinned_costs", PassCosts(chain=flat, tree=flat, draft_ms=8.0))
    page.get_by_role("tab", name="Studio").click()
    set_number(page, "block size", 16)
    page.get_by_role("radio", name="tree", exact=True).check()
    page.locator("#prompt textarea").fill("Repeat this list three times: apple, banana, cherry, apple, banana, cherry.")
    page.get_by_role("button", name="Send", exact=True).click()
    page.wait_for_function("document.querySelector('#stats-line')?.innerText.includes('finished:')",
                           timeout=TIMEOUT_MS)
    assert int(title(page, "#tree-view").split("a tree of ")[1].split()[0]) >= 30
    # Readable: no token label or probability overlaps another (a pixel of slack for antialiasing).
    boxes = page.evaluate(LABEL_BOXES, "#tree-view .scatterlayer .textpoint text")
    assert len(boxes) >= 60  # a token and a probability per candidate
    clashes = [(a[0], b[0]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
               if min(a[3], b[3]) - max(a[1], b[1]) > 1 and min(a[4], b[4]) - max(a[2], b[2]) > 1]
    assert not clashes
    page.locator("#tree-view").screenshot(path=str(ARTIFACTS / "browser_tree_large.png"))


def test_race_plain_decoding_shows_both_panes_side_by_side(page: Any) -> None:
    # Runs last on the same page: tick the one race switch and send a prompt.
    page.get_by_role("tab", name="Studio").click()
    set_number(page, "block size", 4)
    set_number(page, "max new tokens", MAX_NEW)
    page.locator("#race-switch input[type=checkbox]").check()
    page.locator("#prompt textarea").fill(PROMPT)
    page.get_by_role("button", name="Send", exact=True).click()
    page.wait_for_function("document.querySelector('#race-view .race-finish')?.innerText.includes('identical')",
                           timeout=TIMEOUT_MS)
    panes = {side: page.locator(f"#race-view [data-side={side}]") for side in ("dflash", "plain")}
    texts = {side: pane.locator(".race-text").inner_text() for side, pane in panes.items()}
    assert texts["dflash"].strip() and texts["dflash"] == texts["plain"]
    assert "DFlash" in panes["dflash"].locator(".race-head").inner_text()
    assert "tok/s" in panes["plain"].locator(".race-head").inner_text()
    assert "own engine clock" in page.locator("#race-view .race-note").inner_text()
    # Side by side: the plain pane sits right of the DFlash pane, on the same row.
    left, right = (panes[s].bounding_box() for s in ("dflash", "plain"))
    assert left is not None and right is not None
    assert right["x"] >= left["x"] + left["width"] - 1 and abs(right["y"] - left["y"]) < 2
    assert "speed-up" in title(page, "#speed")
    lines = page.evaluate("document.querySelector('#speed .js-plotly-plot').data.map(t => t.name)")
    assert lines == ["DFlash", "plain"]
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#race-view").screenshot(path=str(ARTIFACTS / "browser_race.png"))
    page.screenshot(path=str(ARTIFACTS / "browser_race_page.png"), full_page=True)
