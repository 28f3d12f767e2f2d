"""deploy/kubernetes/: the core kinds valid against Kubernetes' own schemas (strictly: no
unknown field), the LeaderWorkerSet's pod templates as pods too, the custom kinds consistent
with what they point at, and every `tokenmill serve` command line one that the real parser
and its checks take."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tokenmill.cli.main import build_parser
from tokenmill.frontend.server_config import from_namespace

MANIFESTS = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KUBERNETES = "1.32"  # NOTE: preStop `sleep` needs 1.30 or later
# What LeaderWorkerSet puts in every pod of a group of two
LWS_ENV = {"LWS_LEADER_ADDRESS": "tokenmill-tp-0.tokenmill-tp", "LWS_GROUP_SIZE": "2"}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc)
        for path in sorted(MANIFESTS.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
    ]


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in _documents() if doc["kind"] == kind]


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every workload: Deployments' and the LWS's two templates."""
    specs = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in _by_kind("Deployment")]
    for lws in _by_kind("LeaderWorkerSet"):
        template = lws["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            specs.append((f"{lws['metadata']['name']} {role}", template[role]["spec"]))
    return specs


def test_the_core_kinds_are_valid() -> None:
    checked = 0
    for name, doc in _documents():
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
            checked += 1
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in ("LeaderWorkerSet", "InferencePool", "HTTPRoute"), name
    for _, spec in _pod_specs():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}
        kubernetes_validate.validate(pod, KUBERNETES, strict=True)
        checked += 1
    assert checked >= 12


def _serve_args(container: dict[str, Any], node_rank: int) -> list[str]:
    """The container's `tokenmill serve` arguments, with LWS's variables filled in."""
    command = [*container.get("command", []), *container.get("args", [])]
    if command[:2] == ["/bin/sh", "-c"]:
        env = {**LWS_ENV, "LWS_WORKER_INDEX": str(node_rank)}
        script = command[2]
        for key, value in env.items():
            script = script.replace("${" + key + "}", value)
        command = shlex.split(script)
        assert command[0] == "exec", "the shell must exec the server (SIGTERM reaches it)"
        command = command[1:]
    assert command[:2] == ["tokenmill", "serve"]
    return command[2:]


@pytest.mark.parametrize(
    ("where", "rank"), [("tokenmill", 0), ("leaderTemplate", 0), ("workerTemplate", 1)]
)
def test_the_serve_flags_are_ones_tokenmill_takes(where: str, rank: int) -> None:
    (spec,) = [s for name, s in _pod_specs() if name.endswith(where)]
    (container,) = spec["containers"]
    args = _serve_args(container, rank)
    config = from_namespace(build_parser().parse_args(["serve", *args]))
    if where != "tokenmill":
        p = config.parallel
        assert (p.nnodes, p.node_rank) == (2, rank)
        assert p.dist_init_addr == "tokenmill-tp-0.tokenmill-tp:29500"
        assert p.cluster_key_file.startswith("/etc/tokenmill/")
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/etc/tokenmill" in mounts
    if rank == 0:
        assert config.http.host == "0.0.0.0" and config.http.port == 8000
        # the drain finishes inside the grace period, after the preStop pause
        pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pause + config.http.drain_timeout < spec["terminationGracePeriodSeconds"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == config.http.port


def test_the_gateway_objects_point_at_the_servers() -> None:
    (pool,) = _by_kind("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    servers = [d for d in _by_kind("Deployment") if d["metadata"]["name"] == "tokenmill"]
    (server,) = servers
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = server["spec"]["template"]["spec"]["containers"][0]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [
        p["containerPort"] for p in container["ports"]
    ]
    picker = pool["spec"]["endpointPickerRef"]
    (service,) = [s for s in _by_kind("Service") if s["metadata"]["name"] == picker["name"]]
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    (epp,) = [d for d in _by_kind("Deployment") if d["metadata"]["name"] == picker["name"]]
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    for gauge in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert any(a.endswith(f"=vllm:{gauge}") for a in args), gauge
    (route,) = _by_kind("HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])


def test_the_leaderworkerset_groups_the_flags_nodes() -> None:
    (lws,) = _by_kind("LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == int(LWS_ENV["LWS_GROUP_SIZE"])
    leader = template["leaderTemplate"]["metadata"]["labels"]
    (service,) = [s for s in _by_kind("Service") if s["metadata"]["name"] == "tokenmill-tp"]
    assert service["spec"]["selector"].items() <= leader.items()
    worker = template["workerTemplate"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= worker.items()  # workers serve no HTTP
