"""Build the warm pipeline: load through ``from_pretrained``, pick device and dtype, compile."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import torch

from hotlora.durable import TMP, read_verified, sweep_orphans, write_atomic, write_verified
from hotlora.engine.device import default_dtype
from hotlora.families import ModelFamily, family_of_pipeline
from hotlora.errors import HotloraError

log = logging.getLogger(__name__)


class ModelLoadError(HotloraError):
    """The model could not be loaded (start-up fault: neither a request nor a warm-engine error)."""


def resolve_dtype(dtype, device: str) -> torch.dtype:
    """The configured dtype (a torch dtype, or its name as settings text gives it: "bfloat16"),
    else the device's default."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        named = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(named, torch.dtype):
            raise ModelLoadError(f"dtype {dtype!r} is not a torch dtype name (bfloat16, float16, float32)")
        return named
    return dtype


# The libraries a saved pipeline's classes come from that loading imports lazily (diffusers' lazy
# modules); nothing else a model_index.json names is imported ahead of the load.
IMPORTED_AHEAD = ("diffusers", "transformers")


def import_pipeline_classes(model: str | os.PathLike | None) -> list[str]:
    """Import the classes a local model's ``model_index.json`` names, the pipeline's and its
    components' (``IMPORTED_AHEAD``), before the load, which would import them anyway: ~2.8 s for
    Flux's pipeline and its CLIP and T5 on 2 cores, taken by an engine process spawned ahead while it
    waits for its spec. Returns the names imported; a hub id, a folder without the file, or a class
    that does not import yields none of it, and the load that follows says what is wrong."""
    import importlib
    import json

    index = Path(str(model)) / "model_index.json" if model is not None else None
    try:
        entries = json.loads(index.read_text()) if index is not None and index.is_file() else {}
    except (OSError, ValueError):
        return []
    wanted = [("diffusers", entries.get("_class_name"))] + [
        tuple(entry) for entry in entries.values() if isinstance(entry, list) and len(entry) == 2]
    imported = []
    for library, name in wanted:
        if library not in IMPORTED_AHEAD or not isinstance(name, str):
            continue
        try:
            getattr(importlib.import_module(library), name)
        except Exception as exc:  # the load reports it, with the model's name
            log.debug("not imported ahead: %s.%s (%s)", library, name, exc)
            continue
        imported.append(f"{library}.{name}")
    return imported


def load_pipeline(model: str | os.PathLike, *, dtype: torch.dtype, device: str):
    """Load a Flux or SDXL pipeline from a local directory or a hub id (``from_pretrained``)."""
    from diffusers import DiffusionPipeline

    model = str(model)
    local = os.path.isdir(model)
    log.info("loading %s (%s) as %s on %s", model, "local directory" if local else "hub id", dtype, device)
    try:
        pipeline = DiffusionPipeline.from_pretrained(model, dtype=dtype, local_files_only=local or None)
    except Exception as exc:  # diffusers and huggingface_hub raise many types; the message is what matters
        raise ModelLoadError(f"cannot load model {model!r}: {type(exc).__name__}: {exc}") from exc
    family = family_of_pipeline(pipeline)
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline, family


def hold_weight_shapes(denoiser: torch.nn.Module) -> None:
    """Every weight and buffer of ``denoiser`` gets static shapes in its compiled graphs, each dim
    marked, except the dims already marked dynamic (the slot writer's rank rows, slots.py), and
    dynamo is told to read those marks on module weights: by default it holds every module weight
    static whatever it is marked (``force_parameter_static_shapes`` and
    ``force_nn_module_property_static_shapes``, process-wide). The marks keep what the defaults
    kept: without them a weight whose shape changed between two engines of one block class (two
    sizes of one family in a process) would turn dynamic instead of compiling its own graph."""
    torch._dynamo.config.force_parameter_static_shapes = False
    torch._dynamo.config.force_nn_module_property_static_shapes = False
    for tensor in (*denoiser.parameters(), *denoiser.buffers()):
        dynamic = getattr(tensor, "_dynamo_dynamic_indices", ())
        for dim in range(tensor.dim()):
            if dim not in dynamic:
                torch._dynamo.mark_static(tensor, dim)


