"""The LLM server, in three rooms and a CLI on top.

- ``serving.managers``: SGLang's request path — the TokenizerManager, the
  Scheduler (with its batch state and radix cache) and the
  DetokenizerManager — and the messages between them. Actors; no HTTP.
- ``serving.http``: the Starlette app (native ``/generate``, the OpenAI
  routes, admin), its shared state and metrics, and a tokenizer worker
  process's HTTP side. It uses a running topology through the ``Runtime``
  interface and never starts one.
- ``serving.runtime``: topologies (YAML, a schema: ``topology``), what to
  start (``specs``, ``replicas``, ``frontend``), starting it under supervision
  (``launch``), the multi-worker main process, and the offline ``Engine``.
- ``serving.cli``: ``tercet serve``.

Imports go managers ← runtime.topology/interface ← http ← cli, and
runtime.launch/workers/engine → managers; ``tests/test_layering.py`` keeps
the graph acyclic.
"""
