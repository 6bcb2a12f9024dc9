"""Training data: image folders (corrupt files skipped and counted), the built-in split, crops."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from PIL import Image

from vqserve.training.data import (
    BUILTIN_TRAIN,
    BUILTIN_VAL,
    DataError,
    ImageSource,
    RandomCrops,
    center_crop_multiple,
    image_folder,
    smooth_patch,
    tile_crops,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _photo(seed: int, h: int = 40, w: int = 56) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (h + w)], axis=-1)
    return np.clip(base + rng.normal(0, 10, base.shape), 0, 255).astype(np.uint8)


@pytest.fixture()
def messy_folder(tmp_path):
    """3 good images (png, jpg, webp in nested folders), 3 bad ones, 1 non-image file."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    Image.fromarray(_photo(0)).save(tmp_path / "one.png")
    Image.fromarray(_photo(1)).save(tmp_path / "a" / "two.JPG", quality=95)
    Image.fromarray(_photo(2)).save(tmp_path / "a" / "b" / "three.webp")
    good = (tmp_path / "one.png").read_bytes()
    (tmp_path / "a" / "truncated.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "a" / "b" / "not_really.jpg").write_text("this is not a jpeg")
    (tmp_path / "empty.webp").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("ignored: not an image extension")
    return tmp_path


def test_corrupt_images_are_skipped_warned_and_counted(messy_folder):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = image_folder(messy_folder)
    assert len(src) == 3
    assert sorted(p.rsplit("/", 1)[-1] for p in src.names) == ["one.png", "three.webp", "two.JPG"]
    assert len(src.skipped) == 3
    assert {p.rsplit("/", 1)[-1] for p in src.skipped} == {"truncated.png", "not_really.jpg", "empty.webp"}
    messages = [str(w.message) for w in caught]
    assert any("3 of 6 image files" in m for m in messages)
    assert sum("skipping unreadable image" in m for m in messages) == 3
    for img in src.images:
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3


def test_training_on_a_folder_with_corrupt_files_does_not_crash(messy_folder, tmp_path_factory):
    from vqserve.training.config import TrainConfig
    from vqserve.training.trainer import Trainer

    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(data=str(messy_folder), val_data=str(messy_folder), crop_size=16, batch_size=2,
                      val_crop_size=16, steps=2, warmup_steps=0, log_every=1, val_every=2,
                      ckpt_every=2, model={"channels": [8, 8, 8], "levels": [8, 5, 5, 5]},
                      out=str(out), progress=False, plots=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(cfg)
    assert len(trainer.skipped) == 3
    assert trainer.run()["step"] == 2


def test_empty_or_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        image_folder(tmp_path / "nope")
    src = image_folder(tmp_path)
    assert len(src) == 0
    with pytest.raises(DataError, match="no usable images"):
        RandomCrops(src, 16, 2)


def test_builtin_split_is_fixed_and_disjoint():
    assert set(BUILTIN_TRAIN).isdisjoint(BUILTIN_VAL)
    assert BUILTIN_VAL == ("chelsea", "coffee")
    # the photographs the default was validated on must stay out of training
    assert "chelsea" not in BUILTIN_TRAIN and "coffee" not in BUILTIN_TRAIN


def test_builtin_validation_photographs_load():
    from vqserve.training.data import builtin_source

    src = builtin_source("val")
    assert src.names == list(BUILTIN_VAL)
    assert [img.shape for img in src.images] == [(300, 451, 3), (400, 600, 3)]


def test_random_crops_are_a_function_of_seed_and_step():
    src = ImageSource([_photo(0, 50, 70), _photo(1, 30, 30)], ["a", "b"])
    crops = RandomCrops(src, 24, 5, seed=3)
    a, b = crops.batch_uint8(7), crops.batch_uint8(7)
    assert a.shape == (5, 24, 24, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, crops.batch_uint8(8))
    assert not np.array_equal(a, RandomCrops(src, 24, 5, seed=4).batch_uint8(7))
    x = crops.batch(0)
    assert x.shape == (5, 3, 24, 24) and float(x.min()) >= -1 and float(x.max()) <= 1


def test_crops_flip_and_cover_the_image():
    img = np.arange(16 * 16 * 3, dtype=np.uint8).reshape(16, 16, 3)
    crops = RandomCrops(ImageSource([img], ["x"]), 16, 64, seed=0)
    batch = crops.batch_uint8(0)
    flipped = sum(np.array_equal(c, img[:, ::-1]) for c in batch)
    same = sum(np.array_equal(c, img) for c in batch)
    assert flipped + same == 64 and flipped > 10 and same > 10


def test_smooth_fraction_swaps_that_share_of_crops_for_smooth_patches_in_their_own_colour():
    img = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)  # all texture
    src = ImageSource([img], ["noise"])
    plain = RandomCrops(src, 32, 400, seed=1)
    mixed = RandomCrops(src, 32, 400, seed=1, smooth_fraction=0.25)
    np.testing.assert_array_equal(mixed.batch_uint8(3), mixed.batch_uint8(3))  # still (seed, step)
    stds = mixed.batch_uint8(3).astype(float).std(axis=(1, 2)).max(axis=1)
    assert (plain.batch_uint8(3).astype(float).std(axis=(1, 2)).max(axis=1) > 40).all()
    smooth = stds < 12
    assert 0.18 < smooth.mean() < 0.32, smooth.mean()
    # a smooth crop keeps the mean colour of the crop it replaced (within the gradient's rounding)
    means = mixed.batch_uint8(3)[smooth].reshape(int(smooth.sum()), -1, 3).mean(axis=1)
    assert np.abs(means - img.reshape(-1, 3).mean(axis=0)).max() < 12
    with pytest.raises(ValueError, match="smooth_fraction"):
        RandomCrops(src, 32, 4, smooth_fraction=1.5)


def test_smooth_patch_is_a_gentle_gradient_around_its_colour():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        colour = rng.uniform(0, 255, 3)
        p = smooth_patch(rng, 64, colour).astype(float)
        assert p.shape == (64, 64, 3)
        assert np.abs(p.mean(axis=(0, 1)) - colour).max() < 2 or np.ptp(p.mean(axis=(0, 1))) < 1  # or made grey
        assert np.abs(np.diff(p, axis=0)).mean() < 3 and np.abs(np.diff(p, axis=1)).mean() < 3


def test_small_images_are_padded_not_dropped():
    src = ImageSource([_photo(0, 10, 12)], ["tiny"])
    assert RandomCrops(src, 16, 2).batch_uint8(0).shape == (2, 16, 16, 3)


def test_tiles_and_centre_crop():
    img = _photo(0, 300, 451)
    tiles = tile_crops([img], 128)
    assert tiles.shape == (2 * 3, 128, 128, 3)
    assert tile_crops([img], 128, max_per_image=2).shape[0] == 2
    assert center_crop_multiple(img, 8).shape == (296, 448, 3)


def test_sampling_by_area_by_default_or_uniform():
    big, small = _photo(0, 200, 200), _photo(1, 20, 20)
    src = ImageSource([big, small], ["big", "small"])
    np.testing.assert_allclose(RandomCrops(src, 16, 1).p, [40000 / 40400, 400 / 40400])
    np.testing.assert_allclose(RandomCrops(src, 16, 1, sampling="uniform").p, [0.5, 0.5])
    with pytest.raises(ValueError, match="sampling"):
        RandomCrops(src, 16, 1, sampling="sqrt")


# -- issue 17: the pinned package photographs -----------------------------------------


def _fake_deb(files: dict[str, bytes]) -> bytes:
    """A real ar archive holding a data.tar.xz, as dpkg-deb builds one."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    members = {"debian-binary": b"2.0\n", "control.tar.xz": b"", "data.tar.xz": buf.getvalue()}
    out = b"!<arch>\n"
    for name, data in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    return out


def test_deb_members_are_extracted_without_dpkg(tmp_path):
    from vqserve.training.datasets import extract_members, local_path

    deb = _fake_deb({"./usr/share/backgrounds/a.jpg": b"odd", "./usr/share/backgrounds/b.png": b"bb"})
    written = extract_members(deb, ["./usr/share/backgrounds/a.jpg"], tmp_path, "pkg")
    assert written == [local_path("pkg", "./usr/share/backgrounds/a.jpg", tmp_path)]
    assert written[0].read_bytes() == b"odd" and written[0] == tmp_path / "pkg" / "backgrounds" / "a.jpg"
    with pytest.raises(DataError, match="not found in the package"):
        extract_members(deb, ["./usr/share/backgrounds/missing.jpg"], tmp_path, "pkg")
    with pytest.raises(DataError, match="no ar header"):
        extract_members(b"PK\x03\x04 a zip", [], tmp_path, "pkg")


def test_a_deb_with_the_wrong_sha256_is_refused(tmp_path):
    from vqserve.training.datasets import PACKAGES, fetch

    debs = tmp_path / "debs"
    debs.mkdir()
    name = next(iter(PACKAGES))
    (debs / f"{name}_0_all.deb").write_bytes(_fake_deb({"./x": b"tampered"}))
    with pytest.raises(DataError, match="sha256 does not match"):
        fetch(tmp_path / "cache", debs=debs, log=lambda *_: None)
    assert not (tmp_path / "cache" / name).exists()


def test_package_photographs_missing_is_a_clear_error_naming_make_data(tmp_path, monkeypatch):
    from vqserve.training.config import TrainConfig
    from vqserve.training.data import open_source

    monkeypatch.setenv("VQSERVE_DATA_DIR", str(tmp_path / "empty"))
    with pytest.raises(DataError, match="make data"):
        open_source("photos:train")
    with pytest.raises(DataError, match="unknown image set"):
        open_source("photos:everything")
    for key in ("data", "val_data"):
        with pytest.raises(ValueError, match="reserved for evaluation"):
            TrainConfig(**{key: "heldout"})


def test_roles_never_share_a_file():
    from vqserve.training.datasets import PIP_HELDOUT, ROLES

    files = [f for role in ROLES.values() for f in role]
    assert len(files) == len(set(files))
    assert not {pkg for pkg, _ in ROLES["train"]} & {pkg for pkg, _ in ROLES["test"]}
    assert {m for m, _ in PIP_HELDOUT} == {"matplotlib", "sklearn"}


def test_reduce_keeps_the_long_side_within_bounds(tmp_path):
    from vqserve.training.datasets import load_reduced

    Image.fromarray(_photo(3, h=300, w=1000)).save(tmp_path / "wide.png")
    img = load_reduced(tmp_path / "wide.png", max_side=400)
    assert img.shape == (100, 334, 3) and img.dtype == np.uint8  # reduced by 3 (ceil 1000/400)
    assert load_reduced(tmp_path / "wide.png", max_side=1000).shape == (300, 1000, 3)


def test_export_writes_a_split_as_the_same_pixels_and_never_into_a_used_folder(tmp_path, monkeypatch, capsys):
    """`python -m vqserve.training.datasets export`: how the v6 default's photographs reached a
    GPU machine with no network. A folder of the exported PNGs must give training exactly
    the pixels the spec gives. The package photographs are stand-ins here (written where
    `make data` would put them), so the test needs no download."""
    from vqserve.training.data import open_source
    from vqserve.training.datasets import ROLES, local_path, main

    cache = tmp_path / "cache"
    rng = np.random.default_rng(3)
    for pkg, member in ROLES["select"]:
        path = local_path(pkg, member, cache)
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(path, quality=95)
    monkeypatch.setenv("VQSERVE_DATA_DIR", str(cache))
    assert main(["export", "--role", "select", "--out", str(tmp_path / "sel")]) == 0
    assert "photos:select: 4 images" in capsys.readouterr().out
    spec, folder = open_source("photos:select"), open_source(str(tmp_path / "sel"))
    assert len(folder.images) == len(spec.images) == 4
    for a, b in zip(spec.images, folder.images, strict=True):
        assert np.array_equal(a, b)
    # a folder that holds anything is refused, and left as it was
    before = sorted(p.name for p in (tmp_path / "sel").iterdir())
    assert main(["export", "--role", "select", "--out", str(tmp_path / "sel")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "sel").iterdir()) == before
    with pytest.raises(SystemExit):
        main(["export", "--role", "test", "--out", str(tmp_path / "t")])   # held-out: no such choice
