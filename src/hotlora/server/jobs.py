"""Jobs: generations that outlive their HTTP request (``Prefer: respond-async``), polled, streamed,
cancelled and fetched later by the key that made them.

A job is a generation request run through the same ``Service`` as a direct one: checked before
its 202 (a bad body or a refused source is answered at once, never turned into a failed job),
then fetched under its client's share, admitted under the same bound (a job *waits* for a slot
where a request is answered 429: it has already been accepted), queued on the same worker; it is
dropped before it starts when cancelled, and stopped at its next denoising step when it runs. It does not watch a connection: the client may leave.

Ownership: a job belongs to the client identity that made it (its API key's name, else the peer
address when auth is off); to anyone else it does not exist (404, never 403: ids say nothing about
other tenants). Ids are random (128 bits), so they are not guessed either.

Records and results live on disk (``server/jobstore.py``: restart recovery, retention, the bytes
bound). The resource (``view``) is shaped so that OpenAI's videos API (``video_object``: ``{id,
object: "video", status, progress, ...}``) is a mapping of the same record, not a second mechanism.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace

from hotlora.engine.request import GenerationRequest
from hotlora.errors import ClientGone, HotloraError, InvalidRequest, JobNotFinished, JobNotFound, Overloaded
from hotlora.server.errors import error_body, status_of
from hotlora.server.jobstore import JobRecord, JobStore, Status, new_id, view
from hotlora.server.outputs import output_format
from hotlora.server.service import Checked, Generated, Service
from hotlora.tracing import NO_TRACE

__all__ = ["Jobs", "JobStore", "view"]
log = logging.getLogger(__name__)
HEARTBEAT_S = 15.0  # an events stream with nothing to say sends a comment this often (proxies idle out)


@dataclass
class Live:
    """What only the running server knows of a job: its task, its cancel flag (the worker reads
    it: a cancelled job is dropped before it starts) and a wake-up for its event streams."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()  # the waiters of the one just set wake; later ones wait anew


