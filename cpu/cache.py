"""Cache appends without copying the whole cache: `GrowingLayer`, a `DynamicLayer` with spare positions.

transformers' `DynamicCache` appends a decoding step's keys and values to each layer with `torch.cat`, which
copies the whole cache into a fresh tensor at every step. A step of GPT-2 then copies every layer's keys
and values (B x 12 heads x T positions x 64 floats, twice, in 12 layers) and asks the allocator for 24 new
blocks, which above glibc's mmap threshold are fresh pages faulted in one by one.

`GrowingLayer` keeps each layer's keys and values in buffers with spare positions and writes a step's new
positions into them; `layer.keys` and `layer.values` are views of the buffers' first positions, so every
reader of the cache (sdpa, the one-call step's attention, `get_seq_length`, the masks) sees what a
`DynamicLayer` holds, with the buffers' strides. transformers' own edits of a layer (`crop`,
`batch_select_indices`, `batch_repeat_interleave`, `reorder_cache`, `reset`) assign new tensors to
`keys` and `values` as for a `DynamicLayer`: the next update keeps using the buffer where the new keys
are still its first positions (a crop), and otherwise copies them into a new buffer.

`grow_in_place(cache)` turns the `DynamicLayer`s of a plain `DynamicCache` into `GrowingLayer`s, keeping
the object that the caller (`generate()`, a user's loop) holds; the CPU backend's one-call decoding step
calls it on the cache it is given (`hfgpt.cpu.decoding`).
"""

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# Spare positions a buffer gets when it is (re)allocated: a quarter of the positions it must hold, and at
# least this many.
MIN_SPARE = 64


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose update writes the new positions into buffers with spare room instead of
    concatenating. Where the write does not apply (autograd through the cache, a compiled graph, tensors of
    another dtype, device or shape than the buffers'), it updates as a `DynamicLayer` does."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    @classmethod
    def from_layer(cls, layer: DynamicLayer) -> "GrowingLayer":
        """A `GrowingLayer` holding what `layer` holds (its attributes, the same tensors)."""
        grown = cls.__new__(cls)
        grown.__dict__.update(layer.__dict__)
        return grown

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        empty = not self.is_initialized or self.keys.numel() == 0
        if not self._writes(key_states, value_states, empty):
            return super().update(key_states, value_states, *args, **kwargs)
        if empty:  # the prompt: buffers start with its positions
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.keys, self._key_buffer = _append(self.keys, self._key_buffer, key_states)
        self.values, self._value_buffer = _append(self.values, self._value_buffer, value_states)
        return self.keys, self.values

    def reserve(self, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers, (B, H, capacity, D) and contiguous, whose first positions hold the
        cached ones, with room for `extra` more: for a kernel that writes a step's keys and values into them
        itself (hfgpt's int8 decoding step), after which `advance(extra)` makes them the layer's. The layer
        must hold keys already (a prompt's)."""
        self._key_buffer = _reserve(self.keys, self._key_buffer, extra)
        self._value_buffer = _reserve(self.values, self._value_buffer, extra)
        return self._key_buffer, self._value_buffer

    def advance(self, extra: int) -> None:
        """The layer holds the `extra` positions written after its cached ones in `reserve`'s buffers."""
        length = self.keys.shape[-2] + extra
        self.keys, self.values = (
            self._key_buffer.narrow(2, 0, length),
            self._value_buffer.narrow(2, 0, length),
        )

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()

    def _writes(self, key_states: torch.Tensor, value_states: torch.Tensor, empty: bool) -> bool:
        """Whether this update writes into the buffers: eager, no autograd through the cache, and (B, H, T, D)
        states that start the cache (`empty`: nothing cached yet) or extend the cached ones (same dtype,
        device, batch, heads and head size)."""
        if torch.compiler.is_compiling() or key_states.dim() != 4 or key_states.shape != value_states.shape:
            return False
        tensors = (key_states, value_states) if empty else (key_states, value_states, self.keys, self.values)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return False
        if empty:
            return key_states.dtype == value_states.dtype and key_states.device == value_states.device
        keys, values = self.keys, self.values
        return (
            keys.dim() == 4
            and keys.shape == values.shape
            and keys.shape[:2] == key_states.shape[:2]
            and keys.shape[-1] == key_states.shape[-1]
            and keys.dtype == key_states.dtype == value_states.dtype == values.dtype
            and keys.device == key_states.device == value_states.device == values.device
        )


def _prefix_of(cached: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    """Whether `cached` is the first positions of `buffer` (a view the layer handed out, or a crop of it)."""
    return (
        buffer is not None
        and cached.data_ptr() == buffer.data_ptr()
        and cached.stride() == buffer.stride()
        and cached.shape[:2] == buffer.shape[:2]
        and cached.shape[-1] == buffer.shape[-1]
        and cached.shape[-2] <= buffer.shape[-2]
    )


def _reserve(cached: torch.Tensor, buffer: torch.Tensor | None, extra: int) -> torch.Tensor:
    """A buffer whose first positions are `cached`, with room for `extra` more: `buffer` where `cached` is
    its first positions, it has the room and it may be written here, else a new one with a quarter spare
    that receives a copy of `cached`."""
    length = cached.shape[-2]
    if (
        not _prefix_of(cached, buffer)
        or length + extra > buffer.shape[-2]
        # a buffer made under `torch.inference_mode()` can be written only there
        or (buffer.is_inference() and not torch.is_inference_mode_enabled())
    ):
        need = length + extra
        batch, heads, _, dim = cached.shape
        buffer = cached.new_empty(batch, heads, need + max(need // 4, MIN_SPARE), dim)
        buffer[:, :, :length].copy_(cached)
    return buffer


def _append(
    cached: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cached positions followed by `new`, as a view of the buffer's first positions; the buffer),
    `new` written into `_reserve`'s buffer."""
    length, extra = cached.shape[-2], new.shape[-2]
    buffer = _reserve(cached, buffer, extra)
    buffer[:, :, length : length + extra].copy_(new)
    return buffer[:, :, : length + extra], buffer


def grow_in_place(cache: object) -> None:
    """Turn the `DynamicLayer`s of `cache`, a plain `DynamicCache` (not a subclass, which may depend on
    its layers' type), into `GrowingLayer`s holding the same tensors, and the layers it adds as it fills
    (a cache made without a config adds one per layer on its first update) into `GrowingLayer`s too;
    anything else is left as it is."""
    if type(cache) is not DynamicCache:
        return
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    layers = cache.layers
    for index, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            layers[index] = GrowingLayer.from_layer(layer)
