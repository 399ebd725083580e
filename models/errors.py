"""The exceptions models/ raises; each message names what failed and why."""


class ModelLoadError(Exception):
    """A model path is missing, unreadable or of an unsupported architecture."""


class OutOfPages(Exception):
    """The KV-cache pool cannot hold the pages asked for; the pool is unchanged."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"KV cache full: {wanted} pages wanted, {free} free")
        self.wanted = wanted
        self.free = free


class InvalidBatch(ValueError):
    """A step was given an inconsistent SeqInput (page table too short, no tokens...)."""


class NonFiniteLogits(ValueError):
    """A step gave NaN logits for some of its rows (never sampled: a NaN argmax would pick token 0)."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"the model gave NaN logits (rows {rows} of the step)")
        self.rows = rows
