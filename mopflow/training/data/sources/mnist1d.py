"""MNIST-1D generation, vectorized: the same samples as ``mnist1d.data.make_dataset``, bit for bit.

The ``mnist1d`` package builds each sample in a Python loop that sets up four
``scipy.interpolate.interp1d`` objects and a Gaussian filter per sample (about 250 µs a sample,
nearly all of it call overhead on arrays of 12 to 72 numbers). Here the random draws still come
one sample at a time from the same legacy ``RandomState`` stream, in the package's order, but
the arithmetic runs on all the samples of a partition at once, with the very operations the
package applies (``numpy.interp``'s formula, ``gaussian_filter1d`` row by row), so the output is
identical (``tests/training/data/sources/test_mnist1d.py`` checks it against the package for several
sizes and seeds). Only the package's default dataset arguments are supported: they are what the
shard stage uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from scipy.ndimage import gaussian_filter1d

# mnist1d.data.get_dataset_args() defaults (the package's published dataset)
TRAIN_SPLIT = 0.8
TEMPLATE_LEN = 12
PADDING = (36, 60)
SCALE_COEFF = 0.4
MAX_TRANSLATION = 48
CORR_NOISE_SCALE = 0.25
IID_NOISE_SCALE = 2e-2
SHEAR_SCALE = 0.75
FINAL_SEQ_LENGTH = 40
EPS = 1e-8
N_CLASSES = 10
DILATED_LEN = TEMPLATE_LEN + PADDING[-1]  # 72
# Samples transformed at once: the temporaries (128 x 72 doubles, 72 KiB) stay in the CPU cache
# and under glibc's default mmap threshold (128 KiB), so they are not mmap'd afresh each time.
CHUNK = 128


@dataclass(frozen=True)
class Mnist1d:
    """A generated dataset, split like the package's: the first 80% train, the rest test."""

    x: np.ndarray  # (n_train, 40) float64
    y: np.ndarray  # (n_train,) int64
    x_test: np.ndarray
    y_test: np.ndarray


# The ten digit templates of ``mnist1d.data.get_templates`` (copied: importing the package
# pulls in matplotlib, a second or more per process; the test checks they are the package's).
_DIGITS = (
    (5, 6, 6.5, 6.75, 7, 7, 7, 7, 6.75, 6.5, 6, 5),
    (5, 3, 3, 3.4, 3.8, 4.2, 4.6, 5, 5.4, 5.8, 5, 5),
    (5, 6, 6.5, 6.5, 6, 5.25, 4.75, 4, 3.5, 3.5, 4, 5),
    (5, 6, 6.5, 6.5, 6, 5, 5, 6, 6.5, 6.5, 6, 5),
    (5, 4.4, 3.8, 3.2, 2.6, 2.6, 5, 5, 5, 5, 5, 5),
    (5, 3, 3, 3, 3, 5, 6, 6.5, 6.5, 6, 4.5, 5),
    (5, 4, 3.5, 3.25, 3, 3, 3, 3, 3.25, 3.5, 4, 5),
    (5, 7, 7, 6.6, 6.2, 5.8, 5.4, 5, 4.6, 4.2, 5, 5),
    (5, 4, 3.5, 3.5, 4, 5, 5, 4, 3.5, 3.5, 4, 5),
    (5, 4, 3.5, 3.5, 4, 5, 5, 5, 5, 4.7, 4.3, 5),
)


@cache
def templates() -> np.ndarray:
    """The digit templates, whitened and scaled with the package's operations (10 x 12)."""
    x = np.stack([np.asarray(d, dtype=np.float64) for d in _DIGITS])
    x -= x.mean(1, keepdims=True)
    x /= x.std(1, keepdims=True)
    x -= x[:, :1]
    x = x / 6.0
    x.setflags(write=False)
    return x


