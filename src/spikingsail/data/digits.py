"""scikit-learn's bundled digits images (1797 8×8 grey-scale digits, 10 classes): real data, no download."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from spikingsail.errors import SailError


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets of ``(image [1, 8, 8] in 0..1, label)``, split the same way on every rank."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SailError(
            "the digits data set needs scikit-learn",
            "it ships the images inside the package, so no network is needed",
            "pip install 'spikingsail[examples]' (or scikit-learn)",
        ) from None
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])
