"""Training-time augmentation of a pass's batches, on the worker that trains: random crop,
horizontal flip and shift for images; shift, crop and noise for sequences.

Augmentations are a registry of small objects (:data:`AUGMENTATIONS`); a config names them in a
spec (``"auto"``: the data modality's default, ``"none"``, or ``"flip,shift:2"``: names with an
optional amount). Each batch's random draws come from a generator seeded by (seed, epoch, pass,
batch index) alone, so a pass stopped at batch k and resumed gets the same augmented batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

AUTO, NONE = "auto", "none"
# the default of each modality (tables: none; their columns have no neighbours to shift into)
MODALITY_DEFAULTS = {"table": NONE, "image": "flip,shift:2", "sequence": "shift:2,noise:0.02"}


class AugmentError(ValueError):
    """An augmentation spec names an unknown augmentation, a bad amount, or one the data's
    modality cannot take."""


class Augmentation(Protocol):
    """One augmentation: its name, the modalities it takes, the amount it uses by default, and
    how it changes a batch of examples ``(n, *shape)`` with draws from ``generator``."""

    @property
    def name(self) -> str: ...

    @property
    def modalities(self) -> frozenset[str]: ...

    @property
    def default(self) -> float: ...

    def apply(self, x: Any, amount: float, generator: Any) -> Any: ...


def _uniform_ints(n: int, low: int, high: int, generator: Any) -> Any:
    import torch

    return torch.randint(low, high + 1, (n,), generator=generator)


def _gather_window(x: Any, rows: Any, cols: Any) -> Any:
    """Per example, the rows ``rows[i]`` and columns ``cols[i]`` of image ``x[i]`` (indices
    outside the image read zeros)."""
    import torch

    n, c, h, w = x.shape
    pad_h = int(max(0, -int(rows.min()), int(rows.max()) - h + 1))
    pad_w = int(max(0, -int(cols.min()), int(cols.max()) - w + 1))
    padded = torch.nn.functional.pad(x, (pad_w, pad_w, pad_h, pad_h))
    r = (rows + pad_h).to(x.device)[:, None, :, None]
    q = (cols + pad_w).to(x.device)[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, channel, r, q]


@dataclass(frozen=True)
class ImageFlip:
    """Mirror each image left to right with probability ``amount``."""

    name: str = "flip"
    modalities: frozenset[str] = frozenset({"image"})
    default: float = 0.5

    def apply(self, x: Any, amount: float, generator: Any) -> Any:
        import torch

        flip = (torch.rand(len(x), generator=generator) < amount).to(x.device)
        return torch.where(flip[:, None, None, None], x.flip(-1), x)


@dataclass(frozen=True)
class ImageShift:
    """Move each image by up to ``amount`` pixels each way (the edge filled with zeros)."""

    name: str = "shift"
    modalities: frozenset[str] = frozenset({"image"})
    default: float = 2.0

    def apply(self, x: Any, amount: float, generator: Any) -> Any:
        import torch

        k, (n, _, h, w) = int(amount), x.shape
        dy, dx = _uniform_ints(n, -k, k, generator), _uniform_ints(n, -k, k, generator)
        return _gather_window(x, dy[:, None] + torch.arange(h), dx[:, None] + torch.arange(w))


@dataclass(frozen=True)
class ImageCrop:
    """A random crop of each image, ``amount`` (0 to 1) of its height and width at the smallest,
    resized back to the image's size (nearest pixel)."""

    name: str = "crop"
    modalities: frozenset[str] = frozenset({"image"})
    default: float = 0.8

    def apply(self, x: Any, amount: float, generator: Any) -> Any:
        import torch

        n, _, h, w = x.shape
        scale = amount + (1.0 - amount) * torch.rand(n, generator=generator)
        ch, cw = (scale * h).long().clamp(1, h), (scale * w).long().clamp(1, w)
        top = (torch.rand(n, generator=generator) * (h - ch + 1)).long()
        left = (torch.rand(n, generator=generator) * (w - cw + 1)).long()
        rows = top[:, None] + (torch.arange(h)[None] * ch[:, None]) // h
        cols = left[:, None] + (torch.arange(w)[None] * cw[:, None]) // w
        return _gather_window(x, rows, cols)


@dataclass(frozen=True)
class SequenceShift:
    """Move each sequence by up to ``amount`` steps along time (the end filled with zeros)."""

    name: str = "shift"
    modalities: frozenset[str] = frozenset({"sequence"})
    default: float = 2.0

    def apply(self, x: Any, amount: float, generator: Any) -> Any:
        import torch

        n, steps, _ = x.shape
        k = int(amount)
        index = _uniform_ints(n, -k, k, generator)[:, None] + torch.arange(steps)
        return _gather_window(x[:, None], index, torch.arange(x.shape[2]).expand(n, -1))[:, 0]