def compile_denoiser(denoiser: torch.nn.Module, family: ModelFamily, fullgraph: bool = True,
                     dynamic: bool | None = None) -> str:
    """Regional compilation where the model declares repeated blocks, whole-model otherwise.
    ``dynamic``: torch.compile's (None: dims that change between calls turn dynamic on their second
    value; False: one static graph per shape)."""
    hold_weight_shapes(denoiser)
    if not getattr(denoiser, "_repeated_blocks", None) and family.repeated_blocks:
        denoiser._repeated_blocks = list(family.repeated_blocks)  # what compile_repeated_blocks reads
    for block in denoiser.modules():
        if (type(block).__name__ in family.contiguous_block_outputs
                and _contiguous_outputs not in block._forward_hooks.values()):  # compiled again: once
            block.register_forward_hook(_contiguous_outputs)
    if getattr(denoiser, "_repeated_blocks", None):
        denoiser.compile_repeated_blocks(fullgraph=fullgraph, dynamic=dynamic)
        if family.eager_block_paths:
            _eager_where_declared(denoiser, family)
        return f"regional ({', '.join(denoiser._repeated_blocks)})"
    denoiser.compile(fullgraph=fullgraph, dynamic=dynamic)
    return "whole model"


def _eager_where_declared(denoiser: torch.nn.Module, family: ModelFamily) -> None:
    """Each compiled repeated block runs its eager forward for the calls ``family.eager_block_call``
    names. By hand: torch has no per-call opt-out of a module's compile but ``torch.compiler.disable``,
    which is per function; ``nn.Module.compile`` keeps the compiled callable in ``_compiled_call_impl``
    (torch 2.2 on), and the eager one stays ``_call_impl``."""
    for block in denoiser.modules():
        compiled = block._compiled_call_impl
        if type(block).__name__ in denoiser._repeated_blocks and compiled is not None \
                and not getattr(compiled, "eager_where_declared", False):
            def call(*args, _compiled=compiled, _eager=block._call_impl, **kwargs):
                return (_eager if family.eager_block_call(kwargs) else _compiled)(*args, **kwargs)

            call.eager_where_declared = True
            block._compiled_call_impl = call


def fold_linear_inputs(denoiser: torch.nn.Module, family: ModelFamily) -> None:
    """Every Linear inside ``denoiser``'s compiled region reads a contiguous input (a forward pre-hook,
    traced into the compiled blocks). Why: a Linear on a slice of the joint sequence (SD3's and
    Flux.2's attention output split into text and image tokens) cannot be viewed as 2-D; torch's
    matmul then folds it into one GEMM (copying the activation) only when the weight requires grad,
    and otherwise runs a batched GEMM against the weight expanded over the batch, which a CPU copies:
    PEFT's LoRA layers freeze the base weights, so a model with slots paid 1.34-1.51x the model
    without them in rank bucket 0 (docs/benchmarks.md "Per family"). A contiguous input makes it one
    GEMM again, whatever ``requires_grad`` says; an input already contiguous is returned as it is.
    Where the model is compiled regionally: every Linear inside the repeated blocks, and outside them
    the LoRA layers over a Linear only (their base weight is the frozen one; a plain Linear there keeps
    its trainable weight and needs no Python call a step). Outside the blocks such inputs occur too:
    SDXL's ``Transformer2DModel.proj_in`` (outside its BasicTransformerBlocks) reads the normalised
    feature map permuted to (batch, pixels, channels), a view, and with slots paid a weight-copying
    ``bmm`` (the wide SDXL row: 1.04x the model without slots). Compiled engines only: eager ones keep plain diffusers' arithmetic bit for bit."""
    blocks = set(getattr(denoiser, "_repeated_blocks", None) or family.repeated_blocks)
    roots = [m for m in denoiser.modules() if type(m).__name__ in blocks] if blocks else [denoiser]
    for root in roots:
        _hook_layers(root)
    for layer in denoiser.modules():
        if isinstance(getattr(layer, "base_layer", None), torch.nn.Linear) \
                and _contiguous_input not in layer._forward_pre_hooks.values():
            layer.register_forward_pre_hook(_contiguous_input)


