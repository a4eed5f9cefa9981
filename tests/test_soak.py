"""scripts/soak.py in CI: a small configuration of the whole measurement against the real launch.py, and
its plan and verdict logic on their own. Timing checks are reported by the script, never asserted here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from dflash_core.engine import Engine

pytest.importorskip("gradio_client")
pytest.importorskip("httpx")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"
spec = importlib.util.spec_from_file_location("soak", SCRIPT)
soak = importlib.util.module_from_spec(spec)
sys.modules["soak"] = soak  # its dataclasses look their module up
spec.loader.exec_module(soak)


class FakeRefs:
    """Stands in for References: a reply named after the conversation, no model."""

    block_size = 4

    def reply(self, messages: list[dict[str, str]], max_new: int) -> str:
        return f"reply {len(messages)} to {messages[-1]['content']} ({max_new})"


def test_soak_plan_cycles_send_regenerate_send_clear_with_new_visitors() -> None:
    cfg = soak.Config(replies=10, soak_max_new=5, cycles_per_visitor=2)
    steps = soak.soak_plan(FakeRefs(), cfg)
    assert sum(s.action != "clear" for s in steps) == 10
    assert [s.action for s in steps[:8]] == ["send", "regenerate", "send", "clear"] * 2
    assert [i for i, s in enumerate(steps) if s.new_visitor] == [0, 8]  # every 2 cycles of 4 steps
    first, regen, second, clear = steps[:4]
    assert [m["role"] for m in second.expected_chat] == ["user", "assistant"] * 2
    assert regen.expected_chat == first.expected_chat  # greedy: Regenerate gives the same reply
    assert second.expected_chat[:2] == first.expected_chat and clear.expected_chat == []
    assert steps[-1].action == "clear"


def test_flat_check_ignores_warm_up_and_catches_growth() -> None:
    warm = [{"m": v} for v in (100, 140, 141, 140, 141, 141)]
    assert soak.flat_check(warm, "m", 4)[0]
    growing = [{"m": v} for v in (100, 110, 120, 130, 140, 150)]
    assert not soak.flat_check(growing, "m", 4)[0]
    assert soak.flat_check([{"m": 1}], "m", 0)[0]  # too few samples: no verdict against it


def test_foreign_content_finds_other_visitors_turns() -> None:
    chat = [{"role": "user", "content": "mine"}, {"role": "assistant", "content": "about chess and more"}]
    assert soak.foreign_content(chat, {"mine"}, ["theirs"]) == []
    assert soak.foreign_content(chat, {"mine"}, ["about chess"]) == ["about chess"]
    assert soak.foreign_content([*chat, {"role": "user", "content": "theirs"}], {"mine"}, []) == ["theirs"]


def test_replies_are_compared_as_the_chatbot_shows_them() -> None:
    # gr.Chatbot drops a reply's trailing blank lines; the session (and the model) keep them.
    assert soak.shown("To add 5 and 7 ...\n\n") == "To add 5 and 7 ..."
    turn = soak.Turn(0, "What is 5 + 7?", "12.\n\n", reply="12.")
    assert turn.ok and not soak.Turn(0, "p", "12.", reply="13.").ok


def test_arguments_are_checked() -> None:
    assert soak.parse_args([]).cancel_modes == soak.CANCEL_MODES
    assert soak.parse_args(["--cancel-modes", ""]).cancel_modes == ()
    for bad in (["--cancel-modes", "stop,sideways"], ["--replies", "-1"], ["--max-new", "0"]):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)


@pytest.mark.slow
def test_small_soak_against_launch_py(app_engine: Engine, tmp_path: Path) -> None:
    cfg = soak.Config(visitors=2, max_new=6, long_max_new=64, queued=1, replies=9, soak_max_new=6, sample_every=3,
                      cycles_per_visitor=2, block_size=4, pinned_costs=True, progress=False)
    report = soak.measure(cfg, engine=app_engine, log=tmp_path / "server.log")
    failed = [c for c in report["checks"] if not c["ok"] and not c["timing"]]
    assert not failed, failed
    assert report["server"]["url"].startswith("http://127.0.0.1:")  # loopback only

    visitors = report["visitors"]
    assert visitors["replies"] == visitors["replies_equal_plain"] == 4
    assert visitors["ranks_seen"], "the visitor who waited was shown no queue position"
    assert all(t["foreign"] == [] and t["error"] is None for t in visitors["turns"])

    assert [c["mode"] for c in report["cancel"]] == list(soak.CANCEL_MODES)
    for case in report["cancel"]:
        assert case["queued_before_cancel"] and case["cancel_to_next_served_s"] is not None
        assert all(t["reply"] == soak.shown(t["expected"]) for t in case["queued"])
    assert "finished: cancelled" in report["cancel"][0]["stopped_stats"]
    for case in report["cancel"][:2]:  # Stop and job.cancel(): the visitor chats on after the cut reply
        assert 0 < case["stopped_reply_tokens"] < cfg.long_max_new and case["next_reply_equals_plain"]

    s = report["soak"]
    assert s["replies"] == s["replies_equal_plain"] == 9 and s["answers_after"]
    assert [x["replies"] for x in s["samples"]] == [0, 3, 6, 9, 9]
    assert all(x["rss_mb"] > 0 and x["fds"] > 0 and x["threads"] > 0 for x in s["samples"])
    assert report["server"]["alive_at_end"]


def test_race_script_reads_the_first_turn_of_each_prompt_of_a_set() -> None:
    race_spec = importlib.util.spec_from_file_location("race_in_browser", SCRIPT.parent / "race_in_browser.py")
    race_script = importlib.util.module_from_spec(race_spec)
    race_spec.loader.exec_module(race_script)
    committed = race_script.prompt_list(str(SCRIPT.parent.parent / "bench" / "prompts" / "chatterbot-12.jsonl"), None)
    assert len(committed) == 12 and len(set(committed)) == 12 and committed[0] == "What is AI?"
    mtbench = race_script.prompt_list("mtbench", 2)  # two-turn prompts: the race sends the first
    assert len(mtbench) == 2 and all(isinstance(p, str) and p for p in mtbench)
    from dflash_core.prompt_sets import load_prompt_set
    assert mtbench == [turns[0] for turns in load_prompt_set("mtbench", limit=2)]
    assert len(load_prompt_set("mtbench", limit=2)[0]) == 2
