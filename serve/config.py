"""``ServerConfig``: every setting of ``vqserve serve``, and the sections each process needs.

One flat dataclass is what the CLI builds and what a Python user passes to ``ServerThread``
(``ServerConfig(model=path, port=0)``). Each process of a server reads only its sections:

* ``grpc``: the port and what guards it (TLS, auth, message and stream limits, listeners,
  drain, ``/metrics``, when health calls the model stalled): every process that answers gRPC;
* ``engine``: the request checks and batching (batch and pixel limits, queue, decoding);
* ``model``: what runs the model (model, backend, dtype, device, plan, expected hash);
* ``split``: the GPU-node layout (front-end processes, the executor's socket, shared memory).

A front-end process is started with its ``grpc``, ``engine`` and ``split`` sections only
(:func:`frontend_settings`): it never loads a model, so it is never told which.
"""

from __future__ import annotations

from dataclasses import dataclass

from vqserve.serve.engine.planning import DEFAULT_PLAN_BUDGET_S
from vqserve.serve.liveness import DEFAULT_STALL_TIMEOUT_S

GRPC_FIELDS = ("host", "port", "metrics_port", "metrics_host", "max_message_mb", "tls_cert", "tls_key",
               "auth_token", "grace_s", "max_streams", "metrics_auth", "metrics_tls", "listeners", "stall_timeout_s")
ENGINE_FIELDS = ("max_batch_size", "max_delay_ms", "max_queue", "max_pixels", "max_batch_pixels",
                 "max_decoded_mb", "decode_threads")
MODEL_FIELDS = ("model", "backend", "dtype", "device", "expect_hash", "micro_batch", "model_workers",
                "self_check", "threads", "cuda_graphs", "plan", "plan_cache", "min_agreement", "plan_budget_s")
SPLIT_FIELDS = ("frontends", "executor_socket", "arena_mb")
SECTIONS = {"grpc": GRPC_FIELDS, "engine": ENGINE_FIELDS, "model": MODEL_FIELDS, "split": SPLIT_FIELDS}


@dataclass
class ServerConfig:
    model: str = "default"
    backend: str = "auto"
    dtype: str | None = None         # None: fp32 for checkpoints, the exported dtype for artifacts
    device: str = "auto"
    host: str = "[::]"
    port: int = 50051                # 0 = ephemeral (the bound port is logged)
    metrics_port: int = 50052        # 0 = ephemeral, negative = no metrics endpoint
    metrics_host: str = "0.0.0.0"
    max_batch_size: int = 32
    max_delay_ms: float = 0.0        # a free model slot never waits for a fuller call (serve/engine/batcher.py)
    max_queue: int = 1024            # queued items (images), over all queues
    max_message_mb: int = 64         # per gRPC message, each way
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None
    grace_s: float = 30.0            # drain time on SIGTERM
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S  # health NOT_SERVING after this long with work waiting and
    #                                  no model call finishing (or the larger serve/liveness.stall_bound)
    max_streams: int = 256           # open streaming calls per service (EncodeStream+DecodeStream, ...)
    expect_hash: str | None = None   # refuse a model whose model_hash differs, before loading it
    metrics_auth: bool = False       # /metrics requires the gRPC bearer token (auth_token)
    metrics_tls: bool = False        # /metrics over HTTPS with tls_cert / tls_key
    max_pixels: int | None = None    # per image (H*W); None: the runtime's own (1024*1024)
    max_batch_pixels: int | None = None  # per model call; None: default_batch_pixels(device)
    max_decoded_mb: int | None = None    # decoded PNG/JPEG in flight; None: default_decoded_bytes
    decode_threads: int | None = None    # PNG/JPEG decoding threads; None: up to 4
    micro_batch: int | None = None   # images per model call (fixed, padded); None: default_plan(device)
    model_workers: int | None = None  # model calls at once, one thread each; None: default_plan(device)
    self_check: bool = True          # measure batch invariance at start (GetModelInfo.determinism)
    threads: int | None = None       # intra-op threads per model call; None: the plan's (1 on CPU)
    cuda_graphs: bool = True         # False: never replay calls from CUDA graphs (export/runtimes/cuda_graphs.py)
    plan: str = "default"            # "auto": the cached plan, else serve the safe plan and measure in
    #                                  the background; "default": default_plan(device); else a plan
    #                                  file (`vqserve plan --out`). `vqserve serve` defaults to auto.
    plan_cache: str | None = None    # where measured plans are kept; None: export.plan.cache_dir()
    min_agreement: float = 0.995     # --dtype auto: least token agreement with fp32 for a lower dtype
    plan_budget_s: float = DEFAULT_PLAN_BUDGET_S  # --plan auto: the background measurement stops after this
    frontends: int | None = 0        # gRPC front-end processes (serve/split/frontend.py) before one device
    #                                  executor; 0: one process does everything; None: by the device
    #                                  (serve/split/executor.py default_frontends). `vqserve serve`: auto.
    executor_socket: str | None = None  # set in a front-end process: the executor it forwards to
    arena_mb: int = 0                # a front-end's shared pixel memory; 0: default_arena_bytes
    listeners: int = 8               # gRPC servers per front-end process, on its port (serve/grpc_listeners.py)

    def section(self, name: str) -> dict:
        """The settings of one section (``grpc``, ``engine``, ``model``, ``split``) by name."""
        return {field: getattr(self, field) for field in SECTIONS[name]}


def frontend_settings(config: ServerConfig, port: int, socket_path: str) -> dict:
    """What a front-end process is started with: the ``grpc``, ``engine`` and ``split``
    sections, on the port its executor reserved, forwarding to ``socket_path``, with no
    ``/metrics`` of its own (the executor serves every process's metrics)."""
    settings = {name: config.section(name) for name in ("grpc", "engine", "split")}
    settings["grpc"].update(port=port, metrics_port=-1)
    settings["split"].update(frontends=0, executor_socket=socket_path)
    return settings


def config_from_sections(settings: dict) -> ServerConfig:
    """The ServerConfig of a process started with some sections (the others at defaults)."""
    fields = {}
    for name, values in settings.items():
        unknown = set(values) - set(SECTIONS[name])
        if unknown:
            raise ValueError(f"unknown {name} settings: {sorted(unknown)}")
        fields.update(values)
    return ServerConfig(**fields)

