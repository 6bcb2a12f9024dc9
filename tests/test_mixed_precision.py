"""The bf16 serving policy: only residual-branch convolutions run in bf16, the stream stays fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import make_tokenizer
from vqserve.model.mixed_precision import default_fp32_stream, low_precision_encoder
from vqserve.model.networks import ResBlock

CONFIGS = {
    "three stages": {},
    "channel changes (skip convs)": dict(channels=[8, 16, 16]),
    "attention": dict(channels=[16, 16, 16], attention=True, attention_heads=2),
    "pixel-unshuffle stem": dict(channels=[16], patch_size=4, num_res_blocks=2),
}


def _branch_conv_names(encoder: nn.Module) -> set[str]:
    return {f"{name}.{conv}" for name, m in encoder.named_modules() if isinstance(m, ResBlock)
            for conv in ("conv1", "conv2")}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_only_branch_convolutions_run_in_bf16(overrides):
    tok = make_tokenizer(**overrides)
    enc, kept = low_precision_encoder(tok.encoder, "bf16")
    branch = _branch_conv_names(tok.encoder)
    convs = {name for name, m in tok.encoder.named_modules() if isinstance(m, nn.Conv2d)}
    assert branch and kept == [n for n, m in tok.encoder.named_modules() if n in convs - branch]
    for name, p in enc.named_parameters():
        in_branch = name.rsplit(".", 1)[0] in branch
        assert p.dtype == (torch.bfloat16 if in_branch else torch.float32), name
    # the caller's fp32 encoder is untouched: still fp32, no hooks
    assert all(p.dtype == torch.float32 for p in tok.encoder.parameters())
    assert not any(m._forward_pre_hooks for m in tok.encoder.modules())


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_residual_stream_stays_fp32_and_is_closer_to_fp32_than_a_whole_cast(overrides):
    tok = make_tokenizer(seed=3, **overrides)
    x = torch.rand(2, 3, 32, 48) * 2 - 1
    stream_dtypes = []
    enc, _ = low_precision_encoder(tok.encoder, "bf16")
    for m in enc.modules():
        if isinstance(m, ResBlock):
            m.register_forward_hook(lambda _m, _a, out: stream_dtypes.append(out.dtype))
    with torch.no_grad():
        ref = tok.encoder(x)
        mixed = enc(x)
        whole = low_precision_encoder(tok.encoder, "bf16", fp32_stream=False)[0](x)
    assert stream_dtypes and set(stream_dtypes) == {torch.float32}
    assert mixed.dtype == torch.float32 and whole.dtype == torch.bfloat16
    err_mixed = (mixed - ref).abs().mean()
    err_whole = (whole.float() - ref).abs().mean()
    assert 0 < err_mixed < err_whole


@pytest.mark.parametrize("dtype,stream", [("bf16", True), ("fp16", False), ("fp32", False)])
def test_default_policy_per_dtype(dtype, stream):
    assert default_fp32_stream(dtype) is stream
    enc, kept = low_precision_encoder(make_tokenizer().encoder, dtype)
    assert bool(kept) is stream
    if not stream:
        want = {"fp16": torch.float16, "fp32": torch.float32}[dtype]
        assert {p.dtype for p in enc.parameters()} == {want}


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="int8"):
        low_precision_encoder(make_tokenizer().encoder, "int8")
