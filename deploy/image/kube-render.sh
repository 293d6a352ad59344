#!/usr/bin/env bash
# deploy/k8s/overlays/cpu rendered for `podman kube play` (used by smoke.sh):
#   kube-render.sh IMAGE NAME KEYS_FILE > kube.yaml
#   kube-render.sh IMAGE NAME KEYS_FILE --config > hotlora.toml   # the ConfigMap's config file only
# The Deployment, its ConfigMap and its PVC as kustomize renders them, with what podman cannot take
# from a cluster swapped in, and nothing else changed (probes, security context, mounts stay):
# the image is the local tag, names are NAME-prefixed (the ConfigMap becomes a named volume, removed
# after), one replica, and the Secret volume (a cluster object podman has no store for) becomes
# the keys file itself (hostPath), and HOTLORA_MAX_BATCH_SIZE=2 (fewer shapes to compile: CI's
# time). The cache claims become the named volumes NAME-adapters and NAME-compile, which must
# exist (smoke.sh's first container made them); kube play would refuse to make them again. Service, PodDisruptionBudget and NetworkPolicy need a cluster.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
KUBECTL=$(dirname "$PYTHON")/kubectl
[ -x "$KUBECTL" ] || KUBECTL=kubectl
KUBECONFIG=/dev/null "$KUBECTL" kustomize "$ROOT/deploy/k8s/overlays/cpu" | "$PYTHON" -c '
import sys, yaml
image, name, keys = sys.argv[1:4]
docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
if sys.argv[4:] == ["--config"]:
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    sys.stdout.write(config["data"]["hotlora.toml"])
    sys.exit()
keep = [d for d in docs if d["kind"] in ("Deployment", "ConfigMap", "PersistentVolumeClaim")]
(deployment,) = [d for d in keep if d["kind"] == "Deployment"]
# The cache claims become the named volumes NAME-adapters and NAME-compile.
claims = {"hotlora-adapter-cache": f"{name}-adapters", "hotlora-compile-cache": f"{name}-compile"}
(config_map,) = [d for d in keep if d["kind"] == "ConfigMap"]
config_name, config_map["metadata"]["name"] = config_map["metadata"]["name"], f"{name}-config"  # podman makes it a volume
deployment["metadata"]["name"] = name
deployment["spec"]["replicas"] = 1
pod = deployment["spec"]["template"]["spec"]
for container in pod["containers"]:
    container["image"] = image
    container["imagePullPolicy"] = "Never"
    container["env"].append({"name": "HOTLORA_MAX_BATCH_SIZE", "value": "2"})
for volume in pod["volumes"]:
    if volume.get("configMap", {}).get("name") == config_name:
        volume["configMap"]["name"] = config_map["metadata"]["name"]
    if "persistentVolumeClaim" in volume:
        volume["persistentVolumeClaim"]["claimName"] = claims[volume["persistentVolumeClaim"]["claimName"]]
    if "secret" in volume:
        del volume["secret"]
        volume["hostPath"] = {"path": keys, "type": "File"}
        for container in pod["containers"]:
            for mount in container["volumeMounts"]:
                if mount["name"] == volume["name"]:  # the file itself, where the Secret key would be
                    mount["mountPath"] += "/api-keys"
yaml.safe_dump_all([d for d in keep if d["kind"] != "PersistentVolumeClaim"], sys.stdout, sort_keys=False)
' "$@"
