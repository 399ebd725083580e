"""What tercet reads back from its cache is trusted only if no one else could have written it.

The cache (``loading.cache_root``: ``$TERCET_CACHE_DIR``, else ``~/.cache/tercet``) holds the
compiled CPU kernels, a ``.so`` that every scheduler loads, and GGUF files converted to
safetensors, the weights it serves. Their names are digests anyone can compute, so a cache
another user can write to is code execution (a planted ``.so``) or poisoned weights. A
directory or file is trusted only when it is owned by this process's user and no one else
may write to it (no group or other write bit); the caller then rebuilds, reconverts, or
refuses with a ``CacheNotPrivate`` that says why and how to fix it.

tercet makes its own directories 0700 and its files without group or other write bits, so
a cache it made is always trusted, whatever the umask.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["CacheNotPrivate", "drop_write_bits", "private_dir", "why_untrusted", "why_untrusted_tree"]


class CacheNotPrivate(Exception):
    """A cache directory that another user owns or may write to."""


def why_untrusted(path: Path) -> str | None:
    """None when ``path`` (followed if a link: what is read) is this user's and only this user
    may write to it; else why not."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("other users", stat.S_IWOTH)) if st.st_mode & bit]
    if writers:
        return f"{path} is writable by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def why_untrusted_tree(path: Path) -> str | None:
    """``why_untrusted`` for ``path`` and everything under it (the first problem found)."""
    if (why := why_untrusted(path)) is not None:
        return why
    for directory, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            if (why := why_untrusted(Path(directory, name))) is not None:
                return why
    return None


def private_dir(path: Path) -> Path:
    """``path``, made (0700) if missing; ``CacheNotPrivate`` if it is not this user's alone."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    why = why_untrusted(path)
    if why is not None:
        raise CacheNotPrivate(f"{why}: fix it with `chmod go-w {path}` (or chown), or set TERCET_CACHE_DIR "
                              "to a directory of your own")
    return path


def drop_write_bits(path: Path) -> None:
    """No group or other write bit on ``path`` and anything under it (what the umask let through)."""
    for directory, dirs, files in os.walk(path):
        for name in [".", *dirs, *files]:
            entry = Path(directory, name)
            mode = stat.S_IMODE(os.lstat(entry).st_mode)
            if mode & 0o022 and not entry.is_symlink():
                os.chmod(entry, mode & ~0o022)
