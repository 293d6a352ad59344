#!/usr/bin/env bash
# deploy/k8s/overlays/cpu rendered for `podman kube play` (used by smoke.sh):
#   kube-render.sh IMAGE NAME KEYS_FILE > kube.yaml
# The Deployment, its ConfigMap and its PVC as kustomize renders them, with what podman cannot take
# from a cluster swapped in, and nothing else changed (probes, security context, mounts stay):
# the image is the local tag, names are NAME-prefixed (the PVC becomes a named volume, removed
# after), one replica, and the Secret volume (a cluster object podman has no store for) becomes
# the keys file itself (hostPath). Service, PodDisruptionBudget and NetworkPolicy need a cluster.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
KUBECTL=$(dirname "$PYTHON")/kubectl
[ -x "$KUBECTL" ] || KUBECTL=kubectl
KUBECONFIG=/dev/null "$KUBECTL" kustomize "$ROOT/deploy/k8s/overlays/cpu" | "$PYTHON" -c '
import sys, yaml
image, name, keys = sys.argv[1:4]
docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
keep = [d for d in docs if d["kind"] in ("Deployment", "ConfigMap", "PersistentVolumeClaim")]
(deployment,) = [d for d in keep if d["kind"] == "Deployment"]
(claim,) = [d for d in keep if d["kind"] == "PersistentVolumeClaim"]
claim["metadata"]["name"] = f"{name}-cache"
deployment["metadata"]["name"] = name
deployment["spec"]["replicas"] = 1
pod = deployment["spec"]["template"]["spec"]
for container in pod["containers"]:
    container["image"] = image
    container["imagePullPolicy"] = "Never"
for volume in pod["volumes"]:
    if "persistentVolumeClaim" in volume:
        volume["persistentVolumeClaim"]["claimName"] = claim["metadata"]["name"]
    if "secret" in volume:
        del volume["secret"]
        volume["hostPath"] = {"path": keys, "type": "File"}
        for container in pod["containers"]:
            for mount in container["volumeMounts"]:
                if mount["name"] == volume["name"]:  # the file itself, where the Secret key would be
                    mount["mountPath"] += "/api-keys"
yaml.safe_dump_all(keep, sys.stdout, sort_keys=False)
' "$@"
