"""One worst-case slab per sequence: the KV cache the way early servers stored it (stage 2).

Before paging, a server reserved for every request in the batch one contiguous region big
enough for the longest sequence it might ever become (``max_seq_len`` tokens), in every layer,
up front. Writing is trivial (token ``t`` goes to row ``t``), reading is one slice, and the
memory map is easy to draw. The price is waste: a request that stops after 40 tokens still
holds ``max_seq_len`` slots until it finishes, and no other request can use them.

``ContiguousKVCache`` is a real ``transformers.Cache``: hand it to ``model.generate`` and the
model writes its keys and values into the slabs. ``reserved_bytes()`` and ``used_bytes()``
show the gap between what the slabs hold back and what the tokens actually fill.

Per layer the slab for K (and one for V) is ``[max_batch_size, num_kv_heads, max_seq_len,
head_dim]``: the layout attention wants (``[batch, heads, seq, dim]``), so the filled prefix
can be handed to attention as a view, without a copy.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from minikv.models import default_device
from minikv.sizing import cache_shape
from minikv.validation import check_int


def resolve_dtype_device(config, dtype, device) -> tuple[torch.dtype, torch.device]:
    """Defaults for a cache built before it has seen the model's tensors.

    The model's dtype when the config records one, else torch's default; the device
    ``minikv.models.load_model`` would pick. If the model turns out to run elsewhere,
    the caches re-allocate on their first write, while they are still empty.
    """
    if dtype is None:
        dtype = getattr(config, "dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
    return dtype, torch.device(device) if device is not None else default_device()


class SlabLayer(CacheLayerMixin):
    """One layer's slabs: K and V, each ``[max_batch_size, num_kv_heads, max_seq_len, head_dim]``."""

    is_compileable = False  # keeps generate from torch.compile-ing around our Python bookkeeping
    is_croppable = True  # dropping tail tokens is just moving `seq_len` back
    is_sliding = False

    def __init__(self, max_batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.num_rows = 0  # batch rows in use (the slab has max_batch_size of them)
        self.seq_len = 0  # tokens written per row; all rows of a transformers batch move together
        self._allocate(dtype, device)

    def _allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        # The whole worst case, reserved now: this is the point (and the problem) of slabs.
        shape = (self.max_batch_size, self.num_kv_heads, self.max_seq_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.device = self.keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Follow the model's dtype and device; only allowed while nothing is stored."""
        if self.seq_len:
            raise ValueError(
                f"the cache holds {self.keys.dtype} K/V on {self.keys.device}, but the "
                f"model now gives {key_states.dtype} on {key_states.device}; call cache.reset() first, or build "
                "the cache with dtype=model.dtype, device=model.device"
            )
        self._allocate(key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write this step's K/V after the tokens already cached; return every cached token."""
        if (key_states.dtype, key_states.device) != (self.keys.dtype, self.keys.device):
            self.lazy_initialization(key_states, value_states)
        rows, heads, new, dim = key_states.shape
        if (heads, dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"got K/V with {heads} heads of size {dim}; the cache was built for "
                             f"{self.num_kv_heads} KV heads of size {self.head_dim} (wrong config?)")
        if rows > self.max_batch_size:
            raise ValueError(f"a batch of {rows} sequences does not fit: the cache has max_batch_size="
                             f"{self.max_batch_size} slabs. Build it with max_batch_size >= {rows}.")
        if self.seq_len and rows != self.num_rows:
            raise ValueError(f"the batch changed from {self.num_rows} to {rows} sequences mid-generation; "
                             "call cache.reset() before starting a new batch")
        start, end = self.seq_len, self.seq_len + new
        if end > self.max_seq_len:
            raise ValueError(
                f"ContiguousKVCache is full: each sequence would grow to {end} tokens, but its slab was sized "
                f"for max_seq_len={self.max_seq_len} when the cache was built. Build it with max_seq_len >= "
                "prompt length + max_new_tokens, or use minikv.paged.PagedKVCache, which grows block by block."
            )
        self.keys[:rows, :, start:end] = key_states
        self.values[:rows, :, start:end] = value_states
        self.num_rows, self.seq_len = rows, end
        # A view of the filled prefix: attention reads the slab in place.
        return self.keys[:rows, :, :end], self.values[:rows, :, :end]

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called before `update`: attention will see the cached tokens plus the new ones, from 0.
        return self.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return self.max_seq_len

    def reset(self) -> None:
        # No need to zero the slab: reads stop at seq_len, and the next writes overwrite it.
        self.num_rows = self.seq_len = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count (tokens to drop from the end), as in transformers")
        self.seq_len = max(0, self.seq_len + tokens_to_remove)

    def _select_rows(self, index: torch.Tensor) -> None:
        """Make row i hold what row index[i] held (beam search reorders, repeats and drops rows)."""
        index = index.to(self.device)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        if len(index) > self.max_batch_size:
            raise ValueError(f"{len(index)} sequences do not fit in max_batch_size={self.max_batch_size}")
        # index_select copies first, so rows can move onto each other safely.
        for slab in (self.keys, self.values):
            slab[: len(index), :, : self.seq_len] = slab[: self.num_rows, :, : self.seq_len].index_select(0, index)
        self.num_rows = len(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(torch.arange(self.num_rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)


class ContiguousKVCache(Cache):
    """A ``transformers.Cache`` that reserves one worst-case slab per sequence, per layer.

    ``ContiguousKVCache(model.config, max_batch_size=4, max_seq_len=512)`` reserves
    ``4 * 512`` token slots in every layer before the first token arrives.
    """

    # A plain attribute, set in __init__. Declared here because transformers 5.15 (Colab's) has a read-only
    # `Cache.max_batch_size` property (deprecated, removed in 5.16) that would refuse the assignment.
    max_batch_size: int = 0

    def __init__(self, config, max_batch_size: int, max_seq_len: int,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        check_int("max_batch_size", max_batch_size, 1, "sequences the cache holds at once")
        check_int("max_seq_len", max_seq_len, 1, "the slab's length in tokens: the longest sequence it holds")
        self.shape = cache_shape(config)
        dtype, device = resolve_dtype_device(config, dtype, device)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        layers = [SlabLayer(max_batch_size, max_seq_len, self.shape.num_kv_heads, self.shape.head_dim,
                            dtype, device) for _ in range(self.shape.num_layers)]
        super().__init__(layers=layers)

    def reserved_bytes(self) -> int:
        """Bytes the slabs hold back, filled or not: fixed from the moment the cache is built."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    def used_bytes(self) -> int:
        """Bytes holding cached tokens (padding tokens of a padded batch included: they occupy slots)."""
        per_slot = self.shape.num_kv_heads * self.shape.head_dim * self.layers[0].keys.element_size()
        return sum(2 * layer.num_rows * layer.seq_len * per_slot for layer in self.layers)

    def __repr__(self) -> str:
        return (f"ContiguousKVCache(max_batch_size={self.max_batch_size}, max_seq_len={self.max_seq_len}, "
                f"tokens={self.get_seq_length()}, used={self.used_bytes()}/{self.reserved_bytes()} bytes)")
