"""The data cache: a folder per tokenized corpus, built by one process and published whole.

[Note: the token cache]
Tokenized text lives in ``<cache>/<tokenizer>-<hash>/`` (tokens.bin, tokenizer.json, meta.json),
where the hash covers the text and the tokenizer settings and <cache> is ``data.cache_dir``,
``$MESHPAR_CACHE`` or ``~/.cache/meshpar``. An entry is built in a temporary folder and published
with one ``os.replace``, so it is complete or absent. Builders serialize on ``<key>.lock``
(fcntl.flock): when every rank of a host calls prepare() at once, one trains and tokenizes while
the others wait, then all read the same entry (meta.json's ``built_by``: host, pid, torchrun rank).
BPE training is deterministic (the same tokenizer.json whatever the thread count), so hosts with
separate caches agree on the tokens. Cold and warm times: docs/performance.md#the-token-cache.

[Note: a cache per node or one for all]
Under torchrun every rank runs prepare() (in preflight, before any process group), so who
builds is decided by the lock, not by a rank number: the first process to take it, once per
cache folder. A node-local cache (``$MESHPAR_CACHE`` on local disk) is built once on each node
by one of its own ranks; a shared one (``~/.cache/meshpar`` on an NFS home) once for the job,
where flock spans hosts (NFS, GPFS, Lustre mounted with ``flock``). Where it does not (Lustre's
``localflock``; ``noflock``, whose flock fails), each host builds in its own temporary folder
``.<key>.tmp@<host>.*``, removes only its own host's dead ones, and drops its copy if another
host published the entry first (the same bytes: BPE training is deterministic).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
from pathlib import Path

from meshpar.config.recipe import RecipeError
from meshpar.runtime.atomic import fsync_dir


def cached(root: Path, key: str, build) -> Path:
    """The complete cache entry ``root/key``, built by ``build(tmp_folder)`` in exactly one process
    per host that shares the lock ([Note: a cache per node or one for all])."""
    entry = root / key
    if (entry / "meta.json").exists():
        return entry
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{key}.lock", "a")  # noqa: SIM115 - the with block below closes it
    except OSError as e:
        raise RecipeError(f"data.cache_dir = {str(root)!r}: cannot write there ({e.strerror}); set data.cache_dir "
                          f"or $MESHPAR_CACHE to a writable folder", "data.cache_dir") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            locked = True
        except OSError:  # a file system without flock (Lustre's noflock): build unlocked, publish safely
            locked = False
        if not (entry / "meta.json").exists():  # a process we waited for may have built it
            mine = f".{key}.tmp@{socket.gethostname()}."
            if locked:  # dead builders' folders: of this host only, whose builders shared our lock
                for stale in root.glob(f".{key}.tmp*"):
                    if "@" not in stale.name or stale.name.startswith(mine):
                        shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=mine, dir=root))
            try:
                build(tmp)
                _publish(tmp, entry)
                fsync_dir(root)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return entry


def _publish(tmp: Path, entry: Path) -> None:
    """Rename the built folder to ``entry``, unless a builder on a host outside our lock did first."""
    try:
        os.replace(tmp, entry)
    except OSError:  # renaming onto a non-empty folder fails: theirs stays, ours is removed
        if not (entry / "meta.json").exists():
            raise
