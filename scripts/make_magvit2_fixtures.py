"""Generate the Open-MAGVIT2 reference fixtures once, by running Open-MAGVIT2's own code.

vqserve does not ship Open-MAGVIT2's code (it is not on PyPI). This script imports it from a
scratch copy of TencentARC/SEED-Voken (commit in tests/fixtures/magvit2/README.md), outside
this repository, with Lightning beside it (its ``VQModel`` is a LightningModule)::

    git clone https://github.com/TencentARC/SEED-Voken /tmp/seed-voken
    pip install --target /tmp/seed-voken-deps --no-deps lightning==2.2.0 lightning-utilities \
        torchmetrics 'setuptools<70'       # einops comes with vqserve's test extras
    PYTHONPATH=/tmp/seed-voken-deps python scripts/make_magvit2_fixtures.py --reference /tmp/seed-voken

``fixtures`` (the default) writes into tests/fixtures/magvit2/:

* ``weights.safetensors``: a small random-initialised ``VQModel`` (the original class, with a
  stand-in for its training loss, whose LPIPS needs downloaded VGG weights), its encoder and
  decoder weights as int8 with a power-of-two scale per tensor (``NAME#exp``): the
  weights were rounded to those values *before* the reference ran, so the file holds the
  exact fp32 values it used in 1 byte each. ``ema:NAME`` tensors are the EMA weights that
  differ from the trained ones (the model is built with ``use_ema=True``, as every published
  config is, and the reference ran inside ``ema_scope()``, as Open-MAGVIT2's evaluation and
  reconstruction scripts do);
* ``cases.safetensors``: inputs and the reference's outputs;
* ``layout.json``: what a genuine Lightning checkpoint of that model holds (saved with
  ``Trainer.save_checkpoint`` and re-read with ``torch.load(weights_only=True)``);
* ``published_keys.json``: the encoder/decoder tensor names and shapes of the published
  configurations, from the original ``VQModel`` built at full size.

``full-size`` runs a published architecture (random-initialised by the original code, seed
0) next to vqserve on photographs and prints how many indices and decoded pixels agree.

``ibq-fixtures`` and ``ibq-full-size`` do the same for IBQ (same repository; its module also
imports ``pytorch_lightning``: add ``pytorch-lightning==2.2.0`` to the pip line), writing
tests/fixtures/ibq/ (README.md there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from fixture_kit import photo_inputs, to_int8_grid, to_uint8
from PIL import Image
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "magvit2"
SEED = 0
# The small configuration: ch 32, ch_mult [2, 1, 1] (factor 4; widths 64, 32, 32, so both
# width changes and their 1x1 skips occur), one block per level, 10 bits (1,024 codes).
SMALL = dict(ch=32, ch_mult=[2, 1, 1], num_res_blocks=1, z_channels=10)
# configs/Open-MAGVIT2/gpu/*.yaml: the published tokenizers' ddconfig
PUBLISHED = {
    "imagenet-256": dict(ch=128, ch_mult=[1, 1, 2, 2, 4], num_res_blocks=4, z_channels=18),
    "imagenet-128": dict(ch=128, ch_mult=[1, 2, 2, 4], num_res_blocks=4, z_channels=18),
    "pretrain-16384": dict(ch=128, ch_mult=[1, 1, 2, 2, 4], num_res_blocks=4, z_channels=14),
}
EMA_DIFFERS = ("encoder.conv_out.weight", "encoder.conv_out.bias", "decoder.conv_out.weight")


class StandInLoss(nn.Module):
    """Takes the place of ``VQLPIPSWithDiscriminator`` (whose LPIPS downloads VGG weights):
    a discriminator, so the checkpoint carries ``loss.*`` tensors as real ones do."""

    def __init__(self):
        super().__init__()
        from src.Open_MAGVIT2.modules.discriminator.model import NLayerDiscriminator

        self.discriminator = NLayerDiscriminator(input_nc=3, ndf=8, n_layers=1)


def build_reference(cfg: dict, use_ema: bool):
    from src.Open_MAGVIT2.models.lfqgan import VQModel

    sys.modules["__main__"].StandInLoss = StandInLoss  # instantiate_from_config imports by name
    ddconfig = dict(double_z=False, resolution=256, in_channels=3, out_ch=3, **cfg)
    return VQModel(ddconfig=ddconfig, lossconfig={"target": "__main__.StandInLoss"},
                   n_embed=2 ** cfg["z_channels"], embed_dim=cfg["z_channels"],
                   sample_minimization_weight=1.0, batch_maximization_weight=1.0, use_ema=use_ema)






MAGVIT2_OWN = ("encoder.", "decoder.")
IBQ_OWN = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.", "quantize.")


def randomise(model, own: tuple[str, ...] = MAGVIT2_OWN, ema_differs: tuple[str, ...] = EMA_DIFFERS) -> None:
    """Random weights that matter: GroupNorm affine parameters perturbed, every tokenizer
    float (names under ``own``) rounded to an int8 grid (a power-of-two scale per tensor);
    EMA buffers set to those values, except ``ema_differs``, which get other random values."""
    torch.manual_seed(SEED)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.GroupNorm) and m.affine:
                m.weight.add_(0.1 * torch.randn_like(m.weight))
                m.bias.add_(0.1 * torch.randn_like(m.bias))
        for name, p in model.named_parameters():
            if name.startswith(own):
                q, e = to_int8_grid(p)
                p.copy_(q.float() * 2.0 ** -e)
        ema = dict(model.model_ema.named_buffers())
        for name, p in model.named_parameters():
            s_name = name.replace(".", "")
            if s_name not in ema:
                continue
            value = p.detach().clone()
            if name in ema_differs:
                q, e = to_int8_grid(p + 0.5 * p.abs().mean() * torch.randn_like(p))
                value = q.float() * 2.0 ** -e
            ema[s_name].copy_(value)


def weights_file(model, own: tuple[str, ...] = MAGVIT2_OWN) -> dict[str, torch.Tensor]:
    """``NAME`` (int8) and ``NAME#exp`` (its power-of-two exponent, int8 [1]) per encoder /
    decoder parameter: the value is ``NAME * 2^-exp``; ``ema:NAME`` for EMA weights that
    differ from the trained ones."""
    tensors: dict[str, torch.Tensor] = {}
    ema = dict(model.model_ema.named_buffers())

    def put(key: str, value: torch.Tensor) -> None:
        q, e = to_int8_grid(value)
        assert torch.equal(q.float() * 2.0 ** -e, value), key
        tensors[key], tensors[f"{key}#exp"] = q, torch.tensor([e], dtype=torch.int8)

    for name, p in model.named_parameters():
        if name.startswith(own):
            put(name, p.detach())
            shadow = ema[name.replace(".", "")]
            if not torch.equal(shadow, p.detach()):
                put(f"ema:{name}", shadow)
    return tensors


def dataset_pixels(images: np.ndarray) -> torch.Tensor:
    """Open-MAGVIT2's data pipeline (data/imagenet.py): ``(image / 127.5 - 1.0).astype(float32)``,
    NHWC numpy, float64 arithmetic."""
    return torch.from_numpy((images / 127.5 - 1.0).astype(np.float32))






def codes_of(model, indices: torch.Tensor, b: int, h: int, w: int) -> torch.Tensor:
    """The original's indices -> codes: ``LFQ.get_codebook_entry`` (channels-last NCHW view)."""
    return model.quantize.get_codebook_entry(indices.view(b, h * w), (b, h, w, model.quantize.codebook_dim), None)


