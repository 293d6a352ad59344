"""Typed settings in one place. Environment variables use the prefix ``HOTLORA_``.

``EngineConfig`` holds every engine option and its default; ``ServerConfig`` produces one
(``engine_config()``), the CLI fills one, and the compile-cache fingerprint is derived from it.
A model directory's ``hotlora.json`` (serving defaults) and config files (TOML or YAML) are read
here and nowhere else.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hotlora.errors import HotloraError

ENV_PREFIX = "HOTLORA_"
GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the engine, checked before any weight is touched."""

    max_images: int = 64
    max_steps: int = 200
    max_scale: float = 8.0  # |scale| per adapter: a huge scale would overflow the pack
    max_work: int = 16 * 1024 * 1536 * 50  # height x width x images x steps
    # height x width of a size the engine was not configured with: an eager engine with no
    # ``sizes`` takes any multiple, and max_work alone lets a 4096x4096 image through (16 Mpx:
    # Flux's attention over 65,536 tokens). 4 Mpx is twice the side of Flux's and SDXL's 1024.
    # Configured sizes (``sizes``, height x width) are served whatever their area.
    max_pixels: int = 2048 * 2048


@dataclass(frozen=True)
class StepCache:
    """Step-cache settings (applied by ``hotlora.engine.stepcache``)."""

    backend: str = "dbcache"
    threshold: float = 0.12  # the article ran DBCache + TaylorSeer at 0.12
    warmup_steps: int = 4  # steps always computed before any may be skipped (cache-dit)
    compute_blocks: int = 1  # leading blocks always computed to measure the change (cache-dit Fn)

    @property
    def fullgraph(self) -> bool:
        return self.backend != "fbcache"


