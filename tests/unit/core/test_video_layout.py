"""The video token layout (vqserve.core.token_layout kind ``video``, vqserve.core.video_frames):
the frame rule 1 + k*T -> 1 + k latent frames, the chunk and pad policies as NVIDIA's
Cosmos-Tokenizer applies them, one-line refusals of what no policy covers, and the record
that identities, GetModelInfo, manifests and shards carry."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vqserve.core.runtime_info import RuntimeInfo
from vqserve.core.token_layout import VIDEO, TokenLayout
from vqserve.core.video_frames import latent_windows, plan_clip

DV8 = TokenLayout(factor=16, kind=VIDEO, temporal_factor=8)

T = st.sampled_from([4, 8])
F = st.sampled_from([8, 16])


def cosmos_pad_video_batch(frames: int, height: int, width: int):
    """NVIDIA's ``cosmos_tokenizer.utils.pad_video_batch`` padding amounts, transcribed
    (spatial 16, temporal 8: zeros centred in space, edge frames centred in time)."""
    hp = (16 - height % 16) if height % 16 else 0
    wp = (16 - width % 16) if width % 16 else 0
    fp = (8 - (frames - 1) % 8) if (frames - 1) % 8 else 0
    return (fp >> 1, fp - (fp >> 1)), (hp >> 1, hp - (hp >> 1), wp >> 1, wp - (wp >> 1))


@given(T, F, st.integers(0, 6), st.integers(1, 4), st.integers(1, 4))
def test_frame_rule_on_rule_clips_whole(t, f, k, hb, wb):
    layout = TokenLayout(factor=f, kind=VIDEO, temporal_factor=t)
    assert layout.clip_token_shape(1 + k * t, hb * f, wb * f) == (1 + k, hb, wb)
    assert layout.frames_of(1 + k) == 1 + k * t
    assert layout.shape_rule((2, 1 + k, hb, wb)) is None


@given(T, st.integers(2, 60))
def test_off_rule_frames_refused_in_one_line_unless_a_policy_is_asked(t, frames):
    layout = TokenLayout(factor=8, kind=VIDEO, temporal_factor=t)
    if (frames - 1) % t == 0:
        return
    with pytest.raises(ValueError) as err:
        layout.clip_token_shape(frames, 64, 64)
    message = str(err.value)
    assert "\n" not in message and f"{frames} frames" in message and "policy" in message
    padded = layout.with_policy(pad="cosmos").plan(frames, 64, 64)
    assert padded.padded and padded.windows[0][:2] == (0, frames)


@given(st.integers(1, 40), st.integers(1, 70), st.integers(1, 70))
def test_cosmos_pad_policy_is_pad_video_batch(frames, height, width):
    plan = DV8.with_policy(pad="cosmos").plan(frames, height, width)
    (front, back), space = cosmos_pad_video_batch(frames, height, width)
    assert plan.windows == ((0, frames, front, back),) and plan.space == space
    assert plan.latent == (1 + (frames + front + back - 1) // 8, (height + space[0] + space[1]) // 16,
                           (width + space[2] + space[3]) // 16)


@given(T, st.integers(1, 4), st.integers(1, 5), st.integers(0, 3))
def test_chunks_restart_and_concatenate(t, k, chunks, tail_k):
    n = 1 + k * t
    tail_k = min(tail_k, k - 1)  # a shorter last window, on the rule (or none)
    tail = (1 + tail_k * t) if tail_k else 0
    frames = chunks * n + tail
    layout = TokenLayout(factor=8, kind=VIDEO, temporal_factor=t, chunk_frames=n)
    plan = layout.plan(frames, 16, 16)
    assert [(s, e) for s, e, *_ in plan.windows][:chunks] == [(i * n, (i + 1) * n) for i in range(chunks)]
    assert plan.latent[0] == chunks * (1 + k) + (1 + tail_k if tail else 0)
    # decode cuts the latent frames back into the same windows, each decoded on its own
    assert [e - s for s, e in latent_windows(plan.latent[0], temporal_factor=t, chunk_frames=n)] == list(
        plan.window_latent)
    assert layout.frames_of(plan.latent[0]) == frames


def test_off_rule_last_chunk_is_named():
    layout = DV8.with_policy(chunk_frames=17)
    with pytest.raises(ValueError, match="the last 17-frame chunk has 16 frames"):
        layout.clip_token_shape(33, 32, 32)
    assert layout.clip_token_shape(34, 32, 32) == (6, 2, 2)
    assert DV8.clip_token_shape(33, 32, 32) == (5, 2, 2)  # the whole clip: other tokens, other count


def test_spatial_factor_and_bad_policies_refused():
    with pytest.raises(ValueError, match="multiples of the spatial factor 16, got 40x32"):
        DV8.clip_token_shape(9, 40, 32)
    with pytest.raises(ValueError, match="1 \\+ k\\*8 frames, got 16"):
        DV8.with_policy(chunk_frames=16)
    with pytest.raises(ValueError, match="pad policy"):
        DV8.with_policy(pad="reflect")
    with pytest.raises(ValueError, match="positive temporal factor"):
        TokenLayout(factor=16, kind=VIDEO)
    with pytest.raises(ValueError, match="give \\[B,T,H,W,3\\] frames"):
        DV8.token_shape(64, 64)
    with pytest.raises(ValueError, match="policies are for video"):
        TokenLayout(factor=16).with_policy(chunk_frames=9)
    assert DV8.shape_rule((1, 2, 2)).startswith("must be [B,t,h,w]")
    assert DV8.shape_rule((1, 0, 2, 2)).startswith("must be [B,t,h,w]")


def test_record_travels_through_identity_and_back():
    layout = DV8.with_policy(chunk_frames=33, pad="cosmos")
    record = layout.to_dict()
    assert record == {"kind": "video", "temporal_factor": 8, "chunk_frames": 33, "pad": "cosmos",
                      "frame_rule": "1+k*8 frames -> 1+k latent frames; independent 33-frame chunks; pad cosmos"}
    info = RuntimeInfo(backend="eager", dtype="fp32", device="cpu", quantizer="fsq", codebook_size=64000,
                       factor=16, model_hash="h", token_layout=record)
    assert info.identity()["token_layout"] == record
    assert TokenLayout.from_info(info.to_dict()) == layout == TokenLayout.from_info(info)
    assert layout.item_rank() == 3 and not layout.is_grid
    assert layout.image_size((5, 2, 3)) == (32, 48)
    assert np.array_equal(layout.split(np.zeros((1, 5, 2, 3)))[0], np.zeros((1, 5, 2, 3)))
    # a whole-clip and a chunked layout are different identities: their tokens differ
    assert DV8.to_dict() != layout.to_dict()


@given(st.integers(1, 50), st.integers(1, 50), st.integers(1, 50))
def test_plan_refusals_are_one_line(frames, height, width):
    try:
        plan_clip(frames, height, width, factor=8, temporal_factor=4, chunk_frames=0)
    except ValueError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("clips: ")
