"""Grammar backends for constrained decoding, side by side: llguidance and xgrammar.

For the embedded SmolLM2's tokenizer (49,152 tokens) and a typical JSON schema
(an object of strings, numbers, an enum and a nested array of objects):

- compile_ms: the schema to a matcher-ready grammar (median of several, cold cache);
- mask_us_per_token: batch 32 matchers walking a valid document token by token;
  per step every matcher's next-token bitmask is filled (each library's batched
  API) and every matcher consumes its token; the figure is the time of one step
  divided by 32 (the per-request cost inside a batched step);
- first_mask_ms: the first mask of a fresh matcher (what a new request pays).

    python -m benchmarks.bench_grammar [--batch 32] [--json out.json]
    python -m benchmarks.bench_grammar --smoke

The ratio xgrammar / llguidance of each figure is in the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "height_m": {"type": "number"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "height_m", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "height_m": 1.65, "role": "admin", "tags": ["math", "engines"],
            "address": {"city": "London", "zip": "W1"}}


def llguidance_backend(tokenizer):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer)
    executor = llguidance.LLExecutor()

    def compile_schema():
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))

    def matchers(grammar, n):
        return [llguidance.LLMatcher(lltok, grammar) for _ in range(n)]

    def bitmask(n):
        return llguidance.torch.allocate_token_bitmask(n, lltok.vocab_size)

    def fill(ms, mask):
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], mask)

    def consume(ms, tokens):
        for m, t in zip(ms, tokens):
            assert m.consume_token(t), m.get_error()

    def check(ms):
        assert all(m.is_accepting() for m in ms)

    return compile_schema, matchers, bitmask, fill, consume, check


def xgrammar_backend(tokenizer):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    batch = xgr.BatchGrammarMatcher()

    def compile_schema():
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)

    def matchers(grammar, n):
        return [xgr.GrammarMatcher(grammar) for _ in range(n)]

    def bitmask(n):
        return xgr.allocate_token_bitmask(n, info.vocab_size)

    def fill(ms, mask):
        batch.batch_fill_next_token_bitmask(ms, mask)

    def consume(ms, tokens):
        ok = xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)
        assert all(ok)

    def check(ms):
        assert all(m.is_terminated() or m.accept_token(info.stop_token_ids[0]) for m in ms)

    return compile_schema, matchers, bitmask, fill, consume, check


def measure(name, backend, tokens, batch, repeats):
    compile_schema, matchers, bitmask, fill, consume, check = backend
    compiles = []
    for _ in range(repeats):
        start = time.perf_counter()
        grammar = compile_schema()
        ms = matchers(grammar, 1)
        fill(ms, bitmask(1))  # the first mask: lazily built tables are built now
        compiles.append(time.perf_counter() - start)
    ms = matchers(grammar, batch)
    mask = bitmask(batch)
    start = time.perf_counter()
    fill(ms[:1], mask[:1])
    first = time.perf_counter() - start
    steps = []
    for token in tokens:
        start = time.perf_counter()
        fill(ms, mask)
        consume(ms, [token] * batch)
        steps.append(time.perf_counter() - start)
    check(ms)
    return {"backend": name, "compile_ms": statistics.median(compiles) * 1e3, "first_mask_ms": first * 1e3,
            "mask_us_per_token": statistics.median(steps) / batch * 1e6, "step_ms_batch": statistics.median(steps) * 1e3,
            "steps": len(steps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--smoke", action="store_true", help="batch 4, one compile each (the tests run this)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.repeats = 4, 1
    import torch

    from models.loading import load_tokenizer

    torch.set_num_threads(2)
    tokenizer = load_tokenizer()
    tokens = tokenizer(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False).input_ids
    results = [measure("llguidance", llguidance_backend(tokenizer), tokens, args.batch, args.repeats),
               measure("xgrammar", xgrammar_backend(tokenizer), tokens, args.batch, args.repeats)]
    base = results[0]
    rows = [f"JSON schema of 6 fields, document of {len(tokens)} tokens, vocab {len(tokenizer)}, batch {args.batch}",
            "| backend | compile ms | first mask ms | mask µs / token (batch step / batch) | ratio to llguidance |",
            "|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['backend']} | {r['compile_ms']:.1f} | {r['first_mask_ms']:.2f} | "
                    f"{r['mask_us_per_token']:.1f} | compile {r['compile_ms'] / base['compile_ms']:.2f}, "
                    f"mask {r['mask_us_per_token'] / base['mask_us_per_token']:.2f} |")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"batch": args.batch, "tokens": len(tokens), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
