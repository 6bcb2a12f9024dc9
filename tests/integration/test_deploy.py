"""The deployment files (deploy/, docker-compose.yml) against vqserve itself.

Every file parses; the Kubernetes objects validate offline against the API schemas; the
ports, health service names and drain times in the manifests are the ones the server
really uses (read from its code, not restated here); the manifests' VQSERVE_* settings
build a valid server config through the real `vqserve serve` path; every metric named by
an alert, the HPA's adapter rules or a Grafana panel is exported by a live server, and
the dashboard covers every metric it exports; the PromQL parses.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ROOT
from vqserve.serve.api import oip as service_oip
from vqserve.serve.api import v1 as service_v1
from vqserve.serve.clients import ServerError, TokenizerClient, check_health
from vqserve.serve.config import ServerConfig
from vqserve.serve.grpc_server import TokenizerServer
from vqserve.serve.launcher import ServerThread

pytestmark = pytest.mark.timeout(120)

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
COMPOSE = ROOT / "docker-compose.yml"
OVERLAYS = sorted(p.parent for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
# Kustomize's own files are not API objects; the schemas do not know them.
NOT_API_OBJECTS = {"kustomize.config.k8s.io/v1beta1", "kustomize.config.k8s.io/v1alpha1"}
# Files in deploy/kubernetes that are deliberately not in kustomization.yaml.
NOT_KUSTOMIZED = {"prometheus-adapter-rules.yaml", "secret-example.yaml", "kustomization.yaml"}
# The oldest Kubernetes the manifests claim to support (native gRPC probes, the preStop
# sleep action), and the newest schema kubernetes-validate ships.
MIN_K8S = "1.30.0"
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")
METRIC_NAME = re.compile(r"\bvqserve_[a-z0-9_]+")
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h",
                "${instance}": ".*", "$instance": ".*"}


# ---- loading ----------------------------------------------------------------------------------
def docs(path: Path) -> list:
    text = path.read_text()
    if path.suffix == ".json":
        return [json.loads(text)]
    return [d for d in yaml.safe_load_all(text) if d is not None]


def one(path: Path):
    (doc,) = docs(path)
    return doc


def deploy_files() -> list[Path]:
    files = [p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".json")]
    return sorted(files) + [COMPOSE]


def api_objects(path: Path) -> list[dict]:
    return [d for d in docs(path) if "kind" in d and d.get("apiVersion") not in NOT_API_OBJECTS]


def k8s_objects() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in api_objects(p)]


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in k8s_objects() if d["kind"] == kind]


def deployment() -> dict:
    (dep,) = by_kind("Deployment")
    return dep


def container() -> dict:
    (c,) = deployment()["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def alert_rules() -> list[dict]:
    return [r for g in one(PROMETHEUS / "alerts.yml")["groups"] for r in g["rules"] if "alert" in r]


def adapter_rules() -> list[dict]:
    return one(K8S / "prometheus-adapter-rules.yaml")["rules"]


def dashboard() -> dict:
    (path,) = sorted((GRAFANA / "dashboards").glob("*.json"))
    return one(path)


def dashboard_panels() -> list[dict]:
    out = []
    for p in dashboard()["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels
    return out


def grafana_exprs() -> list[tuple[str, str]]:
    found = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard_panels()
             for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"variable {var['name']}", query))
    return found


def grafana_promql(expr: str) -> str:
    """A panel's query as Grafana sends it (variables filled in); for a variable's
    `label_values(selector, label)`, which is Grafana's, the selector inside."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    m = re.fullmatch(r"label_values\((.+),\s*\w+\)", expr.strip())
    return m.group(1) if m else expr


def adapter_promql(rule: dict) -> str:
    """A rule's metricsQuery as the adapter sends it for two pods of one namespace."""
    series = METRIC_NAME.search(rule["seriesQuery"]).group(0)
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="ml",pod=~"vqserve-a|vqserve-b"')
            .replace("<<.GroupBy>>", "pod"))


def all_promql() -> list[tuple[str, str]]:
    exprs = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    exprs += [(f"adapter rule {i}", adapter_promql(r)) for i, r in enumerate(adapter_rules())]
    exprs += [(where, grafana_promql(e)) for where, e in grafana_exprs()]
    return exprs


def duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---- vqserve's own defaults (read, never restated) -------------------------------------------
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
HEALTH_SERVICES = {"", *TokenizerServer.SERVICES}