def _hook_layers(module: torch.nn.Module) -> None:
    for child in module.children():
        if isinstance(child, torch.nn.Linear) or hasattr(child, "base_layer"):
            # A LoRA layer (PEFT's wrapper) as a whole: its base layer and its lora_A share its one
            # contiguous input, so its children need no hook of their own.
            if _contiguous_input not in child._forward_pre_hooks.values():
                child.register_forward_pre_hook(_contiguous_input)
        else:
            _hook_layers(child)


def _contiguous_input(module, args):
    return (args[0].contiguous(), *args[1:]) if args and isinstance(args[0], torch.Tensor) else None


@torch.compiler.disable  # eager, outside every graph: a traced hook would be a frame of its own
def _contiguous_outputs(module, args, output):
    """A block's outputs with row-major strides (``ModelFamily.contiguous_block_outputs``): the next
    block then receives the strides the first one did, and runs its graph."""
    if isinstance(output, tuple):
        return tuple(_row_major(t) if isinstance(t, torch.Tensor) else t for t in output)
    return _row_major(output) if isinstance(output, torch.Tensor) else output


def _row_major(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the strides a fresh tensor of its shape has. Not ``.contiguous()``: a slice with
    a batch of one counts as contiguous whatever its batch stride (a size-1 dimension's stride is
    ignored there), so it comes back as it is, and dynamo's guards compare that stride too (a
    single-image pack recompiled every later block for it)."""
    expected, step = [], 1
    for size in reversed(tensor.shape):
        expected.append(step)
        step *= max(size, 1)
    if tensor.stride() == tuple(reversed(expected)):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def graph_count() -> int:
    """Dynamo graphs compiled so far in this process (``counters['recompiles']`` is never written in torch 2.13)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------- attention backends

# Friendly names for diffusers' attention dispatcher backends, in the order they are tried.
ATTENTION_ALIASES = {
    "native": ["native"],
    "sdpa": ["native"],
    "fa3": ["_flash_3_hub", "_flash_3"],  # FlashAttention 3 from the `kernels` package, then a local build
    "flash": ["flash_hub", "flash"],
}


def set_attention_backend(denoiser: torch.nn.Module, wanted: str) -> str:
    """Switch the denoiser's attention through diffusers' dispatcher; fall back to native SDPA,
    with a log line, when the backend cannot be had here (no kernels package, no Hopper GPU, ...)."""
    candidates = ATTENTION_ALIASES.get(wanted, [wanted])
    for backend in candidates:
        try:
            denoiser.set_attention_backend(backend)
            if backend != "native":
                log.info("attention backend: %s", backend)
            return backend
        except (RuntimeError, ValueError, ImportError, OSError) as exc:
            log.warning("attention backend %s unavailable (%s)", backend, str(exc).splitlines()[0][:200])
    denoiser.set_attention_backend("native")
    log.warning("attention backend %r could not be used: falling back to native SDPA", wanted)
    return "native"


# ---------------------------------------------------------------------------- compile cache artifacts


