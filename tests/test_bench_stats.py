"""The benchmark's arithmetic on hand-made results: method names, τ histogram, medians, the bound,
the tables and the README region. No model is loaded here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_core import bench, bench_stats
from dflash_core.bench_stats import MethodSpec, RunResult
from dflash_core.errors import DFlashError

PROMPTS = [["p1"], ["p2"], ["p3"]]
PLAIN = MethodSpec("plain", "plain")
B4 = MethodSpec("dflash-b4", "dflash", block_size=4, steps=1)
HF = MethodSpec("hf-generate", "hf-generate")


def hand_made() -> list[dict[str, RunResult]]:
    """Plain: 10 tokens in 1.0 s, 7 timed steps of 100 ms (t1). DFlash-b4: the same tokens in
    0.29 s, 4 blocks accepting 3, 1, 0, 3 (τ = 11/4), 10 ms draft + 100 ms verify per block.
    hf-generate: differs from plain on prompt 2."""
    ids = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    plain = [RunResult(ids[0], 0.4, blocks=3, verify_s=0.3), RunResult(ids[1], 0.2, blocks=1, verify_s=0.1),
             RunResult(ids[2], 0.4, blocks=3, verify_s=0.3)]
    b4 = [RunResult(ids[0], 0.2, tau=4.0, blocks=1, accepted=[3], draft_s=0.01, verify_s=0.1),
          RunResult(ids[1], 0.05, tau=2.0, blocks=1, accepted=[1], draft_s=0.01, verify_s=0.1),
          RunResult(ids[2], 0.04, tau=2.5, blocks=2, accepted=[0, 3], draft_s=0.02, verify_s=0.2)]
    hf = [RunResult(ids[0], 0.5), RunResult([5, 9], 0.5), RunResult(ids[2], 0.5)]
    return [{"plain": p, "dflash-b4": d, "hf-generate": h} for p, d, h in zip(plain, b4, hf, strict=True)]


def full_summary(methods: list[MethodSpec] | None = None) -> tuple[dict, list[dict]]:
    methods = methods or [PLAIN, B4, HF]
    primary = next(m.name for m in methods if m.kind == "dflash")
    summary, rows = bench_stats.summarize(PROMPTS, hand_made(), methods, primary=primary)
    summary.update({"target": "t", "draft": "d", "device": "cpu", "dtype": "float32", "block_size": 4, "steps": 1,
                    "temperature": 0.0, "max_new_tokens": 4, "cpu": "Test CPU", "torch_threads": 1,
                    "date": "2026-01-02T03:04:05+00:00", "prompt_set": "humaneval",
                    "command": "python -m dflash_core bench --set humaneval --methods plain,dflash-b4,hf-generate"})
    return summary, rows


# ----- method names -----

def test_all_expands_to_the_scoreboard() -> None:
    specs = bench_stats.parse_methods("all")
    assert tuple(s.name for s in specs) == bench_stats.ALL_METHODS
    by_name = {s.name: s for s in specs}
    assert by_name["dflash-b16-s2"] == MethodSpec("dflash-b16-s2", "dflash", block_size=16, steps=2)
    assert by_name["dflash-b8"] == MethodSpec("dflash-b8", "dflash", block_size=8, steps=1)
    assert by_name["prompt-lookup"].kind == "prompt-lookup" and by_name["plain"].kind == "plain"
    assert bench_stats.parse_method("dflash") == MethodSpec("dflash", "dflash")  # the run's own settings
    assert by_name["dflash-b16-full"] == MethodSpec("dflash-b16-full", "dflash", block_size=16, steps=1,
                                                    verify="full")
    assert bench_stats.parse_method("dflash-b4-s2-adaptive").verify == "adaptive"
    assert bench_stats.parse_method("dflash-b16-tree").verify == "tree"
    assert bench_stats.parse_method("dflash-b16-tree-full").verify == "tree-full"
    # A tree method names its candidates: the drafter alone, or with prompt-lookup guesses.
    assert bench_stats.parse_method("dflash-b16-tree").lookup is False
    assert bench_stats.parse_method("dflash-b16-tree-lookup").lookup is True
    assert bench_stats.parse_method("dflash-b8-tree-full-lookup").verify == "tree-full"
    assert bench_stats.parse_method("dflash-b16-adaptive").lookup is None
    with pytest.raises(DFlashError, match="adds candidates to a tree"):
        bench_stats.parse_method("dflash-b16-adaptive-lookup")
    with pytest.raises(DFlashError):
        bench_stats.parse_method("dflash-b16-forest")
    assert by_name["dflash-b8"].verify is None  # the run's --verify


def test_method_lists_tolerate_spaces_and_trailing_commas() -> None:
    assert [s.name for s in bench_stats.parse_methods(" plain , dflash-b4-s3,")] == ["plain", "dflash-b4-s3"]
    assert [s.name for s in bench_stats.parse_methods(["hf-generate", "dflash"])] == ["hf-generate", "dflash"]


@pytest.mark.parametrize(("text", "message"), [
    ("plain,magic,dflash,wizard", r"unknown bench method\(s\) \['magic', 'wizard'\]"),
    ("dflash-b1", "block size must be 2..32"),
    ("dflash-b64", "block size must be 2..32"),
    ("dflash-b04", "unknown bench method"),
    ("dflash-b4-s0", "unknown bench method"),
    ("dflash-s2", "unknown bench method"),
    ("dflash-b4-sometimes", "unknown bench method"),
    ("dflash-b4-full-s2", "unknown bench method"),
    ("plain,all", r"\['plain'\] given twice"),
    (" , ", "no bench methods"),
])
def test_bad_method_names(text: str, message: str) -> None:
    with pytest.raises(DFlashError, match=message):
        bench_stats.parse_methods(text)


# ----- statistics -----

def test_histogram_counts_accepted_lengths() -> None:
    assert bench_stats.accept_histogram([0, 3, 3, 1], 4) == [1, 1, 0, 2]
    with pytest.raises(ValueError, match=r"outside 0\.\.3"):
        bench_stats.accept_histogram([4], 4)


def test_bound_formula() -> None:
    assert bench_stats.speedup_bound(2.0, 10.0, 15.0, 5.0) == pytest.approx(1.0)  # 2 · 10 / (15 + 5)
    assert bench_stats.speedup_bound(3.0, 10.0, 10.0, 0.0) == pytest.approx(3.0)
    assert bench_stats.speedup_bound(2.0, 0.0, 15.0, 5.0) is None
    assert bench_stats.speedup_bound(2.0, 10.0, 0.0, 0.0) is None


def test_per_method_statistics() -> None:
    summary, rows = full_summary()
    pm = summary["per_method"]
    d = pm["dflash-b4"]
    assert d["tau"] == pytest.approx(11 / 4) and summary["mean_tau"] == pytest.approx(11 / 4)
    assert d["tau_hist"] == [1, 1, 0, 2]
    assert d["draft_ms_per_block"] == pytest.approx(10.0) and d["verify_ms_per_block"] == pytest.approx(100.0)
    assert summary["plain_step_ms"] == pytest.approx(100.0) == pm["plain"]["step_ms"]
    assert d["bound"] == pytest.approx(11 / 4 * 100 / 110)
    assert d["speedup"] == pytest.approx(0.1 / 0.029) == summary["speedup"]  # plain 0.1 s/token, DFlash 0.029
    assert d["achieved"] == pytest.approx(0.1 / 0.029 / 2.5)
    # Per-prompt rates 20, 40 and 100 tok/s: the median is not the mean, nor the aggregate.
    assert d["tokens_per_s_median"] == pytest.approx(40.0)
    assert d["tokens_per_s_mean"] == pytest.approx(160 / 3)
    assert d["tokens_per_s"] == pytest.approx(10 / 0.29)
    assert d["exact_matches"] == 3 and pm["hf-generate"]["exact_matches"] == 2
    h = pm["hf-generate"]
    assert h["tau"] is None and h["tau_hist"] is None and h["bound"] is None and h["step_ms"] is None
    assert summary["hf-generate_speedup"] == pytest.approx(0.1 / 0.15)
    # Only our engine's methods promise plain's tokens: hf-generate's difference is shown, not counted.
    assert summary["mismatches"] == 0 and [r["match"] for r in rows] == [True, True, True]
    bad = hand_made()
    bad[2]["dflash-b4"] = RunResult([7, 8, 0, 10], 0.04, tau=2.5, blocks=2, accepted=[0, 3])
    summary, rows = bench_stats.summarize(PROMPTS, bad, [PLAIN, B4, HF], primary="dflash-b4")
    assert summary["mismatches"] == 1 and [r["match"] for r in rows] == [True, True, False]
    assert pm["plain"]["speedup"] == 1.0 and pm["plain"]["bound"] is None


def test_no_bound_without_plain_in_the_run() -> None:
    summary, _ = full_summary([B4, HF])
    d = summary["per_method"]["dflash-b4"]
    assert summary["baseline"] == "dflash-b4" and d["speedup"] == pytest.approx(1.0)
    assert d["bound"] is None and d["achieved"] is None and summary["plain_step_ms"] is None
    assert d["tau_hist"] == [1, 1, 0, 2]  # what needs no plain run is still there


def test_json_report_round_trips() -> None:
    summary, rows = full_summary()
    text = bench._report_json(summary, rows)
    assert json.loads(text) == {"summary": summary, "per_prompt": rows}
    assert sum('"dflash-b4": {' in line for line in text.splitlines()) == 1  # one line per method


# ----- tables -----

def test_terminal_table() -> None:
    summary, _ = full_summary()
    lines = bench_stats.format_table(summary).splitlines()
    row = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in summary["methods"]}
    assert set(row) == {"plain", "dflash-b4", "hf-generate"}
    assert row["dflash-b4"][1:] == ["10", "34.5", "40.0", "2.75", "3.45x", "10.00", "100.00", "2.50x", "138%", "3/3"]
    assert row["plain"][-6:] == ["1.00x", "-", "100.00", "-", "-", "3/3"]  # verify column = t1 for plain
    assert row["hf-generate"][-1] == "2/3"
    assert "mismatches 0" in lines[-1]
    assert any(line.startswith("bound = tau·t1/(t_verify+t_draft)") for line in lines)


def test_markdown_table_names_hardware_date_and_command() -> None:
    summary, _ = full_summary()
    md = bench_stats.markdown_table(summary)
    assert "2026-01-02T03:04:05+00:00" in md and "Test CPU" in md
    assert f"`{summary['command']}`" in md
    table = [line for line in md.splitlines() if line.startswith("| `")]
    assert [line.split("`")[1] for line in table] == ["plain", "dflash-b4", "hf-generate"]
    assert "| 2.75 | 3.45x | 10.00 | 100.00 | 2.50x | 138% | 3/3 |" in table[1]
    summary["device"], summary["cuda_device"] = "cuda:0", "NVIDIA H200"
    assert "NVIDIA H200 (CUDA)" in bench_stats.markdown_table(summary)


# ----- the README region -----

README = "# Title\n\nintro text\n\n<!-- bench:start -->\nold placeholder\n<!-- bench:end -->\n\nafter text\n"


def test_region_rewrite_keeps_the_rest_and_is_idempotent() -> None:
    once = bench_stats.replace_region(README, "| new | table |\n")
    assert once == README.replace("old placeholder", "| new | table |")
    assert bench_stats.replace_region(once, "| new | table |") == once


@pytest.mark.parametrize(("text", "message"), [
    ("no markers at all\n", "exactly one"),
    (README + "<!-- bench:start -->\n", "exactly one"),
    ("<!-- bench:end -->\nx\n<!-- bench:start -->\n", "comes before"),
])
def test_region_rewrite_errors(text: str, message: str) -> None:
    with pytest.raises(DFlashError, match=message):
        bench_stats.replace_region(text, "block")


def test_write_readme(tmp_path: Path) -> None:
    summary, _ = full_summary()
    path = tmp_path / "README.md"
    path.write_text(README)
    bench_stats.write_readme(path, summary)
    text = path.read_text()
    assert "old placeholder" not in text and "| `dflash-b4` |" in text
    assert text.startswith("# Title\n\nintro text\n\n<!-- bench:start -->\n") and text.endswith("after text\n")
    bench_stats.write_readme(path, summary)
    assert path.read_text() == text
    with pytest.raises(DFlashError, match="cannot read"):
        bench_stats.check_readme(tmp_path / "missing.md")
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(DFlashError, match=r"plain\.md: expected exactly one"):
        bench_stats.write_readme(tmp_path / "plain.md", summary)
    assert (tmp_path / "plain.md").read_text() == "no markers\n"


def test_write_readme_keeps_one_table_per_prompt_set(tmp_path: Path) -> None:
    summary, _ = full_summary()
    path = tmp_path / "README.md"
    path.write_text("<!-- bench:start:gsm8k -->\nold gsm8k\n<!-- bench:end:gsm8k -->\n"
                    "<!-- bench:start:humaneval -->\nold humaneval\n<!-- bench:end:humaneval -->\n")
    bench_stats.write_readme(path, {**summary, "prompt_set": "gsm8k"})
    text = path.read_text()
    assert "old gsm8k" not in text and "old humaneval" in text  # only the set's own region changed
    assert text.index("| `dflash-b4` |") < text.index("<!-- bench:end:gsm8k -->")


def test_write_readme_keeps_sampled_runs_apart(tmp_path: Path) -> None:
    summary, _ = full_summary()
    path = tmp_path / "README.md"
    path.write_text("<!-- bench:start:gsm8k -->\nold greedy\n<!-- bench:end:gsm8k -->\n"
                    "<!-- bench:start:gsm8k-t1 -->\nold sampled\n<!-- bench:end:gsm8k-t1 -->\n")
    bench_stats.write_readme(path, {**summary, "prompt_set": "gsm8k", "temperature": 1.0})
    text = path.read_text()
    assert "old greedy" in text and "old sampled" not in text
    assert text.index("<!-- bench:start:gsm8k-t1 -->") < text.index("| `dflash-b4` |")
    assert bench_stats.region_name("gsm8k", 0.0) == "gsm8k" and bench_stats.region_name("x", 0.7) == "x-t0.7"