@torch.no_grad()
def run_case(model, images: np.ndarray, prefix: str) -> dict[str, torch.Tensor]:
    pixels = dataset_pixels(images)
    out = {f"{prefix}_images": torch.from_numpy(images)}
    with model.ema_scope():
        # the autoregressive stage's input (cond_transformer.get_input): contiguous NCHW
        x = pixels.permute(0, 3, 1, 2).to(memory_format=torch.contiguous_format)
        latents = model.encoder(x)
        quant, _, indices, _ = model.encode(x)
        b, _, h, w = quant.shape
        decoded = model.decode(codes_of(model, indices, b, h, w))
        # one image at a time (a server's micro-batch of 1): CPU convolutions may round a
        # batch of 2 differently, so the original's pixels depend on the batch by a level
        per_image = [model.decode(codes_of(model, indices.view(b, h * w)[i:i + 1], 1, h, w)) for i in range(b)]
        # reconstruct_image.py / evaluation_image.py: batch["image"].permute(0, 3, 1, 2), channels-last
        x_cl = pixels.permute(0, 3, 1, 2)
        quant_cl, _, indices_cl, _ = model.encode(x_cl)
        recon = model.decode(quant_cl)
    out.update({f"{prefix}_latents": latents.contiguous(), f"{prefix}_indices": indices.view(b, h, w).clone(),
                f"{prefix}_indices_cl": indices_cl.view(b, h, w).clone(),
                f"{prefix}_decoded_uint8": torch.from_numpy(to_uint8(decoded)),
                f"{prefix}_decoded1_uint8": torch.from_numpy(np.concatenate([to_uint8(d) for d in per_image]))})
    out.update(recon_case(prefix, to_uint8(recon), out[f"{prefix}_decoded_uint8"]))
    return out


