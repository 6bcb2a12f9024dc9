"""Train one tokenizer config within a wall-clock budget (a lent GPU's minutes), then save it.

``vqserve train`` runs a fixed number of steps. A borrowed accelerator comes with minutes,
not steps, and several candidates share it side by side, so their speed is only known once
they all run. This driver trains ``--probe`` steps, measures the rate, sets ``steps`` so the
cosine schedule ends inside the budget, and trains on (on a GPU the Trainer cuts the next
batches' crops in threads meanwhile); if the machine turns out slower than
measured, a hard deadline stops early and saves what there is (said in the tokenizer's
``meta``). The config's own ``steps`` is an upper bound.

    python scripts/train_on_budget.py --config configs/default-v6-decoder.yaml --seconds 420 \
        --set device=cuda --set data=DIR --set init_from=runs/v4 --out runs/v6

Writes ``OUT/final`` (config.json + model.safetensors, networks stored fp16 as the shipped
default is) and ``OUT/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml


def parse_value(text: str):
    """``--set key=value``: the value read as YAML (numbers, booleans, lists)."""
    return yaml.safe_load(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a training config (YAML), as for vqserve train")
    ap.add_argument("--seconds", type=float, required=True, help="wall-clock budget for training")
    ap.add_argument("--probe", type=int, default=60, help="steps timed to set the schedule (default 60)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (repeatable)")
    ap.add_argument("--out", required=True, help="run directory")
    ap.add_argument("--storage", default="fp16", help="network storage of the saved tokenizer")
    args = ap.parse_args(argv)

    import torch

    from vqserve.model.checkpoint import save_tokenizer
    from vqserve.training.config import TrainConfig, load_config_file
    from vqserve.training.trainer import Trainer

    t_start = time.monotonic()
    data = load_config_file(args.config)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        data[key] = parse_value(value)
    data.update(out=args.out, progress=False, plots=False)
    cfg = TrainConfig.from_dict(data)
    cap = cfg.steps
    trainer = Trainer(cfg)
    deadline = t_start + args.seconds
    warm = min(20, args.probe // 3)
    trainer.run(stop_at=warm)
    t1 = time.monotonic()
    trainer.run(stop_at=args.probe)
    t2 = time.monotonic()
    rate = (args.probe - warm) / (t2 - t1)
    # the final save and the last log take a few seconds: aim for 92 % of what is left
    planned = args.probe + int(rate * max(0.0, deadline - t2) * 0.92)
    cfg.steps = max(args.probe + 1, min(cap, planned))
    print(f"[budget] {rate:.1f} steps/s -> {cfg.steps} steps (cap {cap})", file=sys.stderr, flush=True)
    stopped_early = False
    while trainer.step < cfg.steps:
        if time.monotonic() > deadline:
            stopped_early = True
            break
        trainer.run(stop_at=min(cfg.steps, trainer.step + 250))
    meta = {**trainer.meta(), "planned_steps": cfg.steps, "steps_per_second": round(rate, 2),
            "device": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu"}
    if stopped_early:
        meta["stopped_early"] = "the budget ran out before the schedule ended"
    out = Path(args.out)
    save_tokenizer(trainer.tokenizer, out / "final", extra=meta, network_storage=args.storage)
    (out / "summary.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"[budget] {trainer.step} steps in {time.monotonic() - t_start:.0f} s -> {out / 'final'}",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
