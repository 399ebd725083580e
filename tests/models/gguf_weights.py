"""Weights as tercet loads a GGUF's, for the block-code tests (test_nibble_codes, test_bf16_codes)."""

import torch


def quantized(out_features: int, k: int, kind: str, seed: int = 0) -> torch.Tensor:
    """A weight quantized by gguf-py (llama.cpp's formats) and dequantized; "mixed": Q4_1 rows over
    Q8_0 rows (a fused q/k/v of differently quantized parts)."""
    from gguf import GGMLQuantizationType, quants

    if kind == "mixed":
        half = out_features // 2
        return torch.cat([quantized(half, k, "q4_1", seed), quantized(out_features - half, k, "q8_0", seed + 1)])
    kinds = {"q4_1": GGMLQuantizationType.Q4_1, "q4_0": GGMLQuantizationType.Q4_0, "q8_0": GGMLQuantizationType.Q8_0}
    weight = (torch.randn(out_features, k, generator=torch.Generator().manual_seed(seed)) * 0.05).numpy()
    return torch.from_numpy(quants.dequantize(quants.quantize(weight, kinds[kind]), kinds[kind]).copy())