def recon_case(prefix: str, recon: np.ndarray, decoded: torch.Tensor) -> dict[str, torch.Tensor]:
    """``reconstruct_image.py``'s pixels (encode -> decode of its quant): stored only where they
    differ from the decode of the indices (``{prefix}_recon_same`` says which), to keep the file small."""
    same = bool(np.array_equal(recon, decoded.numpy()))
    return {f"{prefix}_recon_same": torch.tensor(same)} | ({} if same else {f"{prefix}_recon_uint8": torch.from_numpy(recon)})


@torch.no_grad()
def extra_cases(model) -> dict[str, torch.Tensor]:
    """Indices the reference decodes (random, and a 1 x 2 grid), and LFQ edge values."""
    g = torch.Generator().manual_seed(SEED + 1)
    bits = model.quantize.codebook_dim
    out: dict[str, torch.Tensor] = {}
    with model.ema_scope():
        given = torch.randint(0, 2 ** bits, (1, 6, 6), generator=g)
        out["given_indices"] = given
        out["given_decoded_uint8"] = torch.from_numpy(to_uint8(model.decode(codes_of(model, given, 1, 6, 6))))
        row = torch.tensor([[[5, 1000]]])  # the smallest grid the small model decodes (1 x 2)
        out["row_indices"] = row
        out["row_decoded_uint8"] = torch.from_numpy(to_uint8(model.decode(codes_of(model, row, 1, 1, 2))))
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45, float("inf"), float("-inf"),
                            float("nan"), 3.0])
    z = torch.randn(1, bits, 4, 4, generator=g)
    for c in range(bits):  # 10 positions of edge values, in a different order per channel
        z[0, c].view(-1)[:10] = special.roll(c)
    z[0, :, 3, 3] = torch.tensor([float(i % 2) - 0.5 for i in range(bits)])  # alternating bits
    model.quantize.eval()
    quant, _, indices = model.quantize(z, return_loss_breakdown=False)
    out["lfq_z"] = z
    out["lfq_indices"] = indices.view(1, 4, 4).clone()
    out["lfq_codes"] = codes_of(model, indices, 1, 4, 4).contiguous()
    # the original's LFQ on bf16 latents (what a model cast to bf16 runs): indices from the signs
    _, _, indices_bf16 = model.quantize(z.to(torch.bfloat16), return_loss_breakdown=False)
    out["lfq_indices_bf16"] = indices_bf16.view(1, 4, 4).clone()
    # the autoregressive stage's token factorization: the same bits as two sub-tokens
    from src.Open_MAGVIT2.modules.vqvae.lookup_free_quantize import LFQ

    split = [bits // 2, bits - bits // 2]
    factorized = LFQ(dim=bits, codebook_size=2 ** bits, token_factorization=True, factorized_bits=split).eval()
    _, _, (pre, post) = factorized(z, return_loss_breakdown=False)
    out["lfq_factorized_pre"], out["lfq_factorized_post"] = pre.view(1, 4, 4).clone(), post.view(1, 4, 4).clone()
    return out


def lightning_layout(model) -> dict:
    """What ``Trainer.save_checkpoint`` writes for this LightningModule, and whether
    ``torch.load(weights_only=True)`` reads it back."""
    import tempfile

    import lightning as L

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, max_epochs=1,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(model)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "small.ckpt"
        trainer.save_checkpoint(path)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    groups: dict[str, int] = {}
    for key in ckpt["state_dict"]:
        head = key.split(".")[0]
        groups[head] = groups.get(head, 0) + 1
    return {"lightning_version": L.__version__, "top_level_keys": sorted(ckpt),
            "state_dict_groups": groups, "weights_only_loads": True,
            "ema_keys_sample": sorted(k for k in ckpt["state_dict"] if k.startswith("model_ema."))[:4]}


def published_keys() -> dict[str, dict[str, list[int]]]:
    out = {}
    for name, cfg in PUBLISHED.items():
        model = build_reference(cfg, use_ema=False)
        out[name] = {k: list(v.shape) for k, v in model.state_dict().items()
                     if k.startswith(("encoder.", "decoder.", "quantize."))}
        del model
    return out


def make_fixtures(out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)  # the default initialisation draws from the global generator
    model = build_reference(SMALL, use_ema=True).eval()
    randomise(model)
    tensors = weights_file(model)
    cases: dict[str, torch.Tensor] = {}
    for prefix, images in photo_inputs().items():
        cases.update(run_case(model, images, prefix))
    cases.update(extra_cases(model))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "weights.safetensors"))
    save_file({k: v.contiguous() for k, v in cases.items()}, str(out / "cases.safetensors"))
    layout = {"reference": "TencentARC/SEED-Voken", "config": SMALL, "torch": torch.__version__,
              "checkpoint": lightning_layout(model)}
    for prefix in ("square", "rect"):
        same = torch.equal(cases[f"{prefix}_indices"], cases[f"{prefix}_indices_cl"])
        layout[f"{prefix}_indices_same_for_channels_last_input"] = same
    (out / "layout.json").write_text(json.dumps(layout, indent=1) + "\n")
    published = published_keys()
    (out / "published_keys.json").write_text(
        "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                           for k, v in published.items()) + "\n}\n")
    print(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(out.iterdir())))


