"""scripts/gpu_check.sh, the prepared GPU check, as far as a machine without a GPU can run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_script_parses_and_documents_its_calls() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    header = SCRIPT.read_text()
    assert 'run(command="bash scripts/gpu_check.sh --stage", carry=[".gpu/a"]' in header
    assert 'run(command="bash scripts/gpu_check.sh --stage", carry=[".gpu/b"]' in header
    assert 'run(command="bash scripts/gpu_check.sh", carry=[".gpu/c"]' in header
    done = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stderr


def test_cpu_smoke_runs_tests_and_both_benches_and_prints_their_tables(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "DFLASH_TEST_THREADS": os.environ.get("DFLASH_TEST_THREADS", "1")}
    done = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "[check] tests" in out and " passed" in out and "bench exit 0" in out
    assert "with --cuda-graphs: bench exit 0" in out and "plain tokens equal on 1/1 prompts" in out
    assert out.count("method ") == 2 and "dflash-b4" in out and out.count("mismatches 0") == 2
    s = json.loads((tmp_path / "bench.json").read_text())["summary"]
    assert s["methods"] == ["plain", "dflash-b4"] and s["prompts"] == 2 and s["mismatches"] == 0
    assert s["per_method"]["dflash-b4"]["tau_hist"] is not None
    g = json.loads((tmp_path / "bench_graphs.json").read_text())["summary"]
    assert g["methods"] == ["plain", "dflash-b4-full"] and g["mismatches"] == 0
    assert "static passes" in g["target_forward"]  # no CUDA here: the passes a graph would replay
    assert "hybrid rollback exit 0" in out and "record ms" in out and "replay ms" in out
    h = json.loads((tmp_path / "hybrid.json").read_text())
    assert [r["accepted"] for r in h["rows"]] == [0, 15] and h["plain_step_ms"] > 0
    assert (tmp_path / "gpu_check.log").read_text() in out  # the summary also comes back as a file
