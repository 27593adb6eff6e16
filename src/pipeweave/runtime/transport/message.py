"""What an activation or gradient message holds, and the metadata that describes it once per stream.

A message is one tensor, sent as it is, or a tuple of tensors (a custom
model's layers may pass several, ``models.boundary``), packed into one byte
buffer: its tensors' bytes one after the other, each starting at a multiple of
``ALIGN`` bytes so that the receiver can view each as its dtype in place.
Dimension 0 of every tensor is the microbatch, which both ends know, so the
metadata -- ``META_LEN`` int64 values, sent before a stream's first message --
holds what they do not: for one tensor its dtype code, the number of its
per-sample dimensions and those dimensions; for a tuple, minus the number of
tensors, then those three for each tensor (dimensions padded to ``MAX_DIMS``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeweave.models.boundary import MAX_TENSORS

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
MAX_DIMS = 8
META_LEN = 1 + MAX_TENSORS * (2 + MAX_DIMS)
ALIGN = 8


def tensor_meta(tensor: torch.Tensor) -> torch.Tensor:
    """The metadata of a stream of single tensors like ``tensor``.

    Raises:
        ValueError: a dtype outside ``DTYPES`` or more than ``MAX_DIMS`` per-sample dimensions.
    """
    sample = tuple(tensor.shape[1:])
    if len(sample) > MAX_DIMS or tensor.dtype not in DTYPES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
    values = [DTYPES.index(tensor.dtype), len(sample), *sample]
    return torch.tensor(values + [0] * (META_LEN - len(values)), dtype=torch.int64)


def read_meta(values: list[int]) -> tuple[torch.dtype, tuple[int, ...]] | Layout:
    """A received metadata message: ``(dtype, per-sample shape)`` of a single tensor, or a tuple's ``Layout``.

    Example:
        >>> read_meta(tensor_meta(torch.zeros(5, 2, 3)).tolist())
        (torch.float32, (2, 3))
    """
    if values[0] < 0:
        return Layout.decode(values)
    ndim = values[1]
    return DTYPES[values[0]], tuple(values[2 : 2 + ndim])


@dataclass(frozen=True)
class Layout:
    """A tuple message's tensors: dtype and per-sample shape of each, packed into one byte buffer.

    Example:
        >>> parts = (torch.ones(2, 3), torch.tensor([True, False]))
        >>> layout = Layout.of(parts)
        >>> layout.spans(2), [t.tolist() for t in layout.unpack(layout.pack(parts, 2), 2)]
        ([(0, 24), (24, 2)], [[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [True, False]])
    """

    entries: tuple[tuple[torch.dtype, tuple[int, ...]], ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> Layout:
        return cls(tuple((t.dtype, tuple(t.shape[1:])) for t in tensors))

    def spans(self, samples: int) -> list[tuple[int, int]]:
        """(offset, bytes) of each tensor in the buffer of a microbatch of ``samples``."""
        out, offset = [], 0
        for dtype, sample in self.entries:
            n = samples * dtype.itemsize * math.prod(sample)
            out.append((offset, n))
            offset += -(-n // ALIGN) * ALIGN
        return out

    def nbytes(self, samples: int) -> int:
        spans = self.spans(samples)
        return spans[-1][0] + spans[-1][1] if spans else 0

    def pack(self, tensors: Sequence[torch.Tensor], samples: int) -> torch.Tensor:
        device = tensors[0].device if tensors else torch.device("cpu")
        buffer = torch.empty(self.nbytes(samples), dtype=torch.uint8, device=device)
        for t, (offset, n) in zip(tensors, self.spans(samples)):
            buffer[offset : offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
        return buffer

    def unpack(self, buffer: torch.Tensor, samples: int) -> tuple[torch.Tensor, ...]:
        return tuple(
            buffer[offset : offset + n].view(dtype).view(samples, *sample)
            for (dtype, sample), (offset, n) in zip(self.entries, self.spans(samples))
        )

    def encode(self) -> torch.Tensor:
        if len(self.entries) > MAX_TENSORS:
            raise ValueError(f"cannot send a tuple of {len(self.entries)} tensors (at most {MAX_TENSORS})")
        values = [-len(self.entries)]
        for dtype, sample in self.entries:
            if len(sample) > MAX_DIMS or dtype not in DTYPES:
                raise ValueError(f"cannot send a {dtype} tensor of per-sample shape {sample}")
            values += [DTYPES.index(dtype), len(sample), *sample, *[0] * (MAX_DIMS - len(sample))]
        return torch.tensor(values + [0] * (META_LEN - len(values)), dtype=torch.int64)

    @classmethod
    def decode(cls, values: list[int]) -> Layout:
        entries, at = [], 1
        for _ in range(-values[0]):
            ndim = values[at + 1]
            entries.append((DTYPES[values[at]], tuple(values[at + 2 : at + 2 + ndim])))
            at += 2 + MAX_DIMS
        return cls(tuple(entries))
