"""One exception tree for hotlora, defined here (httpx's way: one error module).

::

    HotloraError
    ├── RequestError          the caller's fault: the worker stays warm, nothing is rebuilt
    │   ├── AdapterNotFound       a reference that names nothing
    │   ├── AdapterFormatError    a file we cannot read or convert (layout, dtype, header)
    │   ├── AdapterRejected       a readable adapter that does not fit the served engine;
    │   │                         carries every problem found, not just the first
    │   ├── InvalidRequest        bad generation parameters
    │   │   ├── RequestTooLarge       over a work, body or field bound, the limit in the message
    │   │   ├── UnsafeReference       a path or host outside what is allowed
    │   │   │   └── EgressRefused         (adapters.egress) a destination the egress policy refuses
    │   │   ├── InvalidReference      (adapters.references) a reference that is not well-formed: a URL
    │   │   │                         with a bad port or host, whitespace, a control character
    │   │   ├── UnservedShape         (engine.request) a size or shape the warm engine would compile for
    │   │   ├── NonFiniteOutput       (engine.guard) the request's adapters overflowed the pack; the
    │   │   │                         base weights were checked and are intact
    │   │   └── UnsupportedMediaType  POST / with a body a cross-site form could send, JSON not
    │   │                             labelled as JSON, or an input image that is not PNG, JPEG or
    │   │                             WebP (hotlora.images)
    │   ├── Overloaded, NotAccepting, DeadlineExceeded, ClientGone
    │   │                         the queue's answers (engine.worker): full, not accepting (starting,
    │   │                         rebuilding, stopping), not started in time, the client left
    │   ├── FetchersBusy          every adapter fetcher stayed busy for the fetch's whole deadline
    │   ├── BodyTimeout           a body that trickled in too long
    │   ├── CrossOriginRefused    a web page's request from another origin
    │   ├── Unauthorized, Forbidden
    │   │                         no or an unknown API key; a key outside its scopes or adapter sources
    │   ├── JobNotFound, JobNotFinished
    │   │                         (server.jobs) no such job for this caller (another key's job too);
    │   │                         a job's content asked for before it succeeded
    │   └── UnknownModel          a model id no deployment serves (scaleout.routing)
    ├── SourceUnavailable     a remote source failed after retries: nobody's fault here,
    │                         nothing to rebuild
    ├── EngineError           our fault: the engine is rebuilt
    │   └── SlotStateCorrupt      slot tensors found in a state no swap can produce
    ├── ReplicasUnavailable, ModelsOverloaded
    │                         the Ray ingress's answers (scaleout.ingress); nothing to rebuild
    └── start-up faults, raised before anything serves: ModelLoadError (engine.pipeline),
        StepCacheError (engine.stepcache), CatalogError (adapters.catalog), ModelDefaultsError
        (settings.files: an unreadable hotlora.json), SettingsError (settings.fields: a setting's
        value refused; a ValueError too), DeployConfigError (scaleout.config), AuthConfigError
        (server.auth: no API keys where they are required, an unreadable keys line),
        DoesNotFit (here: the memory plan of the configured engine exceeds the memory it has;
        the plan is in the message and on ``.plan``)

The errors say what went wrong, not how a transport answers it: the HTTP edge maps classes to
status codes in one table (``hotlora.server.errors.STATUS``, looked up along the class's MRO), which
the Ray ingress uses too. Every class with an entry of its own there is defined in this module, so
the table imports nothing else; a subclass that only refines its parent's meaning (the ones marked
with a module above) is defined next to the code that raises it. ``retry_after_s`` on a class or
an instance is how long the caller should wait before trying again.

Foreign exceptions (diffusers, safetensors, huggingface_hub, botocore) are translated into this
tree at the boundary where they are raised, so callers only ever catch these.
"""

from __future__ import annotations


class HotloraError(Exception):
    """Base of every error hotlora raises on purpose."""


