"""Real data for convergence checks: scikit-learn's bundled 8x8 digits.

``sklearn.datasets.load_digits`` ships 1,797 grey-scale 8x8 images of the
digits 0-9 with the library (no download). :func:`load_digits_data` splits
them deterministically into train and test sets and normalises them with the
training set's mean and standard deviation; :meth:`DigitsData.shard` gives a
rank its contiguous slice of the training set; :func:`evaluate_accuracy`
measures a classifier. Two models read ``(B, 1, 8, 8)`` images: an MLP and a
small CNN.

scikit-learn is an optional dependency (``pip install scaleout[data]``); it is
imported only when the data are first loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from scaleout.workloads.base import (
    Batch,
    Workload,
    build_seeded,
    check_int,
    make_generator,
    shard_bounds,
)

__all__ = [
    "DigitsData",
    "DigitsWorkload",
    "digits_cnn",
    "digits_mlp",
    "evaluate_accuracy",
    "load_digits_data",
]

NUM_CLASSES = 10
_MODELS = ("mlp", "cnn")


@functools.lru_cache(maxsize=1)
def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    """The bundled images ``(1797, 64)`` and labels, read once, read-only."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "the digits workloads need scikit-learn, which ships the dataset; "
            "install it with `pip install scikit-learn` (or `pip install scaleout[data]`)"
        ) from err
    images, labels = load_digits(return_X_y=True)
    images = images.astype(np.float32)
    labels = labels.astype(np.int64)
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


@dataclass(frozen=True, kw_only=True)
class DigitsData:
    """Normalised digits, ``inputs`` as ``(N, 1, 8, 8)`` float32, ``targets`` as ``(N,)`` int64."""

    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    test_inputs: torch.Tensor
    test_targets: torch.Tensor

    def shard(self, rank: int, world_size: int) -> DigitsData:
        """This rank's contiguous slice of the training set (the test set is kept whole).

        Concatenating the shards of ranks ``0..world_size-1`` gives the whole
        training set in its original order.

        Raises:
            TypeError, ValueError: for an invalid ``rank`` / ``world_size``.
        """
        start, stop = shard_bounds(len(self.train_targets), rank, world_size)
        return DigitsData(
            train_inputs=self.train_inputs[start:stop],
            train_targets=self.train_targets[start:stop],
            test_inputs=self.test_inputs,
            test_targets=self.test_targets,
        )

    def steps_per_epoch(self, batch_size: int, world_size: int) -> int:
        """Batches of ``batch_size`` samples that every rank takes from its :meth:`shard` of
        ``world_size`` per epoch: the same number on every rank, that of the smallest shard.

        Shards differ by one sample. Counted per shard (as the digits examples did before
        stop 51), 1,438 images at 3 ranks of 32 gave ranks 0 and 1 14 steps and rank 2 15,
        whose last step waited for the others' gradients until the job's timeout.

        Raises:
            TypeError, ValueError: for an invalid ``batch_size`` / ``world_size``.
        """
        check_int("batch_size", batch_size, 1)
        check_int("world_size", world_size, 1)
        return len(self.train_targets) // world_size // batch_size


