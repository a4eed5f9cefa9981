"""bench's HTML report: the app renders it (plotly) in a process of its own from the JSON bench
wrote, so the engine imports neither; what it needs is checked before a run, in one line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from cli_run import FAST, run, shared_engines, write_jsonl  # noqa: F401  (shared_engines: autouse)

from dflash_core import bench
from dflash_core.errors import DFlashError


def test_bench_scoreboard_json_html_and_readme(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One tiny real run writes all three outputs; the HTML opens offline and names every method."""
    from plotly.offline import get_plotlyjs

    from app import bench_report

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Name a colour."}, {"prompt": "Count to five."}])
    readme = tmp_path / "README.md"
    readme.write_text("# R\n\n<!-- bench:start -->\nplaceholder\n<!-- bench:end -->\n\ntail\n")
    argv = ["bench", "--set", str(prompts), "--max-new-tokens", "16", "--warmup", "0", "--methods", "plain,dflash-b4",
            "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"), "--readme", str(readme),
            "--device", "cpu", "--no-progress"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    s = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert s["methods"] == ["plain", "dflash-b4"] and s["primary"] == "dflash-b4" and s["block_size"] == 4
    assert s["command"] == "python -m dflash_core bench " + " ".join(argv[1:])
    d, p = s["per_method"]["dflash-b4"], s["per_method"]["plain"]
    assert len(d["tau_hist"]) == 4 and d["tau"] == pytest.approx(
        sum((k + 1) * c for k, c in enumerate(d["tau_hist"])) / sum(d["tau_hist"]))
    # Every committed token is the prefill's (one per prompt) or a block's; blocks may overshoot the cut.
    assert sum((k + 1) * c for k, c in enumerate(d["tau_hist"])) + 2 >= d["tokens"] == p["tokens"] > 0
    assert d["exact_matches"] == p["exact_matches"] == 2 and s["mismatches"] == 0
    assert p["step_ms"] > 0 and d["verify_ms_per_block"] > 0 and d["draft_ms_per_block"] > 0
    assert d["bound"] == pytest.approx(d["tau"] * p["step_ms"] / (d["verify_ms_per_block"] + d["draft_ms_per_block"]))
    assert d["achieved"] == pytest.approx(d["speedup"] / d["bound"])
    assert "dflash-b4" in out and "bound" in out

    html = (tmp_path / "r.html").read_text()
    assert get_plotlyjs() in html  # plotly.js inlined, whole
    page = html.replace(get_plotlyjs(), "")  # the bundle's own code mentions URLs; the page must fetch none
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|(?:src|href)=[\"']?(?:https?:)?//", page, re.IGNORECASE)
    assert page.count('class="plotly-graph-div"') == 4
    for name in ("plain", "dflash-b4", "τ histogram", "Achieved vs bound", s["command"]):
        assert name in html, name

    text = readme.read_text()
    assert "placeholder" not in text and text.startswith("# R\n\n<!-- bench:start -->\n") and text.endswith("tail\n")
    assert "| `dflash-b4` |" in text and s["command"] in text and s["date"] in text

    # The same HTML again from the JSON alone (e.g. one that came back from a GPU run).
    assert bench_report.main([str(tmp_path / "r.json"), "--html", str(tmp_path / "again.html")]) == 0
    again = (tmp_path / "again.html").read_text()
    assert again.count('class="plotly-graph-div"') == 4 and "dflash-b4" in again


@pytest.mark.parametrize(("missing", "message"), [("app", "app/ package"), ("plotly", "pip install plotly")])
def test_bench_html_without_its_modules_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, missing: str, message: str) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # the package is now not found
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    rc, _, err = run(capsys, "bench", "--set", str(prompts), "--json", str(tmp_path / "r.json"),
                     "--html", str(tmp_path / "r.html"), *FAST)
    assert rc == 2 and err.startswith("error: --html needs") and message in err and err.count("\n") == 1
    assert not (tmp_path / "r.json").exists()


def test_bench_html_render_failure_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DFlashError, match=r"^--html: rendering .*missing.json failed \(error: .*\); the JSON"):
        bench.html_renderer().render(tmp_path / "missing.json", tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_engine_package_imports_neither_plotly_nor_the_app() -> None:
    """The app renders bench's HTML in a process of its own: no engine file imports it, and
    importing the engine loads neither it nor plotly."""
    import subprocess

    engine_files = sorted((Path(__file__).resolve().parent.parent / "dflash_core").rglob("*.py"))
    assert len(engine_files) > 30
    importers = [p.name for p in engine_files
                 if re.search(r"^\s*(from|import)\s+(app|plotly|gradio)\b", p.read_text(), re.MULTILINE)]
    assert importers == []
    code = ("import sys, dflash_core, dflash_core.bench, dflash_core.bench_stats, dflash_core.__main__, "
            "dflash_core.export, dflash_core.train.run; print('plotly' in sys.modules, 'app' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False False"




def test_bench_with_pinned_costs_sizes_blocks_from_the_reference_table(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--pinned-costs: blocks and trees sized from the reference table (not this machine's) on a
    fixed thread count, so two runs verify the same blocks; the report and the table say so."""
    from dflash_core.engine import Engine
    from dflash_core.verify_length import REFERENCE_CPU_COSTS

    monkeypatch.setattr(Engine, "pinned_costs", Engine.pinned_costs)  # restored after the test
    monkeypatch.setattr(Engine, "fit_threads", Engine.fit_threads)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "List the days of the week."}])
    hists = []
    for k in range(2):
        argv = ["bench", "--set", str(prompts), "--max-new-tokens", "40", "--warmup", "0", "--pinned-costs",
                "--methods", "plain,dflash-b16-tree-lookup", "--json", str(tmp_path / f"r{k}.json"), "--device",
                "cpu", "--no-progress"]
        rc, out, err = run(capsys, *argv)
        assert rc == 0, err
        assert Engine.pinned_costs is REFERENCE_CPU_COSTS and Engine.fit_threads is False
        s = json.loads((tmp_path / f"r{k}.json").read_text())["summary"]
        assert s["pass_costs"].startswith("pinned") and "pass costs pinned" in out and s["mismatches"] == 0
        hists.append(s["per_method"]["dflash-b16-tree-lookup"]["tau_hist"])
    assert hists[0] == hists[1] and sum(hists[0]) > 1
