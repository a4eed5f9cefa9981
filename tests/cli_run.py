"""The command line run in-process on the real embedded target, for the CLI's test files:
`run(capsys, *argv)` → exit code + output, every load() done once per argument set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dflash_core.__main__ as cli
from dflash_core.engine import Engine
from dflash_core.loading import load

FAST = ["--device", "cpu", "--block-size", "4"]  # small blocks: cheap verify forwards on a shared CPU
ENGINES: dict[tuple, Engine] = {}


def cached_load(target: str | None = None, draft: str | None = None, device: str | None = None,
                dtype: str | None = None, graphs: bool | None = None) -> Engine:
    # Loading the target costs seconds; every test runs the same real load() once per argument set.
    key = (target, draft, device, dtype, graphs)
    if key not in ENGINES:
        ENGINES[key] = load(target, draft, device, dtype, graphs=graphs)
    return ENGINES[key]


@pytest.fixture(autouse=True)
def shared_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autouse in every module that imports it."""
    monkeypatch.setattr(cli, "load", cached_load)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path
