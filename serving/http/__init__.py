"""The HTTP face of a server: a Starlette app on hypercorn's trio worker.

- ``app``: ``build_app(topology, open_runtime)``, the route table, API keys,
  ``hypercorn_config``;
- ``generate``: ``/generate``, ``/v1/completions``, ``/v1/chat/completions``
  (``run_request``: admission, streaming, disconnects);
- ``openai_api``: the OpenAI request and response shapes;
- ``admin``: models, health, metrics, server info, abort, flush, pause,
  weight updates;
- ``state`` (what the routes share), ``errors``, ``metrics``;
- ``worker``: a tokenizer worker process (its ``WorkerRuntime`` and hypercorn).

It reaches a topology only through ``serving.runtime.interface.Runtime``.
"""
