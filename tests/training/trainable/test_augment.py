"""Augmentation on the workers: a registry of small objects, seeded by (seed, epoch, pass, batch)
alone, so a resumed pass gets the same augmented batches."""

from __future__ import annotations

import pytest
import torch

from mopflow.training.trainable.augment import (
    AUGMENTATIONS,
    AugmentedBatches,
    AugmentError,
    augmenter,
    parse_spec,
    resolve,
)

SHAPES = {"image": (3, 6, 5), "sequence": (9, 2)}


@pytest.mark.parametrize("augmentation", AUGMENTATIONS, ids=lambda a: f"{sorted(a.modalities)[0]}-{a.name}")
def test_every_augmentation_keeps_the_shape_and_is_seeded(augmentation: object) -> None:
    modality = sorted(augmentation.modalities)[0]  # type: ignore[attr-defined]
    x = torch.rand(16, *SHAPES[modality])

    def run(seed: int) -> torch.Tensor:
        return augmentation.apply(x, augmentation.default, torch.Generator().manual_seed(seed))  # type: ignore[attr-defined]

    assert run(1).shape == x.shape and torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2)) or not torch.equal(run(1), x)


def test_specs_resolve_per_modality_and_bad_ones_are_named() -> None:
    assert [a.name for a, _ in resolve("auto", "image")] == ["flip", "shift"]
    assert resolve("auto", "table") == [] and resolve("none", "image") == []
    assert [(a.name, amount) for a, amount in resolve("crop:0.5,noise", "sequence")] == [
        ("crop", 0.5),
        ("noise", 0.02),
    ]
    with pytest.raises(AugmentError, match=r"unknown augmentation 'blur' in 'flip,blur'"):
        parse_spec("flip,blur")
    with pytest.raises(AugmentError, match=r"'shift:x': the amount after ':' must be a number"):
        parse_spec("shift:x")
    with pytest.raises(
        AugmentError, match=r"augmentation 'flip' takes \['image'\] data, not 'sequence' data"
    ):
        resolve("flip", "sequence")


def test_a_resumed_pass_gets_the_same_augmented_batches() -> None:
    x = torch.rand(40, 3 * 6 * 5)
    batches = [[x[i : i + 8], torch.zeros(8)] for i in range(0, 40, 8)]
    augment = augmenter("crop,flip,shift", "image", (3, 6, 5))
    whole = [b[0] for b in AugmentedBatches(batches, augment, 7, 2, 0, 0)]
    resumed = [b[0] for b in AugmentedBatches(batches[3:], augment, 7, 2, 0, 3)]
    assert all(torch.equal(a, b) for a, b in zip(whole[3:], resumed, strict=True))
    again = [b[0] for b in AugmentedBatches(batches, augment, 7, 3, 0, 0)]  # another epoch: other draws
    assert not all(torch.equal(a, b) for a, b in zip(whole, again, strict=True))
    assert not augmenter("none", "image", (3, 6, 5))


def test_the_pipeline_config_validates_augment() -> None:
    from mopflow.pipeline.config import ConfigError, PipelineConfig

    assert (
        PipelineConfig.from_conf({"dataset": "shapes", "augment": "Flip, shift:1"}).search.augment
        == "flip, shift:1"
    )
    with pytest.raises(ConfigError, match="unknown augmentation 'warp'"):
        PipelineConfig.from_conf({"augment": "warp"})
    with pytest.raises(ConfigError, match=r"augmentation 'noise' takes \['sequence'\] data, not 'image'"):
        PipelineConfig.from_conf({"dataset": "shapes", "augment": "noise"})