class Jobs:
    """The jobs of one server: created from a checked request, run on the service, kept in ``store``."""

    def __init__(self, service: Service, store: JobStore, webhooks=None):
        self.service = service
        self.config = service.config
        self.store = store
        self.webhooks = webhooks
        self._live: dict[str, Live] = {}

    def retention(self, asked: float | None) -> float:
        """The retention a job gets: the default, or what it asks for up to the server's most (422 beyond)."""
        if asked is None:
            return self.config.job_retention_s
        if asked > self.config.job_max_retention_s:
            raise InvalidRequest(f"retention_s {asked} exceeds this server's most, {self.config.job_max_retention_s}")
        return asked

    async def create(self, request, job: GenerationRequest, fmt: str | None, *, retention_s: float | None = None,
                     webhook: str | None = None, kind: str | None = None, params: dict | None = None) -> JobRecord:
        """Check ``job`` as a direct request is checked (its errors answered now, its format too:
        ``outputs.output_format``), then run it in the background; the record as it stands (queued).
        ``kind``: "images" or "video", the one the route serves (422 for a model of the other);
        None: the served model's."""
        principal, client = self.service.access.principal_of(request), self.service.access.client_of(request)
        retention = self.retention(retention_s)
        if webhook is not None:
            if self.webhooks is None:
                raise InvalidRequest("this server sends no webhooks")
            await self.webhooks.check(webhook)
        if self.store.unfinished(client) >= self.config.max_jobs_per_client:
            raise Overloaded(f"this client has {self.config.max_jobs_per_client} unfinished jobs, the most it may "
                             "have; wait for one to finish", retry_after_s=5)
        job_id = new_id()
        loop = asyncio.get_running_loop()
        began = time.monotonic()

        def progress(done: int, total: int) -> None:  # called on the worker thread
            loop.call_soon_threadsafe(self._progress, job_id, done, total)

        checked = self.service.check(principal, replace(job, progress=progress, trace=NO_TRACE))
        # The input images in the body are decoded now: one that is no image is the client's 4xx here,
        # not a failed job later. URLs are fetched when the job runs, as its adapters are.
        engine, store, result = checked
        deadline = began + (result.request.timeout_s or self.config.request_timeout_s)
        request = await self.service.load_inputs(engine, result.request, client, deadline, fetch=False)
        checked = Checked(engine, store, replace(result, request=request))
        output = {"images": "images", "video": "frames"}.get(kind) if kind is not None else None
        fmt = output_format(checked.engine, fmt, output)
        kind = "video" if checked.engine.family.output_kind == "frames" else "images"
        record = JobRecord(id=job_id, owner=client, kind=kind, created_at=self.store.clock(), retention_s=retention,
                           webhook=webhook, params=params or {})
        live = Live()
        self.store.save(record)
        self._live[record.id] = live
        live.task = loop.create_task(self._run(record.id, checked, fmt, principal, client, began))
        return record

    def _progress(self, job_id: str, done: int, total: int) -> None:
        record = self.store.get(job_id)
        if record is None or record.finished:
            return
        update = {"step": done, "total": total}
        if record.status == "queued":  # the first step ran: it started (saved, so a restart says "running")
            self.store.save(record.model_copy(update={**update, "status": "running",
                                                      "started_at": record.started_at or self.store.clock()}))
        else:
            self.store.save(record.model_copy(update=update), write=False)
        self._notify(job_id)

    def _notify(self, job_id: str) -> None:
        live = self._live.get(job_id)
        if live is not None:
            live.notify()

    async def _run(self, job_id: str, checked, fmt: str, principal, client: str, began: float) -> None:
        live = self._live[job_id]

        async def watch(queued) -> None:  # no connection to watch: mark it running once the worker takes it
            record = self.store.get(job_id)
            if queued.started is not None and record is not None and record.status == "queued":
                self.store.save(record.model_copy(update={"status": "running", "started_at": self.store.clock()}))
                self._notify(job_id)

        try:
            try:
                out = await self.service.run(checked, fmt, principal=principal, client=client, trace=NO_TRACE,
                                             began=began, watch=watch, wait_for_admission=True,
                                             cancelled=live.cancelled)
                record = self.store.get(job_id)
                if record is not None and not record.finished:  # else deleted or cancelled while it ran
                    files = {f"{i}.{fmt}": data for i, data in enumerate(out.images)}
                    meta = {**out.body(), "format": fmt}
                    del meta["images"]
                    await asyncio.to_thread(self.store.put_result, record, files, out.media_type, meta)
            except ClientGone:
                self._finish(job_id, "cancelled")
            except HotloraError as exc:
                self._finish(job_id, "failed", {**error_body(exc), "status": status_of(exc)})
            except Exception as exc:  # a job must end with a status, whatever happened
                log.exception("job %s failed unexpectedly", job_id)
                self._finish(job_id, "failed", {"error": f"internal error: {type(exc).__name__}",
                                                "type": type(exc).__name__, "status": 500})
            self._announce(job_id)
        finally:
            self._notify(job_id)
            self._live.pop(job_id, None)

    def _finish(self, job_id: str, status: Status, error: dict | None = None) -> JobRecord | None:
        record = self.store.get(job_id)
        if record is None or record.finished:
            return record
        now = self.store.clock()
        record = record.model_copy(update={"status": status, "error": error, "finished_at": now,
                                           "expires_at": now + record.retention_s})
        self.store.save(record)
        return record

    def _announce(self, job_id: str) -> None:
        record = self.store.get(job_id)
        if self.webhooks is None or record is None or record.webhook is None:
            return

        def delivered(delivery) -> None:
            current = self.store.get(job_id)
            if current is not None:
                self.store.save(current.model_copy(update={"webhook_delivery": delivery.as_dict()}))

        self.webhooks.send(record.webhook, f"job.{record.status}", view(record), done=delivered)

    # ------------------------------------------------------------------ what the routes ask

    def get(self, request, job_id: str) -> JobRecord:
        """The caller's job, or JobNotFound (also for another client's job)."""
        record = self.store.get(job_id)
        if record is None or record.owner != self.service.access.client_of(request):
            raise JobNotFound(f"no job {job_id[:64]!r}")
        return record

    def cancel(self, request, job_id: str) -> JobRecord:
        """An unfinished job is cancelled (dropped before it starts; one already running stops at
        its next denoising step, ``runner.DenoiseClock``, unless it shares a mixed batch with a
        request still wanted) and kept as ``cancelled`` until it expires; a finished one is
        deleted with its result."""
        record = self.get(request, job_id)
        if record.finished:
            self.store.delete(job_id)
            return record
        live = self._live.get(job_id)
        if live is not None:
            live.cancelled.set()
        return self._finish(job_id, "cancelled") or record

    def content(self, record: JobRecord) -> tuple[Generated, list[bytes]]:
        if record.status != "succeeded" or record.result is None:
            raise JobNotFinished(f"job {record.id} is {record.status}; its content exists once it has succeeded")
        files = self.store.read_result(record)
        meta = dict(record.result["meta"])
        meta["input_notes"] = tuple(meta.get("input_notes") or ())
        return Generated(images=files, **meta), files

    async def events(self, request, job_id: str):
        """Server-Sent Events of the caller's job: ``progress`` {step, total} whenever a step is
        done, then ``status`` (the job, as ``GET /v1/jobs/{id}`` answers it) once it has finished."""
        record = self.get(request, job_id)
        sent = None
        while True:
            live = self._live.get(job_id)
            changed = live.changed if live is not None else None
            record = self.store.get(job_id)
            if record is None:
                yield f"event: status\ndata: {json.dumps({'id': job_id, 'status': 'deleted'})}\n\n"
                return
            if record.total is not None and (record.step, record.total) != sent:
                sent = (record.step, record.total)
                yield f"event: progress\ndata: {json.dumps({'step': record.step, 'total': record.total})}\n\n"
            if record.finished:
                yield f"event: status\ndata: {json.dumps(view(record))}\n\n"
                return
            if changed is None:  # unfinished with no task: only between create and its task's start
                await asyncio.sleep(0.05)
                continue
            try:
                await asyncio.wait_for(changed.wait(), timeout=HEARTBEAT_S)
            except TimeoutError:
                yield ": still running\n\n"

    async def close(self) -> None:
        """Shutdown: the worker has drained; jobs still waiting end as failed at the next start."""
        if self.webhooks is not None:
            await self.webhooks.close()


