"""scripts/gpu_train.sh, the prepared GPU training lease, as far as a quick CPU check goes.

Its whole CPU rehearsal (`--cpu-smoke`: generation, training, packing) takes minutes and is run
by hand before a lease; here, the parts that fail fast: parsing, the documented calls, refusals.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_train.sh"


def test_script_parses_and_documents_its_calls() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_bundle.sh")], check=True)
    header = SCRIPT.read_text()
    for call in ('run(command="bash scripts/gpu_train.sh --stage", carry=[".gpu/a"]',
                 'run(command="bash scripts/gpu_train.sh --stage", carry=[".gpu/b"]',
                 'bash scripts/gpu_train.sh", carry=[".gpu/c"]',
                 'bash scripts/gpu_train.sh --more", carry=[".gpu/c"]',
                 "bash scripts/gpu_bundle.sh --light", "bash scripts/gpu_bundle.sh --full"):
        assert call in header, call
    done = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stderr


def test_more_without_an_earlier_run_stops_at_once(tmp_path: Path) -> None:
    # `--more` continues the run a previous call made on the same machine; on a fresh one
    # (no run there) it must stop before training anything, with the lease's "fresh machine" code.
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "DFLASH_GPU_RUN": str(tmp_path / "no-run"), "DFLASH_GPU_NEW": str(tmp_path / "new")}
    done = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke", "--more"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no run in" in done.stdout + done.stderr
    assert not (tmp_path / "no-run").exists() and not (tmp_path / "new").exists()
    assert "[gpu]" in (tmp_path / "out" / "gpu_train.log").read_text()


def test_bundle_light_and_full_round_trip_without_losing_changes(tmp_path: Path) -> None:
    # --light deletes committed files for the staging calls; --full must bring back exactly those,
    # and leave a file changed since (new weights copied in after a lease) as it is.
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    bundle = clone / "scripts" / "gpu_bundle.sh"
    bundle.write_text((ROOT / "scripts" / "gpu_bundle.sh").read_text())  # this tree's version, committed or not
    weights, ngrams = clone / "assets/drafter/model.safetensors", clone / "assets/drafter/ngrams.npz"
    want = weights.read_bytes()
    done = subprocess.run(["bash", str(bundle), "--light"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not weights.exists() and not ngrams.exists() and not (clone / "data").exists()
    subprocess.run(["bash", str(bundle), "--full"], check=True, capture_output=True)
    assert weights.read_bytes() == want and ngrams.exists() and any((clone / "data").iterdir())
    weights.write_bytes(b"new weights")
    refused = subprocess.run(["bash", str(bundle), "--light"], capture_output=True, text=True)
    assert refused.returncode == 1 and "uncommitted" in refused.stderr and weights.exists()
    ngrams.unlink()
    subprocess.run(["bash", str(bundle), "--full"], check=True, capture_output=True)
    assert weights.read_bytes() == b"new weights" and ngrams.exists()
