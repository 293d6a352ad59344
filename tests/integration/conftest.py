"""Fixtures shared by the integration tests."""

import random
import socket

import pytest

from hotlora.families import family_named

from ..helpers import family_params

MIXED_BATCH = 3


@pytest.fixture
def s3_endpoint(monkeypatch):
    import moto.s3.models
    from moto.server import ThreadedMotoServer

    # Real S3 wants 5 MiB parts; small parts let a tiny adapter be a genuine multipart object.
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 256)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                        "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="session", params=family_params(mixed=True))
def mixed(request, tiny_models, tmp_path_factory):
    """A compiled mixed-batch engine per family and a pool of adapters for it, shared by the test
    modules that serve through one (compiles are most of CI's time). Tests turn recompiles into
    errors themselves: a session-wide switch would fail other engines' warm-ups."""
    from hotlora import Engine
    from hotlora.testing import random_lora, save_diffusers_lora

    from hotlora.engine.request import IMAGE_TASKS

    from ..helpers import CORE_FAMILIES, TARGET_RANK

    family = request.param
    # The core families' engines serve image-to-image and inpaint too (their mixed batches of different
    # input images: tests/integration/test_tasks.py): a few more warm-up passes on graphs that exist
    # anyway, far cheaper than a second compiled engine per family.
    tasks = [task for task in IMAGE_TASKS if task in family_named(family).task_pipelines and family in CORE_FAMILIES]
    import torch

    # Warm-up compiles by definition: a module that asks for this engine may hold recompiles as errors
    # already (test_tasks.py's own engine does, for the module's life).
    with torch._dynamo.config.patch(error_on_recompile=False):
        engine = Engine.from_pretrained(tiny_models[family], target_rank=TARGET_RANK, batch_size=MIXED_BATCH,
                                        compile=True, mixed=True, tasks=tuple(tasks))
    pool_dir = tmp_path_factory.mktemp(f"mixed-{family}")
    linears = dict(engine.ceiling.modules)
    rng = random.Random(f"pool-{family}")
    pool = []
    for i in range(6):
        rank = rng.randint(1, TARGET_RANK)
        modules = rng.sample(sorted(linears), rng.randint(len(linears) // 3, len(linears)))
        sd = random_lora(linears, rank, seed=1000 + i, modules=modules)
        trainer = pool_dir / f"a{i}.safetensors"
        if i == 5 and family_named(family).trainer_lora(trainer, linears, sd, rank, seed=1000 + i) is not None:
            pool.append(trainer)
        else:
            pool.append(save_diffusers_lora(pool_dir / f"a{i}", family, sd, rank=rank, alpha=rng.choice([rank, 2 * rank])))
    return family, tiny_models[family], engine, pool