class RequestError(HotloraError):
    """The request is at fault. Fail fast, keep the warm engine untouched."""


class AdapterNotFound(RequestError):
    """A reference that names nothing: no such file, object or repository."""


class AdapterFormatError(RequestError):
    """An adapter file we cannot read or convert (layout, dtype, header)."""


class AdapterRejected(RequestError):
    """An adapter that was read fine but cannot be served here; lists every problem at once."""

    def __init__(self, adapter: str, problems: list[str]):
        self.adapter = adapter
        self.problems = list(problems)
        shown = "\n  - ".join(self.problems)
        super().__init__(f"adapter {adapter!r} rejected ({len(self.problems)} problem(s)):\n  - {shown}")


class InvalidRequest(RequestError):
    """Bad generation parameters."""


class RequestTooLarge(InvalidRequest):
    """Over a work, body or field bound; the message names the limit."""


class UnsafeReference(InvalidRequest):
    """A reference that points outside what this server may read."""


class UnsupportedMediaType(InvalidRequest):
    """A body whose content type a cross-site form could have sent, JSON not labelled as JSON, or an
    input image in a format the server does not decode (``hotlora.images``: PNG, JPEG and WebP only)."""


# ------------------------------------------------------------------ the queue's answers (engine.worker)


class Overloaded(RequestError):
    """The queue is full; retry later."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotAccepting(RequestError):
    """Starting up, rebuilding past the wait limit, or shutting down."""

    retry_after_s = 5


class DeadlineExceeded(RequestError):
    """The request's deadline passed before it could start."""


class ClientGone(RequestError):
    """The client went away before its request ran."""


class FetchersBusy(RequestError):
    """A fetch that spent its whole deadline waiting for a worker: retry later."""

    retry_after_s = 5


# ------------------------------------------------------------------ the HTTP edge's refusals (server)


class BodyTimeout(RequestError):
    """A request body that trickled in for longer than the server waits."""


class CrossOriginRefused(RequestError):
    """A browser request from another origin (its ``Origin`` header) without a key."""


class Unauthorized(RequestError):
    """No key, a malformed ``Authorization`` header, or a key this server does not know."""


class Forbidden(RequestError):
    """A known key asking for something outside its scopes or its adapter sources."""


class JobNotFound(RequestError):
    """No job of this id for this caller: never created, expired, deleted, or another key's (which
    is answered the same, so that job ids say nothing about other tenants)."""


class JobNotFinished(RequestError):
    """A job's content asked for while it is queued or running, or after it failed or was cancelled."""


# ------------------------------------------------------------------ scale-out (scaleout)


class UnknownModel(RequestError):
    """A model id no deployment serves."""


class ReplicasUnavailable(HotloraError):
    """Every try of a request landed on a replica that died, or no answer came in time."""

    retry_after_s = 5


class ModelsOverloaded(HotloraError):
    """Serve's own back-pressure: every replica of the model is at max_ongoing_requests and its queue is full."""

    retry_after_s = 5


# ------------------------------------------------------------------ not the caller's fault


class SourceUnavailable(HotloraError):
    """Storage or the Hub did not answer in time, after retries. The engine is fine."""


class EngineError(HotloraError):
    """Something inside the engine failed; the warm state can no longer be trusted."""


class SlotStateCorrupt(EngineError):
    """Slot tensors found in a state no swap can produce."""


class SettingUnusable(HotloraError):
    """Start-up: a folder a setting names cannot be used (not creatable, not writable); the message
    names the setting and its environment variable. Raised before anything listens."""


class DoesNotFit(HotloraError):
    """Start-up: the configured engine's memory plan (``hotlora.engine.plan``) exceeds the memory
    it would run in; raised before the model is loaded. ``plan`` is the ``MemoryPlan``."""

    def __init__(self, plan):
        self.plan = plan
        super().__init__(f"the engine does not fit in memory; refusing to start\n{plan.text()}")
