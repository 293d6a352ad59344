"""One exception tree for hotlora.

::

    HotloraError
    ├── RequestError          the caller's fault: 4xx, the worker stays warm, nothing is rebuilt
    │   ├── AdapterNotFound       a reference that names nothing
    │   ├── AdapterFormatError    a file we cannot read or convert (layout, dtype, header)
    │   ├── AdapterRejected       a readable adapter that does not fit the served engine;
    │   │                         carries every problem found, not just the first
    │   ├── InvalidRequest        bad generation parameters
    │   │   ├── RequestTooLarge       over a work, body or field bound: 413, the limit in the message
    │   │   ├── InvalidReference      (adapters.references) a reference that is not well-formed: a URL
    │   │   │                         with a bad port or host, whitespace, a control character
    │   │   ├── UnsafeReference       (adapters.references) a path or host outside what is allowed
    │   │   ├── UnservedShape         (engine.request) a size or shape the warm engine would compile for
    │   │   ├── NonFiniteOutput       (engine.guard) the request's adapters overflowed the pack; the
    │   │   │                         base weights were checked and are intact
    │   │   └── UnsupportedMediaType  (server.middleware) POST / with a body a cross-site form could
    │   │                             send, or JSON not labelled as JSON: 415
    │   ├── Overloaded, NotAccepting, DeadlineExceeded, ClientGone
    │   │                         (engine.worker) the queue's answers: 429, 503, 504, 499
    │   ├── BodyTimeout           (server.middleware) a body that trickled in too long: 408
    │   ├── CrossOriginRefused    (server.middleware) a web page's request from another origin: 403
    │   ├── Unauthorized, Forbidden
    │   │                         (server.auth) no or an unknown API key: 401 with WWW-Authenticate;
    │   │                         a key outside its scopes or adapter sources: 403
    │   └── UnknownModel          (scaleout.routing) a model id no deployment serves: 404
    ├── SourceUnavailable     a remote source failed after retries: 502, nobody's fault here,
    │                         nothing to rebuild
    ├── EngineError           our fault: 5xx, the engine is rebuilt
    │   └── SlotStateCorrupt      slot tensors found in a state no swap can produce
    ├── ReplicasUnavailable (503), ModelsOverloaded (429)
    │                         (scaleout.ingress) the Ray ingress's answers; nothing to rebuild
    └── start-up faults, raised before anything serves: ModelLoadError (engine.pipeline),
        StepCacheError (engine.stepcache), CatalogError (adapters.catalog), ModelDefaultsError
        (settings.files: an unreadable hotlora.json), SettingsError (settings.fields: a setting's
        value refused; a ValueError too), DeployConfigError (scaleout.config), AuthConfigError
        (server.auth: no API keys where they are required, an unreadable keys line),
        DoesNotFit (here: the memory plan of the configured engine exceeds the memory it has;
        the plan is in the message and on ``.plan``)

The subclasses that belong to one module are defined next to it; they all derive from this tree.

Foreign exceptions (diffusers, safetensors, huggingface_hub, botocore) are translated into this
tree at the boundary where they are raised, so callers only ever catch these.
"""

from __future__ import annotations


class HotloraError(Exception):
    """Base of every error hotlora raises on purpose."""


class RequestError(HotloraError):
    """The request is at fault. Fail fast, keep the warm engine untouched."""

    status_code = 400


class AdapterNotFound(RequestError):
    status_code = 404


class AdapterFormatError(RequestError):
    status_code = 422


class AdapterRejected(RequestError):
    """An adapter that was read fine but cannot be served here; lists every problem at once."""

    status_code = 422

    def __init__(self, adapter: str, problems: list[str]):
        self.adapter = adapter
        self.problems = list(problems)
        shown = "\n  - ".join(self.problems)
        super().__init__(f"adapter {adapter!r} rejected ({len(self.problems)} problem(s)):\n  - {shown}")


class InvalidRequest(RequestError):
    status_code = 422


class RequestTooLarge(InvalidRequest):
    status_code = 413


class SourceUnavailable(HotloraError):
    """Storage or the Hub did not answer in time, after retries. The engine is fine."""

    status_code = 502


class EngineError(HotloraError):
    """Something inside the engine failed; the warm state can no longer be trusted."""

    status_code = 500


class SlotStateCorrupt(EngineError):
    pass


class DoesNotFit(HotloraError):
    """Start-up: the configured engine's memory plan (``hotlora.engine.plan``) exceeds the memory
    it would run in; raised before the model is loaded. ``plan`` is the ``MemoryPlan``."""

    def __init__(self, plan):
        self.plan = plan
        super().__init__(f"the engine does not fit in memory; refusing to start\n{plan.text()}")
