"""Jobs' records and results on disk (``jobs_dir``), and how a record is answered: ``view`` (the
``/v1/jobs`` resource) and ``video_object`` (OpenAI's videos API over the same record).

Records are written whole (a temporary file, then a rename), so a reader or a crash sees the old
record or the new. A store opened on a folder a previous server left fails the jobs it never
finished ("the server restarted before the job finished"): a poll then gets an answer, never a
404 or a status that stays "running". Finished jobs expire ``retention_s`` after they end;
results are bounded all together (``max_bytes``): the oldest finished jobs are evicted first, and
a single result over the bound fails its job instead.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel

from hotlora.errors import RequestTooLarge, SettingUnusable

log = logging.getLogger(__name__)

Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
UNFINISHED = ("queued", "running")
RESTARTED = "the server restarted before the job finished"
ID = re.compile(r"job_[A-Za-z0-9_-]{22}")  # what new_id makes: anything else names no file here


def new_id() -> str:
    return "job_" + secrets.token_urlsafe(16)


class JobRecord(BaseModel):
    """One job as kept on disk (``<id>.json``) and answered (``view``)."""

    id: str
    owner: str  # the client identity that made it (Access.client_of); never shown
    kind: Literal["images", "video"] = "images"
    status: Status = "queued"
    step: int = 0  # denoising steps done, of ``total`` (the engine's per-step progress)
    total: int | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    retention_s: float
    expires_at: float | None = None  # set when it finishes
    error: dict | None = None  # {error, type, status}: the error body a direct request would have had
    result: dict | None = None  # {files: [name, ...], bytes, media_type, meta: the answer beside its files}
    webhook: str | None = None
    webhook_delivery: dict | None = None
    params: dict = {}  # what a mapping (``video_object``) shows of the request: model, size, seconds

    @property
    def finished(self) -> bool:
        return self.status not in UNFINISHED


class JobStore:
    """Job records and results under ``root``: ``<id>.json`` and ``<id>/<file>``. Thread-safe;
    ``clock`` (``time.time``) is a parameter so expiry is tested without waiting."""

    def __init__(self, root: str | os.PathLike, max_bytes: int, clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self._check_writable()
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.RLock()
        self._records: dict[str, JobRecord] = {}
        self._recover()

    def _check_writable(self) -> None:
        """Fail at start-up, naming the setting, where a job would otherwise fail on its first write
        (a read-only root filesystem with no volume for jobs_dir)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.root).close()
        except OSError as exc:
            raise SettingUnusable(f"jobs_dir {str(self.root)!r} (HOTLORA_JOBS_DIR) cannot be written: "
                                  f"{exc.strerror or exc}; point it at a writable folder, one per server") from None

    def _recover(self) -> None:
        """Read what a previous server left: unfinished jobs are failed (nothing runs them now),
        expired ones removed, unreadable records dropped (logged)."""
        for path in sorted(self.root.glob("job_*.json")):
            try:
                record = JobRecord.model_validate_json(path.read_bytes())
            except (OSError, ValueError) as exc:
                log.warning("dropping unreadable job record %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            if not record.finished:
                now = self.clock()
                record = record.model_copy(update={
                    "status": "failed", "finished_at": now, "expires_at": now + record.retention_s,
                    "error": {"error": RESTARTED, "type": "ServerRestarted", "status": 500}})
                self._write(record)
            self._records[record.id] = record
        self.sweep()

    # ------------------------------------------------------------------ records

    def save(self, record: JobRecord, write: bool = True) -> None:
        """Keep ``record``; ``write`` False: in memory only (progress: a write per step is not worth
        it, a restart fails the job whatever step it had reached)."""
        with self._lock:
            self._records[record.id] = record
            if write:
                self._write(record)

    def _write(self, record: JobRecord) -> None:
        path = self.root / f"{record.id}.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(record.model_dump_json())
        os.replace(temporary, path)  # a reader (or a crash) sees the old record or the new, never half

    def get(self, job_id: str) -> JobRecord | None:
        if not ID.fullmatch(job_id):
            return None
        self.sweep()
        with self._lock:
            return self._records.get(job_id)

    def owned(self, owner: str, kind: str | None = None) -> list[JobRecord]:
        """``owner``'s jobs (of ``kind``), oldest first."""
        self.sweep()
        with self._lock:
            records = [r for r in self._records.values() if r.owner == owner and kind in (None, r.kind)]
        return sorted(records, key=lambda r: (r.created_at, r.id))

    def unfinished(self, owner: str) -> int:
        with self._lock:
            return sum(1 for r in self._records.values() if r.owner == owner and not r.finished)

    def delete(self, job_id: str) -> None:
        with self._lock:
            self._records.pop(job_id, None)
            (self.root / f"{job_id}.json").unlink(missing_ok=True)
            self._remove_result(job_id)

    def sweep(self) -> None:
        """Remove the jobs whose retention has passed."""
        now = self.clock()
        with self._lock:
            for record in [r for r in self._records.values() if r.expires_at is not None and r.expires_at <= now]:
                self.delete(record.id)

    # ------------------------------------------------------------------ results

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(r.result["bytes"] for r in self._records.values() if r.result)

    def put_result(self, record: JobRecord, files: dict[str, bytes], media_type: str, meta: dict) -> JobRecord:
        """``record`` succeeded with ``files``, written under its directory, the oldest finished
        jobs evicted until every result fits ``max_bytes``; RequestTooLarge for a result that
        alone is over it (nothing evicted for it)."""
        size = sum(len(data) for data in files.values())
        if size > self.max_bytes:
            raise RequestTooLarge(f"the job's result is {size} bytes, over the server's jobs_max_bytes "
                                  f"({self.max_bytes}); ask for fewer or smaller outputs")
        with self._lock:
            kept = sorted((r for r in self._records.values() if r.result and r.id != record.id),
                          key=lambda r: r.finished_at or 0)
            total = sum(r.result["bytes"] for r in kept)
            while kept and total + size > self.max_bytes:
                oldest = kept.pop(0)
                total -= oldest.result["bytes"]
                log.info("evicting job %s (%d bytes) for a newer result", oldest.id, oldest.result["bytes"])
                self.delete(oldest.id)
            folder = self.root / record.id
            folder.mkdir(exist_ok=True)
            for name, data in files.items():
                (folder / name).write_bytes(data)
            now = self.clock()
            record = record.model_copy(update={
                "status": "succeeded", "finished_at": now, "expires_at": now + record.retention_s,
                "result": {"files": list(files), "bytes": size, "media_type": media_type, "meta": meta}})
            self.save(record)
            return record

    def read_result(self, record: JobRecord) -> list[bytes]:
        folder = self.root / record.id
        return [(folder / name).read_bytes() for name in record.result["files"]]

    def _remove_result(self, job_id: str) -> None:
        folder = self.root / job_id
        if folder.is_dir():
            for path in folder.iterdir():
                path.unlink(missing_ok=True)
            folder.rmdir()


def view(record: JobRecord) -> dict:
    """A job as ``GET /v1/jobs/{id}`` answers it."""
    base = f"/v1/jobs/{record.id}"
    out = {"id": record.id, "object": "job", "kind": record.kind, "status": record.status,
           "progress": {"step": record.step, "total": record.total,
                        "fraction": round(record.step / record.total, 4) if record.total else
                        (1.0 if record.status == "succeeded" else 0.0)},
           "created_at": record.created_at, "started_at": record.started_at, "finished_at": record.finished_at,
           "expires_at": record.expires_at, "error": record.error,
           "links": {"self": base, "content": f"{base}/content", "events": f"{base}/events"}}
    if record.result is not None:
        out["result"] = {"media_type": record.result["media_type"], "count": len(record.result["files"]),
                         "bytes": record.result["bytes"]}
    if record.webhook is not None:
        out["webhook"] = record.webhook_delivery or {"delivered": None, "attempts": 0, "error": None}
    return out


# OpenAI's video statuses for the job's
VIDEO_STATUS = {"queued": "queued", "running": "in_progress", "succeeded": "completed", "failed": "failed",
                "cancelled": "failed"}


def video_object(record: JobRecord) -> dict:
    """A job as OpenAI's videos API answers ``POST /v1/videos`` and ``GET /v1/videos/{id}``
    (``{id, object: "video", status, progress (0-100), created_at, completed_at, expires_at,
    model, seconds, size, prompt, error}``; times in whole seconds), plus ``adapter_defaults`` once
    it has succeeded at steps or guidance its adapters declared. ``/content`` is the job's MP4."""
    progress = round(100 * record.step / record.total) if record.total else (100 if record.status == "succeeded" else 0)
    error = None
    if record.status == "cancelled":
        error = {"code": "cancelled", "message": "the job was cancelled"}
    elif record.error is not None:
        error = {"code": record.error.get("type", "error"), "message": record.error.get("error", "")}
    answer = {"id": record.id, "object": "video", "status": VIDEO_STATUS[record.status], "progress": progress,
              "created_at": int(record.created_at),
              "completed_at": int(record.finished_at) if record.status == "succeeded" else None,
              "expires_at": int(record.expires_at) if record.expires_at is not None else None,
              "model": record.params.get("model"), "seconds": record.params.get("seconds"),
              "size": record.params.get("size"), "prompt": record.params.get("prompt"), "error": error}
    declared = (record.result or {}).get("meta", {}).get("adapter_defaults")
    if declared:  # hotlora's extension, as on images: the steps / guidance the adapters declared, where it ran at them
        answer["adapter_defaults"] = declared
    return answer
