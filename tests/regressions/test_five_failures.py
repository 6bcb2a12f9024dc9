"""Regression tests for the five mixed-precision failures in docs/DESIGN.md.

Each test first reproduces the original situation (showing the naive code really breaks
or loses information) and then asserts that vqserve handles the same situation.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import make_tokenizer
from vqserve.model import FSQ, LFQ, policy

LOW = [torch.bfloat16, torch.float16]


# -- 1. LFQ fed bf16 activations with fp32 weights -------------------------------------
def test_failure1_original_situation_is_real():
    with pytest.raises(RuntimeError, match="dtype"):
        torch.randn(4, 16, dtype=torch.bfloat16) @ torch.randn(16, 8)


@pytest.mark.parametrize(
    "input_dtype,codebook_dtype,autocast",
    list(itertools.product([torch.bfloat16, torch.float16, torch.float32],
                           [torch.float32, torch.bfloat16], [False, True])),
)
def test_failure1_lfq_any_input_dtype_any_codebook_dtype(input_dtype, codebook_dtype, autocast):
    q = LFQ(16).train()
    q.codebook = q.codebook.to(codebook_dtype)  # "the reverse": low-precision state, fp32 input
    z = torch.randn(2, 64, 16).to(input_dtype).requires_grad_()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        codes, indices, aux = q(z, return_aux=True)
    assert codes.dtype == input_dtype
    assert indices.dtype == torch.int64
    assert set(aux) == {"entropy", "commitment"}
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in aux.values())
    (codes.float().sum() + sum(aux.values())).backward()
    assert z.grad is not None and torch.isfinite(z.grad.float()).all()
    # indices are those of the fp32 input of the same values
    assert torch.equal(indices, LFQ(16).eval()(z.detach().float())[1])


# -- 2. FSQ [8,5,5,5] in bf16 lost half its codebook ------------------------------------
def _latents_for_every_code(q: FSQ) -> torch.Tensor:
    """fp32 latents whose bounded value sits at the centre of each code's bin."""
    idx = torch.arange(q.codebook_size)
    level = q.indices_to_level_indices(idx).float()
    half_width = q._half_width().float()
    levels = q._levels.float()
    half_l = (levels - 1) * 1.001 / 2
    offset = torch.where(q._levels % 2 == 0, 0.5, 0.0)
    centre = level - half_width  # the rounded value
    return torch.atanh((centre + offset) / half_l) - torch.atanh(offset / half_l)


def test_failure2_original_situation_is_real():
    assert torch.tensor([1000, 1001, 1002, 1003], dtype=torch.bfloat16).tolist() == [1000, 1000, 1000, 1004]
    # index arithmetic done in bf16 collapses an [8,5,5,5] codebook to about half
    q = FSQ([8, 5, 5, 5])
    level = q.indices_to_level_indices(torch.arange(q.codebook_size)).to(torch.bfloat16)
    naive = (level * q._basis.to(torch.bfloat16)).sum(-1)
    assert naive.unique().numel() / q.codebook_size < 0.6


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("autocast", [False, True])
def test_failure2_fsq_full_utilization_in_low_precision(dtype, autocast):
    q = FSQ([8, 5, 5, 5])
    z = _latents_for_every_code(q)
    assert torch.equal(q(z)[1], torch.arange(1000))  # fp32: every code exactly once
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        codes, indices = q(z.to(dtype))
    assert codes.dtype == dtype
    assert indices.unique().numel() == q.codebook_size  # 100% utilization, as in fp32
    assert torch.equal(indices, torch.arange(1000))


@pytest.mark.parametrize("dtype", LOW)
def test_failure2_large_indices_survive_bf16(dtype):
    q = FSQ([8, 8, 8, 5, 5, 5])
    wanted = torch.tensor([1000, 1001, 1002, 1003])
    z = _latents_for_every_code(q)[wanted]
    _, indices = q(z.to(dtype))
    assert indices.tolist() == [1000, 1001, 1002, 1003]
    codes = q.indices_to_codes(indices, dtype=dtype)
    assert q.codes_to_indices(codes).tolist() == [1000, 1001, 1002, 1003]


def test_failure2_constants_stay_fp32_when_module_is_cast():
    q = FSQ([8, 8, 8, 5, 5, 5])
    z = torch.randn(512, 6) * 2
    expected = q(z)[1]
    for cast in (torch.nn.Module.half, torch.nn.Module.bfloat16):
        cast(q)
        assert all(not b.is_floating_point() or b.dtype == torch.float32 for b in q.buffers())
        assert torch.equal(q(z)[1], expected)


