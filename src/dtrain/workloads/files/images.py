"""An image folder: one subfolder per class, PNG or JPEG files in each, read one by one as a batch needs them.

The sorted subfolder names are the class ids (0, 1, ...). Each image is read with Pillow, converted to
RGB, resized to ``image_size x image_size`` (bilinear) and given as a float tensor ``(3, H, W)`` in
[0, 1]. Loading the folder lists the files and checks that Pillow reads each one (its header and
data, without decoding it), once per process and version of the folder, so a broken image is named
before any worker starts; the pixels are read only when a sample is drawn.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dtrain.errors import ConfigError
from dtrain.workloads.files.common import Samples, optional

__all__ = ["ImageFolder", "read_image_folder", "IMAGE_SUFFIXES"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


class ImageFolder(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``(image, label)`` pairs of ``files`` (each ``(path, class id)``), read when indexed."""

    def __init__(self, files: list[tuple[str, int]], image_size: int) -> None:
        self.files, self.image_size = files, image_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        path, label = self.files[int(i)]
        with Image.open(path) as im:
            rgb = im.convert("RGB").resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
            pixels = np.asarray(rgb, dtype=np.float32) / 255.0
        return torch.from_numpy(pixels).permute(2, 0, 1).contiguous(), torch.tensor(label, dtype=torch.long)


def read_image_folder(folder: Path, image_size: int) -> Samples:
    """The images of ``folder``'s class subfolders (every file checked by Pillow, once per process)."""
    optional("PIL", "Pillow", f"the image folder {folder}")
    root = folder.resolve()
    version = tuple(p.stat().st_mtime_ns for p in (root, *sorted(q for q in root.iterdir() if q.is_dir())))
    classes, files = _scan(str(root), version)
    what = f"{folder}: {len(files)} images of {len(classes)} classes ({', '.join(classes)}), {image_size}x{image_size}"
    return Samples(
        ImageFolder(list(files), image_size),
        (3, image_size, image_size),
        len(classes),
        "classify",
        what,
        labels=classes,
    )


@functools.lru_cache(maxsize=4)
def _scan(folder: str, version: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """The classes and files of ``folder``, each file checked; cached per ``version`` (the times its folders last
    changed: ``dtrain run`` loads its data more than once)."""
    from PIL import Image

    root = Path(folder)
    classes = tuple(sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")))
    if not classes:
        raise ConfigError(
            f"dataset {folder} holds no class subfolders (an image folder has one per class) and "
            "no state.json (a save_to_disk folder)"
        )
    if len(classes) < 2:
        raise ConfigError(f"dataset {folder} holds one class ({classes[0]}); a classifier needs two or more")
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        mine = sorted(p for p in (root / name).iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not mine:
            raise ConfigError(f"dataset {folder}: class folder {name} holds no PNG or JPEG image")
        for p in mine:
            _check_image(Image, p)
            files.append((str(p), label))
    return classes, tuple(files)


def _check_image(image_module: Any, path: Path) -> None:
    try:
        with image_module.open(path) as im:
            im.verify()
    except Exception as e:  # Pillow's UnidentifiedImageError, a truncated file's OSError or SyntaxError
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"image {path}: Pillow cannot read it ({msg})") from None
