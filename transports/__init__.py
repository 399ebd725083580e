"""Channels between actors (inproc, ipc, tcp) and the msgspec codec.

Nothing here knows about language models.
"""
