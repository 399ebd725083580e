"""ModelRunner: one forward + sample per step over a ragged batch.

The Scheduler owns which requests run; the runner owns the weights, the
paged KV cache (`runner.kv`: allocate / free / num_free) and the batch
layout. A step is a list of `SeqInput`s, any mix of prefill chunks
(possibly after a cached prefix) and decode tokens, flattened without
padding into one forward pass.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .attention import AttentionPlan, PrefillChunk, decode_gather_plan
from .errors import InvalidBatch
from .kv_cache import DEFAULT_BUDGET_BYTES, KVCache
from .layers import CausalLM
from .loading import LoadedModel
from .sampling import GREEDY, SamplingParams, sample


@dataclass
class SeqInput:
    token_ids: Sequence[int]  # new tokens: a prompt chunk, or the last sampled token
    page_table: Sequence[int]  # the sequence's pages in order, covering cached + new tokens
    num_cached: int = 0  # tokens whose K/V are already in those pages (own or shared prefix)
    sample: bool = True  # draw the next token after the last new one
    params: SamplingParams = GREEDY
    prompt_ids: Sequence[int] = ()  # for the repetition penalty
    output_ids: Sequence[int] = ()  # tokens generated so far (penalties)


@dataclass
class StepOutput:
    """Aligned with the step's inputs; None where a SeqInput had sample=False."""

    token_ids: list[int | None] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        page_size: int = 1,
        kv_budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        self.device = torch.device(device)
        dtype = dtype if dtype is not None else default_dtype(self.device)
        self.dtype = dtype
        self.tokenizer = model.tokenizer
        self.eos_token_ids = model.eos_token_ids
        self.config = model.config
        self.model = CausalLM(model.config, model.state_dict, dtype, self.device)
        self.kv = KVCache(
            num_layers=self.model.num_layers, num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim, dtype=dtype, device=self.device,
            page_size=page_size, budget_bytes=kv_budget_bytes,
        )
        self.use_triton = (
            self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        )

    @torch.inference_mode()
    def step(self, seqs: Sequence[SeqInput]) -> StepOutput:
        if not seqs:
            return StepOutput()
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) != 1)
        input_ids, positions, plan, last_rows = self._layout([seqs[i] for i in order])
        hidden = self.model.forward(input_ids, positions, plan, self.kv.k, self.kv.v)
        wanted = [j for j, i in enumerate(order) if seqs[i].sample]
        out = StepOutput([None] * len(seqs), [None] * len(seqs), [None] * len(seqs))
        if not wanted:
            return out
        picked = [seqs[order[j]] for j in wanted]
        logits = self.model.logits(hidden[torch.tensor([last_rows[j] for j in wanted])])
        drawn = sample(
            logits, [s.params for s in picked],
            [s.num_cached + len(s.token_ids) for s in picked],
            [s.prompt_ids for s in picked], [s.output_ids for s in picked],
        )
        for k, j in enumerate(wanted):
            i = order[j]
            out.token_ids[i] = drawn.token_ids[k]
            out.logprobs[i] = drawn.logprobs[k]
            out.top_logprobs[i] = drawn.top_logprobs[k]
        return out

    def _layout(self, seqs: list[SeqInput]):
        ps, dev = self.kv.page_size, self.device
        num_decode = sum(1 for s in seqs if len(s.token_ids) == 1)
        for s in seqs:
            if not s.token_ids:
                raise InvalidBatch("a SeqInput has no new tokens")
            needed = self.kv.pages_for(s.num_cached + len(s.token_ids))
            if len(s.page_table) < needed:
                raise InvalidBatch(
                    f"page table of {len(s.page_table)} pages cannot hold "
                    f"{s.num_cached}+{len(s.token_ids)} tokens (page_size {ps})"
                )
        decode, prefill = seqs[:num_decode], seqs[num_decode:]
        ids = [s.token_ids[0] for s in decode]
        pos = [s.num_cached for s in decode]
        if decode:
            widest = max(self.kv.pages_for(s.num_cached + 1) for s in decode)
            table = torch.tensor(
                [list(s.page_table[:widest]) + [0] * (widest - len(s.page_table[:widest])) for s in decode],
                dtype=torch.int32,
            )
            context_lens = torch.tensor([s.num_cached + 1 for s in decode], dtype=torch.int32)
            table, context_lens = table.to(dev), context_lens.to(dev)
        else:
            table = torch.zeros(0, 1, dtype=torch.int32, device=dev)
            context_lens = torch.zeros(0, dtype=torch.int32, device=dev)
        last_rows = list(range(num_decode))
        slot_parts = [(table.long()[torch.arange(num_decode), (context_lens.long() - 1) // ps] * ps
                       + (context_lens.long() - 1) % ps)] if decode else []
        chunks, row = [], num_decode
        for s in prefill:
            n, cached = len(s.token_ids), s.num_cached
            pages = torch.tensor(s.page_table[: self.kv.pages_for(cached + n)], dtype=torch.long)
            context = torch.arange(cached + n)
            context_slots = (pages[context // ps] * ps + context % ps).to(dev)
            slot_parts.append(context_slots[cached:])
            mask = None
            if cached:
                mask = (context[None, :] <= (cached + torch.arange(n))[:, None])[None, None].to(dev)
            chunks.append(PrefillChunk(row, row + n, context_slots if cached else None, mask))
            ids.extend(s.token_ids)
            pos.extend(range(cached, cached + n))
            row += n
            last_rows.append(row - 1)
        plan = AttentionPlan(
            slots=torch.cat(slot_parts), num_decode=num_decode, page_table=table,
            context_lens=context_lens, page_size=ps,
            decode_gather=decode_gather_plan(table, context_lens, ps) if decode and not self.use_triton else None,
            prefills=chunks, use_triton=self.use_triton,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, torch.tensor(pos, dtype=torch.long, device=dev), plan, last_rows


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the hardware multiplies bf16 natively (CUDA, AVX512-BF16/AMX CPUs), else fp32.

    On an AVX2-only CPU a bf16 matmul is emulated and runs 4-5x slower than
    fp32 at batch 64 (measured: 2.2 s vs 0.47 s per SmolLM2 decode step).
    """
    if device.type != "cpu":
        return torch.bfloat16
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return torch.float32
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32


def generate(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams = GREEDY,
    prefill_chunk: int | None = None,
    output_so_far: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """A plain static-batch loop (no eos stop): for tests, benchmarks and examples.

    `output_so_far[i]` are tokens generated before a restart, already at the
    end of `prompts[i]`: they count as output for the penalties.
    """
    prior = [list(p) for p in output_so_far] if output_so_far else [[] for _ in prompts]
    tables = [runner.kv.allocate(runner.kv.pages_for(len(p) + max_new_tokens)) for p in prompts]
    try:
        outputs: list[list[int]] = [[] for _ in prompts]
        cached = [0] * len(prompts)
        chunk = prefill_chunk or max(len(p) for p in prompts)
        while any(c < len(p) for c, p in zip(cached, prompts)):  # (chunked) prefill
            batch, who = [], []
            for i, p in enumerate(prompts):
                if cached[i] < len(p):
                    new = p[cached[i] : cached[i] + chunk]
                    last = cached[i] + len(new) == len(p)
                    batch.append(SeqInput(new, tables[i], cached[i], last, params, p, prior[i]))
                    who.append(i)
            result = runner.step(batch)
            for i, s, token in zip(who, batch, result.token_ids):
                cached[i] += len(s.token_ids)
                if token is not None:
                    outputs[i].append(token)
        while len(outputs[0]) < max_new_tokens:
            batch = [
                SeqInput([out[-1]], tables[i], len(prompts[i]) + len(out) - 1, True, params, prompts[i], prior[i] + out)
                for i, out in enumerate(outputs)
            ]
            for out, token in zip(outputs, runner.step(batch).token_ids):
                out.append(token)
        return outputs
    finally:
        for table in tables:
            runner.kv.free(table)
