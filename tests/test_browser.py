"""The app in a real browser: headless Debian chromium driven by Playwright.

Serves the app with the real embedded engine on a free port, types a prompt, presses Send and
checks what a visitor sees: the reply, coloured token spans, three plotly charts, a stepped
block and the "How it works" tab. Screenshots go to artifacts/ (git-ignored) for a human look.

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
    # The shipped drafter is weak (tau ~1.3): every short reply has target tokens and struck-out rejected drafts.
    assert {"tok-target", "tok-rejected"} <= kinds
    assert all(any(k in c.split() for k in ("tok-accepted", "tok-target", "tok-rejected")) for c in classes)
    # The legend shows all three colours, and the style sheet really colours them differently.
    legend = page.locator("#spec-view .spec-legend .tok")
    assert legend.count() == 3
    colours = legend.evaluate_all(
        "els => els.map(e => getComputedStyle(e).backgroundColor + ' ' + getComputedStyle(e).color)")
    assert len(set(colours)) == 3
    rejected = page.locator("#spec-view .spec-tokens .tok-rejected").first
    assert "line-through" in rejected.evaluate("e => getComputedStyle(e).textDecorationLine")

    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 3", timeout=TIMEOUT_MS)
    plots = page.locator(".js-plotly-plot")
    assert plots.count() == 3
    titles = " ".join(plots.nth(i).locator(".gtitle").text_content() or "" for i in range(3))  # SVG: no innerText
    assert "Denoising · block" in titles and "Acceptance per block" in titles and "DFlash" in titles

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser.png"), full_page=True)
    assert (ARTIFACTS / "browser.png").stat().st_size > 10_000


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
    ARTIFACTS.mkdir(exist_ok=True)
    panel.screenshot(path=str(ARTIFACTS / "browser_step.png"))

    page.get_by_role("tab", name="How it works").click()
    teach = page.locator("#teach")
    teach.get_by_text("Your last reply, block by block").wait_for()
    text = teach.inner_text()
    assert "In block 1 the drafter proposed" in text and "committed for one target forward" in text
    assert "τ (tau)" in text and "identical" in text
    assert teach.locator(".tok-target").count() >= 1  # token chips survive the Markdown sanitiser
    page.screenshot(path=str(ARTIFACTS / "browser_how.png"), full_page=True)
