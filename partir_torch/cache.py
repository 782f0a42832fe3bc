"""The plan cache: a repeat request returns the stored plan without searching.

Entries are JSON files under `$XDG_CACHE_HOME/partir_torch` (default `~/.cache/partir_torch`), at two levels:

- program level, `plans/<key>.json`, read by `search()` (so `auto_shard`, `partir-torch plan` and `train`)
  after the capture. Key: a sha256 over the captured program's content hash (`Program.content_hash`: every
  value's name, shape, dtype and role, every op and its arguments, the fold), the mesh with its DCN axes,
  every figure of the hardware, the schedule's tactics (goal and mode included), the search options (budget,
  seed, algorithm, memory limit, fallback, inference mode, prune, goals, fold) and `version()`.
- request level, `requests/<key>.json`, read by `partir-torch plan` before torch is imported. Key: a sha256
  over the command line's request as typed (the subcommand, MODEL — a zoo name, or a factory file's
  absolute path — its `--config` values, mesh, hardware, schedule and options) and `version()`.

Why two: a program key needs the capture, and the capture needs torch, whose import alone takes seconds;
the request key is known from the command line. A request entry stores the plan, the program key it was
stored under, the report the first run printed, and every file the process had loaded when it planned
(each loaded module's path, size and mtime: partir_torch, torch, the factory's file and every module it
imported). A request hit requires each of those files unchanged; any change is a miss, and the request
goes on to the capture and the program key. What the request key cannot see: data files a factory reads
(not modules) and environment variables; `--no-cache` plans afresh after changing those.

`version()` is a hash of partir_torch's own sources (`__version__` among them: an edit to any module changes
every key, so a plan is never served by other code than would search it), torch's installed version (read from
its metadata, without importing it) and Python's. Time budgets make searches nondeterministic: the key
holds the budget, and the plan says it came from the cache (`ShardingPlan.cache`: level, key, file).

Writes go to a temporary file in the entry's directory, then `os.replace`: concurrent writers of one key
leave one whole entry. An unreadable or corrupt entry is ignored with a `CacheWarning` naming the file (and
overwritten by the next write); a directory that cannot be written gives a `CacheWarning`, and the plan is
still returned. This module imports neither torch nor the rest of the package.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = 1  # of an entry; part of every key
_UNWRITABLE: set[Path] = set()  # cache directories this process failed to write (warned once each)


class CacheWarning(UserWarning):
    """The plan cache could not be read or written; the plan is searched (or returned) all the same."""


def directory() -> Path:
    """`$XDG_CACHE_HOME/partir_torch`, or `~/.cache/partir_torch` (the XDG default) when it is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "partir_torch"


@functools.cache
def version() -> dict[str, str]:
    """What code a plan comes from: a hash of partir_torch's sources (`__version__` is among them), torch's
    version, Python's."""
    pkg = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes() + b"\0")
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "none"
    return {"partir_torch": h.hexdigest()[:16], "torch": torch,
            "python": sys.version.split()[0], "format": str(FORMAT)}


def digest(parts: Mapping[str, Any]) -> str:
    """The key of `parts` (JSON-able; other objects by `str`) with `version()`."""
    text = json.dumps({**parts, "version": version()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def path(kind: str, key: str) -> Path:
    return directory() / kind / f"{key}.json"


def _warn(message: str) -> None:
    warnings.warn(message, CacheWarning, stacklevel=3)


def read(kind: str, key: str) -> dict[str, Any] | None:
    """The entry stored under `key`, or None: absent, unreadable or corrupt (the last two with a warning)."""
    p = path(kind, key)
    try:
        text = p.read_text()
    except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory)
        return None
    except (OSError, UnicodeDecodeError) as e:
        _warn(f"cannot read the plan cache entry {p} ({e}); planning without it")
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("key") != key:
            raise ValueError("not an entry of this key")
    except ValueError as e:
        _warn(f"ignoring the corrupt plan cache entry {p} ({e}); planning again, the entry will be rewritten")
        return None
    return data


def write(kind: str, key: str, data: Mapping[str, Any]) -> Path | None:
    """Store `data` under `key` atomically (a temporary file, then `os.replace`); None, with a warning, when
    the cache directory cannot be written."""
    p = path(kind, key)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({**data, "key": key}, f)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        if directory() not in _UNWRITABLE:  # once per directory: the CLI writes two levels
            _UNWRITABLE.add(directory())
            _warn(f"cannot write the plan cache in {p.parent} ({e.strerror or e}); the plan is not cached. Make "
                  f"{directory()} writable, set XDG_CACHE_HOME to a writable directory, or pass --no-cache / "
                  "cache=False")
        return None
    return p


def _generated(f: str) -> bool:
    """A module a library wrote into a `tempfile.mkdtemp()` directory of its own (torch.distributed does): not
    a source, and gone when the process exits."""
    parent = Path(f).parent
    return parent.parent == Path(tempfile.gettempdir()) and re.fullmatch(r"tmp[a-z0-9_]{8}", parent.name) is not None


def loaded_files() -> dict[str, list[int]]:
    """Every file a loaded module came from: path -> [size, mtime in ns]."""
    out: dict[str, list[int]] = {}
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if isinstance(f, str) and f not in out and not _generated(f):
            try:
                s = os.stat(f)
            except OSError:
                continue
            out[f] = [s.st_size, s.st_mtime_ns]
    return out


def changed_file(files: Mapping[str, list[int]]) -> str | None:
    """The first of `files` that is gone or differs in size or mtime, else None."""
    for f, (size, mtime) in files.items():
        try:
            s = os.stat(f)
        except OSError:
            return f
        if s.st_size != size or s.st_mtime_ns != mtime:
            return f
    return None


def lookup_request(key: str) -> dict[str, Any] | None:
    """A request entry whose files are all unchanged (else None: the request is planned again)."""
    data = read("requests", key)
    if data is None:
        return None
    files = data.get("files")
    if not isinstance(files, dict) or changed_file(files) is not None:
        return None
    return data


def store_request(key: str, data: Mapping[str, Any]) -> Path | None:
    """A request entry with the files this process has loaded (call it after planning)."""
    return write("requests", key, {**data, "files": loaded_files()})
