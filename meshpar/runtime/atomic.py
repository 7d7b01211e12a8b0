"""Writes that survive a crash: a reader sees the old file or the whole new one, never a part.

    write_atomic(folder / "meshpar.json", json.dumps(info))      # text or bytes
    with atomic_path(folder / "trace.json.gz") as tmp:             # any writer, e.g. gzip.open(tmp)
        write_with_any_library(tmp)
    fsync(*written_files); fsync_dir(folder)                       # make finished files durable

[Note: fsync, then rename, then fsync the folder]
``os.replace`` is atomic for readers, but without an ``fsync`` of the new file first, a power
loss can leave the new name pointing at a file whose blocks never reached the disk (ext4 and
xfs order data and rename only with ``data=ordered`` and only in some cases). So: write a
temporary file beside the target, flush it to disk, rename it over the target, then fsync the
folder so the rename itself is durable. Every file meshpar writes for a later run to trust
(checkpoint markers and CRC lists, converted checkpoints, the token cache, memory records,
traces) goes through here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def fsync(*paths: str | os.PathLike) -> None:
    """Flush already written files to disk."""
    for path in paths:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make renames and creations in folder ``path`` durable. Best effort: some file systems
    (and every Windows one) refuse to open or fsync a folder, and that loses nothing a rename
    already guaranteed to readers."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; on a clean exit it is fsynced and renamed
    over ``path``; on an error it is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` atomically and durably."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
