"""A server with mixed-adapter batches under a concurrent load of many distinct users."""

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from ..helpers import generate, metric, pixels


def test_many_users_share_batches_and_each_gets_its_own_result(tiny_models, tmp_path, start_server):
    adapters = tiny_models["flux"] / "adapters"
    server = start_server(tiny_models["flux"], tmp_path, roots=(adapters,), catalog=str(adapters / "catalog.toml"),
                          mixed=True, batch_size=4, max_batch_delay_s=0.2)
    names = ["identity-diffusers", "style-diffusers", "identity-peft", "style-kohya", "style-xlabs"]
    rng = random.Random(3)
    users = [((rng.choice(names), round(rng.uniform(0.3, 1.3), 2)), (rng.choice(names), round(rng.uniform(0, 1), 2)),
              rng.choice([1, 2]), seed) for seed in range(16)]
    alone = [pixels(generate(server.url, identity, style, n=n, seed=seed)) for identity, style, n, seed in users]
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(lambda u: generate(server.url, u[0], u[1], n=u[2], seed=u[3]), users))
    for i, response in enumerate(together):
        assert np.abs(pixels(response).astype(int) - alone[i].astype(int)).max() <= 1, f"user {i} differs"
    assert metric(server.url, "hotlora_mixed_batches_total") > 0  # requests really shared forward passes
    assert metric(server.url, "hotlora_recompiles_total") == 0
    assert httpx.get(f"{server.url}/readyz").json()["engine"]["recompiles"] == 0
