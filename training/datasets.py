"""Photographs that ship in Debian packages and pip packages: a reproducible data set with three roles.

scikit-image's ~16 photographs are too few and too odd (half grayscale, a third of the crops
from one red retina) to train a default tokenizer on (issue 17). More permissively shared
photographs ship in Debian's desktop-wallpaper packages; this module pins exact package
versions by SHA-256, fetches them from a Debian mirror, and extracts only the listed files
into a cache directory. Nothing here is needed to *use* a tokenizer, and the plain
scikit-image set keeps working where the packages are absent.

The roles never mix (docs/TRAINING.md, "Data"):

* **train** (``photos:train``): scikit-image's training split + ``TRAIN_FILES``;
* **select** (``photos:select``): what models and recipes are *chosen* on - scikit-image's
  chelsea and coffee + ``SELECT_FILES`` (two MATE photographs never trained on);
* **test** (``heldout``): the reported figures - the KDE photographs (``TEST_FILES``) plus
  the photographs that ship with matplotlib and scikit-learn (``heldout:pip``, no fetch
  needed). Never trained or selected on; training refuses these specs.

Package images are reduced by an integer factor (Pillow's box filter, ``Image.reduce``) so
the long side is at most ``MAX_SIDE``: deterministic, and closer to the per-pixel detail of
an ordinary photograph than a 5K wallpaper.

Fetch with ``make data`` or ``python -m vqserve.training.datasets fetch`` (about 165 MB of
packages, verified, then deleted; ~60 MB of images kept).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vqserve.core.files import atomic_write_stream
from vqserve.model.photos import (
    BUILTIN_TRAIN,
    BUILTIN_VAL,
    DataError,
    load_builtin_photo,
    to_rgb_uint8,
)

MAX_SIDE = 1280
# the rendered wallpapers are kept smaller, so their smooth gradients are ~10 % of the
# training pixels and photographs stay the majority (docs/TRAINING.md)
MAX_SIDE_BY_PACKAGE = {"ukui-wallpapers": 640}
DEFAULT_MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class DebPackage:
    name: str
    version: str
    pool_path: str
    sha256: str
    size: int
    licence: str


# Debian 12 (bookworm) versions, as `apt-cache show` listed them.
PACKAGES: dict[str, DebPackage] = {p.name: p for p in (
    DebPackage("mate-backgrounds", "1.26.0-1",
               "pool/main/m/mate-backgrounds/mate-backgrounds_1.26.0-1_all.deb",
               "7bf4c2209f34b4f61ba6d24c8b58c28b361e82e4b943aae6d42c030169af9e04", 46638500,
               "GPL-2+ (photographers listed in the package's copyright file)"),
    DebPackage("mypaint-data-extras", "2.0.1-9",
               "pool/main/m/mypaint/mypaint-data-extras_2.0.1-9_all.deb",
               "9d5971baa5eb411309940ea2cfe11aa7f6ec2c39e7f9ecd2bbef81fc6404b1d1", 2873864,
               "GPL-2+ (package); MrMamurk's scanned papers CC0-1.0"),
    DebPackage("ukui-wallpapers", "20.04.3-1.1",
               "pool/main/u/ukui-wallpapers/ukui-wallpapers_20.04.3-1.1_all.deb",
               "6d49be70152e6d603163458e177e501deb0be8f2916389ccbfcf59b0d7fc0262", 21469048,
               "CC-BY-SA-3.0 (Ubuntu Kylin community)"),
    DebPackage("plasma-workspace-wallpapers", "4:5.27.5-2",
               "pool/main/p/plasma-workspace-wallpapers/plasma-workspace-wallpapers_5.27.5-2_all.deb",
               "32cd18b71c8c938a18b3b351f217c02ac590e323caa3cf322fbb875ce8892f8b", 94047772,
               "LGPL-3 (each wallpaper's metadata.json names its photographer)"),
)}

_MATE = "./usr/share/backgrounds/mate/nature/"
_MYPAINT = "./usr/share/mypaint/backgrounds/"
_UKUI = "./usr/share/backgrounds/"
_KDE = "./usr/share/wallpapers/"

# (package, member path in data.tar) per role
TRAIN_FILES: tuple[tuple[str, str], ...] = (
    # photographs: flowers, grass, leaves, water, sand, wood - the greens and smooth bokeh
    # that scikit-image lacks
    *(("mate-backgrounds", f"{_MATE}{n}.jpg") for n in (
        "Aqua", "Blinds", "Dune", "FreshFlower", "Garden", "GreenMeadow", "RainDrops",
        "TwoWings", "Wood", "YellowFlower")),
    # scanned papers and canvases: photographic fine texture
    *(("mypaint-data-extras", f"{_MYPAINT}ramon/HR_{n}.png") for n in (
        "Canvas 01", "Canvas 02", "Cork", "DecoPaper", "PastelPaper 01", "PastelPaper 02",
        "RoughPaper", "SketchPaper 02", "SketchPaper", "WaterColor")),
    *(("mypaint-data-extras", f"{_MYPAINT}mrmamurk/mamurk_{n}.png") for n in (
        "a_1", "a_2", "b_1", "c_3", "e_2", "f_1")),
    # rendered wallpapers: saturated smooth gradients (magenta, cyan, deep blue) and flat areas
    *(("ukui-wallpapers", f"{_UKUI}{n}") for n in (
        "2004default.jpg", "calla.png", "city.png", "desert.png", "firstgeneration.jpg",
        "fluent-color.png", "focal-ubuntukylin.png", "goldfish.png", "rhythm.jpg",
        "rollpaper.png", "string.jpg", "the-mouse.jpg")),
)
SELECT_FILES: tuple[tuple[str, str], ...] = tuple(
    ("mate-backgrounds", f"{_MATE}{n}.jpg") for n in ("Storm", "LadyBird"))
# the photographs among the KDE wallpapers (the rest are illustrations, unused)
TEST_FILES: tuple[tuple[str, str], ...] = tuple(
    ("plasma-workspace-wallpapers", f"{_KDE}{n}/contents/images/2560x1600.jpg") for n in (
        "BytheWater", "ColdRipple", "ColorfulCups", "DarkestHour", "EveningGlow", "FallenLeaf",
        "Grey", "Kite", "OneStandsOut", "Path", "summer_1am"))
ROLES = {"train": TRAIN_FILES, "select": SELECT_FILES, "test": TEST_FILES}

# photographs inside pip packages (the evaluation-only set): (package, path inside it)
PIP_HELDOUT: tuple[tuple[str, str], ...] = (
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
    ("sklearn", "datasets/images/china.jpg"),
    ("sklearn", "datasets/images/flower.jpg"),
)


def cache_dir() -> Path:
    """``$VQSERVE_DATA_DIR``, else ``~/.cache/vqserve/data``."""
    env = os.environ.get("VQSERVE_DATA_DIR")
    return Path(env) if env else Path.home() / ".cache" / "vqserve" / "data"


def local_path(package: str, member: str, root: Path | None = None) -> Path:
    """Where an extracted file lives: ``<cache>/<package>/<member without ./usr/share/>``."""
    rel = member.removeprefix("./usr/share/")
    return (root or cache_dir()) / package / rel


def missing_files(role: str, root: Path | None = None) -> list[Path]:
    return [p for p in (local_path(pkg, m, root) for pkg, m in ROLES[role]) if not p.is_file()]


# -- fetching ---------------------------------------------------------------------------


def _ar_members(blob: bytes) -> dict[str, bytes]:
    """The members of a Debian ``ar`` archive (a .deb): name -> bytes."""
    if not blob.startswith(b"!<arch>\n"):
        raise DataError("not a Debian package (no ar header)")
    out, pos = {}, 8
    while pos + 60 <= len(blob):
        header = blob[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        out[name] = blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    return out


def extract_members(deb: bytes, members: list[str], dest: Path, package: str) -> list[Path]:
    """Extract ``members`` of a .deb's data.tar.* into ``dest/<package>/...`` (no dpkg needed)."""
    parts = _ar_members(deb)
    data_name = next((n for n in parts if n.startswith("data.tar")), None)
    if data_name is None:
        raise DataError(f"{package}: no data.tar member in the package")
    wanted, written = set(members), []
    with tarfile.open(fileobj=io.BytesIO(parts[data_name]), mode="r:*") as tar:
        for info in tar:
            if info.name in wanted and info.isfile():
                target = local_path(package, info.name, dest)
                with tar.extractfile(info) as src:  # a cache, fetched again if lost: no fsync
                    atomic_write_stream(target, lambda fh, src=src: shutil.copyfileobj(src, fh), durable=False)
                written.append(target)
                wanted.discard(info.name)
    if wanted:
        raise DataError(f"{package}: files not found in the package: {sorted(wanted)}")
    return written


