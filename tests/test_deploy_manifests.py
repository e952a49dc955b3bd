"""The split-roles deployment files: deploy/kubernetes (base, overlays/example, the KEDA
component) and deploy/compose/compose.split.yaml with deploy/nginx/split.conf.

The kustomizations are rendered here without kubectl, by a small renderer that knows exactly
the kustomize features these files use (resources, components, secretGenerator, inline
strategic-merge and JSON 6902 patches, images, replicas, namespace) and refuses any other,
so a new feature in the files fails here rather than being skipped silently. Every rendered
object is validated against the Kubernetes API schema (kubernetes_validate, strict: no
unknown fields), then the deployment's invariants are checked on the rendered objects and,
for the comments the worker's security settings must carry, on the raw text.
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
EXAMPLE = K8S / "overlays" / "example"
KEDA = K8S / "components" / "keda"
COMPOSE = ROOT / "deploy" / "compose"
NGINX = ROOT / "deploy" / "nginx"

IMAGE = "ghcr.io/example/sandbox-runtime"
API = {"app.kubernetes.io/name": "sandbox-runtime", "app.kubernetes.io/component": "api"}
WORKER = {"app.kubernetes.io/name": "sandbox-runtime", "app.kubernetes.io/component": "worker"}
REDIS = {"app.kubernetes.io/name": "sandbox-runtime", "app.kubernetes.io/component": "redis"}

# Kinds whose schema is not part of the Kubernetes API that kubernetes_validate bundles:
# CustomResourceDefinitions installed by an add-on. Checked by hand below instead.
CRD_KINDS = {
    # KEDA's CRD (keda.sh), installed with KEDA; components/keda only.
    ("keda.sh/v1alpha1", "ScaledObject"),
}

# Environment variables whose name says they hold a credential: never a literal value.
SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD")
PATH_SUFFIXES = ("_STORE", "_RULES", "_DIR", "_FILE")  # (where secrets are, not secrets)


# ---------------------------------------------------------------------------------------------
# A minimal kustomize
# ---------------------------------------------------------------------------------------------

KUSTOMIZATION_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "components",
    "secretGenerator",
    "patches",
    "images",
    "replicas",
}
# Strategic merge: the lists these patches touch, merged by key as Kubernetes' patchMergeKey.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
}
CLUSTER_SCOPED = {"Namespace"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class Rendered:
    """The objects a kustomization renders to, and the files it read."""

    def __init__(self) -> None:
        self.objects: list[dict[str, Any]] = []
        self.files: set[Path] = set()
        self.missing_secret_files: list[Path] = []

    def find(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
        return found[0]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]


def render(
    directory: Path,
    extra_components: tuple[Path, ...] = (),
    drop_replicas: tuple[str, ...] = (),
) -> Rendered:
    """`directory`'s kustomization, with more components and without some `replicas:`
    entries (as an overlay edited to enable a component)."""
    out = Rendered()
    _render(directory, out, extra_components, drop_replicas)
    return out


def _render(
    directory: Path,
    out: Rendered,
    extra_components: tuple[Path, ...] = (),
    drop_replicas: tuple[str, ...] = (),
) -> None:
    path = directory / "kustomization.yaml"
    k = _load_one(path)
    out.files.add(path.resolve())
    unknown = set(k) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{path}: fields this test's renderer does not know: {unknown}"
    for entry in k.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            assert _load_one(target / "kustomization.yaml")["kind"] == "Kustomization"
            _render(target, out)
        else:
            out.objects += _load_all(target)
            out.files.add(target)
    for entry in [*k.get("components", []), *extra_components]:
        component = (directory / entry).resolve()
        ck = _load_one(component / "kustomization.yaml")
        assert ck["kind"] == "Component", component
        _render(component, out)
    out.objects += _generate_secrets(directory, k.get("secretGenerator", []), out)
    for patch in k.get("patches", []):
        _apply_patch(out.objects, patch)
    for image in k.get("images", []):
        _set_image(out.objects, image)
    for replicas in k.get("replicas", []):
        if replicas["name"] in drop_replicas:
            continue
        obj = next(
            o
            for o in out.objects
            if o["kind"] in WORKLOADS and o["metadata"]["name"] == replicas["name"]
        )
        obj["spec"]["replicas"] = replicas["count"]
    if "namespace" in k:
        for obj in out.objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _load_one(path: Path) -> dict[str, Any]:
    docs = _load_all(path)
    assert len(docs) == 1, path
    return docs[0]


def _generate_secrets(
    directory: Path, generators: list[dict[str, Any]], out: Rendered
) -> list[dict[str, Any]]:
    """Secrets as secretGenerator makes them (without the name's hash suffix, which kustomize
    also writes into every reference). The files are not committed: a missing one gives a
    placeholder value."""
    secrets = []
    for gen in generators:
        assert set(gen) <= {"name", "files"}, gen
        data = {}
        for entry in gen["files"]:
            key, _, file = entry.rpartition("=")
            path = directory / file
            key = key or path.name
            if path.exists():
                value = path.read_bytes()
            else:
                out.missing_secret_files.append(path)
                value = b"placeholder"
            data[key] = base64.b64encode(value).decode()
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": gen["name"]},
                "type": "Opaque",
                "data": data,
            }
        )
    return secrets


def _apply_patch(objects: list[dict[str, Any]], patch: dict[str, Any]) -> None:
    assert set(patch) <= {"patch", "target"}, f"inline patches only: {patch}"
    body = yaml.safe_load(patch["patch"])
    if "target" in patch:
        target = patch["target"]
        assert set(target) <= {"kind", "name"}, target
        matched = [
            o
            for o in objects
            if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
        ]
    else:
        matched = [
            o
            for o in objects
            if o["kind"] == body["kind"] and o["metadata"]["name"] == body["metadata"]["name"]
        ]
    assert len(matched) == 1, f"a patch matches {len(matched)} objects: {patch}"
    if isinstance(body, list):
        _json_patch(matched[0], body)
    else:
        assert "$patch" not in patch["patch"], "strategic-merge directives are not rendered"
        _merge(matched[0], body)


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(dst.get(key), list):
            merge_key = MERGE_KEYS[key]
            for item in value:
                same = [d for d in dst[key] if d.get(merge_key) == item.get(merge_key)]
                if same:
                    _merge(same[0], item)
                else:
                    dst[key].append(copy.deepcopy(item))
        else:
            dst[key] = copy.deepcopy(value)


def _json_patch(obj: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")]
        parent: Any = obj
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        if op["op"] in ("add", "replace"):
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                if last == "-":
                    parent.append(value)
                elif op["op"] == "add":
                    parent.insert(int(last), value)
                else:
                    parent[int(last)] = value
            else:
                assert op["op"] == "add" or last in parent, f"nothing to replace: {op}"
                parent[last] = value
        elif op["op"] == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                del parent[last]
        else:
            raise AssertionError(f"JSON patch op not rendered here: {op}")


def _set_image(objects: list[dict[str, Any]], image: dict[str, Any]) -> None:
    for container in _all_containers(objects):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


# ---------------------------------------------------------------------------------------------
# Helpers over rendered objects
# ---------------------------------------------------------------------------------------------


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def _all_containers(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            spec = _pod_spec(obj)
            yield from spec.get("initContainers", [])
            yield from spec["containers"]


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in _pod_spec(deployment)["containers"] if c["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _sandbox_runtime_containers(rendered: Rendered) -> Iterator[tuple[str, dict[str, Any]]]:
    for dep in rendered.of_kind("Deployment"):
        for c in _pod_spec(dep)["containers"]:
            if "sandbox-runtime" in c["image"]:
                yield dep["metadata"]["name"], c


@pytest.fixture(scope="module")
def base() -> Rendered:
    return render(BASE)


@pytest.fixture(scope="module")
def example() -> Rendered:
    return render(EXAMPLE)


def render_example_keda() -> Rendered:
    """The example with KEDA enabled as its kustomization says: the component listed, the
    workers' `replicas:` entry gone (else it would set the count again after the component
    removed it, as kustomize applies an overlay's own transformers last)."""
    return render(EXAMPLE, extra_components=(KEDA,), drop_replicas=("srt-worker",))


