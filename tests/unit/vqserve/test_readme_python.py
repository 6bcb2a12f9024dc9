"""The README's "Python API" blocks run as written, in a fresh interpreter.

A fresh interpreter is the point: names the face resolves lazily (``vqserve.serve`` is a
subpackage) can look fine inside the test process only because an earlier test imported
them. The blocks are read from README.md itself, so the README cannot drift from the face.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tests.helpers as helpers

README = Path(__file__).resolve().parents[3] / "README.md"


def python_api_blocks() -> list[str]:
    """Every ```python block of the README's "## Python API" section, in order."""
    text = README.read_text()
    section = text.split("\n## Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readme_has_the_blocks_this_test_runs():
    blocks = python_api_blocks()
    assert len(blocks) >= 2 and "vqserve.serve(" in blocks[0] and "import FSQ" in blocks[1]


@pytest.mark.parametrize("name", ["serve", "load", "ServerThread", "ServerConfig", "TokenizerClient",
                                  "AsyncTokenizerClient", "ServerError", "TokenShards"])
def test_each_face_name_resolves_first_thing_in_a_fresh_interpreter(name):
    """One interpreter per name: resolving another name first (the clients import
    ``vqserve.serve.*``) would hide a name that only works after it."""
    import vqserve

    assert name in vqserve.__all__
    out = subprocess.run([sys.executable, "-c", f"import vqserve; vqserve.{name}"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_readme_python_blocks_run_as_written_on_real_photos(photos, tmp_path):
    """The placeholder names are bound to real photographs (64x64 crops, as uint8 [B,H,W,3])
    and to a channel-last latent; ``shards/`` is a real `vqserve tokenize` output."""
    np.save(tmp_path / "photos.npy", photos)
    (tmp_path / "png").mkdir()
    from PIL import Image

    for i, image in enumerate(photos):
        Image.fromarray(image).save(tmp_path / "png" / f"photo{i}.png")
    helpers.tokenize_grids("default", tmp_path / "png", tmp_path / "shards")
    prelude = ("import numpy as np, torch\n"
               "images_uint8_bhw3 = np.load('photos.npy')\n"
               "z = torch.randn(2, 8, 8, 4)\n")
    epilogue = "\nprint('README-BLOCKS-OK', len(list(data)))\n"
    program = prelude + "\n".join(python_api_blocks()) + epilogue
    out = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"README-BLOCKS-OK {len(photos)}" in out.stdout
