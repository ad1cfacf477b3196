"""The residual 1-D CNN family (``rescnn``): shapes, its random-shift augmentation, and that it learns."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mopflow.training.models.builtin import ArchSpec, build_model, count_params, largest_size_within
from mopflow.training.models.families import DataSpec, get_family
from mopflow.training.models.zoo import RandomShift


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: these models are tiny, and on a busy small machine more threads only
    wait for each other (a hundredfold slower at times)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Parameter counts by hand. Convolutions have no bias; a BatchNorm of c channels has 2c parameters
# (its running statistics are buffers). With width w and c input channels:
#   stem: conv k5 c->w (5*c*w) + BN (2w)
#   block keeping the shape (even index): two conv k3 w->w (2 * 3*w*w) + two BN (2 * 2w)
#   block halving the length (odd index): the same plus a 1x1 projection w->w (w*w) and its BN (2w)
#   head: w -> classes (w*classes + classes)
# w=8, c=1, depth 3, 10 classes: stem 40 + 16 = 56; even block 384 + 32 = 416; odd block
#   416 + 64 + 16 = 496; blocks 416 + 496 + 416 = 1328; head 80 + 10 = 90: 56 + 1328 + 90 = 1474
# w=8, c=1, depth 4: 56 + (416 + 496 + 416 + 496 = 1824) + 90 = 1970
# w=6, c=3, depth 1, 3 classes: stem 90 + 12 = 102; block 216 + 24 = 240; head 18 + 3 = 21: 363
@pytest.mark.parametrize(
    ("data", "params", "n_params"),
    [
        (DataSpec(40, 10), {"width": 8, "depth": 3, "shift": 2}, 1474),  # a table row: one channel of 40
        (DataSpec(40, 10, (40, 1), "sequence"), {"width": 8, "depth": 4, "shift": 0}, 1970),
        (DataSpec(24, 3, (8, 3), "sequence"), {"width": 6, "depth": 1, "shift": 1}, 363),  # 3 channels
    ],
)
def test_rescnn_gives_logits_per_class_for_tables_and_sequences(
    data: DataSpec, params: dict, n_params: int
) -> None:
    arch = ArchSpec.of("rescnn", params, data)
    model = build_model(arch, [0.0] * data.input_dim, [1.0] * data.input_dim)
    for mode in (model.train, model.eval):
        mode()
        assert model(torch.randn(5, data.input_dim)).shape == (5, data.num_classes)
    assert count_params(arch) == n_params


def test_rescnn_is_a_student_sized_by_width() -> None:
    family = get_family("rescnn")
    assert family.can_be_student and family.size_param == "width"
    data = DataSpec(40, 10, (40, 1), "sequence")
    width = largest_size_within("rescnn", {"depth": 3, "shift": 0}, data, 5000)
    assert width is not None
    assert count_params(ArchSpec.of("rescnn", {"width": width, "depth": 3, "shift": 0}, data)) <= 5000
    wider = ArchSpec.of("rescnn", {"width": width + 1, "depth": 3, "shift": 0}, data)
    assert count_params(wider) > 5000


def test_random_shift_is_the_identity_in_eval_mode_and_when_zero() -> None:
    x = torch.randn(6, 2, 10)
    shift = RandomShift(3).eval()
    assert torch.equal(shift(x), x)
    assert torch.equal(RandomShift(0).train()(x), x)


def test_random_shift_moves_each_signal_by_at_most_max_shift_with_zeros_coming_in() -> None:
    torch.manual_seed(0)
    n, length, max_shift = 64, 12, 3
    ramp = torch.arange(1, length + 1, dtype=torch.float32)
    x = ramp.repeat(n, 2, 1)  # (n, 2 channels, length), every value non-zero
    out = RandomShift(max_shift).train()(x)
    seen = set()
    for row in out:
        assert torch.equal(row[0], row[1])  # both channels of an example move together
        nonzero = row[0].nonzero().flatten()
        start, stop = int(nonzero[0]), int(nonzero[-1]) + 1
        # a shift by s: the signal moves s steps, s zeros come in at the side it left
        s = start if start > 0 else stop - length
        assert abs(s) <= max_shift
        assert torch.equal(row[0][start:stop], ramp[start - s : stop - s])
        assert row[0][:start].eq(0).all() and row[0][stop:].eq(0).all()
        seen.add(s)
    assert len(seen) > 3  # shifts differ between examples, both directions
    assert min(seen) < 0 < max(seen)


def test_rescnn_trains_down_on_a_tiny_problem() -> None:
    torch.manual_seed(0)
    data = DataSpec(16, 2, (16, 1), "sequence")
    # class 1: a bump somewhere in the signal; class 0: noise only
    n = 128
    y = torch.arange(n) % 2
    x = 0.1 * torch.randn(n, 16)
    positions = torch.randint(2, 12, (n,))
    for i in range(n):
        if y[i] == 1:
            x[i, positions[i] : positions[i] + 3] += 1.0
    arch = ArchSpec.of("rescnn", {"width": 8, "depth": 2, "shift": 2}, data)
    model = build_model(arch, [0.0] * 16, [1.0] * 16)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    model.eval()
    with torch.no_grad():
        first = float(loss_fn(model(x), y))
    model.train()
    for _ in range(60):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert float(loss_fn(logits, y)) < 0.5 * first
    assert float((logits.argmax(dim=1) == y).float().mean()) >= 0.95
