"""What the protocol adapters read: the engine (None while the model loads), readiness,
metrics and the per-request tracker. One object per serving process, shared by the gRPC
services, the model side that fills it in, and (on a GPU node) the device executor."""

from __future__ import annotations

from vqserve.serve.api.errors import Tracker
from vqserve.serve.metrics import Metrics


class ServerState:
    """What the services read: the engine (None while loading), readiness, metrics."""

    def __init__(self, metrics: Metrics):
        self.engine = None  # an Engine once the model side has loaded
        self.ready = False
        # what the model side is doing while not yet SERVING (loading, the start-up check with
        # its progress and time left): the health service's message, None once serving
        self.step: str | None = None
        self.metrics = metrics
        self.tracker = Tracker(metrics)