@pytest.fixture(scope="module")
def example_keda() -> Rendered:
    return render_example_keda()


RENDERINGS = {
    "base": lambda: render(BASE),
    "example": lambda: render(EXAMPLE),
    "example+keda": render_example_keda,
}


@pytest.fixture(scope="module", params=sorted(RENDERINGS))
def every(request: pytest.FixtureRequest) -> Rendered:
    """Each rendering in turn: the invariants hold for the base and what overlays make of it."""
    return RENDERINGS[request.param]()


# ---------------------------------------------------------------------------------------------
# The renderer itself
# ---------------------------------------------------------------------------------------------


def test_every_manifest_file_is_rendered(base: Rendered, example_keda: Rendered) -> None:
    """No YAML under deploy/kubernetes escapes validation by not being in a kustomization."""
    on_disk = {p.resolve() for p in K8S.rglob("*.yaml")}
    assert on_disk - (base.files | example_keda.files) == set()


def test_merge_and_json_patch_work_as_kustomize() -> None:
    dep = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}]}]}}
    _merge(dep, {"spec": {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}]}]}})
    _merge(dep, {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "3"}]}]}})
    assert dep["spec"]["containers"][0]["env"] == [
        {"name": "X", "value": "3"},
        {"name": "Y", "value": "2"},
    ]
    obj = {"spec": {"replicas": 2, "rules": [1]}}
    _json_patch(
        obj,
        [
            {"op": "remove", "path": "/spec/replicas"},
            {"op": "add", "path": "/spec/rules/-", "value": 2},
            {"op": "replace", "path": "/spec/rules/0", "value": 0},
        ],
    )
    assert obj == {"spec": {"rules": [0, 2]}}


