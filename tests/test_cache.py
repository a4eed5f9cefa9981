"""dflash_core/cache.py: the target's preallocated KV cache, across transformers 5.x releases."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import Cache

from dflash_core.cache import TargetCache


def fill(cache: TargetCache, n: int, seed: int = 0) -> torch.Tensor:
    k = torch.randn(1, 2, n, 4, generator=torch.Generator().manual_seed(seed))
    for layer in range(len(cache.layers)):
        cache.update(k, k + 1, layer)
    return k


def test_rollback_moves_a_length_and_keeps_the_buffers() -> None:
    cache = TargetCache(num_layers=2, max_cache_len=12)
    k = fill(cache, 5)
    buffer = cache.layers[0].keys
    assert cache.length == cache.get_seq_length() == 5 and buffer.shape[2] == 12
    cache.truncate(3)
    assert cache.length == 3 and cache.layers[1].length == 3
    k2 = fill(cache, 4, seed=1)  # overwrites positions 3..6, no reallocation
    assert cache.layers[0].keys is buffer
    assert torch.equal(buffer[0, :, :3], k[0, :, :3]) and torch.equal(buffer[0, :, 3:7], k2[0])
    with pytest.raises(RuntimeError, match="overflow"):
        fill(cache, 6)


def test_max_cache_len_where_transformers_has_a_read_only_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers 5.17 (the GPU machine's) has a deprecated, read-only `Cache.max_cache_len`
    # property; 5.25 has none. An assignment in __init__ broke every engine on 5.17.
    monkeypatch.setattr(Cache, "max_cache_len", property(lambda self: -1), raising=False)
    cache = TargetCache(num_layers=3, max_cache_len=20)
    assert cache.max_cache_len == 20
    fill(cache, 2)
    assert cache.length == 2
