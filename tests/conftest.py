"""Shared fixtures: small real tokenizers saved as real checkpoints (no mocks)."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from vqserve.model import Tokenizer, TokenizerConfig, save_tokenizer

# `vqserve serve` and `vqserve tokenize` measure their execution plan at the first start
# (--plan auto, tens of seconds per model on 2 cores). Every test that is not about planning
# runs the fixed default plan, and measured plans never land in the user's cache;
# tests/integration/test_plan.py sets --plan auto and its own cache explicitly.
os.environ.setdefault("VQSERVE_PLAN", "default")
os.environ.setdefault("VQSERVE_PLAN_CACHE", os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                         f"vqserve-test-plans-{os.getpid()}"))

pytest_plugins = ["tests.plugins.process_state"]

# `make test TEST_WORKERS=N` (pytest-xdist): each worker gets its share of the cores for torch,
# so N workers' intra-op threads do not oversubscribe the machine (on 2 cores, 2 workers x 2
# threads made every convolution wait for a core). One process alone keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

TINY = dict(channels=[16, 16, 16], num_res_blocks=1)  # factor 8, fast on CPU


def make_tokenizer(seed: int = 0, **overrides) -> Tokenizer:
    torch.manual_seed(seed)
    config = TokenizerConfig(**{**TINY, "levels": [8, 5, 5, 5], **overrides})
    return Tokenizer(config).eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A factor-8 FSQ [8,5,5,5] tokenizer (random weights) saved as config.json + safetensors."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_tokenizer(make_tokenizer(), path)
    return str(path)


@pytest.fixture(scope="session")
def photos() -> np.ndarray:
    """Real photographs (scikit-image ships them), cropped to 64x64 uint8 NHWC."""
    from skimage import data

    crops = []
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img = getattr(data, name)()
        h, w = img.shape[:2]
        crops.append(img[h // 2 - 32 : h // 2 + 32, w // 2 - 32 : w // 2 + 32, :3])
    return np.stack(crops).astype(np.uint8)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny convolutions on a shared 2-core box run far faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cert(tmp_path_factory):
    """A self-signed certificate for localhost and 127.0.0.1 (the openssl CLI): (cert, key)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make a self-signed certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="session")
def object_store(tmp_path_factory):
    """A real S3 endpoint (moto in server mode on 127.0.0.1, a subprocess) behind the logging,
    fault-injecting proxy of tests/object_store.py; one per session."""
    pytest.importorskip("moto.server", reason="pip install 'moto[server]' (the test extra)")
    pytest.importorskip("s3fs", reason="pip install 'vqserve[s3]'")
    from tests.object_store import ObjectStore

    store = ObjectStore(str(tmp_path_factory.mktemp("moto")))
    yield store
    store.close()


@pytest.fixture
def s3(object_store, monkeypatch, request):
    """This test's view of the endpoint: the standard AWS_* variables set (fake credentials,
    AWS_ENDPOINT_URL at the proxy), a fresh request log and no faults, this process's
    filesystems made anew, and a bucket of its own (``s3.bucket``)."""
    import re

    from vqserve.offline.storage import fs as storage_fs

    for k, v in object_store.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(storage_fs.ENV_OPTIONS, raising=False)
    storage_fs._FILESYSTEMS.clear()
    object_store.proxy.faults.clear()
    object_store.proxy.log.clear()
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    object_store.bucket = f"t-{name}-{os.getpid() % 1000}"
    object_store.client().create_bucket(Bucket=object_store.bucket)
    yield object_store
    storage_fs._FILESYSTEMS.clear()