# ---------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------


def test_every_object_is_valid_against_the_kubernetes_schema(every: Rendered) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()  # the newest schema the package bundles
    problems = []
    for obj in every.objects:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
    assert problems == []


def test_crd_kinds_skipped_are_only_the_keda_component(
    base: Rendered, example: Rendered, example_keda: Rendered
) -> None:
    """The skip list names what is there, and only the optional component needs it."""
    assert {(o["apiVersion"], o["kind"]) for o in example_keda.objects} >= CRD_KINDS
    for rendered in (base, example):
        assert not {(o["apiVersion"], o["kind"]) for o in rendered.objects} & CRD_KINDS


# ---------------------------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------------------------


def test_selectors_match_their_pods(every: Rendered) -> None:
    templates = [
        dep["spec"]["template"]["metadata"]["labels"] for dep in every.of_kind("Deployment")
    ]
    for dep in every.of_kind("Deployment"):
        assert _matches(
            dep["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"]
        )
    for svc in every.of_kind("Service"):
        assert sum(_matches(svc["spec"]["selector"], t) for t in templates) == 1, svc


def test_every_container_has_probes_and_resources(every: Rendered) -> None:
    for container in _all_containers(every.objects):
        name = container["name"]
        assert "livenessProbe" in container, name
        assert "readinessProbe" in container, name
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), (name, kind)


def test_sandbox_runtime_probes_are_health_and_ready(every: Rendered) -> None:
    expected_port = {"srt-api": 8080, "srt-worker": 8081}
    seen = set()
    for deployment, c in _sandbox_runtime_containers(every):
        seen.add(deployment)
        live, ready = c["livenessProbe"]["httpGet"], c["readinessProbe"]["httpGet"]
        assert live["path"] == "/health"
        assert ready["path"] == "/ready"
        assert _port(c, live["port"]) == _port(c, ready["port"]) == expected_port[deployment]
    assert seen == set(expected_port)


def test_credentials_only_from_secrets(every: Rendered) -> None:
    for container in _all_containers(every.objects):
        for env in container.get("env", []):
            if SECRET_NAME.search(env["name"]) and not env["name"].endswith(PATH_SUFFIXES):
                assert "value" not in env, f"{container['name']}: {env['name']} is a literal"
                assert "secretKeyRef" in env["valueFrom"], env
            # No URL with a password written into it (redis://:hunter2@...): only $(VAR).
            credentials = re.search(r"://[^/@\s]*:([^/@\s]+)@", env.get("value", ""))
            if credentials:
                assert re.fullmatch(r"\$\([A-Z0-9_]+\)", credentials.group(1)), env