def load_digits_data(*, test_fraction: float = 0.2, split_seed: int = 0) -> DigitsData:
    """Load, split and normalise the digits dataset deterministically.

    Args:
        test_fraction: share of the 1,797 images held out, in (0, 1); the
            default keeps 1,438 for training and 359 for testing.
        split_seed: seed of the permutation that assigns images to the splits.

    Returns:
        A :class:`DigitsData`; pixel values are standardised with the mean
        and standard deviation of the training pixels.

    Raises:
        ImportError: if scikit-learn is not installed.
        TypeError, ValueError: for arguments out of range.
    """
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)):
        raise TypeError(f"test_fraction must be a float, got {test_fraction!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    check_int("split_seed", split_seed, 0)
    images, labels = _raw_digits()
    order = np.random.default_rng(split_seed).permutation(len(labels))
    n_test = round(len(labels) * test_fraction)
    if not 0 < n_test < len(labels):
        raise ValueError(f"test_fraction={test_fraction} leaves an empty train or test set")
    test_idx, train_idx = order[:n_test], order[n_test:]
    train = images[train_idx]
    mean, std = float(train.mean()), float(train.std())

    def prepare(idx: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((images[idx] - mean) / std).view(-1, 1, 8, 8)

    return DigitsData(
        train_inputs=prepare(train_idx),
        train_targets=torch.from_numpy(labels[train_idx].copy()),
        test_inputs=prepare(test_idx),
        test_targets=torch.from_numpy(labels[test_idx].copy()),
    )


def evaluate_accuracy(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, batch_size: int = 1024
) -> float:
    """Fraction of ``inputs`` whose arg-max logit equals the target.

    The model is evaluated in eval mode without gradients and put back in the
    mode it was in.

    Args:
        model: classifier returning ``(B, num_classes)`` logits.
        inputs: ``(N, ...)`` tensor.
        targets: ``(N,)`` class indices.
        batch_size: evaluation chunk size, >= 1.

    Returns:
        Accuracy in [0, 1].

    Raises:
        ValueError: if ``inputs`` and ``targets`` differ in length, are empty,
            or ``batch_size < 1``.
    """
    if len(inputs) != len(targets) or len(targets) == 0:
        raise ValueError(
            f"need as many inputs as targets, at least one; got {len(inputs)} and {len(targets)}"
        )
    check_int("batch_size", batch_size, 1)
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, len(targets), batch_size):
                logits = model(inputs[start:start + batch_size])
                correct += int((logits.argmax(dim=1) == targets[start:start + batch_size]).sum())
    finally:
        model.train(was_training)
    return correct / len(targets)


def digits_mlp(hidden: int = 128) -> nn.Sequential:
    """MLP ``64 -> hidden -> hidden/2 -> 10`` with ReLU; reads ``(B, 1, 8, 8)``."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden // 2), nn.ReLU(),
        nn.Linear(hidden // 2, NUM_CLASSES),
    )


def digits_cnn(channels: int = 16) -> nn.Sequential:
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers; reads ``(B, 1, 8, 8)``."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 16, 64), nn.ReLU(),
        nn.Linear(64, NUM_CLASSES),
    )


@dataclass(frozen=True, kw_only=True)
class DigitsWorkload(Workload):
    """An MLP or a small CNN on the real digits training set.

    Batches walk through the training set in a fresh permutation each epoch
    (dropping the last partial batch); the permutation depends on
    ``(seed, epoch)``, so ``make_batch`` stays a pure function of
    ``(batch_size, step, seed)``.

    Args:
        model: ``"mlp"`` or ``"cnn"``.
        default_batch_size: per-rank batch size used by benchmarks.

    Raises:
        ValueError: on construction, for an unknown model or bad batch size.
    """

    model: str = "mlp"
    default_batch_size: int = 32

    def __post_init__(self) -> None:
        if self.model not in _MODELS:
            raise ValueError(f"model must be one of {_MODELS}, got {self.model!r}")
        check_int("default_batch_size", self.default_batch_size, 1)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"digits-{self.model}"

    @property
    def description(self) -> str:  # type: ignore[override]
        return (
            f"{self.model.upper()} on scikit-learn's 8x8 digits (real data, 1438 train / "
            f"359 test images), batch {self.default_batch_size}/rank"
        )

    @cached_property
    def data(self) -> DigitsData:
        """The default split of :func:`load_digits_data`, loaded on first use and kept."""
        return load_digits_data()

    def build_model(self, seed: int) -> nn.Sequential:
        return build_seeded(digits_mlp if self.model == "mlp" else digits_cnn, seed)

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def _global_batch(self, batch_size: int, step: int, seed: int) -> Batch:
        data = self.data
        n_train = len(data.train_targets)
        if batch_size > n_train:
            raise ValueError(f"batch_size must be <= {n_train} (the training set), got {batch_size}")
        steps_per_epoch = n_train // batch_size
        epoch, index = divmod(step, steps_per_epoch)
        order = torch.randperm(n_train, generator=make_generator(seed, epoch, n_train))
        rows = order[index * batch_size:(index + 1) * batch_size]
        return data.train_inputs[rows], data.train_targets[rows]
