"""A small trio actor runtime: actors, supervision trees, watchdogs.

Nothing here knows about language models.
"""
