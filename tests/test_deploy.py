"""The deployment files in deploy/ checked as far as a machine without a cluster or a container
engine can: Kubernetes manifests against the API's schemas (kubernetes-validate) and against each
other (selectors, the router's replica list, probes, grace periods), the compose file's wiring, and
the Grafana dashboard's queries against the metric names tokenmill and its router export.
The image itself is built and run by deploy/build_image.sh (and test_container.py where a
container runtime runs)."""
import json
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from tokenmill.router.app import RouterConfig, build_router
from tokenmill.router.metrics import RouterMetrics
from tokenmill.server.metrics import Metrics

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
ROOT = DEPLOY.parent
K8S_VERSION = "1.32.0"


def k8s_docs() -> list[dict]:
    docs = []
    for name in yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    return docs


def exported_metric_names() -> set[str]:
    """Every series name the server and the router expose (counters with _total, histograms with
    _bucket/_sum/_count), read from their registries, so a renamed metric breaks this test."""
    names = set()
    for registry in (Metrics("m").registry, RouterMetrics(["http://a"], "cache_aware").registry):
        for fam in registry.collect():
            if fam.type == "counter":
                names.add(fam.name + "_total")
            elif fam.type == "histogram":
                names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
            else:
                names.add(fam.name)
    return names


def _flag(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


# ---------------------------------------------------------------- Kubernetes
def test_manifests_validate_against_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate")
    for doc in k8s_docs():
        kv.validate(doc, K8S_VERSION, strict=True)  # raises on an unknown or mistyped field


def test_manifests_agree_with_each_other():
    docs = k8s_docs()
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget"} <= set(by_kind)
    sts, = by_kind["StatefulSet"]
    router, = by_kind["Deployment"]
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    workloads = [sts, router]
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        c, = spec["containers"]
        args = c.get("command", []) + c.get("args", [])
        grace = int(_flag(args, "--graceful-shutdown-timeout")[0])
        assert spec["terminationGracePeriodSeconds"] > grace + 5  # drain, plus the preStop pause
        assert c["readinessProbe"] and c["livenessProbe"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["ports"][0]["containerPort"] == 8000
        ready = c["readinessProbe"]["httpGet"]
        assert ready["path"] == "/health"
        # each workload is selected by a Service and protected by a PodDisruptionBudget
        assert any(s["spec"]["selector"].items() <= labels.items() for s in services.values())
        assert any(p["spec"]["selector"]["matchLabels"].items() <= labels.items()
                   for p in by_kind["PodDisruptionBudget"])
    # the router lists exactly the StatefulSet's pods by their stable DNS names
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    args = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert args[:2] == ["tokenmill", "router"]
    want = [f"http://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:8000"
            for i in range(sts["spec"]["replicas"])]
    assert _flag(args, "--replica") == want
    RouterConfig(replicas=want)  # the router would accept them
    replica_args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--metrics-public" in replica_args  # the prometheus.io annotations scrape without a key


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_manifests():
    r = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert len([d for d in yaml.safe_load_all(r.stdout) if d]) == len(k8s_docs())


# ---------------------------------------------------------------- compose, Prometheus, Grafana
def test_compose_wires_router_replicas_prometheus_and_grafana():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    svc = compose["services"]
    assert {"router", "replica-a", "replica-b", "prometheus", "grafana"} <= set(svc)
    build = svc["replica-a"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    router = svc["router"]
    assert router["entrypoint"][:2] == ["tokenmill", "router"] and "8000:8000" in router["ports"]
    replicas = _flag(router["entrypoint"], "--replica")
    names = [re.match(r"http://([a-z0-9-]+):8000$", u).group(1) for u in replicas]
    assert sorted(names) == ["replica-a", "replica-b"]
    for n in names:  # the router starts once the replicas answer /health
        assert router["depends_on"][n]["condition"] == "service_healthy"
        assert "/health" in " ".join(svc[n]["healthcheck"]["test"])
    for s in svc.values():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            assert (DEPLOY / src).exists(), src
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    paths = {r.path for r in build_router(RouterConfig(replicas=["http://a:1"])).routes}
    for job in prom["scrape_configs"]:
        assert job["metrics_path"] in paths
        assert all(t.split(":")[0] in svc for sc in job["static_configs"] for t in sc["targets"])
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tokenmill.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in svc["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]


def test_dockerfile_runs_unprivileged_with_a_healthcheck():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip()
             and not line.startswith("#")]
    instr = [line.split()[0] for line in lines]
    assert instr[0] == "ARG" and "ARG BASE=python:3.11-slim" in lines and lines[1] == "FROM ${BASE}"
    user = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    health = next(line for line in lines if line.startswith("HEALTHCHECK"))
    assert "/health" in health and "--start-period" in health
    assert any(line.startswith("ENTRYPOINT") and '"serve"' in line for line in lines)
    for line in lines:
        if line.startswith("COPY"):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src


def test_dashboard_queries_only_metrics_that_exist():
    dash = json.loads((DEPLOY / "grafana/dashboards/tokenmill.json").read_text())
    names = exported_metric_names()
    used = set()
    for panel in dash["panels"]:
        assert panel["targets"] and panel["gridPos"]["w"] > 0
        for t in panel["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")"), expr
            for m in re.findall(r"tokenmill:[a-z0-9_]+", expr):
                assert m in names, f"{panel['title']}: {m} is not exported"
                used.add(m)
    # what an operator needs to see, each in at least one panel
    for wanted in ("tokenmill:time_to_first_token_seconds_bucket", "tokenmill:inter_token_latency_seconds_bucket",
                   "tokenmill:e2e_request_latency_seconds_bucket", "tokenmill:generation_tokens_total",
                   "tokenmill:kv_cache_usage_perc", "tokenmill:num_requests_waiting", "tokenmill:num_preemptions_total",
                   "tokenmill:prefix_cache_hits_total", "tokenmill:router_routing_decisions_total",
                   "tokenmill:router_replica_healthy", "tokenmill:router_queue_length"):
        assert wanted in used, wanted
