"""TiTok's ViT encoder and decoder (bytedance/1d-tokenizer ``modeling/modules/blocks.py``), rebuilt op for op.

TiTok (``modeling/titok.py``: ``TiTok``) tokenizes a 256x256 image into a 1-D sequence of
``num_latent_tokens`` codes: a ViT reads the image's 16x16 patches *and* ``L`` learned latent
tokens, and only the latent tokens' outputs are quantized. Both transformers are
``ResidualAttentionBlock`` stacks (``nn.MultiheadAttention`` on sequence-first input, pre-norm,
a GELU MLP of 4x the width); this module keeps those very modules and the original's order of
operations, so the fp32 numbers are the original's:

* encoder: ``patch_embed`` (a ``p x p`` stride ``p`` convolution), the class token, positional
  embeddings, then the latent tokens (plus their own positional embedding) appended; ``ln_pre``,
  the blocks, ``ln_post`` on the latent tokens only, then ``conv_out`` (1x1) to ``token_size``.
  **The legacy reshape, kept bug for bug**: the released VQ models (S-128, B-64, L-32:
  ``is_legacy`` true, the default) reshape the ``[B, L, width]`` tokens to ``[B, width, L, 1]``
  *without a permute* before ``conv_out`` (a reinterpretation of memory, not a transpose); the
  weights were trained through that, so it stays. The VQ-8k models (BL-64, BL-128, SL-256:
  ``is_legacy`` false) permute properly;
* decoder: ``decoder_embed`` of the codes, ``grid**2`` mask tokens after a class token, the codes
  appended; ``ln_pre``, the blocks, ``ln_post`` on the grid positions, then ``ffn``. Legacy: a 1x1
  conv, tanh, a 1x1 conv to 1,024 logits per grid position, which TiTok turns into MaskGIT-VQGAN
  codes by ``softmax`` over the logits and ``einsum('nchw,cd->ndhw', ., pixel_quantize)`` and
  decodes with MaskGIT-VQGAN's decoder (vqserve's ``maskgit`` family networks, reused here); not
  legacy: a 1x1 conv to ``p*p*3`` values per position, rearranged to pixels, then a 3x3 conv.

Parameter names are the original's under ``encoder.`` / ``decoder.``, so a released state dict
loads one to one (``latent_tokens`` moves into the encoder, ``pixel_quantize`` and
``pixel_decoder`` into the decoder, ``quantize.embedding.weight`` becomes ``quantizer.embedding``:
``family.to_vqserve_names``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from vqserve.model.families.maskgit.networks import MaskgitDecoder
from vqserve.model.precision import cast_to, module_dtype

PIXEL_CODES = 1024  # the legacy decoder's logits: MaskGIT-VQGAN's codebook size (fixed in the original)


class ResidualAttentionBlock(nn.Module):
    """The original's block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; sequence-first.

    ``branch_layers``: what vqserve's bf16/fp16 policy (``mixed_precision``) runs in low
    precision while the residual stream stays fp32; each branch's input is cast to its dtype
    here (a no-op when the block runs in one dtype, as the original)."""

    branch_layers = ("attn", "mlp")

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(width, width * 4)), ("gelu", nn.GELU()),
                                              ("c_proj", nn.Linear(width * 4, width))]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = cast_to(self.ln_1(x), self.attn.out_proj.weight.dtype)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(cast_to(self.ln_2(x), self.mlp.c_fc.weight.dtype))


def _expand(token: torch.Tensor, batch: int) -> torch.Tensor:
    return token.unsqueeze(0).expand(batch, -1, -1)


class _Transformer(nn.Module):
    """What encoder and decoder share: embeddings, ``ln_pre``, the blocks, ``ln_post``."""

    def __init__(self, width: int, layers: int, heads: int, grid: int, num_latent_tokens: int):
        super().__init__()
        self.width, self.grid, self.num_latent_tokens = width, grid, num_latent_tokens
        # the original draws these from scale * randn; vqserve loads them, zeros are placeholders
        self.class_embedding = nn.Parameter(torch.zeros(1, width))
        self.positional_embedding = nn.Parameter(torch.zeros(grid**2 + 1, width))
        self.latent_token_positional_embedding = nn.Parameter(torch.zeros(num_latent_tokens, width))
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = nn.ModuleList(ResidualAttentionBlock(width, heads) for _ in range(layers))
        self.ln_post = nn.LayerNorm(width)

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_pre(x).permute(1, 0, 2)  # NLD -> LND
        for block in self.transformer:
            x = block(x)
        return x.permute(1, 0, 2)  # LND -> NLD


class TitokEncoder(_Transformer):
    """float pixels NCHW in [0, 255] -> latents ``[B, token_size, 1, L]`` (the original's layout)."""

    residual_block_types = (ResidualAttentionBlock,)  # for vqserve.model.mixed_precision

    def __init__(self, width: int, layers: int, heads: int, image_size: int, patch_size: int,
                 num_latent_tokens: int, token_size: int, is_legacy: bool):
        super().__init__(width, layers, heads, image_size // patch_size, num_latent_tokens)
        self.token_size, self.is_legacy = token_size, is_legacy
        self.patch_embed = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=True)
        self.latent_tokens = nn.Parameter(torch.zeros(num_latent_tokens, width))  # TiTok.latent_tokens
        self.conv_out = nn.Conv2d(width, token_size, kernel_size=1, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # the model's users feed ToTensor pixels (README: ``x / 255.0`` in fp32)
        x = cast_to(pixels.to(torch.float32).contiguous() / 255.0, module_dtype(self.patch_embed))
        batch = x.shape[0]
        x = self.patch_embed(x)
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        x = torch.cat([_expand(self.class_embedding, batch).to(x.dtype), x], dim=1)
        x = x + self.positional_embedding.to(x.dtype)
        latent = _expand(self.latent_tokens, batch).to(x.dtype) + self.latent_token_positional_embedding.to(x.dtype)
        x = self.blocks(torch.cat([x, latent], dim=1))
        latent = self.ln_post(x[:, 1 + self.grid**2:])
        if self.is_legacy:  # a reshape, not a permute (module docstring)
            latent = latent.reshape(batch, self.width, self.num_latent_tokens, 1)
        else:
            latent = latent.reshape(batch, self.num_latent_tokens, self.width, 1).permute(0, 2, 1, 3)
        return self.conv_out(latent).reshape(batch, self.token_size, 1, self.num_latent_tokens)


class TitokPixelDecoder(MaskgitDecoder):
    """MaskGIT-VQGAN's decoder with TiTok's pixel rule: the README's
    ``clamp(y, 0, 1) * 255`` then ``.to(uint8)`` (a truncation), in fp32."""

    @staticmethod
    def to_pixels(y: torch.Tensor) -> torch.Tensor:
        return torch.trunc(torch.clamp(y, 0.0, 1.0) * 255.0)


class TitokDecoder(_Transformer):
    """codes ``[B, token_size, 1, L]`` -> integer-valued float pixels NCHW in [0, 255]."""

    def __init__(self, width: int, layers: int, heads: int, image_size: int, patch_size: int,
                 num_latent_tokens: int, token_size: int, is_legacy: bool, pixel_decoder: dict | None):
        super().__init__(width, layers, heads, image_size // patch_size, num_latent_tokens)
        self.is_legacy = is_legacy
        self.decoder_embed = nn.Linear(token_size, width, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        if is_legacy:
            self.ffn = nn.Sequential(nn.Conv2d(width, 2 * width, 1, padding=0, bias=True), nn.Tanh(),
                                     nn.Conv2d(2 * width, PIXEL_CODES, 1, padding=0, bias=True))
            self.conv_out = nn.Identity()
        else:
            self.patch_size = patch_size
            self.ffn = nn.Sequential(nn.Conv2d(width, patch_size * patch_size * 3, 1, padding=0, bias=True))
            self.conv_out = nn.Conv2d(3, 3, 3, padding=1, bias=True)
        # finetune_decoder: MaskGIT-VQGAN's codebook and decoder after the legacy logits
        self.pixel_quantize = None
        self.pixel_decoder = None
        if pixel_decoder is not None:
            self.pixel_quantize = nn.ModuleDict({"embedding": nn.Embedding(PIXEL_CODES, pixel_decoder["z_channels"])})
            self.pixel_decoder = TitokPixelDecoder(**pixel_decoder)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z = cast_to(codes, module_dtype(self.decoder_embed))
        n, c, h, w = z.shape
        x = self.decoder_embed(z.reshape(n, c * h, w).permute(0, 2, 1))
        batch, seq_len, _ = x.shape
        mask = self.mask_token.repeat(batch, self.grid**2, 1).to(x.dtype)
        mask = torch.cat([_expand(self.class_embedding, mask.shape[0]).to(mask.dtype), mask], dim=1)
        mask = mask + self.positional_embedding.to(mask.dtype)
        x = x + self.latent_token_positional_embedding[:seq_len]
        x = self.blocks(torch.cat([mask, x], dim=1))
        x = self.ln_post(x[:, 1:1 + self.grid**2])
        x = x.permute(0, 2, 1).reshape(batch, self.width, self.grid, self.grid)
        x = self.ffn(x.contiguous())
        if not self.is_legacy:  # Rearrange('b (p1 p2 c) h w -> b c (h p1) (w p2)')
            p, g = self.patch_size, self.grid
            x = x.reshape(batch, p, p, 3, g, g).permute(0, 3, 4, 1, 5, 2).reshape(batch, 3, g * p, g * p)
        x = self.conv_out(x)
        if self.pixel_decoder is None:  # BL/SL VQ-8k: pixels directly
            return TitokPixelDecoder.to_pixels(x.to(torch.float32))
        x = torch.einsum("nchw,cd->ndhw", x.softmax(1), self.pixel_quantize["embedding"].weight.to(x.dtype))
        return self.pixel_decoder(x)