def test_env_references_are_defined_before_use(every: Rendered) -> None:
    """$(VAR) in a value expands only from variables earlier in the same list."""
    for container in _all_containers(every.objects):
        defined: set[str] = set()
        for env in container.get("env", []):
            for ref in re.findall(r"\$\(([A-Za-z0-9_]+)\)", env.get("value", "")):
                assert ref in defined, f"{container['name']}: {env['name']} uses $({ref})"
            defined.add(env["name"])
        for arg in container.get("args", []):
            for ref in re.findall(r"\$\(([A-Za-z0-9_]+)\)", arg):
                assert ref in defined, f"{container['name']}: args use $({ref})"


def test_roles_and_addresses(every: Rendered) -> None:
    api = _container(every.find("Deployment", "srt-api"), "api")
    worker = _container(every.find("Deployment", "srt-worker"), "worker")
    assert _env(api)["SANDBOX_ROLE"]["value"] == "api"
    assert _env(worker)["SANDBOX_ROLE"]["value"] == "worker"
    env = _env(worker)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["SANDBOX_CLUSTER_PORT"]["value"] == "8081"
    assert env["SANDBOX_CLUSTER_ADVERTISE"]["value"] == "$(POD_IP):8081"
    for c in (api, worker):
        assert _env(c)["REDIS_URL"]["value"].endswith("@srt-redis:6379/0")
        assert {"SANDBOX_CLUSTER_SECRET", "SANDBOX_AUTH_TOKEN"} <= set(_env(c))
    for _, c in _sandbox_runtime_containers(every):
        assert c["image"].endswith(":0.1.0")


def test_base_image_names_its_dockerfile() -> None:
    text = (BASE / "api.yaml").read_text() + (BASE / "worker.yaml").read_text()
    assert f"image: {IMAGE}:0.1.0" in text
    assert "deploy/compose/Dockerfile" in text


def test_api_runs_unprivileged(every: Rendered) -> None:
    dep = every.find("Deployment", "srt-api")
    pod = _pod_spec(dep)
    for c in pod["containers"]:
        sc = {**pod["securityContext"], **c.get("securityContext", {})}
        assert sc["runAsNonRoot"] is True
        assert sc["runAsUser"] != 0
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert not sc.get("privileged")
    assert pod["automountServiceAccountToken"] is False


def test_worker_security_settings(every: Rendered) -> None:
    pod = _pod_spec(every.find("Deployment", "srt-worker"))
    c = _container(every.find("Deployment", "srt-worker"), "worker")
    sc = {**pod.get("securityContext", {}), **c["securityContext"]}
    assert sc["seccompProfile"]["type"] == "Unconfined"
    assert sc["appArmorProfile"]["type"] == "Unconfined"
    assert sc["procMount"] == "Unmasked"
    # The API server admits Unmasked only in a user namespace (not a schema rule).
    assert pod["hostUsers"] is False
    assert not sc.get("privileged")
    assert pod["automountServiceAccountToken"] is False
    # No hostPath: in the pod's own cgroup namespace a hostPath /sys/fs/cgroup would make the
    # server take the node's root cgroup for its own.
    assert all("hostPath" not in v for v in pod.get("volumes", []))


@pytest.mark.parametrize("setting", ["hostUsers", "seccompProfile", "appArmorProfile", "procMount"])
def test_worker_security_settings_say_why_and_what_the_node_must_allow(setting: str) -> None:
    lines = (BASE / "worker.yaml").read_text().splitlines()
    at = [i for i, line in enumerate(lines) if line.strip().startswith(f"{setting}:")]
    assert len(at) == 1, setting
    comment = []
    i = at[0] - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        comment.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    text = " ".join(comment).lower()
    assert "why" in text, setting
    assert "the node must" in text, setting


def test_worker_drains_within_its_grace_period(every: Rendered) -> None:
    dep = every.find("Deployment", "srt-worker")
    env = _env(_container(dep, "worker"))
    grace = _pod_spec(dep)["terminationGracePeriodSeconds"]
    drain = float(env["SANDBOX_WORKER_DRAIN_SECONDS"]["value"])
    drain += float(env["SANDBOX_SNAPSHOT_DRAIN_SECONDS"]["value"])
    assert grace > 60
    assert grace > drain
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_worker_state_volume_is_bounded(every: Rendered) -> None:
    pod = _pod_spec(every.find("Deployment", "srt-worker"))
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert "sizeLimit" in state["emptyDir"] or "ephemeral" in state
    mounts = _container(every.find("Deployment", "srt-worker"), "worker")["volumeMounts"]
    env = _env(_container(every.find("Deployment", "srt-worker"), "worker"))
    assert {"name": "state", "mountPath": env["SANDBOX_STATE_DIR"]["value"]} in mounts