def serve_parser() -> argparse.ArgumentParser:
    from vqserve.commands import serve as serve_cmd

    parser = argparse.ArgumentParser(prog="vqserve serve")
    serve_cmd.add_parser(parser)
    return parser


def cli_default(dest: str):
    """The `vqserve serve` flag's built-in default (before any VQSERVE_* variable)."""
    (action,) = [a for a in serve_parser()._actions if a.dest == dest]
    return getattr(action, "builtin_default", action.default)


def config_from_env(monkeypatch, variables: dict[str, str]) -> ServerConfig:
    """Run the real `vqserve serve` (no flags, settings from the environment) up to the
    point where it would start serving, and return the ServerConfig it built."""
    from vqserve.commands import serve as serve_cmd
    from vqserve.serve import launcher as server_mod

    for name in list(os.environ):
        if name.startswith("VQSERVE_"):
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    captured = []

    async def fake_serve(config, runtime=None):
        captured.append(config)
        return 0

    monkeypatch.setattr(server_mod, "serve_until_signal", fake_serve)
    log = logging.getLogger("vqserve")
    saved = (log.handlers[:], log.level, log.propagate)
    try:
        assert serve_cmd.run(serve_parser().parse_args([])) == 0
    finally:
        log.handlers[:], log.level, log.propagate = saved
    (config,) = captured
    return config


# ---- every file parses --------------------------------------------------------------------------
@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_parses(path):
    assert docs(path), f"{path} is empty"


def test_the_expected_files_exist():
    for name in ("deployment.yaml", "service.yaml", "pdb.yaml", "hpa.yaml", "kustomization.yaml",
                 "prometheus-adapter-rules.yaml"):
        assert (K8S / name).is_file(), name
    assert (PROMETHEUS / "prometheus.yml").is_file() and (PROMETHEUS / "alerts.yml").is_file()
    assert list((GRAFANA / "provisioning" / "datasources").glob("*.yml"))
    assert list((GRAFANA / "provisioning" / "dashboards").glob("*.yml"))
    assert {d["kind"] for _, d in k8s_objects()} >= {
        "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


# ---- Kubernetes schemas ------------------------------------------------------------------------
def _validate(obj: dict, version: str, where: str) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{where}: {obj['kind']}/{obj['metadata']['name']} against {version}: "
                    f"{path}: {exc.message}")


def _k8s_versions() -> list[str]:
    from kubernetes_validate.utils import latest_version

    return [MIN_K8S, latest_version()]


@pytest.mark.parametrize("version", _k8s_versions())
def test_kubernetes_objects_validate(version):
    objects = k8s_objects()
    assert len(objects) >= 5
    for name, obj in objects:
        _validate(obj, version, name)


def test_kustomization_lists_every_manifest():
    listed = one(K8S / "kustomization.yaml")["resources"]
    on_disk = {p.name for p in K8S.glob("*.yaml")} - NOT_KUSTOMIZED
    assert sorted(listed) == sorted(on_disk)
    assert not api_objects(K8S / "prometheus-adapter-rules.yaml")  # adapter config, not an object


