"""The network interface a DDP rank's collectives go through: the one holding its worker's
address as the cluster knows it, unless the worker names one itself."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from mopflow.training.compute.interfaces import (
    host_interfaces,
    interface_for,
    interface_settings,
    use_worker_interface,
)
from mopflow.training.compute.workers import worker_addresses

# What psutil.net_if_addrs lists on a Debian host with two networks: IPv4, IPv6 (a link-local one
# with its scope) and the link-layer address, per interface, in no particular order.
HOST = {
    "ib0": ["192.168.7.5", "80:00:02:08:fe:80"],
    "lo": ["127.0.0.1", "::1", "00:00:00:00:00:00"],
    "eth0": ["10.0.0.5", "fe80::fc:ff:fe00:1%eth0", "02:fc:00:00:00:01"],
}


def test_the_interface_holding_the_address_is_chosen_and_loopback_is_lo() -> None:
    assert interface_for("10.0.0.5", HOST) == "eth0"
    assert interface_for("192.168.7.5", HOST) == "ib0"
    assert interface_for("fe80::fc:ff:fe00:1", HOST) == "eth0"  # the scope is no part of the address
    assert interface_for("[fe80::fc:ff:fe00:1]", HOST) == "eth0"
    # Debian's hostname address is not listed on lo, but all of 127.0.0.0/8 is loopback
    assert interface_for("127.0.1.1", HOST) == "lo"
    assert interface_for("::1", HOST) == "lo"
    assert interface_for("10.0.0.6", HOST) is None  # another host's address
    assert interface_for("node1", HOST) is None  # a name: resolved on this host it may be loopback
    assert interface_for("02:fc:00:00:00:01", HOST) is None  # a link-layer address is no host


def test_the_worker_s_own_setting_wins_and_none_found_sets_nothing_saying_why() -> None:
    assert interface_settings("10.0.0.5", HOST, {}) == (
        {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"},
        None,
    )
    assert interface_settings("10.0.0.5", HOST, {"GLOO_SOCKET_IFNAME": "ib0"}) == (
        {"NCCL_SOCKET_IFNAME": "eth0"},
        None,
    )
    both = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert interface_settings("10.0.0.6", HOST, both) == ({}, None)  # nothing to find: no complaint
    settings, why = interface_settings("10.0.0.6", HOST, {"NCCL_SOCKET_IFNAME": "ib0"})
    assert settings == {} and why is not None
    assert "'10.0.0.6' is held by no network interface: GLOO_SOCKET_IFNAME left unset" in why
    _, why = interface_settings("node1", HOST, {})
    assert why is not None and "'node1' is not an IP address" in why


def _gloo_group_on_this_worker(preset: str | None) -> dict[str, Any]:
    """On a Dask worker: the interface a rank would set up, then a one-rank gloo group made with
    it; the worker's environment is left as it was (other tests share the worker)."""
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    if preset is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = preset
    try:
        chosen = use_worker_interface()
        try:
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
            )
            error = ""
        except RuntimeError as exc:
            error = str(exc)
        return {"chosen": chosen, "error": error}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def test_a_rank_s_gloo_group_uses_the_interface_of_its_worker_s_address(dask_client: Any) -> None:
    """On a real worker (of a LocalCluster, at 127.0.0.1): the loopback interface is set for both
    backends and gloo makes its group with it; an interface the worker was started with is kept,
    and gloo honours it at the next group (a wrong one fails there, naming it)."""
    worker = worker_addresses(dask_client)[0]
    loopback = interface_for("127.0.0.1", host_interfaces())
    run = dask_client.submit(_gloo_group_on_this_worker, None, workers=[worker], pure=False)  # type: ignore[attr-defined]
    assert run.result(timeout=120) == {
        "chosen": {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback},
        "error": "",
    }
    run = dask_client.submit(_gloo_group_on_this_worker, "nosuchif0", workers=[worker], pure=False)  # type: ignore[attr-defined]
    result = run.result(timeout=120)
    assert result["chosen"] == {"GLOO_SOCKET_IFNAME": "nosuchif0", "NCCL_SOCKET_IFNAME": loopback}
    assert "nosuchif0" in result["error"]
