"""An OpenAI-compatible speculative-decoding server (vLLM, SGLang) seen from here.

`ServerClient` streams chat replies and reads what the server says about its speculation. vLLM
keeps server-wide Prometheus counters (`/metrics`): drafts, drafted tokens, accepted tokens, and
accepted tokens per draft position. Read before and after a reply, their difference is that
reply's speculation, as long as nobody else uses the server meanwhile (a shared server mixes
other visitors' drafts in, which the reply's `shared` note says when the counters moved by more
drafts than the reply had tokens).

Standard library only (urllib): the CLI and the app use it, and neither should need an HTTP
package for it. Every failure is a `DFlashError` with one line that names the URL.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import DFlashError

# vLLM v1's spec-decode counters (vllm/v1/spec_decode/metrics.py); Prometheus adds `_total`.
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# After the last streamed chunk the engine may still be publishing the step's stats to the
# frontend's counters; poll a little until they settle.
SETTLE_S = 5.0


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculation counters at one moment, summed over its engines."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self - (SpecCounters() - other)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.per_position), len(before.per_position))
        now = self.per_position + (0.0,) * (n - len(self.per_position))
        then = before.per_position + (0.0,) * (n - len(before.per_position))
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(a - b for a, b in zip(now, then, strict=True)))

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens committed per target forward (accepted drafts + the target's own): our τ."""
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else None

    @property
    def position_rates(self) -> list[float]:
        """Share of drafts whose position k+1 was accepted (falls with k: a rejection ends the block)."""
        return [a / self.drafts for a in self.per_position] if self.drafts > 0 else []


def parse_spec_counters(text: str) -> SpecCounters | None:
    """vLLM's spec-decode counters from a Prometheus text page; None when it has none (a server
    without speculation, or one that is not vLLM)."""
    found, totals, per_pos = False, {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}, {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or not m.group(1).startswith("vllm:spec_decode_"):
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))
        if name in totals:
            totals[name] += value
            found = True
        elif name == ACCEPTED_PER_POS and "position" in labels:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    if not found:
        return None
    positions = tuple(per_pos.get(k, 0.0) for k in range(max(per_pos) + 1)) if per_pos else ()
    return SpecCounters(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED], positions)


@dataclass
class ServerReply:
    """One reply from the server, timed here, with its speculation where the server reports it."""

    text: str
    completion_tokens: int
    prompt_tokens: int
    elapsed_s: float
    first_token_s: float | None
    finish_reason: str | None
    spec: SpecCounters | None = None  # this reply's share of the counters; None: not reported
    token_ids: list[int] | None = None  # where the server returns them (vLLM: return_token_ids)
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tau(self) -> float | None:
        return None if self.spec is None else self.spec.mean_acceptance_length


@dataclass(frozen=True)
class ServerInfo:
    """What `/v1/models` and `/metrics` say about a server."""

    url: str
    model: str
    speculative: bool  # the server's /metrics has spec-decode counters
    max_context: int | None


def normalise_url(url: str) -> str:
    """`host:port`, `http://host:port/` and `http://host:port/v1` all name the same server."""
    url = url.strip().rstrip("/")
    if not url:
        raise DFlashError("the server URL is empty")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


