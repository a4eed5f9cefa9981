"""Data folders on disk: gzip JSONL shards of samples, written atomically, and their manifest.

A folder holds `shard-00000.jsonl.gz`, ... (one JSON object per line, e.g. {"id", "prompt_ids",
"response_ids", "temperature"}) plus `manifest.json`. Shards are written atomically (tmp +
rename), so a killed run loses at most the shard in progress.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

SHARD_GLOB = "shard-*.jsonl.gz"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1



def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def encode_shard(samples: list[dict[str, Any]]) -> bytes:
    lines = "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in samples)
    return gzip.compress(lines.encode(), compresslevel=9, mtime=0)


def read_shard(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def shard_paths(folder: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(folder).glob(SHARD_GLOB))


def iter_samples(folder: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    for path in shard_paths(folder):
        yield from read_shard(path)


def done_ids(folder: Path) -> set[str]:
    return {s["id"] for s in iter_samples(folder)}


def write_manifest(folder: Path, settings: dict[str, Any], stats: dict[str, int],
                   fields: Sequence[str] = ("id", "prompt_ids", "response_ids", "temperature"),
                   summary: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> None:
    """`manifest.json` from the shards on disk; `summary` adds keys computed over all samples."""
    shards = []
    everything: list[dict[str, Any]] = []
    for path in shard_paths(folder):
        samples = read_shard(path)
        shards.append({"file": path.name, "samples": len(samples),
                       "response_tokens": sum(len(s["response_ids"]) for s in samples)})
        if summary is not None:
            everything += samples
    manifest = {
        "format": FORMAT_VERSION,
        "fields": list(fields),
        "settings": settings,
        "prompt_filter": stats,
        "samples": sum(s["samples"] for s in shards),
        "response_tokens": sum(s["response_tokens"] for s in shards),
        **(summary(everything) if summary is not None else {}),
        "shards": shards,
    }
    write_atomic(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
