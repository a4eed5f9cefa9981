"""What needs no server at all: a dead URL is one clear line (client, app, bench), and vLLM's
Prometheus page is read right. The real server's side is tests/test_vllm_serving.py."""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import free_port

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from dflash_core.__main__ import main as cli
from dflash_core.errors import DFlashError
from dflash_core.server_client import ServerClient, SpecCounters, normalise_url, parse_spec_counters

# Lines as vLLM 0.32's CPU server wrote them (two draft positions of fifteen shown), with the
# `_created` gauges that must not be mistaken for counts.
METRICS = """\
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="SmolLM2-135M-Instruct"} 40.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="SmolLM2-135M-Instruct"} 1.7965703559535165e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 600.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 24.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="SmolLM2-135M-Instruct",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="SmolLM2-135M-Instruct",position="0"} 17.0
vllm:generation_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 64.0
"""


def test_vllm_counters_are_read_and_subtracted() -> None:
    c = parse_spec_counters(METRICS)
    assert c == SpecCounters(40.0, 600.0, 24.0, (17.0, 5.0))
    assert c.mean_acceptance_length == pytest.approx(1.6)
    assert c.position_rates == pytest.approx([17 / 40, 5 / 40])
    assert (c - SpecCounters()) == c and (c + c).drafts == 80.0
    assert parse_spec_counters("vllm:generation_tokens_total 3.0\n") is None  # no speculation


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1"])
def test_urls_name_one_server(url: str) -> None:
    assert normalise_url(url) == "http://127.0.0.1:8000"


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens on a port just freed


def test_a_dead_url_is_one_line() -> None:
    url = dead_url()
    with pytest.raises(DFlashError, match=f"no OpenAI-compatible server answers at {url}") as e:
        ServerClient(url).info()
    assert "\n" not in str(e.value)


def test_bench_on_a_dead_url_stops_before_loading_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    url = dead_url()
    assert cli(["bench", "--prompts", "humaneval", "--limit", "1", "--server", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no OpenAI-compatible server answers at {url}")


def test_the_app_says_a_dead_server_in_one_line() -> None:
    gradio_client = pytest.importorskip("gradio_client")
    from app.server_mode import build_server_app

    url = dead_url()
    demo = build_server_app(ServerClient(url))
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client: Any = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False, analytics_enabled=False,
                                           download_files=False)
        msg, chat, stats, *_ = client.predict("Hello?", 16, 0.0, api_name="/chat")
    finally:
        demo.close()
    assert msg == "Hello?"  # kept, to send again once the server is up
    assert chat == []
    assert stats.startswith("⚠️ no OpenAI-compatible server answers at") and "\n" not in stats