def full_size(name: str, photos: list[str], size: int) -> None:
    """A published architecture, random-initialised by the original code (seed 0), next to
    vqserve's rebuild on the same weights: indices and decoded pixels compared."""
    from vqserve.model.families.magvit2.family import Magvit2Config, Magvit2Tokenizer

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    cfg = PUBLISHED[name]
    model = build_reference(cfg, use_ema=False).eval()
    arch = Magvit2Config(base_channels=cfg["ch"], ch_mult=cfg["ch_mult"], num_res_blocks=cfg["num_res_blocks"],
                         z_channels=cfg["z_channels"])
    ours = Magvit2Tokenizer(arch).eval()
    ours.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith(("encoder.", "decoder."))})
    from vqserve.model.families.llamagen.precision import load_photo

    same = total = px_same = px_total = cl_same = 0
    for path in photos:
        image = load_photo(path, size)[None]
        with torch.no_grad():
            x = dataset_pixels(image).permute(0, 3, 1, 2)
            quant, _, indices, _ = model.encode(x.contiguous())
            b, _, h, w = quant.shape
            indices = indices.view(b, h, w)
            ref_px = to_uint8(model.decode(codes_of(model, indices, b, h, w)))
            indices_cl = model.encode(x)[2].view(b, h, w)  # reconstruct_image.py's channels-last input
            got = ours.encode(torch.from_numpy(image))
            got_px = ours.decode(indices).numpy()
        n = int((got == indices).sum())
        same, total, cl_same = same + n, total + indices.numel(), cl_same + int((indices_cl == indices).sum())
        px_same += int((got_px == ref_px).sum())
        px_total += ref_px.size
        print(f"{Path(path).name}: {n}/{indices.numel()} indices, {int((got_px == ref_px).sum())}/{ref_px.size} "
              f"pixels", flush=True)
    print(f"{name}: indices {same}/{total} equal; decoded uint8 {px_same}/{px_total} equal; the original "
          f"fed channels-last pixels (its reconstruction scripts) agrees with itself on {cl_same}/{total} indices")


