"""The Python face: ``import vqserve`` gives load / serve / the clients / TokenShards, the same
tokens as the CLI's paths, and a client machine still loads no torch."""

import json
import subprocess
import sys

import numpy as np
import pytest

import vqserve
from vqserve.model import load_tokenizer


@pytest.fixture(scope="module")
def images(photos):
    return photos[:3]


def test_import_vqserve_and_a_client_load_no_torch():
    code = ("import sys, json, vqserve; vqserve.TokenizerClient; vqserve.AsyncTokenizerClient;"
            "print(json.dumps('torch' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


def test_load_gives_the_models_exact_tokens_and_pixels(tiny_checkpoint, images):
    tok = vqserve.load(tiny_checkpoint)
    tokens = tok.encode(images)
    assert tokens.shape == (3, 8, 8) and tokens.dtype.kind == "u"
    assert tok.info.exact and tok.info.dtype == "fp32"
    reference = load_tokenizer(tiny_checkpoint)
    import torch

    with torch.no_grad():
        expected = reference.encode(torch.from_numpy(images)).numpy()
    np.testing.assert_array_equal(tokens, expected)
    pixels = tok.decode(tokens)
    assert pixels.shape == images.shape and pixels.dtype == np.uint8


def test_a_lower_dtype_is_asked_for_and_said(tiny_checkpoint):
    assert vqserve.load(tiny_checkpoint, dtype="bf16").info.exact is False


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "/no/such/model"}, "no/such/model"),
    ({"device": "tpu"}, "device must be auto, cpu or cuda"),
    ({"backend": "tensorrt"}, "backend must be auto or one of"),
])
def test_bad_arguments_are_one_line_before_any_work(kwargs, message):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        vqserve.load(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_serve_answers_with_the_tokens_of_load(tiny_checkpoint, images):
    tokens = vqserve.load(tiny_checkpoint).encode(images)
    with vqserve.serve(tiny_checkpoint, port=0) as server:
        assert isinstance(server, vqserve.ServerThread)
        client = vqserve.TokenizerClient(server.target)
        np.testing.assert_array_equal(client.encode(images), tokens)
        assert client.model_info()["model_hash"] == vqserve.load(tiny_checkpoint).info.model_hash
    server.stop()  # a second stop is harmless


def test_serve_is_still_the_package():
    import vqserve.serve.launcher as launcher

    assert vqserve.serve.launcher is launcher and callable(vqserve.serve)


def test_token_shards_is_the_offline_reader():
    from vqserve.offline.token_shards import TokenShards

    assert vqserve.TokenShards is TokenShards


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vqserve.nope  # noqa: B018
