"""Projections y = x W^T (+ b): one class per way of keeping W, chosen once at load.

- `DenseLinear`: W as it is, through `F.linear`;
- `PackedLinear`: W reordered once for oneDNN (`PACK_ROWS`-row products), optionally the plain W
  kept too for products of `DENSE_ROWS` rows or more;
- `PanelLinear`: tercet's fp32 kernel's panels (`cpu_kernels.packed_linear`);
- `BlockCodeLinear`: the same kernel over a W that is exactly GGUF block codes, kept as GGUF keeps
  them (4-bit codes two a byte, fp16 d and m per block, `cpu_kernels.block_linear`): the panels'
  bits, a sixth of the bytes for Q4_1;
- `Bf16PanelLinear`: tercet's bf16 kernel (AVX512_BF16, `cpu_kernels.bf16_linear`);
- `Bf16BlockCodeLinear`: the bf16 kernel over fp32 weights that are exactly GGUF block codes
  (`cpu_kernels.bf16_block_linear`), each weight rounded to bf16 as it goes: the bf16 panels' bits
  at every number of rows, 0.625 bytes a weight for Q4_1 instead of 2;
- `Int8BlockCodeLinear`: GGUF block codes times int8 activations (`cpu_kernels.i8_block_linear`, the
  opt-in int8 mode: not the exact path's bits, ~2x its products on an AVX2 CPU).

`Linear(...)` picks the class. Which storage pays on a machine is timed at start-up in
`probes.py`; why, with the figures measured, is in docs/cpu-performance.md.

Every class shares the calling convention: `lin(x, upcast=False, tile=None)`. `upcast` is a bf16
product computed as fp32 products on exact upcasts (CPUs without bf16 units). For batch
invariance (the deterministic mode), a path that is not invariant by itself multiplies in fixed
tiles of `tile` rows, or products of at least `min_rows` rows (oneDNN's one-row kernel rounds
otherwise; `probes.onednn_invariant`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels, invariant

PACK_ROWS = 128  # the batch size oneDNN lays prepacked weights out for
DENSE_ROWS = 512  # from here on a PackedLinear with its plain W multiplies through F.linear
BLOCK = 32  # weights of a row per GGUF block (BlockCodeLinear)


class Projection:
    """One projection, W [out, in]; the subclasses keep W their own way."""

    weight: torch.Tensor | None = None  # the plain W, where kept
    packed: torch.Tensor | None = None  # oneDNN's layout (PackedLinear)
    panels: torch.Tensor | None = None  # tercet's fp32 kernel's layout (PanelLinear)
    codes: list[torch.Tensor] | None = None  # codes, scales, offsets (BlockCodeLinear)
    invariant_by_itself = False  # a row's product has the same bits whatever the number of rows

    def __init__(self, shape: tuple[int, int], bias: torch.Tensor | None) -> None:
        self.bias = bias
        self.shape = tuple(shape)  # [out, in]
        self.out_features = self.shape[0]
        self.tile: int | None = None  # multiply in fixed tiles of this many rows (invariance)
        self.min_rows = 1  # pad smaller products with zero rows to this many (invariance)

    def dense(self) -> torch.Tensor:
        """W [out, in] as the products use it."""
        raise NotImplementedError

    def decoder_form(self) -> tuple[int, list[torch.Tensor], int] | None:
        """How csrc/decoder.cpp holds this projection, the same product in C++: its kind, tensors and
        the rows up to which codes serve (-1: every product); None: only Python multiplies it so."""
        return None

    def product(self, x: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        """x W^T without the bias; fp32 when `upcast`."""
        if upcast:
            return F.linear(x.float(), self.dense().float())
        return self._product(x, None)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, upcast: bool = False, tile: int | None = None) -> torch.Tensor:
        tile = self.tile if tile is None else tile
        if tile is not None and not self.invariant_by_itself:
            return invariant.tiled_linear(x, self.product, self.bias, tile, upcast and tile >= 8)
        if 0 < x.shape[0] < self.min_rows:  # padded with zero rows, dropped after
            return self(torch.cat([x, x.new_zeros(self.min_rows - x.shape[0], x.shape[1])]), upcast)[: x.shape[0]]
        if upcast and x.shape[0] >= 8:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.dense().float(), bias).to(x.dtype)
        return self._product(x, self.bias)


class DenseLinear(Projection):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape, bias)
        self.weight = weight

    def dense(self) -> torch.Tensor:
        return self.weight

    def _product(self, x, bias):
        return F.linear(x, self.weight, bias)


class PackedLinear(Projection):
    """W reordered once at load for oneDNN; with `keep_dense`, the plain W too for products of
    DENSE_ROWS rows or more (where the 128-row layout can be slower: `probes.dense_pays`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_dense: bool = False) -> None:
        super().__init__(weight.shape, bias)
        self.weight = weight if keep_dense else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)

    def dense(self) -> torch.Tensor:
        return self.weight if self.weight is not None else self.packed.to_dense()

    def _product(self, x, bias):
        if self.weight is not None and x.shape[0] >= DENSE_ROWS:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class PanelLinear(Projection):
    """tercet's fp32 kernel: W in panels of 16 output columns, one running sum per output over k
    in order, so invariant by itself."""

    invariant_by_itself = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape, bias)
        self.panels = cpu_kernels.pack_linear_weight(weight)

    def dense(self) -> torch.Tensor:
        return _unpanel(self.panels, self.out_features)

    def _product(self, x, bias):
        return cpu_kernels.packed_linear(x, self.panels, self.out_features, bias)

    def decoder_form(self):
        return 0, [self.panels], -1


