"""Cache appends without copying the whole cache: `GrowingLayer`, a `DynamicLayer` with spare positions.

transformers' `DynamicCache` appends with `torch.cat`, copying the whole cache into 24 new blocks a GPT-2 step
(above glibc's mmap threshold, fresh pages faulted in one by one). `GrowingLayer` writes a step's positions
into buffers with spare room; `layer.keys` and `layer.values` are views of their first positions, so every
reader sees what a `DynamicLayer` holds, with the buffers' strides. transformers' edits of a layer (`crop`,
`batch_select_indices`, `reorder_cache`, `reset`, ...) assign new tensors as for a `DynamicLayer`: the next
update keeps the buffer where they are still its first positions (a crop), else copies them into a new one.
`grow_in_place(cache)` converts the layers of the cache object the caller holds; the one-call decoding step
(`hfgpt.cpu.decoding`) calls it.
"""

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# Spare positions a buffer gets when it is (re)allocated: a quarter of the positions it must hold, and at
# least this many.
MIN_SPARE = 64


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose update writes the new positions into buffers with spare room; where that does
    not apply (`_writes`), it updates as a `DynamicLayer` does."""

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
        cached ones (a prompt's at least), with room for `extra` more, for a kernel that writes a step's keys
        and values into them; `advance(extra)` then makes them the layer's."""
        self._key_buffer = _reserve(self.keys, self._key_buffer, extra)
        self._value_buffer = _reserve(self.values, self._value_buffer, extra)
        return self._key_buffer, self._value_buffer

    def advance(self, extra: int) -> None:
        """The layer holds the `extra` positions written after its cached ones in `reserve`'s buffers."""
        length = self.keys.shape[-2] + extra
        self.keys = self._key_buffer.narrow(2, 0, length)
        self.values = self._value_buffer.narrow(2, 0, length)

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
    """Turn the `DynamicLayer`s of `cache`, a plain `DynamicCache` (a subclass may depend on its layers'
    type), into `GrowingLayer`s holding the same tensors, and so the layers it adds as it fills (a cache
    made without a config adds one per layer on its first update); anything else is left as it is."""
    if type(cache) is not DynamicCache:
        return
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    layers = cache.layers
    for index, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            layers[index] = GrowingLayer.from_layer(layer)
