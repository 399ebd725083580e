"""Model loading, the paged KV cache, batched forward and sampling.

Synchronous (no trio): the Scheduler actor drives it one step at a time.
"""
