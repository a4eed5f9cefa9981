"""A real vLLM CPU server for tests: started by the documented script, bounded in time, always stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import free_port

from dflash_core.errors import DFlashError
from dflash_core.server_client import ServerClient

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
# Start-up on 2 busy cores: ~40 s eager (torch.compile would add ~70 s per start, which is why the
# tests pass --enforce-eager; the model code is the same, uncompiled).
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60

needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.is_file(),
    reason=f"vLLM's CPU build is not installed ({VLLM_PYTHON} is missing): run bash scripts/setup.sh --vllm")


class ServerExited(RuntimeError):
    """The server exited before answering: fails the test with its log's tail, unless a test catches
    it to read `log` (the whole log) for a refusal it expects."""

    def __init__(self, code: int, log: str) -> None:
        super().__init__(f"the vLLM server exited with {code} before answering:\n{_tail(log)}")
        self.log = log


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's whole process group (the API server and its engine core), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)
    except ProcessLookupError:
        pass


@contextmanager
def vllm_server(*script_args: str, extra_env: dict[str, str] | None = None) -> Iterator[ServerClient]:
    """`bash scripts/serve_vllm.sh --port P <script_args> -- --enforce-eager` on the loopback (`extra_env`
    added to its environment); yields a client once /v1/models answers. Fails the test with the log's
    tail if the server is not up within START_TIMEOUT_S, or dies first (ServerExited)."""
    port = free_port()
    env = {**os.environ, **(extra_env or {}), "VLLM_PYTHON": str(VLLM_PYTHON),
           "VLLM_DTYPE": "float32",  # what exactness compares
           # Our own processes share the cores with the server: it gets what the tests get.
           "OMP_NUM_THREADS": os.environ.get("DFLASH_TEST_THREADS", "2")}
    log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False)  # noqa: SIM115 (its tail explains a failed start)
    cmd = ["bash", str(ROOT / "scripts" / "serve_vllm.sh"), "--port", str(port), "--max-model-len", "1024",
           *script_args, "--", "--enforce-eager"]
    # A session of its own, so the whole tree can be signalled at once.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = ServerClient(f"http://127.0.0.1:{port}", timeout_s=300)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise ServerExited(proc.returncode, _read(log.name))
            try:
                client.info()
                break
            except DFlashError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the vLLM server did not answer within {START_TIMEOUT_S} s:\n{_tail(_read(log.name))}")
                time.sleep(2)
        yield client
    finally:
        _stop(proc)
        log.close()
        os.unlink(log.name)


def _read(path: str) -> str:
    text = Path(path).read_text(errors="replace").splitlines()
    # pip's notes about this machine's package mirror
    return "\n".join(line for line in text if not line.startswith("WARNING: Location"))


def _tail(log: str, lines: int = 40) -> str:
    return "\n".join(log.splitlines()[-lines:])
