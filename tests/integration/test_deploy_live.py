"""The deployment files against a live ``vqserve serve``: every metric an alert, the HPA's
adapter rules or a Grafana panel names is exported, the dashboard covers every metric
exported, and the probes' health services say SERVING."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.deploy_files import (
    COMPOSE,
    METRIC_NAME,
    SUFFIXES,
    adapter_rules,
    alert_rules,
    container,
    grafana_exprs,
    one,
)
from vqserve.serve.clients import ServerError, TokenizerClient, check_health
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread

pytestmark = pytest.mark.timeout(120)


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
