"""The deployment files (deploy/, docker-compose.yml) against vqserve's code.

Every file parses; the Kubernetes objects validate offline against the API schemas; the
ports, health service names and drain times in the manifests are the ones the server
really uses (read from its code, not restated here); the manifests' VQSERVE_* settings
build a valid server config through the real `vqserve serve` path; the PromQL parses.
Against a live server: test_deploy_live.py.
"""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from tests.integration.deploy_files import (
    COMPOSE,
    DEFAULTS,
    GRAFANA,
    HEALTH_SERVICES,
    K8S,
    MIN_K8S,
    NOT_KUSTOMIZED,
    OVERLAYS,
    PROMETHEUS,
    adapter_rules,
    alert_rules,
    all_promql,
    api_objects,
    by_kind,
    cli_default,
    config_from_env,
    container,
    dashboard,
    dashboard_panels,
    deploy_files,
    deployment,
    docs,
    duration_s,
    env,
    k8s_objects,
    one,
    ports,
)
from vqserve.serve.api import oip as service_oip
from vqserve.serve.api import v1 as service_v1
from vqserve.serve.grpc_server import TokenizerServer

pytestmark = pytest.mark.timeout(120)


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


def test_a_stalled_pod_leaves_the_service_before_liveness_restarts_it():
    """Health turns NOT_SERVING once the model makes no progress for VQSERVE_STALL_TIMEOUT
    (serve/liveness.py): readiness takes the pod out of the Service first, and liveness
    restarts it only when the stall outlasts a minute more (never during one slow call)."""
    from vqserve.serve.liveness import DEFAULT_STALL_TIMEOUT_S

    c = container()
    stall_s = float(env(c)["VQSERVE_STALL_TIMEOUT"])
    assert stall_s == cli_default("stall_timeout") == DEFAULT_STALL_TIMEOUT_S

    def window(kind: str) -> float:
        return c[kind]["periodSeconds"] * c[kind]["failureThreshold"]

    assert c["livenessProbe"]["grpc"].get("service", "") == ""  # turns NOT_SERVING on a stall too
    assert window("readinessProbe") < window("livenessProbe")
    assert window("livenessProbe") >= 60


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
