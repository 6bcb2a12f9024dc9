"""The model in this process: loaded by its plan, run by an :class:`Engine`, and switched to a
measured plan later. Both layouts that own a model use it: one process serving everything
(``serve/grpc_server.py`` through ``serve/launcher.py``) and the device executor behind
front-end processes (``serve/split/executor_server.py``), so what a server loads and how it
announces it is one piece of code.

Loading: the plan from a plan file or the cache, else the safe plan while the fast one is
measured in the background (``serve/engine/serving_plan.py``); ``--dtype auto`` chooses before
serving, since a lower dtype changes tokens. The runtime's batch invariance is certified
before any client sees its tokens; the identity, plan and certificate go to the metrics and
logs, and to whatever else must know (``on_publish``: the executor tells its front-ends).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from vqserve.core.identity import check_expected_hash
from vqserve.core.machine import available_memory
from vqserve.core.progress import Progress
from vqserve.export.runtimes.execution import PlannedRuntime
from vqserve.serve.engine.engine import Engine, build_engine
from vqserve.serve.engine.planning import run_in_daemon
from vqserve.serve.engine.serving_plan import ServingPlan
from vqserve.serve.liveness import batcher_stall
from vqserve.serve.logs import event as _event

BYTES_PER_PIXEL = 300
CPU_BATCH_PIXELS = 4 * 1024 * 1024   # ~1.2 GB peak; batching gains nothing beyond this on CPU


def default_batch_pixels(device: str, max_pixels: int) -> int:
    """A pixel budget per model call that fits the device: half a GPU's memory, or on CPU
    4 megapixels or a quarter of the memory this process may use (a container's memory
    limit, not its node's RAM), whichever is less; never below one image."""
    if device.startswith("cuda"):
        import torch  # only where a CUDA device is already in use

        index = torch.device(device).index or 0
        budget = torch.cuda.get_device_properties(index).total_memory // 2 // BYTES_PER_PIXEL
    else:
        budget = min(CPU_BATCH_PIXELS, available_memory() // 4 // BYTES_PER_PIXEL)
    return max(int(max_pixels), int(budget))


class LocalModel:
    """The model side of a process that runs the model itself (``role`` "all" when it also
    answers gRPC, as :class:`~vqserve.serve.grpc_server.TokenizerServer`'s model side).

    ``runtime``: a loaded Runtime, a zero-argument callable returning one (run in a worker
    thread while health says NOT_SERVING), or None to load ``config.model`` by its plan."""

    LISTENING_EVENT = "listening"

    def __init__(self, config, state, runtime=None, on_publish: Callable[[], None] | None = None):
        self.config = config
        self.state = state
        self.metrics = state.metrics
        self._runtime = runtime
        self._on_publish = on_publish
        self.plans = ServingPlan(config, state, self._publish)
        self.device = config.device
        self.measure_later = False
        self.started = 0.0
        self.plan = None
        self.source = None
        self.certificate = None
        self._plan_task: asyncio.Task | None = None

    async def load(self) -> Engine:
        """Load the model by its plan and set ``state.engine``; the caller then says SERVING."""
        cfg = self.config
        loading = None
        if self._runtime is None:  # said first, then every 2 s: torch, the plan and a large model take a while
            loading = Progress(f"loading the model {cfg.model}", None, say=self.plans.say_step("loading"))
            loading.step(f"the model and its execution plan (--plan {cfg.plan})")
            loading.heartbeat()
        try:
            runtime, chosen, measure_later, device = await self._runtime_by_plan()
        finally:  # loaded or failed: the heartbeat ends here
            if loading is not None:
                loading.close()
        if loading is not None:
            loading.done(f"loaded the model {cfg.model} in {time.perf_counter() - loading.started:.1f} s")
        from vqserve.export.plan import check_reproduces

        check_expected_hash(cfg.expect_hash, runtime.info.model_hash, cfg.model)  # a runtime given ready-made
        source = chosen.source if chosen else ("measuring" if measure_later else
                                              "safe" if cfg.plan == "auto" else "default")
        raw = runtime
        runtime, plan, certificate = await self.plans.planned(raw, chosen.plan if chosen else None, source,
                                                              carried=chosen.result.get("certificates") if chosen else ())
        if chosen is not None and chosen.source == "file":  # measured elsewhere: does this machine agree?
            await run_in_daemon(lambda: check_reproduces(raw, cfg.model, device, chosen, certificate))
        self._publish(runtime, certificate)
        max_pixels = cfg.max_pixels or runtime.info.max_pixels
        engine = build_engine(runtime, self.metrics, cfg, max_batch_pixels=cfg.max_batch_pixels
                              or default_batch_pixels(runtime.info.device, max_pixels))
        engine.determinism = certificate
        engine.batcher.start()
        self.state.engine = engine
        self.state.ready = True
        self.state.step = None
        self.metrics.queue_depth.set_function(lambda: engine.batcher.queued)
        self.device, self.measure_later = device, measure_later
        self.plan, self.source, self.certificate = plan, source, certificate
        return engine

    async def _runtime_by_plan(self):
        """(runtime, the plan chosen or None, measure later?, device): the model as ``--plan`` names it."""
        cfg = self.config
        # imported here, not at the top: the port is bound and health answers NOT_SERVING
        # before torch and the planner load (seconds), and synthetic:N never needs them
        from vqserve.export.runtimes.loader import load_runtime, resolve_device

        self.started = time.perf_counter()
        runtime = self._runtime
        chosen, measure_later, device = None, False, cfg.device
        if runtime is None:
            from vqserve.export.runtimes.synthetic import is_synthetic

            self.plans.keep_certificates = not is_synthetic(cfg.model)  # the stand-in checks in ms
            device = resolve_device(cfg.device)
            chosen, measure_later = await run_in_daemon(lambda: self.plans.find(device))
            if measure_later and cfg.dtype == "auto":  # a lower dtype changes tokens: choose before serving
                chosen, measure_later = await self.plans.measure(device, foreground=True), False

            def runtime():
                if chosen is not None:  # the planned backend: the model as given, or its export
                    return chosen.load(cfg.model, cfg.backend, device, cfg.expect_hash,
                                       artifacts=self.plans.artifacts(), log=lambda msg: _event("plan_progress", msg))
                return load_runtime(cfg.model, backend=cfg.backend, dtype=None if cfg.dtype == "auto" else cfg.dtype,
                                    device=device, expect_hash=cfg.expect_hash)  # checked before the files load
        if callable(runtime) and not hasattr(runtime, "encode"):  # a loader: run it off the loop
            runtime = await run_in_daemon(runtime)
        return runtime, chosen, measure_later, device

    def announce(self, port: int | None, metrics_port: int | None, frontends: int = 0) -> None:
        """Log what serves (identity, limits, plan, certificate) and, with ``--plan auto`` and
        nothing cached, start measuring the fast plan beside serving."""
        cfg, engine = self.config, self.state.engine
        info = engine.runtime.info
        tokens = "exact: the model's fp32 tokens" if info.exact else f"NOT exact: {info.dtype}, asked for"
        certificate = self.certificate
        _event("serving", f"serving {info.backend}/{info.dtype} on {info.device} at port {port} ({tokens})",
               port=port, metrics_port=metrics_port, backend=info.backend, dtype=info.dtype,
               exact=info.exact, device=info.device, codebook_size=info.codebook_size, factor=info.factor,
               model_hash=info.model_hash, source_hash=info.source_hash,
               load_s=round(time.perf_counter() - self.started, 3),
               max_batch_size=cfg.max_batch_size, max_delay_ms=cfg.max_delay_ms, max_queue=cfg.max_queue,
               max_pixels=engine.info.max_pixels, max_batch_pixels=engine.max_batch_pixels,
               max_decoded_bytes=engine.decoder.budget.limit, plan=self.plan.to_dict(), plan_source=self.source,
               frontends=frontends,
               determinism=certificate.summary() if certificate else "not checked (--no-self-check)")
        if self.measure_later and not self.plans.stopped:
            self._plan_task = asyncio.get_running_loop().create_task(self.plans.switch_to_measured(self.device))

    def why_stalled(self) -> str | None:
        """Why the model makes no progress while work waits, or None (serve/liveness.py)."""
        engine = self.state.engine
        return None if engine is None else batcher_stall(engine.batcher, self.config.stall_timeout_s)

    def _publish(self, runtime: PlannedRuntime, certificate) -> None:
        """The identity, plan and start-up check of what serves now, in the metrics and logs
        (and, behind front-ends, to each of them)."""
        if self._on_publish is not None:
            self._on_publish()
        info = runtime.info
        self.metrics.set_model(info)
        self.metrics.set_plan(info.backend, info.dtype, runtime.plan, runtime.source)
        self.metrics.set_determinism(certificate)
        if certificate is not None and not certificate.invariant:
            _event("not_batch_invariant", certificate.summary(), level=logging.WARNING, plan=runtime.plan.to_dict())

    def stop(self) -> None:
        """A plan being measured: ended now, nothing of it cached, no switch after."""
        self.plans.stop()

    def cancel(self) -> None:
        """End a switch to the measured plan still under way (the server drains)."""
        if self._plan_task is not None and not self._plan_task.done():
            self._plan_task.cancel()

    async def close(self) -> None:
        if self._plan_task is not None:  # cancelled by cancel(): let it unwind on this loop
            await asyncio.gather(self._plan_task, return_exceptions=True)
        await self.plans.close()
        if self.state.engine is not None:
            await self.state.engine.close()