# ---- IBQ ------------------------------------------------------------------------------------
IBQ_OUT = ROOT / "tests" / "fixtures" / "ibq"
# ch 32, ch_mult [1, 1] (factor 2), one block per level, attention at the lowest resolution
# (attn_resolutions = [resolution / 2]), z 16 -> quant_conv -> 8, 512 codes.
IBQ_SMALL = dict(ch=32, ch_mult=[1, 1], num_res_blocks=1, z_channels=16, n_embed=512, embed_dim=8)
IBQ_PUBLISHED = {"imagenet-262144": dict(ch=128, ch_mult=[1, 1, 2, 2, 4], num_res_blocks=4, z_channels=256,
                                         n_embed=262144, embed_dim=256)}
IBQ_EMA_DIFFERS = ("quant_conv.weight", "decoder.conv_out.weight")


def build_ibq_reference(cfg: dict, use_ema: bool, resolution: int = 256):
    """The original ``IBQ`` LightningModule; ``attn_resolutions`` is the lowest resolution
    (16 at 256 px, as every published config has it)."""
    from src.IBQ.models.ibqgan import IBQ

    sys.modules["__main__"].StandInLoss = StandInLoss
    cfg = dict(cfg)
    n_embed, embed_dim = cfg.pop("n_embed"), cfg.pop("embed_dim")
    lowest = resolution // 2 ** (len(cfg["ch_mult"]) - 1)
    ddconfig = dict(double_z=False, resolution=resolution, in_channels=3, out_ch=3, attn_resolutions=[lowest],
                    dropout=0.0, **cfg)
    return IBQ(ddconfig=ddconfig, lossconfig={"target": "__main__.StandInLoss"}, n_embed=n_embed,
               embed_dim=embed_dim, use_ema=use_ema)


@torch.no_grad()
def run_ibq_case(model, images: np.ndarray, prefix: str) -> dict[str, torch.Tensor]:
    pixels = dataset_pixels(images)
    d = model.quantize.e_dim
    out = {f"{prefix}_images": torch.from_numpy(images)}
    with model.ema_scope():
        x = pixels.permute(0, 3, 1, 2).to(memory_format=torch.contiguous_format)
        latents = model.quant_conv(model.encoder(x))
        quant, _, (_, _, indices) = model.encode(x)
        b, _, h, w = quant.shape
        indices = indices.view(b, h, w)
        decoded = model.decode(model.quantize.get_codebook_entry(indices.reshape(-1), (b, h, w, d)))
        per_image = [model.decode(model.quantize.get_codebook_entry(indices[i].reshape(-1), (1, h, w, d)))
                     for i in range(b)]
        quant_cl, _, (_, _, indices_cl) = model.encode(pixels.permute(0, 3, 1, 2))
        recon = model.decode(quant_cl)
    out.update({f"{prefix}_latents": latents.contiguous(), f"{prefix}_indices": indices.clone(),
                f"{prefix}_indices_cl": indices_cl.view(b, h, w).clone(),
                f"{prefix}_decoded_uint8": torch.from_numpy(to_uint8(decoded)),
                f"{prefix}_decoded1_uint8": torch.from_numpy(np.concatenate([to_uint8(p) for p in per_image]))})
    out.update(recon_case(prefix, to_uint8(recon), out[f"{prefix}_decoded_uint8"]))
    return out


