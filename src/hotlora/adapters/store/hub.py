"""The Hugging Face Hub source: ``hf://owner/repo[@revision][/file]``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hotlora import __version__
from hotlora.adapters.store.references import Reference, UnsafeReference, confine_tree, inside
from hotlora.adapters.store.remote import Deadline, Remote, check_size
from hotlora.adapters.store.sources import Fetched
from hotlora.adapters.store.egress import EgressPolicy
from hotlora.settings import StoreConfig
from hotlora.errors import AdapterNotFound, SourceUnavailable

log = logging.getLogger(__name__)
MAX_CARD_BYTES = 1 << 20  # a model card read for its base_model alone
MAX_BASE_MODEL_CHARS = 256


def _card_base_model(readme: Path, confined_to: Path) -> str | None:
    """``base_model`` of a model card's YAML header (huggingface_hub's parser; the first of a list).
    ``confined_to``: where the card's real path must lie (a cached snapshot's file links into its
    repository's blobs)."""
    from huggingface_hub.repocard import metadata_load

    real = os.path.realpath(readme)
    if not readme.is_file() or not inside(real, os.path.realpath(confined_to)) or os.path.getsize(real) > MAX_CARD_BYTES:
        return None
    base = (metadata_load(readme) or {}).get("base_model")
    if isinstance(base, list):
        base = base[0] if base else None
    if not isinstance(base, str) or not base.strip() or len(base) > MAX_BASE_MODEL_CHARS:
        return None
    return base.strip()