def download_verified(pkg: DebPackage, mirror: str = DEFAULT_MIRROR) -> bytes:
    """Download one pinned .deb and check its SHA-256 (a mismatch is an error, never used)."""
    url = f"{mirror.rstrip('/')}/{pkg.pool_path}"
    with urllib.request.urlopen(url, timeout=60) as resp:
        blob = resp.read()
    digest = hashlib.sha256(blob).hexdigest()
    if digest != pkg.sha256:
        raise DataError(f"{pkg.name} {pkg.version}: sha256 {digest} from {url} does not match the pinned "
                        f"{pkg.sha256}; the mirror may have dropped this version")
    return blob


def fetch(root: Path | None = None, mirror: str = DEFAULT_MIRROR, debs: Path | None = None,
          log=print) -> Path:
    """Fetch every pinned package not yet extracted, verify it, extract the listed files.

    ``debs``: a folder holding already-downloaded .deb files (``apt-get download``); each is
    verified against its pinned SHA-256 like a download.
    """
    root = root or cache_dir()
    by_package: dict[str, list[str]] = {}
    for files in ROLES.values():
        for pkg, member in files:
            by_package.setdefault(pkg, []).append(member)
    for name, members in by_package.items():
        pkg = PACKAGES[name]
        if all(local_path(name, m, root).is_file() for m in members):
            log(f"{name} {pkg.version}: {len(members)} files already in {root / name}")
            continue
        local = next(iter(sorted(debs.glob(f"{name}_*.deb"))), None) if debs else None
        if local is not None:
            blob = local.read_bytes()
            if hashlib.sha256(blob).hexdigest() != pkg.sha256:
                raise DataError(f"{local}: sha256 does not match the pinned {name} {pkg.version}")
        else:
            log(f"{name} {pkg.version}: downloading {pkg.size / 1e6:.0f} MB from {mirror}")
            blob = download_verified(pkg, mirror)
        extract_members(blob, members, root, name)
        (root / name / "VERSION").write_text(f"{name} {pkg.version} sha256 {pkg.sha256}\n")
        log(f"{name} {pkg.version}: sha256 ok, {len(members)} files -> {root / name}")
    return root