def test_services(every: Rendered) -> None:
    api = every.find("Service", "srt-api")
    assert api["spec"]["type"] == "ClusterIP"
    assert "sessionAffinity" not in api["spec"]
    (port,) = api["spec"]["ports"]
    assert port["port"] == 80
    assert _port(_container(every.find("Deployment", "srt-api"), "api"), port["targetPort"]) == 8080
    worker = every.find("Service", "srt-worker")
    assert worker["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in worker["spec"]["ports"]] == [8081]


def test_worker_network_policy_admits_only_api_pods_on_the_cluster_port(every: Rendered) -> None:
    (policy,) = [
        p
        for p in every.of_kind("NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"] == WORKER
    ]
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": API}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8081}]
    # Egress: DNS and Redis in the base; nothing open to the world.
    egress = policy["spec"]["egress"]
    assert {"podSelector": {"matchLabels": REDIS}} in [peer for r in egress for peer in r["to"]]
    assert not any("ipBlock" in peer for r in egress for peer in r["to"])


def test_redis_network_policy_admits_api_and_workers(
    base: Rendered, example_keda: Rendered
) -> None:
    (policy,) = [
        p for p in base.of_kind("NetworkPolicy") if p["spec"]["podSelector"]["matchLabels"] == REDIS
    ]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": API}},
        {"podSelector": {"matchLabels": WORKER}},
    ]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    # With KEDA, its operator's namespace too (and nothing else).
    keda = example_keda.find("NetworkPolicy", "srt-redis")["spec"]["ingress"]
    assert keda[1]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}}
    ]


def test_disruption_budgets_for_api_and_workers(every: Rendered) -> None:
    selectors = [p["spec"]["selector"]["matchLabels"] for p in every.of_kind("PodDisruptionBudget")]
    assert API in selectors
    assert WORKER in selectors


