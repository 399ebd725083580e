"""Running a topology.

- ``topology``: the YAML schema, its checks and its errors (reads only);
- ``interface``: the ``Runtime`` the HTTP layer uses, its ``StatusTracker``
  and ``Gate`` (starts nothing);
- ``launch``: ``open_runtime`` — the managers under a supervisor, with the
  tokenizer manager in this process (``LocalRuntime``);
- ``specs``: a replica's child specs (scheduler, detokenizer) and supervisors;
- ``replicas``: data-parallel replicas — the replica set, its status, and
  ``run_replica`` (``tercet replica``); ``ray_launcher``: replicas on Ray;
- ``workers``: ``open_worker_pool`` — the main process of a server with
  tokenizer worker processes (coordinator, status broadcast);
- ``engine``: the offline ``Engine`` / ``AsyncEngine``.
"""