class HubSource:
    """``hf://owner/repo[@revision][/file]``. Online, the repository's metadata (commit and file
    sizes) is read first and the size cap applied before any download; the files then come by
    their resolve URLs through the egress client into the store's work directory (no Hub cache
    grows outside the store's disk budget: the converted result lives in the disk tier). Only
    repositories in ``allowed_hub_repos`` get the server's token; any other is fetched anonymously,
    so private or gated repositories the token reaches stay out of clients' reach. Offline
    (``HF_HUB_OFFLINE``), a pre-filled Hub cache (``hf_cache_dir``) is read, confined to the repo.

    Written here by hand: the one metadata request and the file downloads, because huggingface_hub's
    own client is process-wide, unpinned and has per-read timeouts only. URLs, headers and the
    token come from huggingface_hub."""

    PATTERNS = ["*.safetensors", "adapter_config.json", "README.md"]
    BESIDE = ("adapter_config.json", "README.md")

    def __init__(self, config: StoreConfig, cache_dir: str | None = None):
        self.config = config
        self.cache_dir = cache_dir
        self.remote = Remote(config, EgressPolicy.of(config, exclusive=False))

    @staticmethod
    def offline() -> bool:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)

    @staticmethod
    def endpoint() -> str:
        from huggingface_hub import constants

        return constants.ENDPOINT.rstrip("/")

    def token_allowed(self, repo: str) -> bool:
        owner = repo.split("/", 1)[0].lower()
        return any(entry.lower() in (repo.lower(), f"{owner}/*") for entry in self.config.allowed_hub_repos)

    def _headers(self, repo: str) -> dict:
        """The configured token (HF_TOKEN, the login) for listed repos only. Not built with
        ``build_hf_headers``: its user agent fetches an agent registry from the endpoint through
        huggingface_hub's own client, a request outside this policy and its deadline."""
        from huggingface_hub.utils import get_token

        headers = {"user-agent": f"hotlora/{__version__}"}
        token = get_token() if self.token_allowed(repo) else None
        if token:
            headers["authorization"] = f"Bearer {token}"
        return headers

    def _file_url(self, repo: str, sha: str, name: str) -> str:
        """``hf_hub_url``'s resolve URL; written out because hf_hub_url only swaps in an endpoint
        that starts like the one HF_ENDPOINT named at import."""
        from urllib.parse import quote

        return f"{self.endpoint()}/{repo}/resolve/{quote(sha, safe='')}/{quote(name)}"

    def _metadata(self, ref: Reference, deadline: Deadline) -> tuple[str, list[tuple[str, int | None]]]:
        """The commit and the (file, size) pairs to fetch, sizes checked against the cap."""
        from urllib.parse import quote

        from huggingface_hub.utils import filter_repo_objects

        from hotlora.adapters.store.references import _plain_components

        url = f"{self.endpoint()}/api/models/{ref.location}/revision/{quote(ref.revision or 'main', safe='')}"
        info = self.remote.json(ref, url, headers=self._headers(ref.location), params={"blobs": "true"},
                                deadline=deadline)
        sha = info.get("sha") if isinstance(info, dict) else None
        siblings = info.get("siblings") if isinstance(info, dict) else None
        if not isinstance(sha, str) or not sha.isalnum() or not isinstance(siblings, list):
            log.warning("%s: hub metadata without a commit or a file list", ref.display)
            raise SourceUnavailable(f"{ref.display}: not available")
        sizes = {}
        for entry in siblings:
            name = entry.get("rfilename") if isinstance(entry, dict) else None
            if isinstance(name, str) and _plain_components(name):  # a hostile endpoint's names are not paths
                size = entry.get("size")
                sizes[name] = size if isinstance(size, int) and size >= 0 else None
        if ref.filename:
            if ref.filename not in sizes:
                raise AdapterNotFound(f"adapter not found or not allowed: {ref.display}")
            names = [ref.filename, *(n for n in self.BESIDE if n in sizes and n != ref.filename)]
        else:
            names = list(filter_repo_objects(list(sizes), allow_patterns=self.PATTERNS))
        check_size(sum(sizes[n] or 0 for n in names), ref, self.config)
        return sha, [(n, sizes[n]) for n in names]

    def probe(self, ref: Reference, deadline: Deadline | None = None) -> str | None:
        if self.offline():
            return None  # the cached snapshot's commit, known once it is located
        sha, _ = self._metadata(ref, deadline or Deadline.of(self.config))
        return f"hf|{ref.location}|{sha}|{ref.filename or ''}"

    def fetch(self, ref: Reference, workdir: Path, deadline: Deadline | None = None) -> Fetched:
        if self.offline():
            return self._from_cache(ref)
        deadline = deadline or Deadline.of(self.config)  # one for the metadata and every file
        sha, files = self._metadata(ref, deadline)
        folder = workdir / "hub"
        left = self.config.max_adapter_bytes
        for name, _ in files:
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            url = self._file_url(ref.location, sha, name)
            received, _, _ = self.remote.download(ref, url, target, headers=self._headers(ref.location),
                                                  deadline=deadline, budget=left)
            left -= received
        path = folder / ref.filename if ref.filename else folder
        if not path.exists():
            raise AdapterNotFound(f"adapter not found or not allowed: {ref.display}")
        size = self.config.max_adapter_bytes - left
        return Fetched(path, f"hf|{ref.location}|{sha}|{ref.filename or ''}", size, (workdir,))

    def base_model_of(self, repo: str, deadline: Deadline | None = None) -> str | None:
        """The ``base_model`` a Hub repository's model card declares (the Ray ingress routes a
        ``/models/{repo}`` request by it), or None: no such repository, no card, none declared, or a
        repository that is no adapter (its files over the adapter cap). Only the card is read."""
        import tempfile

        from hotlora.adapters.store.references import parse_reference
        from hotlora.errors import InvalidRequest

        try:
            ref = parse_reference(f"hf://{repo}")
        except InvalidRequest:  # malformed or unsafe: no repository
            return None
        if ref.kind != "hf" or ref.filename:
            return None
        try:
            if self.offline():
                from huggingface_hub import snapshot_download

                folder = Path(snapshot_download(ref.location, revision=ref.revision, allow_patterns=["README.md"],
                                                cache_dir=self.cache_dir, local_files_only=True))
                return _card_base_model(folder / "README.md", folder.parents[1])
            deadline = deadline or Deadline.of(self.config)
            sha, files = self._metadata(ref, deadline)
            if "README.md" not in dict(files):
                return None
            with tempfile.TemporaryDirectory(prefix="hotlora-card-") as work:
                target = Path(work) / "README.md"
                self.remote.download(ref, self._file_url(ref.location, sha, "README.md"), target,
                                     headers=self._headers(ref.location), deadline=deadline, budget=MAX_CARD_BYTES)
                return _card_base_model(target, Path(work))
        except Exception as exc:  # not found, not cached, over the cap, unreachable: no base model to route by
            log.info("%s: no base model read from its model card (%s)", ref.display, type(exc).__name__)
            return None

    def _from_cache(self, ref: Reference) -> Fetched:
        from huggingface_hub import snapshot_download

        patterns = [ref.filename, *self.BESIDE] if ref.filename else self.PATTERNS
        try:
            folder = Path(snapshot_download(ref.location, revision=ref.revision, allow_patterns=patterns,
                                            cache_dir=self.cache_dir, local_files_only=True))
        except Exception as exc:  # the hub client's not-cached and not-found errors of every kind
            log.warning("%s: not in the local Hub cache (%s)", ref.display, type(exc).__name__)
            raise AdapterNotFound(f"adapter not found or not allowed: {ref.display}") from None
        # snapshots/<commit>/<file>: the file stays inside the snapshot by name, and inside the
        # repository's cache folder (models--owner--repo) once its symlink into blobs/ is followed.
        repo_folder = Path(os.path.realpath(folder.parents[1]))
        path = folder / ref.filename if ref.filename else folder
        if not inside(os.path.normpath(path), folder):
            raise UnsafeReference(f"{ref.display}: not allowed")
        if not path.exists():
            raise AdapterNotFound(f"adapter not found or not allowed: {ref.display}")
        try:
            confine_tree(path, (repo_folder,))
        except UnsafeReference:
            log.warning("%s: the cached snapshot links outside its repository", ref.display)
            raise UnsafeReference(f"{ref.display}: not allowed") from None
        files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        check_size(size, ref, self.config)
        # snapshots/<commit>/...: the commit hash pins the content.
        return Fetched(path, f"hf|{ref.location}|{folder.name}|{ref.filename or ''}", size, (repo_folder,))


class HubBaseModels:
    """Hub repositories' declared base models, each read once in a while (``HubSource.base_model_of``):
    the Ray ingress routes ``/models/{repository}`` by them. Bounded; an answer, none included, is
    trusted for ``TTL_S`` (a card can change, a repository appear)."""

    TTL_S = 300.0

    def __init__(self, source: HubSource, max_entries: int = 4096):
        from hotlora.lru import LRU

        self.source = source
        self._known: LRU[str, tuple[str | None, float]] = LRU(max_entries=max_entries)

    def __call__(self, repo: str) -> str | None:
        import time

        known = self._known.get(repo)
        if known is not None and time.monotonic() - known[1] < self.TTL_S:
            return known[0]
        base = self.source.base_model_of(repo)
        self._known.put(repo, (base, time.monotonic()))
        return base
