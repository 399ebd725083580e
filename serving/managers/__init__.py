"""The three managers of SGLang's request path, as actors, and their messages.

    TokenizerManager ──GenerateReq──► Scheduler ──BatchTokenIDOut──► DetokenizerManager
    DetokenizerManager ──BatchStrOut──► TokenizerManager

- ``tokenizer_manager``: the API side of every request (``rid_to_state``);
- ``scheduler``: the Scheduler actor, over ``batching`` (waiting queue,
  running batch, pages, stop checks) and ``radix_cache`` (the prefix cache);
- ``detokenizer``: token id deltas to text deltas;
- ``messages``: one tagged msgspec union per channel.
"""
