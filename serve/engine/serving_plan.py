"""Which execution plan a server serves by, and the switch to a measured one.

At start the plan comes from ``--plan``: a plan file, the plan cache, the device's default,
or, with ``--plan auto`` and nothing cached, the safe plan while the fast one is measured
in a child process beside serving (serve/engine/planning.py). Once measured, the server switches
to it between model calls; every plan it may switch to gives the safe plan's tokens and
pixels, so clients see a change in speed only. The user's flags (``--micro-batch``,
``--model-workers``, ``--threads``, ``--no-cuda-graphs``) apply on top of whichever plan,
and each plan is checked for batch invariance before it serves a client.

The server (serve/grpc_server.py) owns the lifecycle and the engine; this module owns the plan
choice, so the server's start-up reads as steps and not as the planner's details.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from vqserve.core.progress import Progress
from vqserve.export.runtimes.certificates import CertificateStore, certificate_key, certify
from vqserve.export.runtimes.determinism import CHECK_BUDGET_S
from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime, plan_for
from vqserve.serve.engine.planning import BackgroundPlan, plan_argv, run_in_daemon
from vqserve.serve.logs import event as _event


class ServingPlan:
    """The plan choices of one server: ``config`` is its ServerConfig, ``state`` its
    ServerState (the engine a switch goes to), ``publish(runtime, certificate)`` makes what
    serves now known (metrics, logs, front-ends). :meth:`stop` (the server drains) ends a
    measurement and any switch still to come."""

    def __init__(self, config, state, publish: Callable[[PlannedRuntime, object], None]):
        self.config = config
        self.state = state
        self._publish = publish
        self.stopped = False
        # passed start-up checks are kept and reused only for a model this server loads
        # itself (a runtime handed in ready-made may be anything under a known hash)
        self.keep_certificates = False
        self._measurement: BackgroundPlan | None = None

    def plan(self, device: str, base: ExecutionPlan | None = None) -> ExecutionPlan:
        """The measured plan (``base``) or the device's default, with the settings the user gave."""
        cfg = self.config
        return plan_for(device, cfg.micro_batch, cfg.model_workers, cfg.threads, base=base,
                        cuda_graphs=None if cfg.cuda_graphs else False)

    def artifacts(self):
        """Where exports made for a plan go: the plan cache's ``artifacts/``."""
        from vqserve.export.plan import cache_dir

        return cache_dir(self.config.plan_cache) / "artifacts"

    def find(self, device: str):
        """(plan, measure later?): the plan ``--plan`` names (``export.plan.find_plan``);
        with ``--plan auto`` and none cached, None and True: the safe plan serves while the
        measurement runs."""
        # here, not at the top: the planner (~12 ms of imports) would delay binding the port
        from vqserve.export.plan import find_plan

        cfg = self.config
        chosen = find_plan(cfg.plan, cfg.model, device, cfg.backend, cfg.dtype, cfg.min_agreement,
                           cfg.plan_cache, cfg.expect_hash)
        if chosen is None:
            from vqserve.export.runtimes.synthetic import is_synthetic

            return None, cfg.plan == "auto" and not is_synthetic(cfg.model)
        log_plan(chosen)
        return chosen, False

    async def planned(self, runtime, base: ExecutionPlan | None, source: str, carried=()):
        """``runtime`` run by ``base`` (or the device's default) with the user's flags, and its
        batch-invariance certificate (checked before any client sees its tokens, or passed
        before under the same key: :meth:`certify`). ``carried``: a plan file's certificates."""
        cfg = self.config
        plan = self.plan(runtime.info.device, base)
        if cfg.micro_batch or cfg.model_workers or cfg.threads or not cfg.cuda_graphs:
            source += "+flags"
        certificate = None
        if cfg.self_check:
            certificate = await run_in_daemon(lambda: self.certify(runtime, plan, carried), "vqserve-check")
        return PlannedRuntime(runtime, plan, source), plan, certificate

    def certify(self, runtime, plan: ExecutionPlan, carried=()):
        """The start-up check of ``runtime`` under ``plan``: reused when one passed under the
        same key (model hash, runtime, plan, machine, software: export/runtimes/certificates.py)
        in the plan cache or in ``carried``; else run, said step by step (log lines, the
        health message, a bar on a terminal), sized to the model (CHECK_BUDGET_S), and kept.
        ``keep_certificates`` False (a runtime handed in ready-made, the stand-in): always run."""
        store = CertificateStore(self.certificates()) if self.keep_certificates else None
        changed = store.changed(certificate_key(runtime.info, plan)) if store is not None and not carried else None
        if changed:
            _event("self_check_again", "a start-up check of this model passed before under another "
                   f"{', '.join(changed)}: checking again", changed=changed)
        progress = Progress("start-up check", 1, say=self.say_step("self_check_progress"),
                            skip="--no-self-check").heartbeat()
        started = time.perf_counter()
        try:
            certificate, record, where = certify(runtime, plan, store, carried, progress, CHECK_BUDGET_S)
        finally:
            progress.close()
        if record is not None:
            _event("self_check_reused", f"start-up check reused: passed for this model, runtime, plan, machine "
                   f"and software at {record.get('checked_at')} (it took {record.get('check_s')} s; {where}); "
                   "serving without checking again", checked_at=record.get("checked_at"),
                   check_s=record.get("check_s"), file=where, determinism=certificate.summary())
            return certificate
        sized = next((n for n in certificate.notes if n.startswith("sized to the model")), "")
        progress.done(f"start-up check done in {time.perf_counter() - started:.1f} s: {certificate.summary()}"
                      + (f" ({sized})" if sized else ""))
        if where:
            _event("self_check_kept", "start-up check kept for later starts with the same model, runtime, plan, "
                   f"machine and software: {where}", file=where)
        return certificate

    def certificates(self):
        """Where passed start-up checks are kept: the plan cache's ``certificates/``."""
        from vqserve.export.plan import cache_dir

        return cache_dir(self.config.plan_cache) / "certificates"

    def say_step(self, event_name: str):
        """A Progress ``say``: one JSON log line, and the health message while not serving."""
        def say(line: str, fields: dict) -> None:
            self.state.step = line if fields.get("step") != "done" else self.state.step
            _event(event_name, line, **fields)
        return say

    async def measure(self, device: str, foreground: bool = False):
        """Run ``vqserve plan`` in a child process (lower priority, within --plan-budget-s,
        ended by :meth:`stop`) and return the plan it cached, or None."""
        from vqserve.export.plan import cache_dir, lookup_plan

        if self.stopped:  # the server began to drain before the measurement could start
            return None
        cfg = self.config
        argv = plan_argv(cfg.model, device, cfg.backend, cfg.dtype, str(cache_dir(cfg.plan_cache)),
                         cfg.plan_budget_s, cfg.min_agreement if cfg.dtype == "auto" else None)
        _event("plan_measuring", f"measuring the execution plan for {cfg.model} on {device} "
               + ("before serving (--dtype auto chooses the dtype, so tokens would change at a switch)"
                  if foreground else "in the background at low priority; serving the safe plan meanwhile")
               + f" (budget {cfg.plan_budget_s:g} s; cached for later starts)", budget_s=cfg.plan_budget_s)
        self._measurement = BackgroundPlan(argv)

        def progress(line: str) -> None:
            if foreground:  # the server waits for it: health says so, and how to skip it
                self.state.step = f"measuring the execution plan before serving: {line} (skip: --plan default)"
            _event("plan_progress", line)

        status = await self._measurement.run(progress)
        if self.stopped:
            return None
        if status != 0:
            _event("plan_not_measured", f"the plan measurement ended with status {status}: keeping the safe "
                   f"plan (`vqserve plan --model {cfg.model}` measures without a budget and fills the cache)",
                   level=logging.WARNING, status=status)
            return None
        chosen, _ = await run_in_daemon(lambda: lookup_plan(cfg.model, device, cfg.backend, cfg.dtype,
                                                            cfg.min_agreement, cfg.plan_cache))
        if chosen is not None:
            chosen.source = "measured"
            log_plan(chosen, measure_s=chosen.result.get("measure_s"))
        return chosen

    async def switch_to_measured(self, device: str) -> None:
        """Measure, then serve by the measured plan from the next call on. Every path the planner
        may choose here gives the safe plan's tokens and pixels, so no client sees a change
        but in speed; anything that fails leaves the safe plan serving."""
        cfg = self.config
        try:
            chosen = await self.measure(device)
            if chosen is None or self.stopped:
                if not self.stopped:
                    self.republish("safe")
                return
            current = self.state.engine.runtime
            if (chosen.backend, chosen.dtype) == (current.info.backend, current.info.dtype) and \
                    self.plan(device, chosen.plan) == current.plan:
                self.republish("measured")
                _event("plan_switched", "the measured plan is the safe plan: nothing to switch")
                return
            # measured on this machine a moment ago: its tokens and pixels were compared with the
            # safe plan's there; the start-up check below is what remains to be seen here
            raw = await run_in_daemon(lambda: chosen.load(cfg.model, cfg.backend, device, cfg.expect_hash,
                                                          artifacts=self.artifacts()))
            if self.stopped:
                return
            runtime, plan, certificate = await self.planned(raw, chosen.plan, "measured")
            if certificate is not None and not certificate.invariant:
                raise RuntimeError(f"the measured plan failed the start-up check here: {certificate.summary()}")
            if self.stopped:
                return
            await self.state.engine.use_runtime(runtime, certificate)
            self._publish(runtime, certificate)
            _event("plan_switched", f"now serving by the measured plan: {runtime.info.extra['plan_line']}",
                   backend=runtime.info.backend, dtype=runtime.info.dtype, plan=plan.to_dict())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the safe plan keeps serving
            _event("plan_not_measured", f"could not switch to a measured plan ({type(exc).__name__}: "
                   f"{' '.join(str(exc).split())[:300]}); keeping the safe plan", level=logging.WARNING)
            if not self.stopped:
                self.republish("safe")

    def republish(self, source: str) -> None:
        """The plan serving now keeps serving, from now on known as coming from ``source``."""
        engine = self.state.engine
        if engine is not None and hasattr(engine.runtime, "relabel"):
            engine.runtime.relabel(source + ("+flags" if engine.runtime.source.endswith("+flags") else ""))
            self._publish(engine.runtime, engine.determinism)

    def stop(self) -> None:
        """The server drains: a plan being measured ends now, nothing of it cached, and no
        switch happens after this."""
        self.stopped = True
        if self._measurement is not None:
            self._measurement.stop()

    async def close(self) -> None:
        """After :meth:`stop`, before the event loop ends: wait for the measuring child to
        exit, so nothing of it is left for the loop's garbage (serve/engine/planning.py)."""
        self.stop()
        if self._measurement is not None:
            await self._measurement.reap()


def log_plan(chosen, **fields) -> None:
    """The ``plan`` log line: the choice and the figures behind it."""
    _event("plan", f"execution plan: {chosen.why()}", dtype=chosen.dtype, backend=chosen.backend,
           exact=chosen.exact, plan=chosen.plan.to_dict(), source=chosen.source, file=chosen.cache_file, **fields)
