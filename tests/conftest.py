import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# A deliberate, persistent inductor cache so repeated runs skip most of the compile work.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from .helpers import TARGET_RANK  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Both tiny pipelines, saved once per session (built offline, loaded via from_pretrained)."""
    from hotlora.testing import save_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {family: save_tiny_model(root / family, family, target_rank=TARGET_RANK) for family in ("flux", "sdxl")}
