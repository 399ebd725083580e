"""Session-wide models for the models/ tests.

The real SmolLM2 model is converted from its GGUF file once per machine
(~40 s, then cached under the user cache dir) and loaded once per session;
the tiny random models reuse its tokenizer.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from models.loading import load_model, tiny_config, tiny_model, to_transformers  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    return load_model()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    return to_transformers(smollm2, torch.float32)


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}
TINY_CONFIGS = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3": ("qwen3", {"head_dim": 16}),  # q/k norms
    "mistral": ("mistral", {"sliding_window": None}),
}


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny(request):
    model_type, overrides = TINY_CONFIGS[request.param]
    return tiny_model(tiny_config(model_type, **overrides), seed=1)


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_model(seed=0)


def _hf_greedy(hf_model, prompt, max_new_tokens):
    """transformers' own greedy continuation (stops at eos, like ours should)."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def _assert_same_greedy(ours, reference, max_new_tokens, eos_ids):
    """Ours (never stopping) agrees with transformers' (which stops at eos).

    Ours must hold all `max_new_tokens`; the reference must too, or stop
    early on an eos token; and ours must match the whole reference.
    """
    assert len(ours) == max_new_tokens, f"ours stopped after {len(ours)} of {max_new_tokens} tokens"
    if len(reference) < max_new_tokens:
        assert reference and reference[-1] in eos_ids, (
            f"transformers stopped after {len(reference)} of {max_new_tokens} tokens without eos"
        )
    assert ours[: len(reference)] == reference, f"ours {ours} != transformers' {reference}"


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


@pytest.fixture(scope="session")
def assert_same_greedy():
    return _assert_same_greedy