@dataclass(frozen=True)
class EngineConfig:
    """Every option of the warm engine, with its default, once."""

    slots: tuple[str, ...] = ("identity", "style")
    target_rank: int = 16
    # None: every Linear layer of the denoiser (the widest ceiling); names/suffixes; or one regex.
    # The slots' and banks' ceiling only: fused mode ignores it (any Linear, and Conv2d on SDXL,
    # is fusable; its pristine copy covers all of them) and logs a warning when it is set.
    target_modules: Any = None
    # "auto": compiled for batches up to max_batch_size, and each pack runs in the chunk size measured
    # fastest per image at warm-up (per size and CFG mode); an integer: compiled for it, packs chunked to it.
    batch_size: int | str = "auto"
    max_batch_size: int = 6
    compile: bool = True
    dtype: Any = None  # None: bf16 on CUDA, float32 on CPU
    device: str | None = None  # None: CUDA when available
    height: int | None = None  # None: hotlora.json's, else the pipeline's default size
    width: int | None = None
    # Sizes served without compiling: (height, width) pairs, or "WIDTHxHEIGHT" strings as the OpenAI
    # images API's `size` writes them ("1024x1024,832x1216" too). Every one is warmed up at start-up
    # and part of the compile fingerprint. Empty: height x width (the default) only. The default size
    # is height x width when given (it must then be one of them), else the first.
    sizes: tuple[tuple[int, int], ...] = ()
    # A request at a size not served: "refuse" (422 listing the sizes) or "nearest" (snapped to the
    # served size closest in aspect ratio, then area; the result says so).
    size_policy: str = "refuse"
    mixed: bool = False  # adapter banks: several requests' adapters in one forward batch
    bank_entries: int | None = None  # None: 2 * batch_size + 1
    attention_backend: str = "native"
    compile_cache_dir: str | os.PathLike | None = None
    step_cache: StepCache | None = None
    rank_buckets: tuple[int, ...] = ()
    # "slots": LoRA layers in the compiled model, adapters copied into them per request (bounded by
    # target_rank and the ceiling). "fused": no LoRA layers; each request's adapters are merged
    # into the weights in place and restored from a pristine copy (any rank, any Linear, and conv
    # LoRA on SDXL's Conv2d layers; target_rank and target_modules do not apply; one adapter set per
    # forward batch). engine/writers/fused.py; docs/benchmarks.md says why the default is slots.
    adapter_mode: str = "slots"
    # Where fused mode keeps its pristine weights: "device", "host" (pinned when CUDA), or "auto"
    # (the device when they fit in its free memory, else the host).
    fused_restore: str = "auto"
    # Text-encoder LoRA (merged into the text encoders per request, engine/writers/text.py; their
    # pristine Linear weights are kept where fused_restore says). False: such keys are skipped
    # and the response says so.
    text_encoder_lora: bool = True
    # Token rows reserved per slot in each tokenizer and embedding table for a request's
    # pivotal-tuning embeddings (0: none; such adapters are then refused).
    embedding_rows: int = 4
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self):
        if isinstance(self.batch_size, str) and self.batch_size.strip().isdigit():
            object.__setattr__(self, "batch_size", int(self.batch_size))
        if self.batch_size != "auto" and not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"batch_size must be 'auto' or an integer >= 1, got {self.batch_size!r}")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        object.__setattr__(self, "slots", tuple(self.slots))
        object.__setattr__(self, "rank_buckets", tuple(self.rank_buckets))
        object.__setattr__(self, "sizes", parse_sizes(self.sizes))
        if self.size_policy not in SIZE_POLICIES:
            raise ValueError(f"size_policy must be one of {', '.join(SIZE_POLICIES)}, got {self.size_policy!r}")
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.mixed and self.rank_buckets:
            raise ValueError("rank buckets apply to the slots of single-request packs, not to mixed batches")
        if self.adapter_mode not in ADAPTER_MODES:
            raise ValueError(f"adapter_mode must be one of {', '.join(ADAPTER_MODES)}, got {self.adapter_mode!r}")
        if self.fused_restore not in FUSED_RESTORE:
            raise ValueError(f"fused_restore must be one of {', '.join(FUSED_RESTORE)}, got {self.fused_restore!r}")
        if not (isinstance(self.embedding_rows, int) and 0 <= self.embedding_rows <= 64):
            raise ValueError(f"embedding_rows must be an integer in 0..64, got {self.embedding_rows!r}")
        if self.adapter_mode == "fused" and (self.mixed or self.rank_buckets):
            raise ValueError("fused mode holds one adapter set per forward batch in the weights themselves: "
                             "it has no mixed batches and no rank buckets")

    # What the compiled graphs depend on; request limits, the device and the cache folder do not.
    # The sizes enter resolved (``sizes=``, the default one resolved from the model), like the dtype.
    FINGERPRINT_EXCLUDES = frozenset({"limits", "compile_cache_dir", "device", "dtype", "height", "width",
                                      "sizes", "size_policy", "attention_backend", "text_encoder_lora",
                                      "embedding_rows"})  # the text encoders run eagerly

    def fingerprint(self, model: str | None, family: str, **resolved) -> str:
        """The compile-cache key: the model, the family, every option the graphs depend on, and the
        values resolved at load time (``resolved``: sizes, attention backend, dtype)."""
        options = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.FINGERPRINT_EXCLUDES}
        return json.dumps({"model": model, "family": family, **options, **resolved}, sort_keys=True, default=repr)

    @property
    def batch_limit(self) -> int:
        """The largest batch compiled for (and the bound of a mixed batch)."""
        return self.max_batch_size if self.batch_size == "auto" else self.batch_size


SIZE_POLICIES = ("refuse", "nearest")
ADAPTER_MODES = ("slots", "fused")
FUSED_RESTORE = ("auto", "device", "host")


