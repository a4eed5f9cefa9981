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


def test_latent_keys_values_of_other_widths_and_indexer_keys_roll_back_together() -> None:
    """DeepSeek-V3's MLA caches a 32-wide latent as keys and a 16-wide rotary key as values;
    V3.2's indexer adds its own keys per position, after the layer's update in the same pass."""
    cache = TargetCache(num_layers=1, max_cache_len=12)
    g = torch.Generator().manual_seed(0)

    def step(n: int) -> torch.Tensor:
        cache.update(torch.randn(1, 1, n, 32, generator=g), torch.randn(1, 1, n, 16, generator=g), 0)
        return cache.update_indexer(torch.randn(1, n, 8, generator=g), 0)

    first = step(5).clone()
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert keys.shape[-1] == 32 and values.shape[-1] == 16 and first.shape == (1, 5, 8)
    cache.truncate(3)  # a rollback: the indexer keys past it go too
    again = step(2)
    assert again.shape == (1, 5, 8) and torch.equal(again[:, :3], first[:, :3])
    assert cache.length == cache.layers[0].indexer_length == 5 and cache.layers[0].keys is keys


@pytest.mark.parametrize("same_shapes", [True, False])
@pytest.mark.parametrize("value_ones", [True, False])
def test_keep_rows_moves_every_layers_accepted_rows(same_shapes: bool, value_ones: bool) -> None:
    """A tree pass appended 6 rows at position 3 and the path kept rows 0, 2, 5. Layers of one
    shape share one buffer (moved in one copy); a layer of another shape keeps its own."""
    cache = TargetCache(num_layers=3, max_cache_len=16, value_ones=value_ones)
    g = torch.Generator().manual_seed(0)
    written = []
    for layer in range(3):
        width = 4 if same_shapes or layer != 1 else 8
        k, v = torch.randn(1, 2, 9, width, generator=g), torch.randn(1, 2, 9, width, generator=g)
        cache.update(k, v, layer)
        written.append((k, v))
    assert cache.stack.complete == same_shapes
    cache.keep_rows(3, [0, 2, 5])
    assert cache.length == 6
    for layer, (k, v) in zip(cache.layers, written, strict=True):
        rows = [0, 1, 2, 3, 5, 8]
        assert torch.equal(layer.keys[:, :, :6], k[:, :, rows]) and torch.equal(layer.values[:, :, :6], v[:, :, rows])
        if value_ones:
            assert torch.equal(layer.values_ones[..., -1], torch.ones(1, 2, 16))