@torch.no_grad()
def ibq_extra_cases(model) -> dict[str, torch.Tensor]:
    """Decoded given indices, and the quantizer's rule on a codebook built for ties: duplicated
    codes (equal logits) and a code whose logit is larger by a hair, which softmax rounds to the
    same probability (the original then keeps the lower index, unlike argmax of the logits)."""
    from src.IBQ.modules.vqvae.quantize import IndexPropagationQuantize

    g = torch.Generator().manual_seed(SEED + 1)
    d = model.quantize.e_dim
    out: dict[str, torch.Tensor] = {}
    with model.ema_scope():
        given = torch.randint(0, model.quantize.n_e, (1, 6, 6), generator=g)
        out["given_indices"] = given
        out["given_decoded_uint8"] = torch.from_numpy(to_uint8(model.decode(
            model.quantize.get_codebook_entry(given.reshape(-1), (1, 6, 6, d)))))
    q = IndexPropagationQuantize(64, 8).eval()
    codebook = torch.randn(64, 8, generator=g) * 0.1
    codebook[10] = codebook[3]                       # an exact duplicate: equal logits
    codebook[7] = codebook[7] / codebook[7].norm()   # the longest code, so it wins where z points at it
    z = torch.randn(1, 8, 2, 4, generator=g) * 0.1
    z[0, :, 0, 0] = codebook[3] * 40.0               # position 0: code 3 (and its duplicate 10) win
    z[0, :, 0, 1] = codebook[7] * 0.1                # position 1: code 7 (logit 0.1) ...
    z[0, :, 0, 2] = 0.0                              # position 2: every logit 0, every code equal
    for k in range(1, 64):                           # ... and code 41, whose logit is one ulp larger:
        codebook[41] = codebook[7] * (1 + k * 2.0 ** -24)  # softmax rounds both to one probability
        logits = torch.einsum("b d h w, n d -> b n h w", z, codebook)
        if logits[0, 41, 0, 1] > logits[0, 7, 0, 1]:
            break
    probs = torch.softmax(logits, dim=1)
    assert logits[0, :, 0, 1].argmax() == 41 and probs[0, 41, 0, 1] == probs[0, 7, 0, 1]
    with torch.no_grad():
        q.embedding.weight.copy_(codebook)
    _, _, (_, _, ind) = q(z)
    out.update({"tie_codebook": codebook, "tie_z": z, "tie_indices": ind.view(1, 2, 4).clone(),
                "tie_logit_argmax": logits.argmax(dim=1).clone()})
    return out


def make_ibq_fixtures(out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = build_ibq_reference(IBQ_SMALL, use_ema=True, resolution=32).eval()
    randomise(model, own=IBQ_OWN, ema_differs=IBQ_EMA_DIFFERS)
    tensors = weights_file(model, own=IBQ_OWN)
    from skimage import data as skdata

    rng = np.random.default_rng(SEED)
    astronaut = np.asarray(Image.fromarray(skdata.astronaut()).resize((32, 32), Image.BICUBIC))
    noise = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    coffee = np.asarray(Image.fromarray(skdata.coffee()).resize((40, 27), Image.BICUBIC))[:24]
    cases: dict[str, torch.Tensor] = {}
    cases.update(run_ibq_case(model, np.stack([astronaut, noise]), "square"))
    cases.update(run_ibq_case(model, coffee[None].copy(), "rect"))
    cases.update(ibq_extra_cases(model))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "weights.safetensors"))
    save_file({k: v.contiguous() for k, v in cases.items()}, str(out / "cases.safetensors"))
    layout = {"reference": "TencentARC/SEED-Voken", "config": IBQ_SMALL, "torch": torch.__version__,
              "checkpoint": lightning_layout(model)}
    for prefix in ("square", "rect"):
        layout[f"{prefix}_indices_same_for_channels_last_input"] = torch.equal(
            cases[f"{prefix}_indices"], cases[f"{prefix}_indices_cl"])
    (out / "layout.json").write_text(json.dumps(layout, indent=1) + "\n")
    published = {}
    for name, cfg in IBQ_PUBLISHED.items():
        ref = build_ibq_reference(cfg, use_ema=False)
        published[name] = {k: list(v.shape) for k, v in ref.state_dict().items()
                           if k.startswith(IBQ_OWN)}
        del ref
    (out / "published_keys.json").write_text(
        "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                           for k, v in published.items()) + "\n}\n")
    print(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(out.iterdir())))


