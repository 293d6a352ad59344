#!/usr/bin/env bash
# deploy/k8s/overlays/cpu rendered for `podman kube play` (used by smoke.sh):
#   kube-render.sh IMAGE NAME KEYS_FILE > kube.yaml
#   kube-render.sh IMAGE NAME KEYS_FILE --config > hotlora.toml   # the ConfigMap's config file only
# The Deployment, its ConfigMap and its PVC as kustomize renders them, with what podman cannot take
# from a cluster swapped in, and nothing else changed (probes, security context, mounts stay):
# the image is the local tag, names are NAME-prefixed (the PVC and the ConfigMap become named volumes,
# removed after), one replica, and the Secret volume (a cluster object podman has no store for) becomes
# the keys file itself (hostPath), and HOTLORA_MAX_BATCH_SIZE=2 (fewer shapes to compile: CI's
# time). The cache volume NAME-cache must exist (smoke.sh seeds it); kube play would refuse to
# make it again. Service, PodDisruptionBudget and NetworkPolicy need a cluster.
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
(claim,) = [d for d in keep if d["kind"] == "PersistentVolumeClaim"]
claim["metadata"]["name"] = f"{name}-cache"
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
        volume["persistentVolumeClaim"]["claimName"] = claim["metadata"]["name"]
    if "secret" in volume:
        del volume["secret"]
        volume["hostPath"] = {"path": keys, "type": "File"}
        for container in pod["containers"]:
            for mount in container["volumeMounts"]:
                if mount["name"] == volume["name"]:  # the file itself, where the Secret key would be
                    mount["mountPath"] += "/api-keys"
yaml.safe_dump_all([d for d in keep if d is not claim], sys.stdout, sort_keys=False)
' "$@"
