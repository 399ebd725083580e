"""Model loading, the paged KV cache, batched forward and sampling.

Synchronous (no trio): the Scheduler actor drives it one step at a time.

    loaded = load_model()                     # embedded SmolLM2 (or a path)
    runner = ModelRunner(loaded, page_size=1)
    pages = runner.kv.allocate(runner.kv.pages_for(len(prompt) + 1))
    out = runner.step([SeqInput(prompt, pages, num_cached=0, params=SamplingParams(seed=7))])
    out.token_ids[0], out.logprobs[0]
    runner.kv.free(pages)
"""

from .errors import InvalidBatch, ModelLoadError, OutOfPages
from .kv_cache import DEFAULT_BUDGET_BYTES, KVCache
from .loading import LoadedModel, load_model, load_tokenizer, tiny_config, tiny_model
from .runner import ModelRunner, SeqInput, StepOutput, default_dtype, generate
from .sampling import GREEDY, SamplingParams, random_seed

__all__ = [
    "DEFAULT_BUDGET_BYTES", "GREEDY", "InvalidBatch", "KVCache", "LoadedModel", "ModelLoadError",
    "ModelRunner", "OutOfPages", "SamplingParams", "SeqInput", "StepOutput", "default_dtype",
    "generate", "load_model", "load_tokenizer", "random_seed", "tiny_config", "tiny_model",
]
