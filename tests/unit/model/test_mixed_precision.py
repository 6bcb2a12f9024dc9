"""The low-precision serving policy: only residual-branch convolutions run in bf16/fp16, the stream stays fp32."""

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


@pytest.mark.parametrize("dtype,stream", [("bf16", True), ("fp16", True), ("fp32", False)])
def test_default_policy_per_dtype(dtype, stream):
    """Both low precisions keep the residual stream in fp32 by default (fp16 too: 99.91% of
    whole-photo tokens instead of 99.73%, docs/EXPORT.md); fp32 is the plain encoder."""
    assert default_fp32_stream(dtype) is stream
    tok = make_tokenizer()
    enc, kept = low_precision_encoder(tok.encoder, dtype)
    assert bool(kept) is stream
    if stream:
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        branch = _branch_conv_names(tok.encoder)
        for name, p in enc.named_parameters():
            assert p.dtype == (low if name.rsplit(".", 1)[0] in branch else torch.float32), name
    else:
        assert {p.dtype for p in enc.parameters()} == {torch.float32}


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="int8"):
        low_precision_encoder(make_tokenizer().encoder, "int8")


def test_mixed_encoder_runs_exactly_the_named_layers_in_low_precision():
    from vqserve.model.mixed_precision import branch_convolutions, mixed_encoder

    tok = make_tokenizer(channels=[8, 16, 16])
    conv1 = branch_convolutions(tok.encoder, ("conv1",))
    assert conv1 and all(n.endswith(".conv1") for n in conv1)
    assert branch_convolutions(tok.encoder) == sorted(_branch_conv_names(tok.encoder),
                                                      key=list(dict(tok.encoder.named_modules())).index)
    enc, kept = mixed_encoder(tok.encoder, "fp16", conv1)
    for name, m in enc.named_modules():
        if isinstance(m, nn.Conv2d):
            assert m.weight.dtype == (torch.float16 if name in conv1 else torch.float32), name
            assert (name in kept) is (name not in conv1)
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        assert enc(x).dtype == torch.float32
    whole, kept = mixed_encoder(tok.encoder, "bf16", None)
    assert kept == [] and {p.dtype for p in whole.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="no layer"):
        mixed_encoder(tok.encoder, "bf16", ["down.0.nope"])


def test_precision_frontier_measures_the_served_path(tiny_checkpoint, photos, tmp_path, one_thread):
    """The benchmark's candidates are the encoders serving runs: its bf16/fp16 stream tokens
    equal the eager runtime's, and a short run writes a complete table and JSON."""
    import json

    import numpy as np
    from PIL import Image

    from vqserve.export.runtimes.loader import EagerRuntime
    from vqserve.model import load_tokenizer
    from vqserve.training import precision_frontier as pf

    tok = load_tokenizer(tiny_checkpoint)
    for dtype in ("bf16", "fp16"):
        enc = pf.build_encoder(tok, pf.candidates()[f"{dtype}-stream"])
        served = EagerRuntime(tiny_checkpoint, dtype=dtype).encode(photos)
        assert np.array_equal(pf.encode_with(tok, enc, photos).numpy(), served)
    Image.fromarray(photos[0]).resize((100, 60)).save(tmp_path / "held_out.png")
    out = tmp_path / "rows.json"
    assert pf.main(["--model", tiny_checkpoint, "--photos", str(tmp_path), "--rounds", "1", "--size", "32",
                    "--candidates", "bf16-stream,fp16-whole", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["candidate"]: r for r in result["rows"]}
    assert list(rows) == ["fp32", "bf16-stream", "fp16-whole"]
    assert rows["fp32"]["report_agreement"] == 1.0 and rows["fp32"]["speed_32"] == 1.0
    assert rows["fp32"]["low_precision_mac_share"] == 0 and rows["fp16-whole"]["low_precision_mac_share"] == 1
    assert 0 < rows["bf16-stream"]["low_precision_mac_share"] < 1
    assert rows["bf16-stream"]["report_tokens"] == (60 // 8) * (96 // 8)  # 100x60 cropped to 96x56
    assert all(r["speed_whole"] > 0 and 0 <= r["selection_agreement"] <= 1 for r in rows.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (TF32 exists there only)")
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_cuda_runtime_turns_tf32_off_whatever_ran_before(tiny_checkpoint, dtype):
    """Regression (H100, `vqserve bench gpu`): a bf16 server's tokens differed from bf16
    in-process after an fp32 load, because only fp32 runtimes turned the process-wide TF32
    flags off, and a bf16 encoder's kept fp32 layers ran in TF32 or not by what ran before."""
    import numpy as np

    from vqserve.bench.inputs import (
        bench_photos,  # built in: a GPU node need not have scikit-image
    )
    from vqserve.export.runtimes.loader import EagerRuntime

    photos = bench_photos(64)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    first = EagerRuntime(tiny_checkpoint, dtype=dtype, device="cuda")
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    tokens = first.encode(photos)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    assert np.array_equal(EagerRuntime(tiny_checkpoint, dtype=dtype, device="cuda").encode(photos), tokens)