@pytest.mark.parametrize("folder", [K8S, *OVERLAYS], ids=lambda p: str(p.relative_to(ROOT)))
def test_kustomize_builds(folder):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its `kustomize` needs no cluster)")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    for obj in built:
        _validate(obj, MIN_K8S, f"kubectl kustomize {folder.relative_to(ROOT)}")
    (dep,) = [d for d in built if d["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"[^:]+:[\w.-]+", c["image"]) and not c["image"].endswith(":latest")
    if "VQSERVE_AUTH_TOKEN_FILE" in env(c):  # the auth overlay: the token file is mounted
        token = Path(env(c)["VQSERVE_AUTH_TOKEN_FILE"])
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        (mount,) = [m for m in mounts.values() if token.parent == Path(m["mountPath"])]
        assert mount["readOnly"] and "secret" in volumes[mount["name"]]


# ---- the manifest agrees with the server ------------------------------------------------------
def test_defaults_are_read_from_vqserve():
    """The numbers the checks below compare against come from vqserve, and agree there."""
    assert DEFAULTS["port"] == cli_default("port")
    assert DEFAULTS["metrics_port"] == cli_default("metrics_port")
    assert DEFAULTS["grace_s"] == cli_default("grace")
    assert TokenizerServer.SERVICES == (service_v1.SERVICE_NAME, service_oip.SERVICE_NAME)
    assert HEALTH_SERVICES == {"", "vqserve.v1.Tokenizer", "inference.GRPCInferenceService"}


def test_probes_use_the_grpc_port_and_registered_health_services():
    c = container()
    assert ports(c)["grpc"] == DEFAULTS["port"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]["grpc"]  # native gRPC probes, not exec or TCP
        assert probe["port"] == DEFAULTS["port"], kind
        assert probe.get("service", "") in HEALTH_SERVICES, kind
    assert c["readinessProbe"]["grpc"]["service"] == service_v1.SERVICE_NAME


def test_ports_and_scrape_annotations_match_the_server():
    dep, c = deployment(), container()
    assert ports(c)["metrics"] == DEFAULTS["metrics_port"]
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == DEFAULTS["metrics_port"]
    assert annotations["prometheus.io/path"] == "/metrics"
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    for svc in by_kind("Service"):
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        for p in svc["spec"]["ports"]:
            assert ports(c)[p["targetPort"]] == p["port"], (svc["metadata"]["name"], p)
            if p["name"] == "grpc":
                assert p["appProtocol"] == "grpc"


def test_manifest_settings_build_a_valid_server_config(monkeypatch):
    c = container()
    variables = env(c)
    assert all(variables[k] for k in ("VQSERVE_DEVICE", "VQSERVE_DTYPE", "VQSERVE_GRACE"))
    import torch

    # the manifest is for GPU nodes, and serve refuses --device cuda where there is none: a
    # node with one GPU stood in for by torch's own device queries (no GPU on the test machine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = config_from_env(monkeypatch, variables)
    assert config.device == "cuda" and config.dtype == "fp32"  # exact by default on GPU nodes too
    assert config.port == ports(c)["grpc"] == DEFAULTS["port"]
    assert config.metrics_port == ports(c)["metrics"]
    assert config.max_queue == int(variables["VQSERVE_MAX_QUEUE"])


def test_every_vqserve_variable_is_one_serve_reads():
    from vqserve.commands import serve as serve_cmd

    known = getattr(serve_cmd, "ENV_VARS", None)
    if known is None:
        pytest.skip("vqserve serve has no ENV_VARS table")
    compose_env = one(COMPOSE)["services"]["vqserve"]["environment"]
    sources = (("deployment.yaml", env(container())), ("docker-compose.yml", compose_env))
    for where, names in sources:
        unknown = {n for n in names if n.startswith("VQSERVE_")} - set(known.values())
        assert not unknown, f"{where} sets variables vqserve serve does not read: {unknown}"


def test_termination_grace_outlasts_prestop_and_drain():
    spec = deployment()["spec"]["template"]["spec"]
    grace = float(env(container())["VQSERVE_GRACE"])
    pre_stop = container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < pre_stop < 30
    # The kubelet counts preStop inside terminationGracePeriodSeconds.
    assert spec["terminationGracePeriodSeconds"] > pre_stop + grace


def test_pod_hardening_and_gpu_scheduling():
    spec = deployment()["spec"]["template"]["spec"]
    c = container()
    assert spec["enableServiceLinks"] is False  # a Service `vqserve` would inject VQSERVE_PORT
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}  # the only writable place
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert {"cpu", "memory"} <= c["resources"]["requests"].keys() <= c["resources"]["limits"].keys()
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert "replicas" not in deployment()["spec"]  # the HPA owns the count


def test_pdb_and_hpa_target_the_deployment():
    dep = deployment()
    (pdb,) = by_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"] == dep["spec"]["selector"]
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2  # one may be down under the PDB


def test_hpa_metrics_are_served_by_the_adapter_rules():
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    metrics = hpa["spec"]["metrics"]
    pods_metrics = [m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"]
    assert pods_metrics
    exposed = {r["name"]["as"] for r in adapter_rules()}
    assert set(pods_metrics) <= exposed
    assert "adapter" in (K8S / "hpa.yaml").read_text()  # the comment naming what it needs
    # The adapter maps the `namespace` and `pod` labels; the Kubernetes scrape job adds them.
    for rule in adapter_rules():
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}
    (job,) = [j for j in one(PROMETHEUS / "prometheus.yml")["scrape_configs"]
              if "kubernetes_sd_configs" in j]
    targets = {r.get("target_label"): r.get("source_labels") for r in job["relabel_configs"]}
    assert targets["namespace"] == ["__meta_kubernetes_namespace"]
    assert targets["pod"] == ["__meta_kubernetes_pod_name"]


def test_prometheus_jobs_label_the_targets_the_alerts_select():
    """alerts.yml selects up{app="vqserve"}: both jobs must produce that label."""
    config = one(PROMETHEUS / "prometheus.yml")
    assert "alerts.yml" in config["rule_files"]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    static = [j for j in jobs.values() if "static_configs" in j]
    assert static
    assert all(sc["labels"]["app"] == "vqserve" for j in static for sc in j["static_configs"])
    (k8s_job,) = [j for j in jobs.values() if "kubernetes_sd_configs" in j]
    app = [r for r in k8s_job["relabel_configs"] if r.get("target_label") == "app"]
    assert app[0]["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
    pod_labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["app.kubernetes.io/name"] == "vqserve"
    for rule in alert_rules():
        if re.search(r"\bup\b", rule["expr"]):
            assert 'app="vqserve"' in rule["expr"], rule["alert"]


# ---- alerts ----------------------------------------------------------------------------------
def test_alerts_have_severity_annotations_and_runbooks():
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert r["annotations"]["runbook_url"] == f"docs/DEPLOY.md#alert-{r['alert'].lower()}"
        duration_s(r["for"])
    exprs = " ".join(r["expr"] for r in rules)
    for needle in ("vqserve_request_latency_seconds_bucket", "vqserve_errors_total",
                   "vqserve_requests_total", "vqserve_queue_items", 'code="RESOURCE_EXHAUSTED"',
                   "vqserve_codebook_usage_ratio", "vqserve_codebook_entropy_bits", "up{"):
        assert needle in exprs, needle


def test_alert_constants_match_the_server_settings():
    from vqserve.serve.metrics import Metrics

    (queue,) = [r for r in alert_rules() if "vqserve_queue_items" in r["expr"]]
    max_queue = env(container())["VQSERVE_MAX_QUEUE"]
    assert re.search(rf"/\s*{max_queue}\b", queue["expr"]), "divide by VQSERVE_MAX_QUEUE"
    # The codebook alerts only count windows holding enough tokens: a size a window can reach.
    window = inspect.signature(Metrics).parameters["window"].default
    pattern = r"vqserve_codebook_window_tokens(?: offset \w+)? >= (\d+)"
    guards = [(r["alert"], int(n)) for r in alert_rules() for n in re.findall(pattern, r["expr"])]
    assert {alert for alert, _ in guards} >= {"VqserveCodebookCollapse", "VqserveCodebookDrift"}
    for alert, need in guards:
        assert 0 < need <= window, alert


# ---- PromQL syntax ------------------------------------------------------------------------------
def test_promql_parses(tmp_path):
    exprs = all_promql()
    checked_by = []
    try:
        import promql_parser
    except ImportError:
        promql_parser = None
    if promql_parser is not None:
        for where, expr in exprs:
            try:
                promql_parser.parse(expr)
            except ValueError as exc:
                pytest.fail(f"{where}: {exc}\n{expr}")
        checked_by.append("promql-parser")
    promtool = shutil.which("promtool")
    if promtool is not None:
        # Any expression is a valid recording rule, so promtool checks them all at once.
        rules = {"groups": [{"name": "all", "rules": [
            {"record": f"vqserve_check:expr_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]}]}
        path = tmp_path / "exprs.yml"
        path.write_text(yaml.safe_dump(rules))
        out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        checked_by.append("promtool")
    if not checked_by:
        pytest.skip("no PromQL parser here: pip install promql-parser, or install promtool "
                    "(Debian package prometheus)")


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        out = subprocess.run([promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


# ---- docker-compose ----------------------------------------------------------------------------
def test_compose_file_matches_the_server_and_the_config_files(monkeypatch):
    compose = one(COMPOSE)
    services = compose["services"]
    assert {"vqserve", "prometheus", "grafana"} <= services.keys()
    vq = services["vqserve"]
    assert vq["build"]["context"] == "." and vq["build"]["args"]["VARIANT"] == "cpu"
    port, metrics_port = DEFAULTS["port"], DEFAULTS["metrics_port"]
    published = {int(p.rsplit(":", 1)[1]) for p in vq["ports"]}
    assert {port, metrics_port} <= published
    test = vq["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:4] == ["vqserve", "health", "--server"]
    assert test[4] == f"localhost:{port}"
    variables = {k: str(v) for k, v in vq["environment"].items() if k.startswith("VQSERVE_")}
    config = config_from_env(monkeypatch, variables)
    assert (config.port, config.metrics_port, config.device) == (port, metrics_port, "cpu")
    grace = float(vq["environment"].get("VQSERVE_GRACE", DEFAULTS["grace_s"]))
    assert duration_s(vq["stop_grace_period"]) > grace  # compose's default SIGKILL is 10 s
    # Pinned images, never a moving tag.
    for name in ("prometheus", "grafana"):
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", services[name]["image"]), name
    # Prometheus: this directory, scraping the vqserve service on its metrics port.
    mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    assert mounts["./deploy/prometheus"] == "/etc/prometheus" and PROMETHEUS.is_dir()
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    static = [t for j in one(PROMETHEUS / "prometheus.yml")["scrape_configs"]
              for sc in j.get("static_configs", []) for t in sc["targets"]]
    assert static == [f"vqserve:{metrics_port}"]
    # Grafana: provisioned from deploy/grafana, reading the compose Prometheus.
    g_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("./"))
    assert g_mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dash_dir = g_mounts["./deploy/grafana/dashboards"]
    (provider,) = one(GRAFANA / "provisioning" / "dashboards" / "vqserve.yml")["providers"]
    assert provider["options"]["path"] == dash_dir
    (ds,) = one(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    assert any(p.endswith(":9090") for p in services["prometheus"]["ports"])


# ---- Grafana ----------------------------------------------------------------------------------
def test_dashboard_is_well_formed():
    d = dashboard()
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and d["uid"] and d["title"]
    assert {v["name"] for v in d["templating"]["list"]} >= {"datasource", "instance"}
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
    kinds = {p["type"] for p in panels}
    assert {"heatmap", "timeseries", "stat"} <= kinds


# ---- against a live server -------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tiny_checkpoint):
    """A real server with one good and one bad request served; its /metrics text."""
    config = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1",
                          port=0, metrics_port=0, grace_s=2)
    with ServerThread(config) as srv:
        images = np.random.default_rng(0).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
        with TokenizerClient(srv.target, timeout=30) as client:
            assert client.encode(images).shape == (2, 8, 8)
            with pytest.raises((grpc.RpcError, ServerError)):
                client.encode(images[:, :60, :60])  # not a multiple of the factor 8
        url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        yield srv, text


@pytest.fixture(scope="module")
def exported(live):
    """(metric family names, sample names) the live server exports. The `_created`
    gauges (series creation times, one per counter and histogram) are not families of
    their own for this purpose: nothing graphs them."""
    families = list(text_string_to_metric_families(live[1]))
    return ({f.name for f in families
             if f.name.startswith("vqserve_") and not f.name.endswith("_created")},
            {s.name for f in families for s in f.samples if s.name.startswith("vqserve_")})


def family_of(name: str, families: set[str]) -> str | None:
    if name in families:
        return name
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return None


def test_live_server_exports_what_the_checks_need(exported):
    families, samples = exported
    assert {"vqserve_requests_total", "vqserve_errors_total", "vqserve_items_total",
            "vqserve_request_latency_seconds_bucket", "vqserve_queue_items",
            "vqserve_codebook_usage_ratio"} <= samples


def test_every_metric_named_is_exported(exported):
    _, samples = exported
    used = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    used += [(f"adapter rule {i}", r["seriesQuery"] + " " + r["metricsQuery"])
             for i, r in enumerate(adapter_rules())]
    used += grafana_exprs()
    missing = sorted({(where, name) for where, text in used for name in METRIC_NAME.findall(text)
                      if name not in samples})
    assert not missing, f"not exported by a live server: {missing}"


def test_dashboard_covers_every_exported_metric(exported):
    families, _ = exported
    shown = {family_of(n, families) for _, e in grafana_exprs() for n in METRIC_NAME.findall(e)}
    assert families - shown == set()


def test_probe_services_and_compose_healthcheck_say_serving(live):
    from vqserve import cli

    srv, _ = live
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        service = container()[kind]["grpc"].get("service", "")
        assert check_health(srv.target, service) == "SERVING", kind
    # The compose healthcheck's exact command line, pointed at the live server.
    argv = one(COMPOSE)["services"]["vqserve"]["healthcheck"]["test"][1:]
    argv = [srv.target if a.startswith("localhost:") else a for a in argv]
    assert argv[0] == "vqserve"
    assert cli.main(argv[1:]) == 0
