"""Rotary embedding tables: cos and sin of each position's angles, a function of the position alone.

A step's rows carry positions; their rotary cos / sin are rows of a table kept per rotary key
(`RotaryTable.at`), grown as longer positions come, and every entry is computed the same way
whenever it is computed: the angle is the fp32 product `float(position) * inv_freq[i]` (what
transformers computes), its cos and sin come from the C library in double precision
(`math.cos`, `math.sin`: one scalar routine, no threads, no dispatch), rounded to fp32, scaled
by the rotary scale in fp32 and cast to the model dtype. So a row's table, and through rope its
q and its stored k, never depend on the step it runs in.

Not torch's `cos` / `sin` per step: on CPU they run through MKL's VML in chunks of 2,048 elements
per thread, and the first such threaded call in a process can give a chunk other bits. A step of
33 rows or more with 64-dim heads is such a call; a restarted scheduler's first one re-prefills
the resumed streams, whose K/V, rounded to bf16, then differed from the ones the crashed process
had computed -- and the resumed text with them (docs/deterministic.md, what was measured).
"""

from __future__ import annotations

import math

import numpy as np
import torch

MIN_POSITIONS = 256  # rows a table starts with; it grows to the next power of two past a step's positions


class RotaryTable:
    """cos and sin [positions, 1, 2 * len(inv_freq)] in the model dtype, for one rotary key."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype, device) -> None:
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.scale = float(scale)
        self.dtype, self.device = dtype, torch.device(device)
        self.cos = self.sin = torch.empty(0, 1, 2 * len(self.inv_freq), dtype=dtype, device=self.device)
        self._grow(MIN_POSITIONS)

    def __len__(self) -> int:
        return self.cos.shape[0]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `positions` [T] (int64, on the table's device): (cos, sin), each [T, 1, D]."""
        if len(positions):
            top = int(positions.max()) + 1
            if top > len(self):
                self._grow(1 << (top - 1).bit_length())
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def _grow(self, size: int) -> None:
        """Extend the tables to `size` positions (the rows there already are kept as they are)."""
        cos, sin = rotary_rows(range(len(self), size), self.inv_freq, self.scale)
        self.cos = torch.cat([self.cos, cos.to(self.device, self.dtype)])
        self.sin = torch.cat([self.sin, sin.to(self.device, self.dtype)])


def rotary_rows(positions, inv_freq: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [len(positions), 1, 2 * len(inv_freq)] of the given positions: each entry a
    function of its position and frequency alone (see the module's docstring)."""
    angles = torch.tensor(list(positions), dtype=torch.float32)[:, None] * inv_freq  # fp32 products, exact IEEE
    flat = angles.reshape(-1).tolist()

    def table(function):  # fp64 results rounded to fp32 (to nearest even), then scaled in fp32
        values = torch.from_numpy(np.fromiter(map(function, flat), np.float64, len(flat)))
        half = values.view(angles.shape).float() * scale
        return torch.cat((half, half), dim=-1)[:, None, :]
    return table(math.cos), table(math.sin)