def parse_size(text: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` (the OpenAI images API's ``size``, e.g. ``"832x1216"``) -> (height, width)."""
    parts = str(text).strip().lower().split("x")
    try:
        width, height = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"a size is WIDTHxHEIGHT in pixels, like 1024x1024; got {text!r}") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return height, width


def parse_sizes(value) -> tuple[tuple[int, int], ...]:
    """Sizes as (height, width) pairs, in order, without repeats: from pairs, ``"WxH"`` strings, or
    one comma-separated string of them (a config file, an environment variable, a flag)."""
    if isinstance(value, str):
        value = [p for p in value.split(",") if p.strip()]
    sizes = []
    for item in value or ():
        if isinstance(item, str):
            size = parse_size(item)
        else:
            height, width = item
            if not (isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0):
                raise ValueError(f"a (height, width) size must be two positive integers, got {item!r}")
            size = (height, width)
        if size not in sizes:
            sizes.append(size)
    return tuple(sizes)


def format_size(height: int, width: int) -> str:
    """(height, width) -> ``"WIDTHxHEIGHT"``, as the OpenAI images API writes a size."""
    return f"{width}x{height}"


@dataclass
class StoreConfig:
    """How the adapter store fetches, checks and caches adapters."""

    cache_dir: Path = Path(".cache/hotlora")
    disk_budget_bytes: int = 20 * GiB
    ram_budget_bytes: int = 4 * GiB
    # Local references must resolve (symlinks followed, every file of a directory too) inside one
    # of these directories or the catalog file's folder. Empty: only the catalog's folder; never
    # the working directory.
    local_roots: tuple[Path, ...] = ()
    # Egress (adapters.egress): every remote connection goes to a public address only, resolved
    # once and pinned. Entries here (``host`` or ``host:port``) are allowed even when internal
    # (how a test server on 127.0.0.1 is reached); when not empty, https:// references may name
    # only these hosts. The S3 and Hub endpoints need an entry only when they are internal.
    allowed_hosts: tuple[str, ...] = ()
    allow_http: bool = False  # plain http:// (loopback test servers, trusted networks)
    # s3:// references allowed, as ``bucket`` or ``bucket/prefix`` entries; empty: s3:// refused
    # (the server's credentials may read far more than its clients should).
    allowed_s3: tuple[str, ...] = ()
    # Hub repositories (``owner/repo`` or ``owner/*``) fetched with the server's HF token; any other
    # hf:// repository is fetched anonymously, so private and gated repos the token reaches stay
    # unreachable to clients. Empty: no request ever uses the token.
    allowed_hub_repos: tuple[str, ...] = ()
    allow_pickle: bool = False  # .bin / .pt adapters: torch.load(weights_only=True), still opt-in
    max_adapter_bytes: int = 2 * GiB
    max_header_bytes: int = 16 * MiB
    timeout_s: float = 30.0  # per network read (connect, each chunk)
    # Whole-fetch deadline, counted from the moment the fetch is asked for: time queued for a
    # worker, the probe (HEAD), the download and every retry together. A source that drips bytes
    # cannot hold a fetch (and the request waiting on it) longer than this.
    download_deadline_s: float = 120.0
    max_fetch_workers: int = 4  # threads that download and convert; RAM-cached adapters never wait for them
    # Fetch workers one client (API key, else peer address) may hold at once in each lane
    # (requests, prefetches); 0: half of max_fetch_workers (at least 1). A client never holds every
    # worker, prefetches never take the last one, and requests go before prefetches.
    fetch_workers_per_client: int = 0
    ram_max_entries: int = 10_000  # the RAM tier's entry cap, besides its byte budget
    retries: int = 3
    backoff_s: float = 0.25
    s3_endpoint_url: str | None = None  # R2, MinIO, ...; else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
    s3_region: str | None = None
    catalog: str | None = None  # TOML/YAML file of adapters to pre-cache at start-up
    # Read only in offline mode (HF_HUB_OFFLINE): a pre-filled Hub cache. None: huggingface_hub's
    # own (HF_HOME / HF_HUB_CACHE). Online, Hub files download into the store's work folder.
    hf_cache_dir: str | None = None
    # How long a remote reference's content identity (ETag, S3 ETag, hub revision) is trusted
    # before asking the server again. N (default 30): an adapter in RAM is served without a fetch
    # worker or a round trip for N seconds after the last answer, and an object replaced at the
    # same address may be served for up to N seconds after the change. 0: ask on every request
    # (never stale; each request, even for an adapter in RAM, waits for a HEAD on a fetch worker).
    revalidate_after_s: float = 30.0

    @classmethod
    def from_env(cls, file_values: dict | None = None, **overrides) -> "StoreConfig":
        """Defaults, then a config file's ``[store]`` table, then ``HOTLORA_*`` variables
        (e.g. HOTLORA_RAM_BUDGET_BYTES), then ``overrides``."""
        return cls(**_layered(cls, file_values, overrides))

    def __post_init__(self):
        self.cache_dir = Path(self.cache_dir)
        roots = self.local_roots.split(os.pathsep) if isinstance(self.local_roots, str) else self.local_roots
        self.local_roots = tuple(Path(p) for p in roots if str(p))
        self.allowed_hosts = tuple(h.strip().lower() for h in _listed(self.allowed_hosts))
        self.allowed_s3 = tuple(e.strip().strip("/") for e in _listed(self.allowed_s3) if e.strip().strip("/"))
        self.allowed_hub_repos = tuple(e.strip() for e in _listed(self.allowed_hub_repos))


def _listed(value) -> tuple:
    """A tuple setting given as one comma-separated string (a config file, a flag) or a sequence."""
    return tuple(p for p in value.split(",") if p.strip()) if isinstance(value, str) else tuple(value)


@dataclass
class ServerConfig:
    """``hotlora serve``: defaults < config file ``[server]`` < ``HOTLORA_*`` env < command-line flags."""

    model: str | None = None  # None: the built-in tiny Flux model, built on first use
    slots: tuple[str, ...] = ("identity", "style")
    target_rank: int = 16
    target_modules: str | None = None  # a regex (full match) over the denoiser's Linear layer names
    batch_size: str | int = "auto"  # "auto": measured at warm-up, up to max_batch_size; or a fixed integer
    max_batch_size: int = 6
    compile: bool = True
    mixed: bool = False  # merge requests with different adapters into one forward batch (adapter banks)
    # Extra ranks to compile for besides target_rank (e.g. 4,8): a request runs the smallest that
    # holds its adapters instead of the full padded rank. Each costs one more warm-up.
    rank_buckets: tuple[int, ...] = ()
    adapter_mode: str = "slots"  # slots | fused (EngineConfig.adapter_mode; docs/benchmarks.md says why slots)
    text_encoder_lora: bool = True  # merge adapters' text-encoder LoRA per request (False: skipped, and said so)
    embedding_rows: int = 4  # token rows reserved per slot for pivotal-tuning embeddings (0: refused)
    attention_backend: str = "native"  # native | fa3 | flash | any diffusers dispatcher backend name
    compile_cache_dir: str | None = ".cache/hotlora/compile"  # compile artifacts kept across restarts
    step_cache: str | None = None  # dbcache | taylorseer | fbcache (off by default: it trades quality)
    step_cache_threshold: float = 0.12
    max_batch_delay_s: float = 0.02  # how long a mixed batch waits for companions
    height: int | None = None
    width: int | None = None
    # Sizes served without compiling ("1024x1024,832x1216": WIDTHxHEIGHT, the default first), all
    # warmed at start-up; empty: the model's default size. A request at another size: size_policy
    # "refuse" (422 listing them) or "nearest" (snapped, and the answer says so).
    sizes: str | None = None
    size_policy: str = "refuse"
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 16
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 120.0
    # Bounds on what one request may ask (answered 413/422 with the limit in the message).
    max_scale: float = 8.0  # |scale| per adapter; real adapters are used at 0..~2
    # height x width x images x steps: 16 images of 1024x1536 at 50 steps by default.
    max_work: int = 16 * 1024 * 1536 * 50
    max_body_bytes: int = 1 * MiB  # HTTP request bodies (prompts and references, never weights)
    max_prefetch_inflight: int = 64  # adapter fetches a prefetch may have running; 429 beyond
    # Of those, what one client (API key, else peer address) may have: three quarters, so one client
    # cannot take every place from the others.
    max_prefetch_per_client: int = 48
    # Requests one client may have waiting for their adapters' fetches (429 beyond). They hold no
    # admission slot (2 x max_queue, taken once the adapters are in) while they wait.
    max_fetching_per_client: int = 32
    max_rebuild_attempts: int = 5  # consecutive failed rebuilds before the worker gives up (503s)
    lora_header_slot: str = "identity"  # the slot the inference API's `lora` header fills
    enable_fault_injection: bool = False  # POST /admin/fault: for tests of the rebuild path only
    # API keys (server/auth.py). auto: required unless the server binds a loopback address and no
    # keys are configured; on: required; off: never (logged loudly when not on loopback).
    auth: str = "auto"
    api_keys_file: str | None = None  # one `sha256:<hex> name=.. scopes=.. sources=..` line per key
    api_keys: str | None = None  # the same lines (';' or newline between them), e.g. HOTLORA_API_KEYS
    # Host headers answered (Starlette's TrustedHostMiddleware: DNS rebinding). Empty: 127.0.0.1,
    # localhost and [::1] while the server takes requests without keys on loopback, else any.
    allowed_host_headers: tuple[str, ...] = ()
    # Browser origins other than the server's own that may call it (CORS). Empty: none, and no CORS headers.
    cors_origins: tuple[str, ...] = ()

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            slots=self.slots, target_rank=self.target_rank, target_modules=self.target_modules,
            batch_size=self.batch_size, max_batch_size=self.max_batch_size, compile=self.compile, height=self.height, width=self.width,
            mixed=self.mixed, attention_backend=self.attention_backend, compile_cache_dir=self.compile_cache_dir,
            step_cache=StepCache(self.step_cache, self.step_cache_threshold) if self.step_cache else None,
            rank_buckets=self.rank_buckets, limits=RequestLimits(max_scale=self.max_scale, max_work=self.max_work),
            adapter_mode=self.adapter_mode, sizes=self.sizes or (), size_policy=self.size_policy,
            text_encoder_lora=self.text_encoder_lora, embedding_rows=self.embedding_rows,
        )

    @classmethod
    def load(cls, config_file: str | Path | None = None, store_flags: dict | None = None,
             **flags) -> tuple["ServerConfig", StoreConfig]:
        file_data = read_config_file(config_file) if config_file else {}
        server = cls(**_layered(cls, file_data.get("server"), {k: v for k, v in flags.items() if v is not None}))
        store = StoreConfig.from_env(file_data.get("store"),
                                     **{k: v for k, v in (store_flags or {}).items() if v is not None})
        return server, store

    def __post_init__(self):
        if isinstance(self.slots, str):
            self.slots = tuple(s.strip() for s in self.slots.split(",") if s.strip())
        self.slots = tuple(self.slots)
        if isinstance(self.rank_buckets, (str, int)):
            self.rank_buckets = str(self.rank_buckets).split(",")
        try:
            self.rank_buckets = tuple(int(str(b).strip()) for b in self.rank_buckets if str(b).strip())
        except ValueError:
            raise ValueError(f"rank_buckets must be integers, got {self.rank_buckets!r}") from None
        for name in ("allowed_host_headers", "cors_origins"):  # flags and env give "a,b"
            setattr(self, name, tuple(p.strip() for p in _listed(getattr(self, name)) if p.strip()))
        if isinstance(self.auth, bool):  # `auth = false` in a TOML file
            self.auth = "on" if self.auth else "off"
        if self.auth not in ("auto", "on", "off"):
            raise ValueError(f"auth must be auto, on or off, got {self.auth!r}")


def read_config_file(path) -> dict:
    """A TOML file, or YAML of the same shape (``.yaml`` / ``.yml``)."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        return yaml.safe_load(text) or {}
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


# A model directory may carry this file to suggest serving defaults (the tiny models do: their
# pipelines' own defaults would be far too large an image for them), among them the ids it
# answers to (``model_id``, ``base_model_aliases``).
MODEL_DEFAULTS_FILE = "hotlora.json"


class ModelDefaultsError(HotloraError):
    """A model directory's hotlora.json cannot be read (a start-up fault)."""


def read_model_defaults(model) -> dict:
    """``hotlora.json`` of a model directory; {} for a hub id or a directory without one."""
    path = Path(str(model)) / MODEL_DEFAULTS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelDefaultsError(f"{path}: unreadable serving defaults ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelDefaultsError(f"{path}: serving defaults must be a JSON object")
    return data


def _layered(cls, file_values: dict | None, overrides: dict) -> dict:
    known = {f.name: f for f in fields(cls)}
    values = {}
    for name, value in (file_values or {}).items():
        if name not in known:
            raise ValueError(f"unknown setting {name!r} for {cls.__name__}; known: {', '.join(known)}")
        values[name] = value
    for name, f in known.items():
        raw = os.environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _parse(raw, f.type)
    values.update(overrides)
    return values


def _parse(raw: str, annotation: str):
    if "bool" in annotation:
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    if annotation.startswith("int"):
        return int(raw) if raw else None
    if annotation.startswith("float"):
        return float(raw) if raw else None
    if annotation.startswith("tuple"):
        return tuple(p for p in raw.split(os.pathsep if "Path" in annotation else ",") if p)
    if annotation.startswith("Path"):
        return Path(raw)
    return raw or None