def ibq_full_size(photos: list[str], size: int, codebook_size: int) -> None:
    """IBQ's published architecture, random-initialised by the original code (seed 0; its
    codebook drawn N(0, 1) as nn.Embedding does), next to vqserve's rebuild."""
    from vqserve.model.families.ibq.family import IbqConfig, IbqTokenizer
    from vqserve.model.families.ibq.importer import to_vqserve_name
    from vqserve.model.families.llamagen.precision import load_photo

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    cfg = {**IBQ_PUBLISHED["imagenet-262144"], "n_embed": codebook_size}
    model = build_ibq_reference(cfg, use_ema=False).eval()
    arch = IbqConfig(codebook_size=codebook_size)
    ours = IbqTokenizer(arch).eval()
    ours.load_state_dict({to_vqserve_name(k, 5): v for k, v in model.state_dict().items() if k.startswith(IBQ_OWN)})
    same = total = px_same = px_total = 0
    for path in photos:
        image = load_photo(path, size)[None]
        with torch.no_grad():
            x = dataset_pixels(image).permute(0, 3, 1, 2).contiguous()
            quant, _, (_, _, indices) = model.encode(x)
            b, d, h, w = quant.shape
            indices = indices.view(b, h, w)
            ref_px = to_uint8(model.decode(model.quantize.get_codebook_entry(indices.reshape(-1), (b, h, w, d))))
            got = ours.encode(torch.from_numpy(image))
            got_px = ours.decode(indices).numpy()
        n = int((got == indices).sum())
        same, total = same + n, total + indices.numel()
        px_same, px_total = px_same + int((got_px == ref_px).sum()), px_total + ref_px.size
        print(f"{Path(path).name}: {n}/{indices.numel()} indices, {int((got_px == ref_px).sum())}/{ref_px.size} "
              f"pixels, {len(torch.unique(indices))} distinct codes", flush=True)
    print(f"ibq {codebook_size}: indices {same}/{total} equal; decoded uint8 {px_same}/{px_total} equal")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="fixtures",
                    choices=["fixtures", "full-size", "ibq-fixtures", "ibq-full-size"])
    ap.add_argument("--reference", required=True, help="a checkout of TencentARC/SEED-Voken (holds src/, main.py)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--model", default="imagenet-256", choices=sorted(PUBLISHED), help="full-size: which architecture")
    ap.add_argument("--photos", nargs="*", default=[], help="full-size: image files")
    ap.add_argument("--size", type=int, default=256, help="full-size: square crop side")
    ap.add_argument("--codebook-size", type=int, default=262144, help="ibq-full-size: codes")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.reference).resolve()))
    if args.mode == "fixtures":
        make_fixtures(Path(args.out))
    elif args.mode == "ibq-fixtures":
        make_ibq_fixtures(IBQ_OUT if args.out == str(OUT) else Path(args.out))
    elif args.mode == "ibq-full-size":
        ibq_full_size(args.photos, args.size, args.codebook_size)
    else:
        full_size(args.model, args.photos, args.size)


if __name__ == "__main__":
    main()
