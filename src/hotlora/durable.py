"""Files that survive a kill: written whole or not at all, checked before they are used.

Every file a running server writes for a later process to read (disk-cache entries, compile
artifacts, the chunk-size record, the built-in tiny model) goes through here:

- ``write_atomic``: the bytes go to ``.tmp-<host>+<pid>+<random>`` in the target's own folder
  (a rename across file systems is a copy), are fsynced, renamed over the target, and the folder is
  fsynced so the rename itself is on disk. A kill leaves the old file or the new one, plus at most
  a temporary file whose name says whose it is.
- ``write_verified`` / ``read_verified``: the data, then a sidecar holding its sha256. A reader
  recomputes the hash; a file cut short, one whose sidecar is missing (killed between the two
  renames) or one that does not match is logged, deleted and read as absent, so nothing half
  written is ever loaded (a pickle handed to torch, a record that decides every pack).
- ``sweep_orphans``: start-up removes the temporary files and folders of processes of this host
  that are gone, and anyone's after ``ORPHAN_AGE_S``. Replicas may share a folder: a live
  writer's files are kept, whoever it is.

Why fsync when a kill does not lose the page cache: a host that loses power after the rename but
before writeback could otherwise keep the new name with empty or partial contents; the hash would
catch that too, but then the entry is lost instead of kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

import psutil

log = logging.getLogger(__name__)

TMP = ".tmp-"  # the prefix of every temporary name written here
SIDECAR = ".sha256"

# Leftovers older than this are removed whoever left them: no download or cache write lives this long
# (downloads have a deadline), and a replica on another host cannot be asked whether it is alive.
ORPHAN_AGE_S = 24 * 3600
# A process that started this much later than a leftover was last written cannot have written it:
# its pid was reused (containers restart with the same host name and, often, the same pid).
_START_SLACK_S = 1.0

_OWNED = re.compile(r"^(?P<host>[A-Za-z0-9.-]+)\+(?P<pid>\d+)\+")


# ----------------------------------------------------------------------------- owners and orphans


def owner_tag() -> str:
    """``host+pid``: who owns a temporary file or work directory. '+' never occurs in a sanitized
    host name, nor in the random part ``tempfile`` appends."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "localhost"
    return f"{host}+{os.getpid()}"


def _owner_alive(host: str, pid: int, written_at: float) -> bool:
    """Whether the process that wrote a leftover may still be using it. Only this host's pids can
    be checked; another host's leftovers count as alive (until ORPHAN_AGE_S)."""
    if host != owner_tag().rsplit("+", 1)[0]:
        return True
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return False
    except (psutil.AccessDenied, psutil.Error):  # cannot tell: keep it
        return True
    return started <= written_at + _START_SLACK_S


def sweep_orphans(directory: Path, prefix: str = "") -> int:
    """Remove ``prefix<host>+<pid>+...`` entries (files or folders) left by dead processes of this
    host, and any entry under ``prefix`` older than ORPHAN_AGE_S, each with a log line. Returns
    how many were removed."""
    removed = 0
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            written_at = entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:  # removed meanwhile by its owner
            continue
        owner = _OWNED.match(entry.name[len(prefix):])
        stale = now - written_at > ORPHAN_AGE_S
        if not stale and (owner is None or _owner_alive(owner["host"], int(owner["pid"]), written_at)):
            continue
        log.warning("removing a leftover of a %s: %s", "crashed process" if not stale else "process long gone",
                    os.path.join(directory, entry.name))
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError as exc:  # removed meanwhile, or not ours to remove: never a reason to fail start-up
            log.debug("could not remove %s: %s", entry.name, exc)
            continue
        removed += 1
    return removed


def temp_dir(directory: Path, label: str = "") -> Path:
    """A new folder in ``directory`` that ``sweep_orphans(directory, TMP)`` removes once this
    process is gone: build something there, then ``publish_dir`` it."""
    return Path(tempfile.mkdtemp(prefix=f"{TMP}{owner_tag()}+{label}", dir=directory))


# ----------------------------------------------------------------------------- writing


def fsync_dir(directory: Path) -> None:
    """Make the renames inside ``directory`` durable. Not every platform opens folders (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder; the rename happened all the same
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` whole (mode 0600, as ``mkstemp`` creates it); raises OSError."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP}{owner_tag()}+", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sidecar_of(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR)


def write_verified(path: Path, data: bytes, sidecar: Path | None = None) -> None:
    """``data`` at ``path`` and its sha256 in ``sidecar`` (default ``<name>.sha256``), data first:
    until the sidecar lands, a reader sees a missing or stale hash and treats the file as absent."""
    path = Path(path)
    sidecar = sidecar or sidecar_of(path)
    write_atomic(path, data)
    try:
        write_atomic(sidecar, hashlib.sha256(data).hexdigest().encode())
    except BaseException:
        remove_quietly(path)  # data without its hash would only be discarded by the next reader
        raise


def publish_dir(built: Path, target: Path) -> bool:
    """Move a folder built by ``temp_dir`` into place, every file in it fsynced first. False (and
    ``built`` removed) when ``target`` appeared meanwhile: another process built it first."""
    for folder, _, files in os.walk(built):
        for name in files:
            with open(os.path.join(folder, name), "rb") as file:
                os.fsync(file.fileno())
        fsync_dir(Path(folder))
    try:
        os.rename(built, target)  # refuses a non-empty target: never merges two builds
    except OSError:
        if not target.exists():
            raise
        shutil.rmtree(built, ignore_errors=True)
        return False
    fsync_dir(target.parent)
    return True


# ----------------------------------------------------------------------------- reading


def remove_quietly(path: Path) -> None:
    """Unlink, tolerating what a shared or failing disk does: already gone (another replica removed
    it), or refused (read-only): a stale file is a smaller harm than a failed request."""
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as exc:
        log.debug("could not remove %s: %s", path, exc)


def discard(path: Path, what: str, why: str, sidecar: Path | None = None) -> None:
    log.warning("%s %s discarded: %s", what, path, why)
    remove_quietly(path)
    remove_quietly(sidecar or sidecar_of(Path(path)))


def read_verified(path: Path, what: str, sidecar: Path | None = None,
                  on_corrupt: Callable[[str], None] | None = None) -> bytes | None:
    """The bytes ``write_verified`` wrote, or None: absent, or not what was written (cut short, no
    sidecar, another hash), which is logged, deleted and reported to ``on_corrupt`` (the reason).
    Other read errors (permissions, I/O) raise OSError: the file may be fine."""
    path = Path(path)
    sidecar = sidecar or sidecar_of(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        expected = sidecar.read_text().strip()
    except FileNotFoundError:
        if not path.exists():  # both removed since the data was read (another replica evicted it)
            return None
        why = "no checksum (its write was interrupted)"
    else:
        actual = hashlib.sha256(data).hexdigest()
        if actual == expected:
            return data
        why = f"checksum mismatch ({len(data)} bytes, sha256 {actual[:12]}, expected {expected[:12]})"
    discard(path, what, why, sidecar)
    if on_corrupt is not None:
        on_corrupt(why)
    return None