# -- 3. TransformerEncoder under bf16 autocast failed in eval mode only ------------------
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_failure3_attention_tokenizer_under_bf16_autocast(mode):
    tok = make_tokenizer(attention=True, channels=[16, 32, 32], attention_heads=4)
    getattr(tok, mode)()
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        indices = tok.encode(images)
        pixels = tok.decode(indices)
        recon, _, _ = tok(torch.rand(2, 3, 32, 32) * 2 - 1)
    assert indices.shape == (2, 4, 4) and pixels.shape == (2, 32, 32, 3)
    assert recon.shape == (2, 3, 32, 32)


@pytest.mark.parametrize("dtype", LOW)
def test_failure3_attention_fast_path_with_low_precision_weights(dtype):
    """Eval + no_grad + cast weights: the layer's fused fast path runs (no autocast)."""
    tok = make_tokenizer(attention=True, channels=[16, 32, 32], attention_heads=4).to(dtype).eval()
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    indices = tok.encode(images)
    assert tok.decode(indices).dtype == torch.uint8


# -- 4. GradScaler in bf16 (no kernels, and not needed) ---------------------------------
def _train_step(precision: str):
    pol = policy(precision)
    tok = make_tokenizer().train()
    opt = torch.optim.Adam(tok.parameters(), lr=1e-3)
    scaler = pol.grad_scaler("cpu")
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    before = [p.detach().clone() for p in tok.parameters()]
    with pol.autocast("cpu"):
        recon, _, aux = tok(x)
        loss = (recon.float() - x).abs().mean() + sum(aux.values(), torch.zeros(()))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    changed = any(not torch.equal(a, b) for a, b in zip(before, tok.parameters(), strict=True))
    return pol, scaler, loss, changed


def test_failure4_bf16_step_without_grad_scaler():
    pol, scaler, loss, changed = _train_step("bf16")
    assert not pol.use_grad_scaler and not scaler.is_enabled()
    assert torch.isfinite(loss) and changed


def test_failure4_fp16_step_with_grad_scaler():
    pol, scaler, loss, changed = _train_step("fp16")
    assert pol.use_grad_scaler and scaler.is_enabled()
    assert scaler.get_scale() > 1.0
    assert torch.isfinite(loss) and changed


def test_failure4_fp32_needs_no_scaler_or_autocast():
    pol = policy("fp32")
    assert not pol.use_grad_scaler and not pol.uses_autocast


# -- 5. A model cast wholesale to fp16 met fp32 side tensors ------------------------------
def test_failure5_original_situation_is_real():
    conv = torch.nn.Conv2d(3, 4, 3).half()
    with pytest.raises(RuntimeError, match="should be the same"):
        conv(torch.randn(1, 3, 8, 8))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("quantizer", ["fsq", "lfq", "vq", "rfsq"])
def test_failure5_cast_tokenizer_takes_uint8_and_fp32(dtype, quantizer):
    tok = make_tokenizer(quantizer=quantizer, lfq_dim=8, vq_codebook_size=64, vq_dim=4).eval()
    tok = tok.half() if dtype == torch.float16 else tok.to(torch.bfloat16)
    assert tok.compute_dtype == dtype
    assert all(b.dtype == torch.float32 for b in tok.quantizer.buffers() if b.is_floating_point())
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    indices = tok.encode(images)
    assert tok.decode(indices).shape == (2, 32, 32, 3)
    fp32_pixels = images.permute(0, 3, 1, 2).float() / 127.5 - 1
    assert tok.encode_float(fp32_pixels).shape == indices.shape
    with torch.no_grad():
        recon, _ = tok(fp32_pixels, return_aux=False)
    assert recon.dtype == dtype


# -- 5b. A model cast to one low-precision dtype, run under autocast to the other -----------
def test_failure5_mixed_cast_original_situation_is_real():
    """PyTorch's CPU GroupNorm takes a mixed input only with fp32 parameters."""
    norm = torch.nn.GroupNorm(2, 4).half()
    with pytest.raises(RuntimeError, match="mixed dtype"):
        norm(torch.randn(1, 4, 8, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize(("cast", "autocast"), [(torch.float16, torch.bfloat16),
                                                (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("quantizer", ["fsq", "lfq", "vq", "rfsq"])
@pytest.mark.parametrize("attention", [False, True])
def test_failure5_cast_tokenizer_under_the_other_autocast(cast, autocast, quantizer, attention):
    tok = make_tokenizer(quantizer=quantizer, lfq_dim=8, vq_codebook_size=64, vq_dim=4,
                         attention=attention).eval().to(cast)
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    with torch.autocast("cpu", dtype=autocast):
        indices = tok.encode(images)
        assert tok.decode(indices).shape == (2, 32, 32, 3)
        recon, _ = tok(images.permute(0, 3, 1, 2).float() / 127.5 - 1, return_aux=False)
    assert recon.shape == (2, 3, 32, 32)
    assert indices.shape[:3] == (2, 4, 4)