def test_hpa_scales_the_api_deployment(every: Rendered) -> None:
    (hpa,) = every.of_kind("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    api = every.find("Deployment", target["name"])
    assert api["spec"]["template"]["metadata"]["labels"] == API
    assert "replicas" not in api["spec"]  # the HPA owns the count
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_redis_persists_with_aof(every: Rendered) -> None:
    dep = every.find("Deployment", "srt-redis")
    args = _container(dep, "redis")["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    claim = next(v for v in _pod_spec(dep)["volumes"] if v["name"] == "data")
    every.find("PersistentVolumeClaim", claim["persistentVolumeClaim"]["claimName"])
    assert dep["spec"]["strategy"]["type"] == "Recreate"


# ---------------------------------------------------------------------------------------------
# The example overlay and the KEDA component
# ---------------------------------------------------------------------------------------------


def test_example_overlay(example: Rendered) -> None:
    namespaced = [o for o in example.objects if o["kind"] != "Namespace"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {"sandbox-runtime"}
    namespace = example.find("Namespace", "sandbox-runtime")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert example.find("Deployment", "srt-worker")["spec"]["replicas"] == 4
    assert example.find("HorizontalPodAutoscaler", "srt-api")["spec"]["minReplicas"] == 3
    for _, c in _sandbox_runtime_containers(example):
        assert c["image"] == "registry.example.com/sandbox-runtime:0.1.0"


def test_example_snapshots_go_to_a_shared_store(example: Rendered) -> None:
    env = _env(_container(example.find("Deployment", "srt-worker"), "worker"))
    assert env["SANDBOX_SNAPSHOT_STORE"]["value"] == "s3://srt-snapshots/prod"
    assert env["SANDBOX_SNAPSHOT_S3_ENDPOINT"]["value"].startswith("http")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        secret = example.find("Secret", ref["name"])
        assert ref["key"] in secret["data"]
    # ...and the workers may reach it.
    egress = example.find("NetworkPolicy", "srt-worker")["spec"]["egress"]
    assert any(p.get("port") == 9000 for rule in egress for p in rule.get("ports", []))


def test_every_secret_reference_resolves(example: Rendered) -> None:
    for container in _all_containers(example.objects):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                assert ref["key"] in example.find("Secret", ref["name"])["data"], env


def test_example_secret_files_are_never_committed(example: Rendered) -> None:
    patterns = [
        line.strip()
        for line in (EXAMPLE / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    overlay = _load_one(EXAMPLE / "kustomization.yaml")
    files = [e.rpartition("=")[2] for g in overlay["secretGenerator"] for e in g["files"]]
    assert files
    for file in files:
        assert any(fnmatch.fnmatch(file, p) for p in patterns), file
    readme = (EXAMPLE / "secrets" / "README.md").read_text()
    for file in files:
        assert Path(file).name in readme, file


def test_keda_component(example_keda: Rendered) -> None:
    (scaled,) = example_keda.of_kind("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    worker = example_keda.find("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    assert worker["spec"]["template"]["metadata"]["labels"] == WORKER
    assert "replicas" not in worker["spec"]  # KEDA's HPA owns the count
    (streams,) = [t for t in scaled["spec"]["triggers"] if t["type"] == "redis-streams"]
    meta = streams["metadata"]
    assert meta["stream"] == "srt:placements"
    assert meta["consumerGroup"] == "srt-workers"
    assert int(meta["lagCount"]) >= 1
    # The password comes from the worker's own environment (its secretKeyRef).
    assert (
        "secretKeyRef" in _env(_container(worker, "worker"))[meta["passwordFromEnv"]]["valueFrom"]
    )
    namespace = example_keda.find("Deployment", "srt-redis")["metadata"]["namespace"]
    assert meta["address"] == f"srt-redis.{namespace}.svc.cluster.local:6379"
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_keda_is_optional_in_the_example(example: Rendered) -> None:
    assert example.of_kind("ScaledObject") == []
    text = (EXAMPLE / "kustomization.yaml").read_text()
    assert "#   - ../../components/keda" in text
    # Enabling it without dropping the workers' count would keep a count the HPA fights.
    assert "remove the srt-worker entry under `replicas:`" in text
    kept = render(EXAMPLE, extra_components=(KEDA,))
    assert kept.find("Deployment", "srt-worker")["spec"]["replicas"] == 4


# ---------------------------------------------------------------------------------------------
# compose.split.yaml and nginx's split.conf
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "compose.split.yaml").read_text())


def _services(compose: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if n.startswith(prefix)}


def test_compose_services(compose: dict[str, Any]) -> None:
    assert {"redis", "nginx"} <= set(compose["services"])
    assert len(_services(compose, "api")) >= 2
    assert len(_services(compose, "worker")) >= 2
    for name, service in _services(compose, "api").items():
        assert service["environment"]["SANDBOX_ROLE"] == "api", name
        assert "deploy" not in service  # `deploy: replicas` is not honoured by plain compose
    for name, service in _services(compose, "worker").items():
        assert service["environment"]["SANDBOX_ROLE"] == "worker", name


def test_compose_workers_publish_nothing_and_advertise_themselves(compose: dict[str, Any]) -> None:
    ids = set()
    for name, service in _services(compose, "worker").items():
        assert "ports" not in service, name
        assert service.get("network_mode") != "host", name
        env = service["environment"]
        assert env["SANDBOX_CLUSTER_ADVERTISE"] == f"{name}:{env['SANDBOX_CLUSTER_PORT']}"
        ids.add(env["SANDBOX_REPLICA_ID"])
        assert "8081" in " ".join(service["healthcheck"]["test"])
    assert len(ids) == len(_services(compose, "worker"))


def test_compose_workers_have_the_replicas_sandbox_settings(compose: dict[str, Any]) -> None:
    replica = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]["replica1"]
    for name, service in _services(compose, "worker").items():
        assert sorted(service["security_opt"]) == sorted(replica["security_opt"]), name
        assert service["cgroup"] == replica["cgroup"] == "host", name
        assert "/sys/fs/cgroup:/sys/fs/cgroup:rw" in service["volumes"], name
        env = service["environment"]
        drain = float(env["SANDBOX_WORKER_DRAIN_SECONDS"]) + float(
            env["SANDBOX_SNAPSHOT_DRAIN_SECONDS"]
        )
        assert float(service["stop_grace_period"].rstrip("s")) > drain, name
        # One store for every worker: a named volume they all mount at the configured path.
        store = env["SANDBOX_SNAPSHOT_STORE"]
        assert any(v.endswith(f":{store}") for v in service["volumes"]), name


def test_compose_api_runs_unprivileged(compose: dict[str, Any]) -> None:
    """(uid 0 without any capability: to read the workers' snapshot directory.)"""
    for name, service in _services(compose, "api").items():
        assert service["read_only"] is True, name
        assert any(str(v).endswith(":ro") for v in service.get("volumes", [])), name
        assert service["cap_drop"] == ["ALL"], name
        assert "seccomp=unconfined" not in service.get("security_opt", []), name


def test_compose_credentials_come_from_the_environment(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if SECRET_NAME.search(key):
                assert re.fullmatch(r"\$\{[A-Z0-9_]+(:\?[^}]*)?\}", str(value)), (name, key)


def _nginx_blocks(text: str) -> list[Any]:
    """nginx's config as nested [name, args, children] (children None for a directive)."""
    text = re.sub(r"#[^\n]*", "", text)
    tokens = re.findall(r'"[^"]*"|\'[^\']*\'|[{};]|[^\s{};]+', text)

    def block(i: int) -> tuple[list[Any], int]:
        out: list[Any] = []
        words: list[str] = []
        while i < len(tokens):
            tok = tokens[i]
            i += 1
            if tok == ";":
                out.append([words[0], words[1:], None])
                words = []
            elif tok == "{":
                children, i = block(i)
                out.append([words[0], words[1:], children])
                words = []
            elif tok == "}":
                return out, i
            else:
                words.append(tok)
        assert not words
        return out, i

    return block(0)[0]


def _walk(blocks: list[Any]) -> Iterator[list[Any]]:
    for b in blocks:
        yield b
        if b[2]:
            yield from _walk(b[2])


@pytest.fixture(scope="module")
def nginx() -> list[Any]:
    return _nginx_blocks((NGINX / "split.conf").read_text())


def test_nginx_is_plain_round_robin_over_the_api_services(
    nginx: list[Any], compose: dict[str, Any]
) -> None:
    names = {b[0] for b in _walk(nginx)}
    assert not names & {"hash", "ip_hash", "sticky", "least_conn", "random", "least_time"}
    (upstream,) = [b for b in nginx if b[0] == "upstream"]
    servers = {d[1][0] for d in upstream[2] if d[0] == "server"}
    assert servers == {f"{name}:8080" for name in _services(compose, "api")}
    assert {d[0] for d in upstream[2]} >= {"keepalive", "keepalive_timeout"}
    proxied = {d[1][0] for d in _walk(nginx) if d[0] == "proxy_pass"}
    assert proxied == {f"http://{upstream[1][0]}"}
    nginx_service = compose["services"]["nginx"]
    assert "../nginx/split.conf:/etc/nginx/conf.d/default.conf:ro" in nginx_service["volumes"]


def test_nginx_streams(nginx: list[Any]) -> None:
    (server,) = [b for b in nginx if b[0] == "server"]
    (root,) = [b for b in server[2] if b[0] == "location" and b[1] == ["/"]]
    settings = {d[0]: d[1] for d in root[2]}
    headers = [d[1] for d in root[2] if d[0] == "proxy_set_header"]
    assert settings["proxy_buffering"] == ["off"]
    assert settings["proxy_request_buffering"] == ["off"]
    assert settings["proxy_http_version"] == ["1.1"]
    assert ["Connection", '""'] in headers  # keepalive connections to the upstream
    assert int(settings["proxy_read_timeout"][0].rstrip("s")) >= 3600
    assert int(settings["proxy_send_timeout"][0].rstrip("s")) >= 3600
    cluster = [b for b in server[2] if b[0] == "location" and b[1] == ["^~", "/cluster/"]]
    assert cluster and cluster[0][2] == [["return", ["404"], None]]
