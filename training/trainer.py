"""The training loop: mixed precision through the one precision policy, resumable runs.

``TrainConfig`` (``training/config.py``) holds every knob (a YAML/JSON file plus CLI
overrides builds it); ``train(config)`` runs it. Precision follows ``vqserve.model.precision``:

* fp32 - plain eager;
* bf16 - the networks under ``torch.autocast(bfloat16)``, **no GradScaler** (failure 4);
* fp16 - the networks under ``torch.autocast(float16)`` **with** a GradScaler;
* the quantizer always computes in fp32 inside its own island (failures 1 and 2), and
  the losses are computed on fp32 upcasts.

Losses (``training/losses.py``): L1 + L2 reconstruction, optionally L1 on the factor x factor
block means (``block_mean_weight``: colour and smooth regions), the quantizer's aux losses
(commitment / entropy for VQ / LFQ), and, optionally, the low-precision robustness **margin**
term for FSQ: the bounded pre-rounding latent of every channel is pushed at least ``margin``
away from its rounding boundaries (the half-integers), so the small drift a bf16/fp16 encoder
adds does not flip a token. ``quant_noise`` additionally perturbs the bounded latent with
uniform noise before rounding in training (straight-through), so the decoder tolerates it.
``latent_tv_weight`` (FSQ) is a rate proxy: L1 between neighbouring bounded latents, in
levels. Neighbours whose latents agree round to the same code, so a busy region spreads over
fewer codes and a prior predicts its tokens more cheaply (issue 28's bits/token).

Run directory (``out``; the metrics log and the plots: ``training/outputs.py``)::

    last/            the latest checkpoint, replaced atomically (temp dir + rename)
      tokenizer/     config.json + model.safetensors (load_tokenizer works on it)
      optimizer.safetensors   optimizer (and GradScaler) tensors, flattened; no pickle
      state.json     step, scalars, param-group settings, the training config
    final/           the finished tokenizer (config.json + model.safetensors)
    metrics.jsonl    one JSON object per logged / validation step
    curves.png, reconstructions.png
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vqserve.core.files import atomic_directory
from vqserve.model.checkpoint import load_tokenizer, resolve_model_path, save_tokenizer
from vqserve.model.config import TokenizerConfig
from vqserve.model.devices import resolve_device
from vqserve.model.evaluation import code_counts, codebook_stats, psnr
from vqserve.model.precision import PrecisionPolicy, fp32_island, policy
from vqserve.model.quantizers import FSQ
from vqserve.model.tokenizer import Tokenizer
from vqserve.training.config import TrainConfig
from vqserve.training.data import RandomCrops, open_source, tile_crops
from vqserve.training.losses import block_losses, latent_tv, lr_at, margin_loss, margin_weight_at
from vqserve.training.outputs import plot_curves, read_metrics, reconstruction_grid, write_metrics

PREFETCH = 3  # batches cut ahead in threads while an accelerator trains (Trainer._host_batch)


class Trainer:
    """One training run. ``run()`` trains to ``cfg.steps`` (resuming if asked)."""

    def __init__(self, cfg: TrainConfig, resume: bool = False):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.device = torch.device(resolve_device(cfg.device))
        if cfg.threads and self.device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # every step has the same shapes
        self.policy: PrecisionPolicy = policy(cfg.precision)
        torch.manual_seed(cfg.seed)
        self.tokenizer = Tokenizer(cfg.tokenizer_config()).to(self.device)
        if cfg.channels_last:
            self.tokenizer.to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.AdamW(self.tokenizer.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.scaler = self.policy.grad_scaler(self.device.type)
        self.step = 0
        self.elapsed = 0.0  # training seconds over all sessions of this run
        self.history: list[dict] = []
        self._load_data()
        if not (resume and self.resume()) and cfg.init_from:
            self.init_weights(cfg.init_from)
        if cfg.freeze_encoder:
            # no gradient reaches the encoder, so AdamW skips its weights and the tokens of every
            # image stay exactly those of init_from: a decoder-only fine-tune changes only pixels
            self.tokenizer.encoder.requires_grad_(False)

    # -- data ----------------------------------------------------------------------------
    def _load_data(self) -> None:
        cfg = self.cfg
        self.train_source = open_source(cfg.data, "train", min_size=1)
        self.crops = RandomCrops(self.train_source, cfg.crop_size, cfg.batch_size, seed=cfg.seed,
                                 sampling=cfg.sampling, smooth_fraction=cfg.smooth_fraction)
        self.val_tiles = None
        if cfg.val_data:
            val = open_source(cfg.val_data, "val", min_size=1)
            if len(val):
                self.val_tiles = torch.from_numpy(
                    tile_crops(val.images, cfg.val_crop_size, cfg.val_tiles_per_image or None))
        self.skipped = list(self.train_source.skipped)
        self.prefetch = 0 if self.device.type == "cpu" else PREFETCH
        self._ahead: dict[int, Future] = {}
        self._crop_pool: ThreadPoolExecutor | None = None

    def _host_batch(self, step: int) -> torch.Tensor:
        """Batch ``step`` on the host. On an accelerator the next ``prefetch`` batches are cut
        in threads while it trains on this one: on an H200 the crops and smooth patches took as
        long as the step itself. A batch is a pure function of (seed, step), so only the time
        changes. On CPU (``prefetch`` 0) the threads would take the cores the step needs."""
        if not self.prefetch:
            return self.crops.batch(step)
        if self._crop_pool is None:
            self._crop_pool = ThreadPoolExecutor(self.prefetch, thread_name_prefix="vqserve-crops")
        for ahead in range(step, step + self.prefetch + 1):
            if ahead not in self._ahead:
                self._ahead[ahead] = self._crop_pool.submit(self.crops.batch, ahead)
        x = self._ahead.pop(step).result()
        for stale in [s for s in self._ahead if not step < s <= step + self.prefetch]:
            del self._ahead[stale]   # left behind by a jump (a resume, a rewind)
        return x.pin_memory() if self.device.type == "cuda" else x

    def _batch(self, step: int) -> torch.Tensor:
        x = self._host_batch(step).to(self.device, non_blocking=True)
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    # -- one step --------------------------------------------------------------------------
    def _forward_losses(self, x: torch.Tensor, step: int) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
        cfg, tok = self.cfg, self.tokenizer
        with self.policy.autocast(self.device.type):
            latents = tok.encode_latents(x)
            fsq = isinstance(tok.quantizer, FSQ)
            needs_bounded = fsq and (cfg.margin_weight > 0 or cfg.quant_noise > 0 or cfg.latent_tv_weight > 0)
            if needs_bounded:
                # FSQ in two halves, so the bounded latent is at hand for the margin, noise and TV
                with fp32_island(self.device.type):
                    z = latents.permute(0, 2, 3, 1).to(torch.float32)
                    bounded = tok.quantizer.bound(z)
                    noisy = bounded
                    if cfg.quant_noise > 0:
                        g = torch.Generator(device=self.device).manual_seed(cfg.seed * 7919 + step)
                        noise = (torch.rand(bounded.shape, generator=g, device=self.device) * 2 - 1)
                        noisy = bounded + noise * cfg.quant_noise
                    codes, indices = tok.quantizer.quantize_bounded(noisy, clamp=cfg.quant_noise > 0)
                    codes = codes.permute(0, 3, 1, 2)
                aux = {}
            else:
                codes, indices, aux = tok.quantize(latents, return_aux=True)
                bounded = None
            recon = tok.decode_codes(codes)
        recon32 = recon.to(torch.float32)
        diff = recon32 - x
        l1, l2 = diff.abs().mean(), diff.pow(2).mean()
        loss = cfg.l1_weight * l1 + cfg.l2_weight * l2
        parts = {"l1": l1.item(), "l2": l2.item()}
        if cfg.block_mean_weight > 0 or cfg.block_chroma_weight > 0:
            bm, bc = block_losses(recon32, x, tok.factor)
            if cfg.block_mean_weight > 0:
                loss = loss + cfg.block_mean_weight * bm
                parts["block_mean"] = bm.item()
            if cfg.block_chroma_weight > 0:
                loss = loss + cfg.block_chroma_weight * bc
                parts["block_chroma"] = bc.item()
        for k, v in (aux or {}).items():
            if torch.is_tensor(v) and v.numel() == 1:
                loss = loss + cfg.aux_weight * v.to(torch.float32)
                parts[k] = v.item()
        if bounded is not None and cfg.margin > 0:
            m = margin_loss(bounded, cfg.margin)
            weight = margin_weight_at(cfg, step)
            if weight > 0:
                loss = loss + weight * m
            parts["margin"] = m.item()
            parts["margin_weight"] = weight
        if bounded is not None and cfg.latent_tv_weight > 0:
            tv = latent_tv(bounded)
            loss = loss + cfg.latent_tv_weight * tv
            parts["latent_tv"] = tv.item()
        return loss, parts, recon32.detach(), indices

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        self.tokenizer.train()
        lr = lr_at(cfg, step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        x = self._batch(step)
        loss, parts, recon, indices = self._forward_losses(x, step)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.tokenizer.parameters(), cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return {"loss": loss.item(), **parts, "lr": lr, "psnr": psnr(recon.cpu(), x.cpu()),
                "indices": indices.detach().cpu()}

    # -- validation ------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict:
        if self.val_tiles is None:
            return {}
        tok = self.tokenizer.eval()
        counts = torch.zeros(tok.codebook_size, dtype=torch.int64)
        sq, n = 0.0, 0
        for i in range(0, len(self.val_tiles), 8):
            u8 = self.val_tiles[i : i + 8]
            x = u8.permute(0, 3, 1, 2).to(torch.float32).div(127.5).sub(1.0).to(self.device)
            if self.cfg.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            codes, idx = tok.quantize(tok.encode_latents(x))
            recon = tok.decode_codes(codes)
            pix = ((recon.float() + 1) * 127.5).clamp(0, 255).round().cpu()
            sq += float(((pix.permute(0, 2, 3, 1) - u8.to(torch.float32)) ** 2).sum())
            n += u8.numel()
            counts += code_counts(idx, tok.codebook_size)
        stats = codebook_stats(counts)
        return {"val_psnr": 10 * math.log10(255.0**2 / (sq / n)), "val_utilization": stats["utilization"],
                "val_perplexity": stats["perplexity"], "val_entropy_bits": stats["entropy_bits"],
                "val_used_codes": stats["used_codes"], "val_positions": stats["positions"]}

    # -- checkpoints -----------------------------------------------------------------------
    def _optimizer_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        sd = self.optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict = {}
        for pid, st in sd["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"state.{pid}.{k}"] = v.detach().to("cpu").contiguous()
                else:
                    scalars[f"state.{pid}.{k}"] = v
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
        scaler = {k: (float(v) if torch.is_tensor(v) else v) for k, v in self.scaler.state_dict().items()}
        return tensors, {"param_groups": groups, "state_scalars": scalars, "scaler": scaler}

    def save_checkpoint(self) -> Path:
        """Write ``out/last`` atomically: a temp directory renamed over the old one."""
        self.out.mkdir(parents=True, exist_ok=True)
        final = self.out / "last"
        with atomic_directory(final) as staged:
            save_tokenizer(self.tokenizer, staged / "tokenizer", extra=self.meta())
            tensors, opt_json = self._optimizer_tensors()
            save_file(tensors, str(staged / "optimizer.safetensors"), metadata={"format": "pt"})
            state = {"step": self.step, "elapsed_seconds": self.elapsed, "optimizer": opt_json,
                     "config": self.cfg.to_dict(), "torch_rng": torch.get_rng_state().tolist()}
            (staged / "state.json").write_text(json.dumps(state) + "\n")
        return final

    def meta(self) -> dict:
        """What the saved tokenizer's config.json records of this run (``meta``)."""
        last_val = next((h for h in reversed(self.history) if "val_psnr" in h), {})
        return {"step": self.step, "precision": self.cfg.precision, "seed": self.cfg.seed,
                "data": self.cfg.data, "crop_size": self.cfg.crop_size,
                "train_seconds": round(self.elapsed, 1),
                **{k: v for k, v in last_val.items() if k.startswith("val_")}}

    def init_weights(self, source: str) -> None:
        """Fine-tune: start the network from a trained tokenizer of the same architecture
        (the optimizer, schedule and step count start fresh). Checked before any step, so a
        mismatch costs nothing; a resumed run ignores it, since its own weights are newer."""
        path = resolve_model_path(source)
        loaded = load_tokenizer(path, device=self.device)
        theirs = getattr(loaded, "config", None)
        ours = self.cfg.tokenizer_config()
        # the dither changes no weight: the same network may be fine-tuned across it (v4 -> v5)
        if not isinstance(loaded, Tokenizer) or dataclasses.replace(theirs, dither=ours.dither) != ours:
            raise ValueError(f"init_from={source!r}: that tokenizer is {theirs or type(loaded).__name__}, "
                             f"but this run trains {ours}; give the same model "
                             "settings (or its own config file)")
        if theirs.dither != ours.dither:
            # ... but its codes then mean something else: a prior trained on the old tokens, or
            # tokens already stored, would not fit the new model. Only on purpose.
            if self.cfg.freeze_encoder:
                raise ValueError(f"init_from={source!r} rounds with dither {theirs.dither!r}, this run with "
                                 f"{ours.dither!r}: freeze_encoder cannot keep its tokens across that")
            if not self.cfg.change_dither:
                raise ValueError(f"init_from={source!r} rounds with dither {theirs.dither!r}, this run with "
                                 f"{ours.dither!r}: the tokens would mean something else than its tokens; "
                                 "set change_dither: true (--change-dither) if that is the point, or "
                                 f"model.dither: {theirs.dither} (--dither {theirs.dither}) to keep them")
        self.tokenizer.load_state_dict(loaded.state_dict())
        print(f"[train] starting from the weights of {path}", file=sys.stderr)

    def resume(self) -> bool:
        """Load ``out/last`` if present. Returns whether a checkpoint was found."""
        ckpt = self.out / "last"
        if not (ckpt / "state.json").is_file():
            print(f"[train] no checkpoint in {ckpt}; starting from step 0", file=sys.stderr)
            return False
        state = json.loads((ckpt / "state.json").read_text())
        saved_model = state["config"]["model"]
        if TokenizerConfig(**saved_model) != self.cfg.tokenizer_config():
            raise ValueError(f"--resume: the checkpoint in {ckpt} has model {saved_model}, "
                             f"but this run asks for {self.cfg.model}")
        loaded = load_tokenizer(ckpt / "tokenizer", device=self.device)
        self.tokenizer.load_state_dict(loaded.state_dict())
        tensors = load_file(str(ckpt / "optimizer.safetensors"), device=str(self.device))
        opt = state["optimizer"]
        sd_state: dict = {}
        for key, v in tensors.items():
            _, pid, name = key.split(".", 2)
            sd_state.setdefault(int(pid), {})[name] = v.cpu() if name == "step" else v
        for key, v in opt["state_scalars"].items():
            _, pid, name = key.split(".", 2)
            sd_state.setdefault(int(pid), {})[name] = v
        self.optimizer.load_state_dict({"state": sd_state, "param_groups": opt["param_groups"]})
        if opt.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(opt["scaler"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self.step = int(state["step"])
        self.elapsed = float(state.get("elapsed_seconds", 0.0))
        self.history = read_metrics(self.out / "metrics.jsonl", up_to_step=self.step)
        # rewrite the log so lines after the checkpoint (lost work) are not duplicated
        write_metrics(self.out / "metrics.jsonl", self.history)
        print(f"[train] resumed from {ckpt} at step {self.step}", file=sys.stderr)
        return True

    # -- the loop --------------------------------------------------------------------------
    def _log(self, row: dict) -> None:
        self.history.append(row)
        with open(self.out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def run(self, stop_at: int | None = None) -> dict:
        """Train to ``cfg.steps``. ``stop_at`` ends this session early at that step, without
        a final checkpoint: exactly what a killed run leaves behind (used by the tests)."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.progress, dynamic_ncols=True,
                   desc=f"train {cfg.precision}", file=sys.stderr)
        window: list[dict] = []
        counts = torch.zeros(self.tokenizer.codebook_size, dtype=torch.int64)
        last_ckpt = time.monotonic()
        t_session = time.monotonic()
        elapsed0 = self.elapsed
        if self.step == 0 and cfg.val_every:
            self._log({"step": 0, "elapsed": 0.0, **self.validate()})
        while self.step < cfg.steps:
            if stop_at is not None and self.step >= stop_at:
                bar.close()
                return {"step": self.step, "interrupted": True}
            r = self.train_step(self.step)
            self.step += 1
            self.elapsed = elapsed0 + time.monotonic() - t_session
            counts += code_counts(r.pop("indices"), self.tokenizer.codebook_size)
            window.append(r)
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                util = codebook_stats(counts)["utilization"]
                row = {"step": self.step, "elapsed": round(self.elapsed, 2),
                       **{k: float(np.mean([w[k] for w in window])) for k in window[0]},
                       "utilization": util, "loss_scale": float(self.scaler.get_scale())
                       if self.scaler.is_enabled() else 1.0}
                row["lr"] = r["lr"]
                bar.set_postfix(loss=f"{row['loss']:.4f}", psnr=f"{row['psnr']:.2f}",
                                util=f"{util:.1%}")
                window, counts = [], torch.zeros_like(counts)
                if cfg.val_every and (self.step % cfg.val_every == 0 or self.step == cfg.steps):
                    row.update(self.validate())
                    bar.write(f"step {self.step}: val PSNR {row.get('val_psnr', float('nan')):.2f} dB, "
                              f"utilization {row.get('val_utilization', 0):.1%}, "
                              f"perplexity {row.get('val_perplexity', 0):.0f}")
                self._log(row)
            bar.update(1)
            due = (cfg.ckpt_every and self.step % cfg.ckpt_every == 0) or (
                cfg.ckpt_minutes and time.monotonic() - last_ckpt > cfg.ckpt_minutes * 60)
            if due or self.step == cfg.steps:
                self.save_checkpoint()
                last_ckpt = time.monotonic()
        bar.close()
        final = save_tokenizer(self.tokenizer, self.out / "final", extra=self.meta())
        summary = {"step": self.step, "train_seconds": round(self.elapsed, 1), "final": str(final),
                   **{k: v for k, v in self.meta().items() if k.startswith("val_")}}
        if cfg.plots:
            try:
                plot_curves(self.history, self.out / "curves.png")
                if self.val_tiles is not None:
                    reconstruction_grid(self.tokenizer, self.val_tiles[:8], self.out / "reconstructions.png")
            except ImportError as exc:  # matplotlib is a training extra
                print(f"[train] plots skipped: {exc}", file=sys.stderr)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def train(cfg: TrainConfig, resume: bool = False) -> dict:
    return Trainer(cfg, resume=resume).run()
