"""Errors as HTTP answers (hotlora/server/errors.py): one mapping for the server and the Ray ingress,
importable where neither FastAPI nor torch is."""

import importlib
import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from hotlora.scaleout.routing import route
from hotlora.errors import AdapterNotFound, EngineError, HotloraError, InvalidRequest, Overloaded
from hotlora.server.errors import (
    STATUS, error_body, error_reply, http_error_reply, internal_error_body, internal_error_reply, is_openai, status_of,
    stream_error, validation_error,
)
from hotlora.server.schemas import GenerateRequest

HEAVY = ("torch", "fastapi", "starlette", "prometheus_client", "ray", "diffusers")


@pytest.mark.parametrize("module", ["hotlora.server.errors", "hotlora.scaleout.routing"])
def test_imports_without_torch_fastapi_or_prometheus(module):
    code = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


class Busy(Overloaded):
    """A subclass with no entry of its own answers as its nearest ancestor in the table."""


class Bare(HotloraError):
    """A HotloraError with no status of its own (start-up errors look like this)."""


def test_the_two_body_shapes():
    exc = AdapterNotFound("no adapter 'x'")
    assert error_body(exc) == {"error": "no adapter 'x'", "type": "AdapterNotFound"}
    assert error_body(exc, openai=True) == {"error": {"message": "no adapter 'x'", "type": "AdapterNotFound"}}
    assert is_openai("/v1/images/generations") and not is_openai("/v1/generate") and not is_openai("/")


def test_status_and_retry_after():
    busy = error_reply(Busy("full", retry_after_s=7))
    assert (busy.status, busy.headers) == (429, {"Retry-After": "7"})
    assert busy.body == {"error": "full", "type": "Busy"}
    plain = error_reply(InvalidRequest("bad"), openai=True)
    assert (plain.status, plain.headers) == (422, {})
    assert plain.body == {"error": {"message": "bad", "type": "InvalidRequest"}}
    assert status_of(EngineError("x")) == 500 and status_of(Bare("x")) == 500
    assert status_of(ValueError("x")) == 500


# Every error's status and fixed headers as they were when each class carried its own status_code
# (before the table): the answers must not change.
ANSWERS = {
    "AdapterFormatError": (422, {}), "AdapterNotFound": (404, {}), "AdapterRejected": (422, {}),
    "AuthConfigError": (500, {}), "BodyTimeout": (408, {}), "CatalogError": (500, {}), "ClientGone": (499, {}),
    "CrossOriginRefused": (403, {}), "DeadlineExceeded": (504, {}), "DeployConfigError": (500, {}),
    "DoesNotFit": (500, {}), "EgressRefused": (403, {}), "EngineError": (500, {}),
    "FetchersBusy": (429, {"Retry-After": "5"}), "Forbidden": (403, {}), "HotloraError": (500, {}),
    "InvalidReference": (422, {}), "InvalidRequest": (422, {}), "ModelDefaultsError": (500, {}),
    "ModelLoadError": (500, {}), "ModelsOverloaded": (429, {"Retry-After": "5"}), "NonFiniteOutput": (422, {}),
    "NotAccepting": (503, {"Retry-After": "5"}), "Overloaded": (429, {}),
    "ReplicasUnavailable": (503, {"Retry-After": "5"}), "RequestError": (400, {}), "RequestTooLarge": (413, {}),
    "SettingsError": (500, {}), "SlotStateCorrupt": (500, {}), "SourceUnavailable": (502, {}),
    "StepCacheError": (500, {}), "Unauthorized": (401, {"WWW-Authenticate": 'Bearer realm="hotlora"'}),
    "UnknownModel": (404, {}), "UnsafeReference": (403, {}), "UnservedShape": (422, {}),
    "UnsupportedMediaType": (415, {}),
}


DEFINE_ERRORS_NEXT_TO_THEIR_CODE = (
    "hotlora.adapters.store.catalog", "hotlora.adapters.store.egress", "hotlora.adapters.store.references", "hotlora.engine.guard",
    "hotlora.engine.pipeline", "hotlora.engine.request", "hotlora.engine.stepcache", "hotlora.scaleout.config",
    "hotlora.server.auth", "hotlora.settings",
)


def _subclasses(cls):
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def test_every_error_answers_as_it_always_did():
    for module in DEFINE_ERRORS_NEXT_TO_THEIR_CODE:
        importlib.import_module(module)
    classes = {c.__name__: c for c in _subclasses(HotloraError) if c.__module__.startswith("hotlora.")}
    assert set(ANSWERS) <= set(classes), set(ANSWERS) - set(classes)
    for name, (status, headers) in ANSWERS.items():
        exc = classes[name].__new__(classes[name])  # what answers is the class: no constructor arguments needed
        reply = error_reply(exc)
        assert (reply.status, reply.headers) == (status, headers), name


def test_the_table_lists_only_hotlora_errors_and_every_one_defined_in_the_one_error_module():
    assert all(issubclass(cls, HotloraError) and cls.__module__ == "hotlora.errors" for cls in STATUS)


def test_unexpected_errors_name_only_their_type():
    assert internal_error_body(KeyError("secret detail")) == {"error": "internal error: KeyError"}
    assert stream_error(KeyError("secret detail")) == {"error": "internal error: KeyError", "status": 500}
    assert stream_error(AdapterNotFound("gone")) == {"error": "gone", "type": "AdapterNotFound", "status": 404}
    assert stream_error(Bare("x"))["status"] == 500


def test_an_unexpected_500_tells_the_client_the_connection_closes():
    # Starlette re-raises after the answer and uvicorn then drops the connection: the header says so.
    reply = internal_error_reply(KeyError("secret detail"))
    assert (reply.status, reply.body, reply.headers) == (500, {"error": "internal error: KeyError"},
                                                         {"Connection": "close"})


def test_the_frameworks_own_refusals_in_the_apis_shape():
    parse = http_error_reply(400, "There was an error parsing the body")
    assert parse.status == 422 and parse.body["type"] == "InvalidRequest"
    assert parse.body["error"].startswith("invalid request: body: ")
    missing = http_error_reply(404, "Not Found", openai=True)
    assert (missing.status, missing.body) == (404, {"error": {"message": "Not Found", "type": "NotFound"}})
    method = http_error_reply(405, "Method Not Allowed", {"Allow": "POST"})
    assert (method.body, method.headers) == ({"error": "Method Not Allowed", "type": "MethodNotAllowed"},
                                             {"Allow": "POST"})


def _errors(data):
    with pytest.raises(ValidationError) as caught:
        GenerateRequest.model_validate(data)
    return caught.value.errors()


def test_validation_messages_name_the_field_the_same_way_whoever_found_it():
    errors = _errors({"prompt": "x", "num_images": "many"})
    plain = validation_error(errors)
    # FastAPI's errors carry where the value came from first; the message leaves it out.
    located = validation_error([{**e, "loc": ("body", *e["loc"])} for e in errors], located=True)
    assert isinstance(plain, InvalidRequest) and str(plain) == str(located)
    assert str(plain).startswith("invalid request: num_images: ")
    whole = validation_error([{"loc": ("body",), "msg": "Field required"}], located=True)
    assert str(whole) == "invalid request: body: Field required"


def test_the_ingress_refuses_with_the_servers_message():
    data = {"prompt": "x", "num_images": "many"}
    with pytest.raises(InvalidRequest) as caught:
        route("POST", "/v1/generate", {}, {}, json.dumps(data).encode(), {"m": "m"}, "m", {"m": "identity"})
    assert str(caught.value) == str(validation_error(_errors(data)))
