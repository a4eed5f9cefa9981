"""Preallocated KV caches. Rolling back rejected tokens is moving a length, never copying.

`TargetCache` plugs into any transformers causal LM (it is a `transformers.Cache`);
`DraftCache` is the drafter's own: it keeps only the projected target context, and the
block's keys/values are written past the end as scratch that the next block overwrites.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PreallocatedLayer(CacheLayerMixin):
    """One attention layer's keys/values in fixed buffers; `length` says how much is valid."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, max_cache_len: int, value_ones: bool = False, **kwargs: object) -> None:
        super().__init__()
        self.max_cache_len = max_cache_len
        self.length = 0
        self.value_ones = value_ones
        self.values_ones: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.device = key_states.device
        self.keys = key_states.new_zeros((b, h, self.max_cache_len, dk))
        if self.value_ones:
            # Values with a column of ones after them, `values` being the view without it: one
            # GEMM of attention weights against this gives the weighted values and the weights'
            # total together (batch_invariant.attention).
            self.values_ones = value_states.new_zeros((b, h, self.max_cache_len, dv + 1))
            self.values_ones[..., dv] = 1
            self.values = self.values_ones[..., :dv]
        else:
            self.values = value_states.new_zeros((b, h, self.max_cache_len, dv))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.max_cache_len:
            raise RuntimeError(f"KV cache overflow: {end} > {self.max_cache_len} positions")
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.length = 0

    def crop(self, max_length: int) -> None:
        # Negative: drop that many tokens (transformers' convention); otherwise keep max_length.
        self.length = self.length + max_length if max_length < 0 else min(self.length, max_length)


class TargetCache(Cache):
    """A transformers cache of `PreallocatedLayer`s for every layer of the target."""

    def __init__(self, num_layers: int, max_cache_len: int, value_ones: bool = False) -> None:
        super().__init__(layers=[PreallocatedLayer(max_cache_len, value_ones) for _ in range(num_layers)])

    @property
    def max_cache_len(self) -> int:
        # A property, not an attribute: in some transformers 5.x releases `Cache` has a read-only,
        # deprecated `max_cache_len` that an assignment cannot set (5.17, the GPU machine's; 5.25 has none).
        return self.layers[0].max_cache_len

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions in every layer (rollback of rejected tokens)."""
        for layer in self.layers:
            layer.length = min(layer.length, length)

    @torch.inference_mode()
    def keep_rows(self, start: int, rows: list[int]) -> None:
        """After a tree pass appended at `start`: keep rows `start + rows[i]` (increasing) as
        positions `start + i`, the accepted path, and drop the rest."""
        # Rows already where they belong (the path's head, often all of it) stay put.
        k = next((i for i, r in enumerate(rows) if r != i), len(rows))
        if k < len(rows):
            first = self.layers[0]
            src = torch.tensor(rows[k:], device=first.keys.device) + start
            end = start + len(rows)
            for layer in self.layers:
                # Advanced indexing gathers a copy first, so overlapping source and target are fine.
                layer.keys[:, :, start + k : end] = layer.keys[:, :, src]
                layer.values[:, :, start + k : end] = layer.values[:, :, src]
        self.truncate(start + len(rows))

    @property
    def length(self) -> int:
        return self.layers[0].length


class DraftCache:
    """Projected-context keys/values for each drafter layer, in fixed buffers.

    Positions `[0, length)` hold the context (one per committed token whose target
    features the drafter has seen). A block's own keys/values go to `[length, length+B)`
    as scratch: they are attended to in that step and overwritten by the next one.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_layers, 1, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.max_len = max_len

    def write(self, layer: int, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = at + k.shape[-2]
        if end > self.max_len:
            raise RuntimeError(f"draft cache overflow: {end} > {self.max_len} positions")
        self.keys[layer, :, :, at:end] = k
        self.values[layer, :, :, at:end] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