def compile_artifacts_path(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
    import hashlib

    digest = hashlib.sha256(f"{torch.__version__}|{fingerprint}".encode()).hexdigest()[:16]
    return Path(cache_dir) / f"compile-artifacts-{digest}.bin"


def untrusted_because(path: Path) -> str | None:
    """Why ``path`` may hold something another user wrote, or None. Compile artifacts are pickles:
    loading one runs whatever its writer put there, so only this process's user (or root) may have
    been able to write the file or the folder that holds it."""
    if not hasattr(os, "getuid"):  # no POSIX owners and modes to check (Windows)
        return None
    for place in (path.parent, path):
        if not place.exists():
            continue
        info = place.stat()
        if info.st_uid not in (os.getuid(), 0):
            return f"{place} belongs to another user (uid {info.st_uid})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{place} is writable by other users (mode {stat.filemode(info.st_mode)})"
    return None


def sweep_compile_cache(cache_dir: str | os.PathLike) -> int:
    """Start-up: remove the temporary files of writers that were killed (``hotlora.durable``)."""
    return sweep_orphans(Path(cache_dir), TMP)


def read_private(path: Path, what: str) -> bytes | None:
    """What ``write_private`` wrote, or None (with a log line) where it is absent, where another
    user could have written it (``untrusted_because``), or where it is not whole (cut short by a
    kill, or its checksum missing or different: deleted, so the next start does not meet it)."""
    if not path.is_file():
        return None
    reason = untrusted_because(path)
    if reason:
        log.warning("not using %s (only this user may write them): %s", what, reason)
        return None
    try:
        return read_verified(path, what)
    except OSError as exc:
        log.warning("cannot read %s at %s: %s", what, path, exc)
        return None


class CompileArtifacts:
    """The compile artifacts of one fingerprint (``compile_artifacts_path``): loaded before compiling,
    saved whenever this process has compiled something the file lacks. Warm-up saves after each
    writer state, so a warm-up killed half way (a start-up probe, a preemption) leaves the next
    process every state it finished; that process loads them, compiles the rest and saves the whole.

    What is written is the union of the file's artifacts and this process's, never less than the
    file held. It is merged here because torch 2.13's own bytes cannot be saved more than once:
    each ``save_cache_artifacts`` appends a new (kind, artifacts) entry to the same stream, and
    ``load_cache_artifacts`` keeps only the last entry of each kind (measured: a file saved after
    the third of three states loaded only the third state's graphs). Where torch's stream format is
    not the one read here, nothing is saved before the end (``incremental`` is False)."""

    def __init__(self, path: Path):
        self.path, self.loaded = path, False
        self._held: dict[str, dict[str, object]] = {}  # kind -> key -> artifact: what the file holds
        self.incremental = _stream is not None

    def load(self) -> bool:
        """Pre-load the compiler's caches (``torch.compiler.load_cache_artifacts``), only from a whole
        file (its sha256 checked) in a file and folder no other user can write (see
        ``untrusted_because``): they are pickles."""
        path = self.path
        data = read_private(path, "compile artifacts")
        if data is None:
            log.info("no usable compile artifacts at %s: compiling from scratch", path)
            return False
        try:
            torch.compiler.load_cache_artifacts(data)
        except Exception as exc:  # a stale or foreign file must not stop start-up
            log.warning("ignoring unusable compile artifacts %s: %s", path, exc)
            return False
        self.loaded, self._held = True, _read_stream(data)
        log.info("loaded compile artifacts from %s", path)
        return True

    def save(self, *, final: bool = True) -> bool:
        """Write the file's artifacts and this process's, atomically, when this process has any the
        file lacks. ``final=False`` (after a writer state): only where the merge can be written."""
        if not (final or self.incremental):
            return False
        saved = torch.compiler.save_cache_artifacts()
        if not saved:
            return False
        data = saved[0]
        fresh = _read_stream(data)
        if not fresh:  # not a stream read here: torch's bytes as they are, once, at the end
            self.incremental = False
            return final and write_private(self.path, data, "compile artifacts")
        merged = {kind: dict(artifacts) for kind, artifacts in self._held.items()}
        for kind, artifacts in fresh.items():
            merged.setdefault(kind, {}).update(artifacts)
        if all(merged[kind].keys() <= self._held.get(kind, {}).keys() for kind in merged):
            return False  # nothing the file does not hold already (a restart that compiled nothing new)
        if not write_private(self.path, _write_stream(merged), "compile artifacts"):
            return False
        self._held = merged
        return True


try:  # torch's artifact stream (torch.compiler._cache), read and written whole here: see CompileArtifacts
    from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer as _stream
except ImportError:  # another torch: one save per process, torch's own bytes
    _stream = None


def _read_stream(data: bytes) -> dict[str, dict[str, object]]:
    """kind -> key -> artifact, every entry of the stream (torch's loader keeps the last per kind)."""
    if _stream is None:
        return {}
    try:
        CacheArtifactManager._ensure_cache_artifacts_registered()  # what load_cache_artifacts does first
        entries = _stream.to_list(data, deserialize_fn=_deserialize_single_cache)
    except Exception:  # not a stream this torch reads (load_cache_artifacts said so already, or will)
        return {}
    held: dict[str, dict[str, object]] = {}
    for kind, artifacts in entries:
        held.setdefault(kind, {}).update((artifact.key, artifact) for artifact in artifacts)
    return held


def _write_stream(held: dict[str, dict[str, object]]) -> bytes:
    """One entry per kind, so ``load_cache_artifacts`` loads all of them."""
    stream = _stream(serialize_fn=_serialize_single_cache)
    stream.extend((kind, list(artifacts.values())) for kind, artifacts in held.items())
    return stream.to_bytes()


def write_private(path: Path, data: bytes, what: str) -> bool:
    """Write ``data`` atomically and durably, with its sha256 beside it (``hotlora.durable``), into a
    folder no other user can write (the next process trusts it: ``untrusted_because``); False, with
    a warning, where another user could replace it or the disk refuses the write."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    reason = untrusted_because(path)
    if reason:
        log.warning("not saving %s where another user could replace them: %s", what, reason)
        return False
    try:
        write_verified(path, data)
    except OSError as exc:  # a full or read-only volume costs the next start a compile, not this one its warm-up
        log.warning("could not save %s to %s: %s", what, path, exc)
        return False
    log.info("saved %d bytes of %s to %s", len(data), what, path)
    return True


# Inductor's precompiled C++ header (cpp_prefix.h's, 150 MB) lives under ``default_cache_dir()``
# (tempfile.gettempdir()/torchinductor_<user>: torch/_inductor/codecache.py's _HEADER_DIR), whatever
# TORCHINDUCTOR_CACHE_DIR says, and a cached kernel's key holds its path: inductor builds the header
# before it can look any cached kernel up (6.6 s of g++ on 2 cores). Where /tmp is new at each start
# (a container's), every restart paid that. Written by hand (``keep_compiler_headers``): the header is
# kept beside the compile artifacts, published after a warm-up and copied back before compiling, each
# whole (temporary name, fsync, rename, its sha256 beside it). The live folder is never shared: g++
# refuses a header cut short and inductor writes it straight to its final name, so a header another
# process could be writing, or a kill could cut, must never be what g++ opens.
KEPT_HEADERS = "precompiled-headers"


def precompiled_headers() -> Path:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()) / "precompiled_headers"


def restore_compiler_headers(cache_dir: str | os.PathLike, live: Path | None = None) -> list[str]:
    """Before compiling: the kept headers (verified whole, in a file and folder only this user can
    write: ``read_private``) copied into inductor's folder where it lacks them. Returns the names copied."""
    kept, live = Path(cache_dir) / KEPT_HEADERS, live or precompiled_headers()
    for folder in (kept, live):  # what killed copies left
        if folder.is_dir():
            sweep_orphans(folder, TMP)
    copied = []
    for path in sorted(kept.glob("*.h")) + sorted(kept.glob("*.gch")):
        if (live / path.name).exists():
            continue
        try:
            data = read_private(path, "precompiled header")  # g++ loads it into every kernel: compile artifacts' trust rule
            if data is not None:
                live.mkdir(parents=True, exist_ok=True)
                write_atomic(live / path.name, data)
                copied.append(path.name)
        except OSError as exc:  # inductor builds it again
            log.warning("precompiled header %s not restored: %s", path.name, exc)
    if copied:
        log.info("restored inductor's precompiled headers from %s: %s", kept, ", ".join(copied))
    return copied


def keep_compiler_headers(cache_dir: str | os.PathLike, live: Path | None = None) -> list[str]:
    """After a warm-up that compiled with them: inductor's headers the cache lacks, kept there
    whole, each read under inductor's own build lock for it. Returns the names kept."""
    from torch.utils._filelock import FileLock

    kept, live = Path(cache_dir) / KEPT_HEADERS, live or precompiled_headers()
    names = [] if not live.is_dir() else [p.name for p in sorted(live.glob("*.gch"))]
    done = []
    for name in names:
        if (kept / name).exists():
            continue
        source = name.removesuffix(".gch")
        try:
            with FileLock(str(live / "locks" / f"{source.split('.')[0]}.lock"), timeout=600):
                header, data = (live / source).read_bytes(), (live / name).read_bytes()
            kept.mkdir(parents=True, exist_ok=True)
            write_verified(kept / source, header)
            write_verified(kept / name, data)  # last: a restart copies it only once it is whole
            done.append(name)
        except OSError as exc:  # the next start builds it, nothing worse
            log.warning("inductor's precompiled header %s not kept in %s: %s", name, kept, exc)
    if done:
        log.info("kept inductor's precompiled headers in %s: %s", kept, ", ".join(done))
    return done
