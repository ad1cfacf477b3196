"""Predictions, ensemble selection and accuracy computed on the Dask workers, one shard at a time.

The ensemble stage does not gather a split into its task process. Each validation or test shard
is read on a worker, every model in question predicts it there, and the class probabilities are
written beside the stage's outputs as one file per shard (``models x rows x classes``, float32).
The task process holds only per-shard counts: an accuracy is the sum of the shards' correct rows
over the sum of their rows, and greedy ensemble selection (Caruana et al. 2004) is one pass over
the probability shards per step, each shard returning, for every candidate, the correct rows and
the summed log loss of the running average with that candidate added.

The probability files are keyed by the models' bundles and the shard's checksum, so a rerun of
the stage reuses them.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mopflow.base import storage
from mopflow.base.hosts import storage_options_here
from mopflow.base.storage import canonical_hash


@dataclass(frozen=True)
class ShardCounts:
    """What one pass over a split's probability shards adds up to."""

    correct: np.ndarray  # per candidate (or per weighting): rows predicted right
    log_loss: np.ndarray  # per candidate: summed negative log probability of the label
    rows: int

    def __add__(self, other: ShardCounts) -> ShardCounts:
        return ShardCounts(
            self.correct + other.correct, self.log_loss + other.log_loss, self.rows + other.rows
        )

    def accuracy(self) -> np.ndarray:
        """Correct rows over all rows (0.0 for an empty split)."""
        return self.correct / self.rows if self.rows else np.zeros_like(self.correct, dtype=np.float64)


def predict_shard(
    manifest_uri: str,
    split: str,
    shard: str,
    bundle_uris: Sequence[str],
    out_uri: str,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """On a worker: every bundle's class probabilities on one shard, saved (with the labels) at
    ``out_uri``; an existing file is reused. Returns ``out_uri``."""
    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    if storage.exists(out_uri, storage_options):
        return out_uri
    from mopflow.training.data import load_split
    from mopflow.training.models.bundle import load_bundle, predict_proba

    x, y = load_split(manifest_uri, split, storage_options, shard_names=[shard])
    probs = np.stack(
        [predict_proba(load_bundle(uri, storage_options).module, x).numpy() for uri in bundle_uris]
    ).astype(np.float32)
    buffer = io.BytesIO()
    np.savez(buffer, probs=probs, labels=y)
    storage.write_bytes_atomic(out_uri, buffer.getvalue(), storage_options)
    return out_uri


def read_probabilities(
    uri: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A probability shard: ``(models, rows, classes)`` probabilities and the rows' labels; one
    that cannot be read raises :class:`~mopflow.training.data.ShardIntegrityError` naming it."""
    from mopflow.training.data import ShardIntegrityError

    try:
        with np.load(io.BytesIO(storage.read_bytes(uri, storage_options))) as saved:
            return saved["probs"], saved["labels"]
    except Exception as exc:
        raise ShardIntegrityError(
            f"prediction shard {uri} cannot be read: {type(exc).__name__}: {exc}"
        ) from exc


def selection_counts(
    uri: str, chosen: Sequence[int], storage_options: Mapping[str, Any] | None = None
) -> ShardCounts:
    """On a worker: for every candidate of a probability shard, the correct rows and summed log loss
    of the average of the ``chosen`` models (repeats count twice) with that candidate added."""
    from mopflow.training.models.metrics import top1_correct

    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    probs, labels = read_probabilities(uri, storage_options)
    rows = np.arange(len(labels))
    running = probs[list(chosen)].sum(axis=0, dtype=np.float64) if chosen else np.zeros(probs.shape[1:])
    correct, log_loss = [], []
    for candidate in probs:
        average = (running + candidate) / (len(chosen) + 1)
        correct.append(top1_correct(average, labels))
        log_loss.append(float(-np.log(average[rows, labels] + 1e-12).sum()))
    return ShardCounts(np.array(correct), np.array(log_loss), len(labels))


def weighted_counts(
    uri: str, weightings: Sequence[Sequence[float]], storage_options: Mapping[str, Any] | None = None
) -> ShardCounts:
    """On a worker: the correct rows of each weighting's average of a probability shard's models
    (a weighting names a weight per model; a one-hot weighting is a single model)."""
    from mopflow.training.models.metrics import top1_correct

    storage_options = storage_options_here(storage_options)  # a worker's own, when it sets them
    probs, labels = read_probabilities(uri, storage_options)
    correct = []
    for weights in weightings:
        w = np.asarray(weights, dtype=np.float64)
        correct.append(top1_correct(np.tensordot(w / w.sum(), probs, axes=1), labels))
    return ShardCounts(np.array(correct), np.zeros(len(correct)), len(labels))


class ShardEvaluator:
    """Runs the per-shard functions above on a Dask client and adds up their counts."""

    def __init__(
        self,
        client: Any,
        manifest_uri: str,
        out_dir: str,
        storage_options: Mapping[str, Any] | None = None,
        manifest: Mapping[str, Any] | None = None,
    ) -> None:
        from mopflow.training.data import load_manifest

        self.client, self.manifest_uri, self.out_dir = client, manifest_uri, out_dir
        self.storage_options = dict(storage_options or {})
        # the caller's manifest when it read it already: one read per stage
        self.manifest = manifest if manifest is not None else load_manifest(manifest_uri, storage_options)

    def predictions(self, split: str, bundle_uris: Sequence[str]) -> list[str]:
        """The probability shards of ``bundle_uris`` on ``split``, one per data shard (computed on
        the workers, or reused when an earlier attempt wrote them)."""
        models = canonical_hash(list(bundle_uris))[:12]
        entries = self.manifest["splits"][split]
        if not entries:
            raise ValueError(f"the {split} split of {self.manifest_uri} has no shards to evaluate on")
        outs = [
            storage.join(self.out_dir, f"{split}-{models}-{entry['sha256'][:12]}.npz") for entry in entries
        ]
        futures = [
            self.client.submit(
                predict_shard,
                self.manifest_uri,
                split,
                str(entry["name"]),
                list(bundle_uris),
                out,
                self.storage_options,
                key=f"predict-{split}-{models}-{index}",
            )
            for index, (entry, out) in enumerate(zip(entries, outs, strict=True))
        ]
        return list(self.client.gather(futures))

    def _total(self, function: Any, uris: Sequence[str], argument: Any) -> ShardCounts:
        futures = self.client.map(
            function, list(uris), [argument] * len(uris), [self.storage_options] * len(uris), pure=False
        )
        counts: list[ShardCounts] = self.client.gather(futures)
        total = counts[0]
        for part in counts[1:]:
            total = total + part
        return total

    def greedy_selection(self, uris: Sequence[str], size: int) -> list[int]:
        """Forward selection with replacement over the models of the probability shards ``uris``:
        at each of ``size`` steps the candidate whose addition is most accurate (log loss breaks
        ties; the lower index wins a full tie). Returns the picks, repeats included."""
        chosen: list[int] = []
        for _ in range(size):
            total = self._total(selection_counts, uris, list(chosen))
            keys = [(float(c), -float(loss)) for c, loss in zip(total.correct, total.log_loss, strict=True)]
            chosen.append(max(range(len(keys)), key=lambda i: (keys[i], -i)))
        return chosen

    def accuracies(self, uris: Sequence[str], weightings: Sequence[Sequence[float]]) -> list[float]:
        """The accuracy of each weighting of the models of the probability shards ``uris``."""
        return [
            float(a) for a in self._total(weighted_counts, uris, [list(w) for w in weightings]).accuracy()
        ]