@dataclass(frozen=True)
class SequenceCrop:
    """A random window of each sequence, ``amount`` (0 to 1) of its steps at the smallest,
    stretched back to its length (nearest step)."""

    name: str = "crop"
    modalities: frozenset[str] = frozenset({"sequence"})
    default: float = 0.8

    def apply(self, x: Any, amount: float, generator: Any) -> Any:
        import torch

        n, steps, features = x.shape
        scale = amount + (1.0 - amount) * torch.rand(n, generator=generator)
        length = (scale * steps).long().clamp(1, steps)
        start = (torch.rand(n, generator=generator) * (steps - length + 1)).long()
        index = start[:, None] + (torch.arange(steps)[None] * length[:, None]) // steps
        return _gather_window(x[:, None], index, torch.arange(features).expand(n, -1))[:, 0]


@dataclass(frozen=True)
class SequenceNoise:
    """Gaussian noise of ``amount`` times each sequence's own standard deviation."""

    name: str = "noise"
    modalities: frozenset[str] = frozenset({"sequence"})
    default: float = 0.02

    def apply(self, x: Any, amount: float, generator: Any) -> Any:
        import torch

        noise = torch.randn(x.shape, generator=generator).to(x.device)
        scale = x.flatten(1).std(dim=1).reshape(-1, *([1] * (x.dim() - 1)))
        return x + amount * scale * noise


AUGMENTATIONS: tuple[Augmentation, ...] = (
    ImageCrop(),
    ImageFlip(),
    ImageShift(),
    SequenceShift(),
    SequenceCrop(),
    SequenceNoise(),
)
BY_KEY = {(modality, a.name): a for a in AUGMENTATIONS for modality in a.modalities}
NAMES = sorted({a.name for a in AUGMENTATIONS})


def parse_spec(spec: str) -> list[tuple[str, float | None]]:
    """The (name, amount or None) steps of a spec; ``auto`` and ``none`` stay as they are."""
    text = spec.strip().lower()
    if text in (AUTO, NONE, ""):
        return [(text or NONE, None)]
    steps: list[tuple[str, float | None]] = []
    for part in text.split(","):
        name, _, raw = part.strip().partition(":")
        if name not in NAMES:
            raise AugmentError(
                f"unknown augmentation {name!r} in {spec!r}; expected {AUTO!r}, {NONE!r} or {NAMES}"
            )
        try:
            amount = float(raw) if raw else None
        except ValueError as exc:
            raise AugmentError(
                f"augmentation {part.strip()!r}: the amount after ':' must be a number"
            ) from exc
        if amount is not None and not 0.0 <= amount <= 64.0:
            raise AugmentError(f"augmentation {part.strip()!r}: the amount must lie in [0, 64]")
        steps.append((name, amount))
    return steps


def resolve(spec: str, modality: str) -> list[tuple[Augmentation, float]]:
    """The augmentations of ``spec`` for data of ``modality`` with their amounts; one the
    modality cannot take is refused naming both."""
    steps = parse_spec(spec)
    if steps[0][0] == AUTO:
        steps = parse_spec(MODALITY_DEFAULTS.get(modality, NONE))
    if steps[0][0] == NONE:
        return []
    out = []
    for name, amount in steps:
        augmentation = BY_KEY.get((modality, name))
        if augmentation is None:
            takes = sorted({m for m, n in BY_KEY if n == name})
            raise AugmentError(f"augmentation {name!r} takes {takes} data, not {modality!r} data")
        out.append((augmentation, augmentation.default if amount is None else amount))
    return out


class Augmenter:
    """A resolved spec applied to flat batches ``(n, prod(shape))``: reshaped to the examples'
    shape, augmented in order, flattened back."""

    def __init__(self, steps: Sequence[tuple[Augmentation, float]], shape: Sequence[int]) -> None:
        self.steps, self.shape = list(steps), tuple(int(n) for n in shape)

    def __bool__(self) -> bool:
        return bool(self.steps)

    def __call__(self, x: Any, seed: int, epoch: int, pass_index: int, batch: int) -> Any:
        """Batch ``batch`` of pass (``epoch``, ``pass_index``) augmented with draws from a
        generator seeded by those alone."""
        import torch

        generator = torch.Generator().manual_seed(hash_seed(seed, epoch, pass_index, batch))
        out = x.reshape(len(x), *self.shape)
        for augmentation, amount in self.steps:
            out = augmentation.apply(out, amount, generator)
        return out.reshape(len(x), -1).to(x.dtype)


def hash_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (stable across processes and runs)."""
    import hashlib

    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def augmenter(spec: str, modality: str, shape: Sequence[int]) -> Augmenter:
    """The augmenter of ``spec`` for data of ``modality`` and example ``shape``."""
    return Augmenter(resolve(spec, modality), shape)


class AugmentedBatches:
    """A pass's batches with the first tensor augmented; ``first``: the index of the first batch
    (a resumed pass), so each batch keeps its index and its draws."""

    def __init__(
        self, batches: Any, augment: Augmenter, seed: int, epoch: int, pass_index: int, first: int
    ) -> None:
        self.batches, self.augment, self.first = batches, augment, first
        self.seed, self.epoch, self.pass_index = seed, epoch, pass_index

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[Any]]:
        for index, batch in enumerate(self.batches, start=self.first):
            x = self.augment(batch[0], self.seed, self.epoch, self.pass_index, index)
            yield [x, *batch[1:]]
