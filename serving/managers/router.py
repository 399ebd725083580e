"""Which data-parallel scheduler replica a request goes to (``router.*`` of the topology).

Policies, by SGLang's router's names:

- ``round_robin``: the next replica that is up, in turn.
- ``shortest_queue``: the replica with the fewest requests in flight (counted here, where every
  request passes).
- ``cache_aware``: while the load is balanced, the replica whose routed prefixes cover the most of
  the prompt, if that covers at least ``cache_threshold`` of it; else the replica holding the fewest
  routed prefixes (the most room). Once the load is imbalanced — the busiest replica has more than
  ``balance_abs_threshold`` requests more than the idlest *and* more than ``balance_rel_threshold``
  times as many — the least loaded, whatever it holds.

What was routed where is approximated, as a radix tree of routed prefixes would, at a granularity
of ``block_tokens``: a prompt is cut into blocks, and each block's key hashes the block with the
key before it, so one key stands for the whole prefix up to its block's end. Each replica keeps
the keys routed to it in least-recently-used order, at most ``max_blocks`` of them. A replica whose
scheduler restarted lost its cache: its keys are dropped (``forget``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import msgspec

__all__ = ["Policy", "Router", "RouterConfig"]

Policy = Literal["cache_aware", "round_robin", "shortest_queue"]


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True):
    policy: Policy = "cache_aware"
    cache_threshold: float = 0.5  # the share of a prompt a replica's prefixes must cover to win it
    balance_abs_threshold: int = 32  # requests in flight: both thresholds passed = imbalanced
    balance_rel_threshold: float = 1.5
    block_tokens: int = 16
    max_blocks: int = 65536  # prefix keys kept per replica (8 bytes and a dict slot each)


class Router:
    def __init__(self, replicas: int, config: RouterConfig = RouterConfig()) -> None:
        self.config = config
        self.load = [0] * replicas  # requests in flight on each replica
        self.routed = [0] * replicas  # requests sent to each (resumes included)
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self._next = 0

    @property
    def replicas(self) -> int:
        return len(self.load)

    def choose(self, ids: Sequence[int], up: Sequence[int]) -> int:
        """The replica for a request with these ids, of those ``up`` (not empty); counted as routed
        and loaded there (``release`` it when it ends or moves)."""
        if self.replicas == 1:
            replica = 0  # nothing to choose, nor to remember for a choice
        elif len(up) == 1:
            replica = up[0]
            if self.config.policy == "cache_aware":
                self._remember(replica, self._keys(ids))
        elif self.config.policy == "round_robin":
            replica = min(up, key=lambda r: (r - self._next) % self.replicas)
            self._next = replica + 1
        elif self.config.policy == "shortest_queue":
            replica = min(up, key=lambda r: (self.load[r], self.routed[r]))
        else:
            replica = self._cache_aware(self._keys(ids), up)
        self.load[replica] += 1
        self.routed[replica] += 1
        return replica

    def release(self, replica: int) -> None:
        self.load[replica] -= 1

    def forget(self, replica: int) -> None:
        """``replica`` lost its cache (its scheduler restarted)."""
        self._blocks[replica].clear()

    def matched(self, ids: Sequence[int], replica: int) -> int:
        """How many leading tokens of ``ids`` were routed to ``replica`` before (block granularity)."""
        return self._match(self._keys(ids), replica) * self.config.block_tokens

    # -- cache_aware -------------------------------------------------------------------------

    def _cache_aware(self, keys: list[int], up: Sequence[int]) -> int:
        c = self.config
        loads = [self.load[r] for r in up]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > c.balance_abs_threshold and busiest > idlest * c.balance_rel_threshold:
            replica = min(up, key=lambda r: self.load[r])
        else:
            matches = {r: self._match(keys, r) for r in up}
            best = max(up, key=lambda r: (matches[r], -self.load[r]))
            if keys and matches[best] >= c.cache_threshold * len(keys):
                replica = best
            else:
                replica = min(up, key=lambda r: (len(self._blocks[r]), self.load[r]))
        self._remember(replica, keys)
        return replica

    def _keys(self, ids: Sequence[int]) -> list[int]:
        n = self.config.block_tokens
        keys, key = [], 0
        for start in range(0, len(ids) - n + 1, n):
            key = hash((key, *ids[start : start + n]))
            keys.append(key)
        return keys

    def _match(self, keys: list[int], replica: int) -> int:
        blocks = self._blocks[replica]
        for i, key in enumerate(keys):
            if key not in blocks:
                return i
        return len(keys)

    def _remember(self, replica: int, keys: list[int]) -> None:
        blocks = self._blocks[replica]
        for key in keys:
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.config.max_blocks:
            blocks.popitem(last=False)