def interp_rows(x_new: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """``np.interp(x_new, xp, row)`` for every row of ``fp`` at once, with numpy's own formula.

    numpy's C loop returns ``fp[j]`` where ``x == xp[j]`` (and at the last point) and otherwise
    ``slope * (x - xp[j]) + fp[j]`` with ``slope = (fp[j+1] - fp[j]) / (xp[j+1] - xp[j])``; the
    same operations in the same order give the same doubles. ``x_new`` must lie in ``[xp[0], xp[-1]]``.
    """
    j = np.searchsorted(xp, x_new, side="right") - 1  # xp[j] <= x < xp[j+1]
    exact = xp[j] == x_new  # numpy returns fp[j] there (the last point included)
    k = np.minimum(j, len(xp) - 2)
    slope = (fp[:, k + 1] - fp[:, k]) / (xp[k + 1] - xp[k])
    out = slope * (x_new - xp[k]) + fp[:, k]
    out[:, exact] = fp[:, j[exact]]
    return out


def _draws(rng: np.random.RandomState, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The random numbers of ``n`` samples, in the package's order per sample:
    pad ``rand()``, scale ``rand()``, translate ``choice(48)``, correlated noise ``randn(72)``,
    iid noise ``randn(72)``, shear ``rand()``.

    Consecutive draws of one kind are merged into one call (the legacy stream is the same).
    """
    uniforms = np.empty((n, 3))  # pad, scale, shear
    shifts = np.empty(n, dtype=np.int64)
    gauss = np.empty((n, 2 * DILATED_LEN))
    random_sample, randint, standard_normal = rng.random_sample, rng.randint, rng.standard_normal
    if n:
        uniforms[0, :2] = random_sample(2)
    for i in range(n):
        shifts[i] = randint(0, MAX_TRANSLATION)
        gauss[i] = standard_normal(2 * DILATED_LEN)
        if i + 1 < n:  # this sample's shear and the next one's pad and scale
            uniforms[i, 2], uniforms[i + 1, 0], uniforms[i + 1, 1] = random_sample(3)
        else:
            uniforms[i, 2] = random_sample()
    return uniforms, shifts, gauss[:, :DILATED_LEN], gauss[:, DILATED_LEN:]


def _transform(labels: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """``mnist1d.transform.transform`` of each label's template, all samples at once."""
    n = len(labels)
    uniforms, shifts, corr_gauss, iid_gauss = _draws(rng, n)
    low, high = PADDING
    pads = low + (uniforms[:, 0] * (high - low + 1)).astype(np.int64)

    # pad with zeros, then dilate to 72 points (numpy.interp's terms come from the table)
    k, j, exact, offset, width = (a[pads - low] for a in _dilation_table())
    padded = np.zeros((n, DILATED_LEN))  # the padded rows are shorter; their zeros go on
    padded[:, :TEMPLATE_LEN] = templates()[labels] + EPS
    lower = np.take_along_axis(padded, k, axis=1)
    slope = (np.take_along_axis(padded, k + 1, axis=1) - lower) / width
    dilated = slope * offset + lower
    dilated[exact] = np.take_along_axis(padded, j, axis=1)[exact]

    dilated *= (1 + SCALE_COEFF * (uniforms[:, 1] - 0.5))[:, None]  # scale
    rolled = dilated[np.arange(n)[:, None], (np.arange(DILATED_LEN) - shifts[:, None]) % DILATED_LEN]

    mask = rolled != 0
    corr = gaussian_filter1d(CORR_NOISE_SCALE * corr_gauss, 2, axis=1)
    noisy = mask * rolled + (1 - mask) * corr
    noisy = noisy + IID_NOISE_SCALE * iid_gauss

    coeff = SHEAR_SCALE * (uniforms[:, 2] - 0.5)
    sheared = noisy - coeff[:, None] * np.linspace(-0.5, 0.5, DILATED_LEN)
    return interp_rows(np.linspace(0, 1, FINAL_SEQ_LENGTH), np.linspace(0, 1, DILATED_LEN), sheared)


@cache
def _dilation_table() -> tuple[np.ndarray, ...]:
    """For each padding (row ``pad - PADDING[0]``), ``numpy.interp``'s terms for dilating a
    template padded to ``12 + pad`` points onto 72: the lower index ``k``, the index ``j`` and
    flag of the points that fall exactly on the padded grid, ``x - xp[k]`` and ``xp[k+1] - xp[k]``
    (computed as ``interp_rows`` computes them, so the results are the same doubles)."""
    grid = np.linspace(0, 1, DILATED_LEN)
    rows: list[tuple[np.ndarray, ...]] = []
    for pad in range(PADDING[0], PADDING[1] + 1):
        xp = np.linspace(0, 1, TEMPLATE_LEN + pad)
        j = np.searchsorted(xp, grid, side="right") - 1
        k = np.minimum(j, len(xp) - 2)
        rows.append((k, j, xp[j] == grid, grid - xp[k], xp[k + 1] - xp[k]))
    table = tuple(np.stack(column) for column in zip(*rows, strict=True))
    for array in table:
        array.setflags(write=False)
    return table


def make_mnist1d(num_samples: int, seed: int) -> Mnist1d:
    """``mnist1d.data.make_dataset`` with the default arguments, ``num_samples`` and ``seed``.

    Like the package, it makes ``num_samples // 10`` samples per class.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    rng = np.random.RandomState(seed)
    per_class = num_samples // N_CLASSES
    labels = np.repeat(np.arange(N_CLASSES, dtype=np.int64), per_class)
    # in chunks, in order (the draws continue the same stream): the arrays stay in the CPU cache
    xs = np.empty((len(labels), FINAL_SEQ_LENGTH))
    for start in range(0, len(labels), CHUNK):
        xs[start : start + CHUNK] = _transform(labels[start : start + CHUNK], rng)
    order = rng.permutation(len(labels))
    xs, ys = xs[order], labels[order]
    xs = (xs - xs.mean()) / xs.std()
    split = int(len(ys) * TRAIN_SPLIT)
    return Mnist1d(xs[:split], ys[:split], xs[split:], ys[split:])
