"""What the deployment tests read: the files of deploy/ and docker-compose.yml, loaded and
picked apart (Kubernetes objects, alert and adapter rules, the Grafana dashboard and its
PromQL), and vqserve's own defaults read from its code, never restated. Shared by
test_deploy.py (the files against the server's code) and test_deploy_live.py (against a
running server)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from pathlib import Path

import yaml

from tests.helpers import ROOT
from vqserve.serve.config import ServerConfig
from vqserve.serve.grpc_server import TokenizerServer

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
