"""A local Ray cluster (2 CPUs) serving the tiny Flux model on two replicas and the tiny SDXL
model on one, behind hotlora's ingress on 127.0.0.1. Started and shut down here, once per module."""

import logging
import os
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from ray import serve  # noqa: E402

from hotlora.settings import ServerConfig, StoreConfig  # noqa: E402
from hotlora.scaleout.app import APP_NAME, build_app  # noqa: E402
from hotlora.scaleout.config import RayServeConfig  # noqa: E402

from ..helpers import TARGET_RANK, fake_hub_cache, free_port  # noqa: E402


HUB_SDXL_LORA = "someone/sdxl-style"  # in the cluster's offline Hub cache, its card naming the tiny SDXL


def ray_config(tiny_models, cache: Path, port: int) -> RayServeConfig:
    # compile=False: the Ray tests are about routing, affinity and failure, not the compiled engine.
    # memory="off": a replica's start-up memory check reads the machine's free RAM, which the test
    # session's other servers (module fixtures, each with its engine process) hold by the time these run:
    # measured, the SDXL replica refused to start (DoesNotFit) with 4 GB free of 23 GB. The check has
    # tests of its own (tests/e2e/test_plan_server.py).
    server = ServerConfig(target_rank=TARGET_RANK, batch_size=2, compile=False, max_queue=16, drain_timeout_s=10,
                          memory="off")
    weights = tiny_models["sdxl"] / "adapters" / "style-diffusers" / "pytorch_lora_weights.safetensors"
    hub = fake_hub_cache(cache / "hub", HUB_SDXL_LORA, {"pytorch_lora_weights.safetensors": weights.read_bytes(),
                                                         "README.md": b"---\nbase_model: hotlora/tiny-sdxl\n---\n"})
    store = StoreConfig(cache_dir=cache, local_roots=tuple(tiny_models.values()), hf_cache_dir=str(hub))

    def model(family, replicas):
        adapters = tiny_models[family] / "adapters"
        # Half a CPU each: three replicas and their replacement fit in the 2-CPU cluster.
        return {"model": str(tiny_models[family]), "num_replicas": replicas, "aliases": [f"tiny-{family}"],
                "ray_actor_options": {"num_cpus": 0.5},
                "store": {"catalog": str(adapters / "catalog.toml"), "cache_dir": str(cache / family)}}

    return RayServeConfig.from_dict({"port": port, "max_attempts": 4, "retry_backoff_s": 0.5,
                                     "request_timeout_s": 120, "models": {"flux": model("flux", 2),
                                                                          "sdxl": model("sdxl", 1)}},
                                    server, store)


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    """(base url, RayServeConfig) of the running application."""
    logging.getLogger("ray").setLevel(logging.WARNING)
    # Ray's memory monitor kills workers (restartable actors first, Serve's controller among them) once the
    # node's memory passes 95%, which the whole suite's other servers can reach on a small CI machine: a full
    # run saw the controller restarted mid-test and requests fail. These tests are about routing and
    # failures hotlora handles, not Ray's memory policy: the monitor is off for this cluster (read at ray.init).
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    config = ray_config(tiny_models, tmp_path_factory.mktemp("ray-cache"), free_port())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": config.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{config.port}"  # serve.run returned: every replica is warm
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        yield url, config
    finally:
        serve.shutdown()
        ray.shutdown()
