"""`bench --server URL`: a DFlash server (vLLM, SGLang) as one more bench method, beside the local
engine's methods on the same prompts, so one table compares them on one machine.

The server's row is timed here, per reply, from the request to the last streamed token (HTTP and
detokenisation included; the engine's rows use the engine's clock, which has neither: on a loopback
server the difference is milliseconds per reply). Its τ is the server's own (vLLM's /metrics
counters over each reply). Its exact column is information, as for transformers' rows: the server
computes in its own kernels, and a near-tie may resolve differently there (with a float32 server
and `--dtype float32` here the replies have been identical: tests/test_vllm_serving.py).
"""

from __future__ import annotations

import sys

from .bench import Method
from .bench_stats import RunResult
from .config import GenerationConfig
from .engine import Engine
from .prompt_sets import Turns
from .server_client import ServerClient, ServerReply

SERVER_METHOD = "server"


def open_server(url: str) -> ServerClient:
    """The server, checked before any model loads here: a dead URL ends the run in one line."""
    client = ServerClient(url)
    info = client.info()
    if not info.speculative:
        print(f"warning: the server at {client.url} ({info.model}) reports no speculative decoding: its row "
              "is its plain decoding, without tau", file=sys.stderr)
    return client


def server_method(client: ServerClient, engine: Engine, name: str = SERVER_METHOD) -> Method:
    """Each prompt's turns through the server's chat endpoint, continuing from its own replies as
    the engine's methods do. Where the server returns no token ids (SGLang), the reply's text is
    tokenised here, which can differ from the ids the server sampled."""

    def run(turns: Turns, config: GenerationConfig) -> RunResult:
        messages: list[dict[str, str]] = []
        result = RunResult(ids=[], seconds=0.0)
        drafts = accepted = 0.0
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            reply = None
            for part in client.stream_chat(messages, max_tokens=config.max_new_tokens,
                                           temperature=config.temperature, seed=config.seed,
                                           token_ids=True):
                if isinstance(part, ServerReply):
                    reply = part
            assert reply is not None
            messages.append({"role": "assistant", "content": reply.text})
            ids = reply.token_ids if reply.token_ids is not None else engine.target.tokenizer.encode(
                reply.text, add_special_tokens=False)
            result.ids.extend(ids)
            result.replies.append(reply.text)
            result.seconds += reply.elapsed_s
            if reply.spec is not None:
                drafts += reply.spec.drafts
                accepted += reply.spec.accepted
        if drafts > 0:
            # No per-block list: the server reports sums, so τ is weighted by the drafts (blocks).
            result.tau, result.blocks = 1.0 + accepted / drafts, int(drafts)
        return result

    return Method(name=name, run=run, kind="server")
