"""The packed state of a trainable unit: safetensors tensors plus JSON metadata.

Weights are ``model.<name>``, AdamW moments ``opt.<index>.exp_avg`` / ``exp_avg_sq`` (their step
counts in the ``steps`` metadata), the RNG of a pass stopped mid-way ``extra.rng``; the ``meta``
metadata holds the global step, the stopped pass's position and the caller's facts (epoch,
visited partitions). Reading a state never unpickles: anything else is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class StateFormatError(ValueError):
    """Packed model state that is not a safetensors blob (truncated, or another format such as a
    pickle): refused, never deserialized as code."""


def moments_of(optimizer: Any) -> dict[int, dict[str, Any]]:
    """AdamW's per-parameter state (first group), detached copies keyed by parameter index."""
    out: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(optimizer.param_groups[0]["params"]):
        state = optimizer.state.get(param, {})
        if "exp_avg" in state:
            out[index] = {
                "step": float(state["step"]),
                "exp_avg": state["exp_avg"].detach().clone(),
                "exp_avg_sq": state["exp_avg_sq"].detach().clone(),
            }
    return out


def load_moments(optimizer: Any, moments: Mapping[int, Mapping[str, Any]]) -> None:
    """Put saved moments into a new optimizer, on each parameter's device (after a hop the
    parameters may sit on a GPU)."""
    import torch

    for index, param in enumerate(optimizer.param_groups[0]["params"]):
        if index in moments:
            saved = moments[index]
            optimizer.state[param] = {
                "step": torch.tensor(float(saved["step"])),
                "exp_avg": saved["exp_avg"].to(param.device, copy=True),
                "exp_avg_sq": saved["exp_avg_sq"].to(param.device, copy=True),
            }


def pack(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """Tensors on the host (contiguous) and text metadata as safetensors bytes.

    Through safetensors' numpy writer where every dtype has a numpy twin: the same bytes as its
    torch writer, which checks each tensor for shared storage and converts it on the way, in
    about a third of the time for a small model's state (a fifth of the cost of a unit beyond
    its passes on GPU-short ones). bfloat16 has no numpy twin and goes through the torch writer.
    """
    import torch

    if any(t.dtype == torch.bfloat16 for t in tensors.values()):
        from safetensors.torch import save

        return bytes(save(dict(tensors), metadata=dict(metadata)))
    from safetensors.numpy import save as save_arrays

    return bytes(save_arrays({k: t.numpy() for k, t in tensors.items()}, metadata=dict(metadata)))


def state_metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__`` (the header is JSON after an 8-byte length)."""
    size = int.from_bytes(data[:8], "little")
    try:
        if len(data) < 8 or not 0 < size <= len(data) - 8:
            raise ValueError(f"header length {size} does not fit in {len(data)} bytes")
        header = json.loads(data[8 : 8 + size])
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise StateFormatError(f"model state is not a safetensors blob ({exc}); refusing to load it") from exc
    return dict(header.get("__metadata__", {}))


def read_meta(data: bytes) -> dict[str, Any]:
    """The metadata packed with a state (epoch, model id, global step, a stopped pass's position)."""
    meta: dict[str, Any] = json.loads(state_metadata(data).get("meta", "{}"))
    return meta


def global_step(state: bytes | None) -> int:
    """The optimizer steps a packed state has taken (0 for an initial state)."""
    if state is None:
        return 0
    return int(read_meta(state).get("global_step", 0))


def partial_meta(state: bytes | None) -> dict[str, Any] | None:
    """The mid-pass position packed with a state stopped on a notice (None for a finished pass)."""
    if state is None:
        return None
    partial = read_meta(state).get("partial")
    return dict(partial) if partial else None