# -- loading ----------------------------------------------------------------------------


def load_reduced(path: str | os.PathLike, max_side: int = MAX_SIDE) -> np.ndarray:
    """Decode to uint8 RGB, reduced by the smallest integer factor that brings the long side
    to at most ``max_side`` (box filter: deterministic)."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        im = im.convert("RGB")
        k = -(-max(im.size) // max_side)
        if k > 1:
            im = im.reduce(k)
        return to_rgb_uint8(np.asarray(im))


def package_images(role: str, root: Path | None = None) -> tuple[list[np.ndarray], list[str]]:
    """The package images of one role; a clear error naming ``make data`` when absent."""
    if role not in ROLES:
        raise DataError(f"unknown data role {role!r}; one of {sorted(ROLES)}")
    missing = missing_files(role, root)
    if missing:
        raise DataError(f"{len(missing)} of the {len(ROLES[role])} '{role}' photographs are not in "
                        f"{root or cache_dir()} (first: {missing[0]}); run `make data` "
                        "(python -m vqserve.training.datasets fetch) to download the pinned packages")
    images, names = [], []
    for pkg, member in ROLES[role]:
        path = local_path(pkg, member, root)
        images.append(load_reduced(path, MAX_SIDE_BY_PACKAGE.get(pkg, MAX_SIDE)))
        # KDE wallpapers are folders named after the picture: <name>/contents/images/<size>.jpg
        names.append(f"{pkg}/{path.parents[2].name if 'contents' in path.parts else path.name}")
    return images, names


def pip_heldout_images() -> tuple[list[np.ndarray], list[str]]:
    """matplotlib's and scikit-learn's sample photographs (evaluation only)."""
    import importlib.util

    images, names = [], []
    for module, rel in PIP_HELDOUT:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise DataError(f"the held-out photographs need {module!r} installed "
                            "(pip install matplotlib scikit-learn)")
        path = Path(next(iter(spec.submodule_search_locations))) / rel
        if not path.is_file():
            raise DataError(f"{module} does not ship {rel} in this version")
        images.append(load_reduced(path))
        names.append(f"{module}/{path.name}")
    return images, names


def role_photos(role: str) -> tuple[list[np.ndarray], list[str]]:
    """``photos:<role>`` as training reads it: scikit-image's split of ``role`` ("train": its
    train split, "select": its val split) followed by the package photographs of ``role``."""
    names = list(BUILTIN_TRAIN if role == "train" else BUILTIN_VAL)
    photos = [load_builtin_photo(n) for n in names]
    images, package_names = package_images(role)
    return photos + images, names + package_names


def export_split(role: str, out: Path) -> tuple[int, int]:
    """Write ``photos:<role>`` as the training code sees it (decoded, reduced, RGB) into
    ``out`` as lossless PNGs, ``000.png`` onwards in the split's order. A folder source of
    these files gives the same pixels as the spec itself, with no cache or network needed.
    Refuses a folder that holds anything: nothing of the user's is overwritten."""
    from PIL import Image

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out}: exists and is not an empty folder; give a new one")
    images, _ = role_photos(role)
    out.mkdir(parents=True, exist_ok=True)
    size = 0
    for i, image in enumerate(images):
        path = out / f"{i:03d}.png"
        Image.fromarray(image).save(path, optimize=True)
        size += path.stat().st_size
    return len(images), size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vqserve.training.datasets",
                                     description="Fetch and list the pinned package photographs.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download, verify and extract the pinned packages")
    f.add_argument("--dir", type=Path, help=f"cache directory (default {cache_dir()})")
    f.add_argument("--mirror", default=DEFAULT_MIRROR, help="Debian mirror base URL")
    f.add_argument("--debs", type=Path, help="use .deb files already downloaded here (verified)")
    sub.add_parser("list", help="print every file, its role and whether it is present")
    e = sub.add_parser("export", help="write the photos:train or photos:select images, as training "
                       "reads them, as PNG files into a new folder (for a machine with no network, "
                       "e.g. a lent GPU: train there with data: DIR)")
    e.add_argument("--role", choices=["train", "select"], default="train",
                   help="which split (the held-out photographs are never exported for training)")
    e.add_argument("--out", type=Path, required=True, help="a folder that does not exist yet, or is empty")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "fetch":
            root = fetch(args.dir, args.mirror, args.debs)
            print(f"data set ready in {root}")
            return 0
        if args.cmd == "export":
            count, size = export_split(args.role, args.out)
            print(f"photos:{args.role}: {count} images, {size / 1e6:.1f} MB of PNG in {args.out}")
            return 0
        for role, files in ROLES.items():
            for pkg, member in files:
                p = local_path(pkg, member)
                print(f"{role:<7} {'ok' if p.is_file() else 'MISSING':<8} {pkg} {member}")
        return 0
    except (DataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
