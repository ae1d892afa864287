"""A state dict as one byte buffer: where each tensor sits, so that a transport copies a publication
into a buffer allocated once (the broadcast's send buffer, the shared slots) and the receiving side
reads it back as views of its own buffer, without a copy per tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tba.weights.base import map_shared

ALIGN = 64  # byte offsets of the tensors in the buffer (any dtype's view of them is aligned)


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a state dict sits in one byte buffer: ``entries`` holds (name, dtype,
    shape, byte offset); tied names share an offset."""

    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    nbytes: int

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> Layout:
        end = 0

        def place(t: torch.Tensor) -> int:  # called once per distinct tensor (ties: map_shared)
            nonlocal end
            at, end = end, end + -(-t.numel() * t.element_size() // ALIGN) * ALIGN
            return at

        offsets = map_shared(state, place)
        entries = [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), offsets[k]) for k, t in state.items()]
        return cls(tuple(entries), end)

    def fill(self, buffer: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` into ``buffer`` (bytes) at this layout's offsets."""
        for (name, _, _, _), view in zip(self.entries, self.views(buffer).values(), strict=True):
            view.copy_(state[name])

    @staticmethod
    def holds(buffer: torch.Tensor, state: dict[str, torch.Tensor]) -> bool:
        """Whether ``state`` is already views of ``buffer`` (what :meth:`views` of it returned)."""
        first = next(iter(state.values()))
        return first.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state dict that ``buffer`` holds, as views of it (tied names: one tensor)."""
        out, made = {}, {}
        for name, dtype, shape, offset in self.entries:
            if (offset, dtype) not in made:
                dt = getattr(torch, dtype)  # a dtype's name as str(dtype) writes it
                size = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                made[(offset, dtype)] = buffer[offset : offset + size].view(dt).view(shape)
            out[name] = made[(offset, dtype)]
        return out