class ServerClient:
    """One server: what it serves (`info`, asked once and remembered), its replies streamed, and
    each reply's share of its speculation counters."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.url = normalise_url(url)
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._info: ServerInfo | None = None

    # ----- HTTP -----

    def _request(self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout_s)
        except urllib.error.HTTPError as e:
            detail = _error_detail(e)
            raise DFlashError(f"the server at {self.url} answered {path} with HTTP {e.code}{detail}") from None
        except (TimeoutError, urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise DFlashError(f"no OpenAI-compatible server answers at {self.url} ({reason}); start one "
                              "(docs/serving.md) or check the URL") from None

    def _get_json(self, path: str, timeout: float = 10.0) -> Any:
        with self._request(path, timeout=timeout) as r:
            try:
                return json.loads(r.read())
            except ValueError:
                raise DFlashError(f"{self.url}{path} did not answer JSON: is this an OpenAI-compatible "
                                  "server?") from None

    def metrics_text(self) -> str | None:
        try:
            with self._request("/metrics", timeout=10.0) as r:
                return r.read().decode("utf-8", "replace")
        except DFlashError:
            return None  # SGLang serves /metrics only with --enable-metrics

    def counters(self) -> SpecCounters | None:
        text = self.metrics_text()
        return None if text is None else parse_spec_counters(text)

    # ----- what the server is -----

    def info(self) -> ServerInfo:
        """The served model and whether it speculates; raises a one-line DFlashError if there is no
        OpenAI-compatible server at the URL."""
        if self._info is None:
            models = self._get_json("/v1/models")
            data = models.get("data") if isinstance(models, dict) else None
            if not data:
                raise DFlashError(f"the server at {self.url} lists no model under /v1/models")
            model = data[0]
            ctx = model.get("max_model_len")
            self._info = ServerInfo(self.url, str(model.get("id")), self.counters() is not None,
                                    int(ctx) if isinstance(ctx, int) else None)
        return self._info

    def require_speculation(self) -> ServerInfo:
        info = self.info()
        if not info.speculative:
            raise DFlashError(f"the server at {self.url} ({info.model}) reports no speculative decoding: "
                              "its /metrics has no vllm:spec_decode_* counters. Start it with a drafter "
                              "(--speculative-config, docs/serving.md)")
        return info

    # ----- replies -----

    def stream_chat(self, messages: list[dict[str, str]], max_tokens: int = 256, temperature: float = 0.0,
                    seed: int | None = None, token_ids: bool = False) -> Iterator[str | ServerReply]:
        """Yield the reply's text so far after each streamed chunk, then a `ServerReply`.
        `token_ids`: ask for the reply's ids too (a vLLM extension; other servers may refuse it)."""
        body: dict[str, Any] = {"model": self.info().model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if seed is not None:
            body["seed"] = seed
        if token_ids:
            body["return_token_ids"] = True
        yield from self._stream("/v1/chat/completions", body, chat=True)

    def stream_completion(self, prompt: str | list[int], max_tokens: int = 256, temperature: float = 0.0,
                          ) -> Iterator[str | ServerReply]:
        """A raw completion: `prompt` token ids bypass the server's chat template (exact comparisons)."""
        body = {"model": self.info().model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        yield from self._stream("/v1/completions", body, chat=False)

    def _stream(self, path: str, body: dict[str, Any], chat: bool) -> Iterator[str | ServerReply]:
        before = self.counters() if self.info().speculative else None
        text, ids, usage, finish, first = "", [], {}, None, None
        t0 = time.perf_counter()
        with self._request(path, body) as r:
            for chunk in _sse_chunks(r, self.url):
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    ids.extend(choice.get("token_ids") or [])
                    finish = choice.get("finish_reason") or finish
                    if piece:
                        first = first if first is not None else time.perf_counter() - t0
                        text += piece
                        yield text
        elapsed = time.perf_counter() - t0
        n = int(usage.get("completion_tokens") or len(ids))
        reply = ServerReply(text, n, int(usage.get("prompt_tokens") or 0), elapsed, first, finish,
                            token_ids=ids or None)
        if before is not None:
            reply.spec = self._settled_delta(before, n)
            if reply.spec.drafts > n:
                reply.notes.append("the server's counters moved by more drafts than this reply has tokens: "
                                   "other requests ran meanwhile, so its acceptance figures are mixed in")
        yield reply

    def _settled_delta(self, before: SpecCounters, tokens: int) -> SpecCounters:
        """The counters' change over a reply of `tokens` tokens, once every draft of it is counted.

        Every token after the first comes from one verify step, and each verify step drafted (bar
        the last, cut by max_tokens or EOS): so committed = drafts + accepted (+1 for the prefill's
        token) tells when the counters hold the whole reply."""
        deadline = time.perf_counter() + SETTLE_S
        while True:
            after = self.counters()
            delta = (after or before) - before
            if delta.drafts + delta.accepted >= tokens - 1 or time.perf_counter() > deadline:
                return delta
            time.sleep(0.05)


def _sse_chunks(response: Any, url: str) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-events stream, up to `[DONE]`."""
    while True:
        try:
            raw = response.readline()
        except (TimeoutError, OSError) as e:
            raise DFlashError(f"the server at {url} stopped answering in the middle of a reply ({e})") from None
        if not raw:
            return
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            raise DFlashError(f"the server at {url} streamed something that is not JSON: is it "
                              "OpenAI-compatible?") from None
        if isinstance(chunk, dict) and chunk.get("error"):  # an error raised mid-stream
            err = chunk["error"]
            raise DFlashError(f"the server at {url} stopped the reply: "
                              f"{err.get('message', err) if isinstance(err, dict) else err}")
        yield chunk


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read() or b"{}")
    except ValueError:
        return ""
    msg = body.get("message") or (body.get("error") or {}).get("message") if isinstance(body, dict) else None
    return f": {' '.join(str(msg).split())[:300]}" if msg else ""