class UpcastPanelLinear(PanelLinear):
    """A bf16 (or fp16) projection on a CPU without bf16 (fp16) units (`upcast`: fp32 products on the
    exact upcasts of the weights and inputs, the sum rounded to `dtype` once) through tercet's fp32
    kernel: the panels hold the weights as fp32 (exact), so one running sum per output over k in
    order, invariant by itself, with no per-call conversion of W and no tiles. `F.linear` on the
    upcasts, which it replaces, converted all of W each call and, for invariance, multiplied one row
    as a tile of 32: SmolLM2 at batch 1 ran 3.5 tok/s in bf16 against 106 in fp32 on a Zen 3 EPYC."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype=torch.bfloat16) -> None:
        super().__init__(weight.to(dtype).float(), None if bias is None else bias.to(dtype).float())
        self.dtype = dtype

    def dense(self) -> torch.Tensor:
        return super().dense().to(self.dtype)

    def product(self, x: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        y = cpu_kernels.packed_linear(x.float(), self.panels, self.out_features, None)
        return y if upcast else y.to(self.dtype)

    def _product(self, x, bias):
        return cpu_kernels.packed_linear(x.float(), self.panels, self.out_features, bias).to(self.dtype)

    def __call__(self, x: torch.Tensor, upcast: bool = False, tile: int | None = None) -> torch.Tensor:
        return self._product(x, self.bias)  # (every row alike: no tiles, no padding, no other path)

    def decoder_form(self):
        return None  # (the decoder's fp32 kind would return fp32)


class BlockCodeLinear(Projection):
    """The same kernel over GGUF block codes (`codes` from `cpu_kernels.pack_block_codes`): each
    block of 32 weights of a row is float(q) * d + m, rebuilt as the kernel goes, bit for bit."""

    invariant_by_itself = True

    def __init__(self, codes: list[torch.Tensor], out_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__((out_features, codes[1].shape[1] * BLOCK), bias)
        self.codes = codes

    def dense(self) -> torch.Tensor:
        codes, scales, offsets = self.codes  # w = float(q) * d + m per block of 32 k
        if codes.dtype == torch.int32 and codes.shape[1] * 8 == self.shape[1]:  # octets (one int32 a code: not)
            codes, scales, offsets = unpaired_octets(codes, scales, offsets)
        q = _unpack_codes(codes, self.shape[1]).float()
        panels = (q.unflatten(1, (scales.shape[1], -1)) * scales.float()[:, :, None]
                  + offsets.float()[:, :, None]).flatten(1, 2)
        return _unpanel(panels, self.out_features)

    def _product(self, x, bias):
        return cpu_kernels.block_linear(x, *self.codes, self.out_features, bias)

    def decoder_form(self):
        return 1, list(self.codes), -1


class Bf16PanelLinear(Projection):
    """tercet's bf16 kernel (AVX512_BF16, `cpu_kernels.bf16_linear`): W in panels of 16 output
    columns with k in pairs, one fp32 sum per output over the k pairs in order, rounded to bf16
    once: invariant by itself."""

    invariant_by_itself = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape, bias)
        self.panels = cpu_kernels.pack_bf16_weight(weight)

    def dense(self) -> torch.Tensor:  # [P, K/2, 32] = 16 columns x 2 k per pair -> [N, K]
        p, pairs, _ = self.panels.shape
        w = self.panels.view(p, pairs, 16, 2).permute(0, 2, 1, 3).reshape(p * 16, pairs * 2)
        return w[: self.out_features, : self.shape[1]].contiguous()

    def _product(self, x, bias):
        return cpu_kernels.bf16_linear(x, self.panels, self.out_features, bias)

    def decoder_form(self):
        return 2, [self.panels], -1


class Bf16BlockCodeLinear(BlockCodeLinear):
    """tercet's bf16 kernel over fp32 weights kept as GGUF block codes (`codes` from
    `cpu_kernels.pack_bf16_block_codes`): each weight float(q) * d + m rebuilt in fp32 and rounded to
    bf16 as `Bf16PanelLinear`'s panels of the same weights hold it, multiplied by the same vdpbf16ps
    in the same order: that class's bits at every number of rows, so invariant by itself.

    With `panels` (those panels, kept too), products of more than `code_rows` rows go through them:
    where many rows share each weight read, plain loads beat rebuilding weights (`serve_codes_up_to`,
    chosen by `probes.bf16_code_rows`); whichever serves, the bits are the same."""

    def __init__(self, codes: list[torch.Tensor], out_features: int, bias: torch.Tensor | None = None,
                 panels: torch.Tensor | None = None) -> None:
        super().__init__(codes, out_features, bias)
        self.panels = panels
        self.code_rows: int | None = None  # None: every product from the codes

    def serve_codes_up_to(self, rows: int | None) -> None:
        """Products of up to `rows` rows from the codes, more from the panels; None: every product
        from the codes (the panels are dropped)."""
        if rows is not None and self.panels is None:
            raise ValueError("no panels kept beside these codes")
        self.code_rows = rows
        if rows is None:
            self.panels = None

    def dense(self) -> torch.Tensor:
        codes, scales, offsets = self.codes
        return BlockCodeLinear([cpu_kernels.bf16_block_codes_dense(codes, self.shape[1]), scales, offsets],
                               self.out_features).dense().to(torch.bfloat16)

    def _product(self, x, bias):
        if self.code_rows is not None and x.shape[0] > self.code_rows:
            return cpu_kernels.bf16_linear(x, self.panels, self.out_features, bias)
        return cpu_kernels.bf16_block_linear(x, *self.codes, self.out_features, bias)

    def decoder_form(self):
        if self.code_rows is None:
            return 3, list(self.codes), -1
        return 3, [*self.codes, self.panels], self.code_rows


class Int8BlockCodeLinear(Projection):
    """GGUF block codes (0..15 nibbles or int8, `cpu_kernels.pack_i8_codes`) multiplied with int8 activations, the
    opt-in `int8_activations` mode (csrc/gemm_i8.cpp): each row of x rounded to int8 codes per block of 32 k, a
    block's products exact integers, one fp32 sum per output over the blocks in order, so invariant by itself.
    Not the exact path's bits (x is rounded to 8 bits a block, as llama.cpp's Q8_1 activations); the output in x's
    dtype (fp32 or bf16), with no upcast path: every product through the kernel."""

    invariant_by_itself = True

    def __init__(self, codes: list[torch.Tensor], out_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__((out_features, codes[1].shape[1] * BLOCK), bias)
        self.codes = codes

    def dense(self) -> torch.Tensor:
        codes, scales, offsets = self.codes  # [P, B, 128 | 256], [P, B, 8] twice
        panels, blocks = scales.shape[:2]
        if codes.dtype == torch.uint8:  # a 32-byte row holds steps 2t (low nibbles) and 2t + 1 (high)
            raw = codes.view(panels, blocks, 4, 1, 32).int()
            q = torch.cat([raw & 15, raw >> 4], dim=3)  # [P, B, 4, 2, 32] -> steps 2t + h
        else:
            q = codes.int()
        q = q.reshape(panels, blocks, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(panels, 8, blocks, BLOCK)
        w = q.float() * scales.float().transpose(1, 2)[..., None] + offsets.float().transpose(1, 2)[..., None]
        return w.reshape(panels * 8, blocks * BLOCK)[: self.out_features].contiguous()

    def product(self, x: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        return self._product(x, None)  # (no upcast path)

    def _product(self, x, bias):
        return cpu_kernels.i8_block_linear(x, *self.codes, self.out_features, bias)

    def __call__(self, x: torch.Tensor, upcast: bool = False, tile: int | None = None) -> torch.Tensor:
        return self._product(x, self.bias)  # (every row alike: no tiles, no padding, no other path)

    def decoder_form(self):
        return 4, list(self.codes), -1


def int8_block_codes(weight: torch.Tensor) -> list[torch.Tensor]:
    """W's block codes in `Int8BlockCodeLinear`'s layout, or [] where W is not exactly codes it takes (Q4_1's 0..15
    or Q8_0's int8; not Q4_0's signed nibbles)."""
    found = cpu_kernels.pack_block_codes(weight.float())
    return cpu_kernels.pack_i8_codes(*found) if found else []


def fp32_block_codes(weight: torch.Tensor) -> list[torch.Tensor]:
    """W's block codes as the fp32 kernel reads them fastest, or [] where W is not exactly codes:
    `pack_block_codes`' layout, with 0..15 codes and fp16 d, m as octets where this build prefers
    them (AVX2: the same bytes and bits; ~10 % faster at one and two rows, and 1.2-1.6x at three and
    four, which octets take straight from the codes where nibbles go through a buffer)."""
    found = cpu_kernels.pack_block_codes(weight)
    if found and found[0].dtype == torch.uint8 and found[1].dtype == torch.float16 and cpu_kernels.octet_codes_preferred():
        found = cpu_kernels.octet_codes(*found)
    return found


def unpaired_octets(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
    """`octet_codes`' three in pairs of panels -> panel after panel ([P, K/8, 16], [P, K/32, 16] twice)."""
    def unpair(t: torch.Tensor, rows: int) -> torch.Tensor:  # `rows` rows a panel and block
        panels, groups, lanes = t.shape[0], t.shape[1] // rows, t.shape[2]
        whole = panels // 2 * 2
        flat = t.reshape(-1, lanes)
        pairs = flat[: whole * groups * rows].view(whole // 2, groups, 2, rows, lanes).transpose(1, 2)
        return torch.cat([pairs.reshape(whole, groups * rows, lanes),
                          flat[whole * groups * rows :].view(panels - whole, groups * rows, lanes)])
    return [unpair(codes, 4), unpair(scales, 1), unpair(offsets, 1)]


def _unpack_codes(codes: torch.Tensor, k: int) -> torch.Tensor:
    """Block codes as `pack_block_codes` keeps them -> one int per code [P, K, 16]: two a byte
    (k = 2i low nibble, 2i + 1 high; uint8 0..15, int8 -8..7) where they have K / 2 rows; eight an
    int32 (`cpu_kernels.octet_codes`: k = 32g + 4t + j in bits 4t of row 4g + j, panel after panel:
    `unpaired_octets`) where K / 8."""
    if codes.shape[1] == k:
        return codes
    if codes.dtype == torch.int32:  # octets [P, G * 4 (j), 16] -> fields [P, G, t, j, 16]
        rows = codes.view(len(codes), k // BLOCK, 4, 16)
        fields = torch.stack([(rows >> (4 * t)) & 15 for t in range(8)], dim=2)
        return fields.reshape(len(codes), k, 16)
    wide = codes.int()
    low, high = wide & 15, (wide >> 4) & 15
    if codes.dtype == torch.int8:  # two's complement nibbles
        low, high = (low ^ 8) - 8, (high ^ 8) - 8
    return torch.stack([low, high], dim=2).flatten(1, 2)


def _unpanel(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """[P, K, 16] -> [P * 16, K], less the padding."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:out_features].contiguous()


def Linear(weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False,  # noqa: N802 - a factory
           keep_dense: bool = False, kernel: bool = False, codes: bool = False,
           dtype: torch.dtype | None = None) -> Projection:
    """The projection for W in `dtype` (default W's): tercet's kernel (`kernel`: with `codes`, block
    codes where W is exactly such codes, in bf16 or fp32, else bf16 or fp32 panels), oneDNN's
    prepacked W (`packed`, the plain W kept too with `keep_dense`), or W as it is. An fp32 W for a
    bf16 projection is the weight as stored (a GGUF's, dequantized): its codes are found in it, before
    it is rounded to bf16; with `keep_dense`, the bf16 panels are kept beside them (for products of
    many rows, `Bf16BlockCodeLinear`)."""
    dtype = weight.dtype if dtype is None else dtype
    if kernel and dtype == torch.bfloat16:
        found = cpu_kernels.pack_bf16_block_codes(weight) if codes and weight.dtype == torch.float32 else []
        if not found:
            return Bf16PanelLinear(weight.to(dtype), bias)
        panels = cpu_kernels.pack_bf16_weight(weight.to(dtype)) if keep_dense else None
        return Bf16BlockCodeLinear(found, weight.shape[0], bias, panels)
    weight = weight.to(dtype)
    if kernel:
        found = fp32_block_codes(weight) if codes else []  # [] where W is not exactly codes
        return BlockCodeLinear(found, weight.shape[0], bias) if found else PanelLinear(weight, bias)
    if packed:
        return PackedLinear(weight, bias, keep_dense)
    return DenseLinear(weight, bias)
