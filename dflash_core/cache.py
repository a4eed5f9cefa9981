"""Preallocated KV caches. Rolling back rejected tokens is moving a length, never copying.

`TargetCache` plugs into any transformers causal LM (it is a `transformers.Cache`). Keys and values
may differ in width: multi-head latent attention (DeepSeek-V3, Kimi-K2.5) caches its compressed
latent as "keys" and the shared rotary key as "values". DeepSeek-V3.2's sparse-attention indexer
keeps its own keys per layer (`update_indexer`), rolled back with the same length;
`DraftCache` is the drafter's own: it keeps only the projected target context, and the
block's keys/values are written past the end as scratch that the next block overwrites.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class LayerStack:
    """The buffers of a cache's layers as slices of one tensor for keys and one for values, when
    every layer's are the same shape: a tree pass's accepted rows then move in one copy for all
    layers (`TargetCache.keep_rows`), not two per layer. Allocated by the first layer to need it."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.keys: torch.Tensor | None = None  # [layers, b, heads, max_len, key_dim]
        self.values: torch.Tensor | None = None  # [layers, b, heads, max_len, value width]
        self.complete = True  # False once a layer's shape differed and it took its own buffers

    def slices(self, index: int, keys: tuple[int, ...], values: tuple[int, ...], like: torch.Tensor,
               value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `index`'s buffers of these shapes (`like`'s dtype and device), or None when they
        cannot be slices of the stack (the layer then allocates its own)."""
        if self.keys is None and value_dtype == like.dtype:
            self.keys = like.new_zeros((self.num_layers, *keys))
            self.values = like.new_zeros((self.num_layers, *values))
        if (self.keys is None or self.values is None or self.keys.shape[1:] != keys or self.values.shape[1:] != values
                or self.keys.dtype != like.dtype or value_dtype != like.dtype):
            self.complete = False
            return None
        return self.keys[index], self.values[index]


class PreallocatedLayer(CacheLayerMixin):
    """One attention layer's keys/values in fixed buffers; `length` says how much is valid."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, max_cache_len: int, value_ones: bool = False, stack: LayerStack | None = None,
                 index: int = 0, **kwargs: object) -> None:
        super().__init__()
        self.max_cache_len = max_cache_len
        self.stack, self.index = stack, index
        self.indexer_keys: torch.Tensor | None = None  # DeepSeek-V3.2's indexer keys [b, max_len, d]
        self.indexer_length = 0
        self.length = 0
        self.value_ones = value_ones
        self.values_ones: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Valid positions; lowering it (a rollback) drops the indexer keys past it too."""
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        self._length = n
        self.indexer_length = min(self.indexer_length, n)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.device = key_states.device
        # Values with a column of ones after them, `values` being the view without it: one
        # GEMM of attention weights against this gives the weighted values and the weights'
        # total together (batch_invariant.attention).
        width = dv + 1 if self.value_ones else dv
        shared = None
        if self.stack is not None:
            shared = self.stack.slices(self.index, (b, h, self.max_cache_len, dk), (b, h, self.max_cache_len, width),
                                       key_states, value_states.dtype)
        if shared is None:
            shared = (key_states.new_zeros((b, h, self.max_cache_len, dk)),
                      value_states.new_zeros((b, h, self.max_cache_len, width)))
        self.keys, values = shared
        if self.value_ones:
            self.values_ones = values
            self.values_ones[..., dv] = 1
            self.values = self.values_ones[..., :dv]
        else:
            self.values = values
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

    def update_indexer(self, key_states: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3.2's indexer keys [b, n, d] for the pass's positions (after the rolled-back
        ones, whether the layer's `update` came first or not); returns all of them."""
        b, n, d = key_states.shape
        if self.indexer_keys is None:
            self.indexer_keys = key_states.new_zeros((b, self.max_cache_len, d))
        end = self.indexer_length + n
        if end > self.max_cache_len:
            raise RuntimeError(f"KV cache overflow: {end} > {self.max_cache_len} positions")
        self.indexer_keys[:, self.indexer_length : end] = key_states
        self.indexer_length = end
        return self.indexer_keys[:, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.length = 0  # the indexer's keys too

    def crop(self, max_length: int) -> None:
        # Negative: drop that many tokens (transformers' convention); otherwise keep max_length.
        self.length = self.length + max_length if max_length < 0 else min(self.length, max_length)


class TargetCache(Cache):
    """A transformers cache of `PreallocatedLayer`s for every layer of the target."""

    def __init__(self, num_layers: int, max_cache_len: int, value_ones: bool = False) -> None:
        self.stack = LayerStack(num_layers)
        layers = [PreallocatedLayer(max_cache_len, value_ones, self.stack, i) for i in range(num_layers)]
        super().__init__(layers=layers)

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
            # Advanced indexing gathers a copy first, so overlapping source and target are fine.
            stack = self.stack
            if stack.complete and stack.keys is not None and all(layer.is_initialized for layer in self.layers):
                assert stack.values is not None
                stack.keys[:, :, :, start + k : end] = stack.keys[:, :, :, src]
                stack.values[:, :, :, start + k : end] = stack.values[:, :, :, src]
            else:
                for layer in self.layers:
                    layer.keys[:, :, start + k : end] = layer.keys[:, :, src]
                    layer.values[:, :, start + k : end] = layer.values[:, :, src]
            for layer in self.layers:
                if layer.indexer_keys is not None:
                    layer.indexer_keys[:, start + k : end] = layer.indexer_keys[:, src]
        self.truncate(start + len(rows))

    @property
    def length(self) -> int:
        return self.layers[0].length


class DraftCache:
    """Projected-context keys/values for each drafter layer, in fixed buffers.

    Positions `[0, length)` hold the context (one per committed token whose target
    features the drafter has seen). A block's own keys/values go to `[length, length+B)`
    as scratch: they are attended to in that step and overwritten by the next one.

    With a draft window (`window`: the drafter reads only the last N context positions) the
    buffer holds the window plus `slack` positions, whatever the conversation's length: slot 0
    holds position `offset`, and when a write would pass the end the window's positions move to
    the front (every ~slack / block positions, a copy of the window).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        window: int | None = None,
        slack: int = 0,
    ) -> None:
        self.max_len = max_len if window is None else min(max_len, window + slack)
        shape = (num_layers, 1, num_kv_heads, self.max_len, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.window = window
        self.offset = 0

    def make_room(self, keep_from: int, end: int) -> None:
        """Before writing positions up to `end`: positions before `keep_from` are never read again."""
        if end - self.offset <= self.max_len:
            return
        keep_from = max(keep_from, self.offset)
        n = self.length - keep_from
        if n > 0:
            kept = slice(keep_from - self.offset, self.length - self.offset)
            self.keys[:, :, :, :n] = self.keys[:, :, :, kept].clone()
            self.values[:, :, :, :n] = self.values[:, :, :, kept].clone()
        self.offset = keep_from
        if end - self.offset > self.max_len:
            raise RuntimeError(f"draft cache overflow: {end - self.offset} > {self.max_len} positions")

    def _writable(self, at: int, end: int) -> None:
        if at < self.offset or end - self.offset > self.max_len:
            raise RuntimeError(f"draft cache overflow: positions {at}..{end} outside its "
                               f"{self.offset}..{self.offset + self.max_len}")

    def _readable(self, start: int) -> None:
        if start < self.offset:
            raise RuntimeError(f"draft cache: position {start} was dropped (the window starts at {self.offset}); "
                               "a draft window cannot widen during a reply")

    def write(self, layer: int, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = at + k.shape[-2]
        self._writable(at, end)
        self.keys[layer, :, :, at - self.offset : end - self.offset] = k
        self.values[layer, :, :, at - self.offset : end - self.offset] = v

    def view(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [start, end)."""
        self._readable(start)
        return self.keys[layer, :, :, start - self.offset : end - self.offset], \
            self.values[layer, :, :, start - self.offset : end - self.offset]

    def slots(self, layer: int, write_at: int, read_from: int, end: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """For a compiled layer that writes positions [write_at, end) and reads [read_from, end)
        in place (`draft_layer`): the layer's key and value buffers [kv_heads, max_len, dim] and
        the slots of `write_at` and `read_from`, after the checks `write` and `view` make."""
        self._writable(write_at, end)
        self._readable(read_from)
        return self.keys[layer, 0], self.values[layer, 0], write_at - self.offset, read_from - self.offset
