"""scikit-learn's bundled digits images (1797 8×8 grey-scale digits, 10 classes): real data, no download."""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from spikingsail.errors import SailError

DATA_FILE = ("datasets", "data", "digits.csv.gz")
"""Where scikit-learn keeps the digits, under its package directory: one row per image, its 64
pixels and then its label, comma-separated."""


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets of ``(image [1, 8, 8] in 0..1, label)``, split the same way on every rank."""
    pixels, target = digits_arrays()
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def digits_arrays(locations: Sequence[str] | None = None) -> tuple[Any, Any]:
    """The digits as ``sklearn.datasets.load_digits()`` gives them (``images``: 1797 × 8 × 8 floats,
    ``target``: their labels), read from scikit-learn's own file as it reads it, without importing
    scikit-learn (which imports SciPy: over a CPU-second in each rank); where that file is not
    where this scikit-learn's ``locations`` (its package directories) say, from ``load_digits()``."""
    if locations is None:
        spec = importlib.util.find_spec("sklearn")  # finds the package without running it
        locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location, *DATA_FILE)
        if path.is_file():
            import numpy

            with gzip.open(path, mode="rt", encoding="utf-8") as rows:
                data = numpy.loadtxt(rows, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int, copy=False)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SailError(
            "the digits data set needs scikit-learn",
            "it ships the images inside the package, so no network is needed",
            "pip install 'spikingsail[examples]' (or scikit-learn)",
        ) from None
    data = load_digits()
    return data.images, data.target


def write_image_folder(root: str | Path, size: int = 32, test_fraction: float = 0.2) -> Path:
    """The digits as RGB PNGs in torchvision's ImageFolder layout, ``root/train/<class>/*.png`` and
    ``root/val/<class>/*.png`` (class folders ``0`` … ``9``), ``size`` × ``size`` pixels: a real
    data set in the shape of ImageNet's and CIFAR's folders, for the examples without a download.
    Written once: a complete folder (its ``.complete`` marker) is reused. Returns ``root``."""
    root = Path(root)
    if (root / ".complete").is_file():
        return root
    try:
        from PIL import Image
    except ImportError:
        raise SailError("writing the digits as images needs Pillow",
                        fix="pip install 'spikingsail[examples]' (or pillow)") from None  # fmt: skip
    train, test = load_digits_split(test_fraction)
    for split, dataset in (("train", train), ("val", test)):
        images, labels = dataset.tensors
        scaled = torch.nn.functional.interpolate(
            images, size=(size, size), mode="bilinear", align_corners=False
        )
        pixels = (scaled.clamp(0, 1) * 255).round().to(torch.uint8).squeeze(1).numpy()
        for index, (image, label) in enumerate(zip(pixels, labels.tolist(), strict=True)):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image, mode="L").convert("RGB").save(folder / f"{index:04d}.png")
    (root / ".complete").touch()
    return root


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m spikingsail.data.digits",
        description="Write the bundled digits as an ImageFolder (train/ and val/, RGB PNGs): data for "
        "examples/imagenet and examples/cifar_toy with no download.",
    )
    parser.add_argument("root", type=Path)
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    args = parser.parse_args(argv)
    root = write_image_folder(args.root, args.size)
    print(f"{root}: train/ and val/ with 10 class folders of {args.size}x{args.size} RGB PNGs")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
