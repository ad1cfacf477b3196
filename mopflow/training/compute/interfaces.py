"""Which network interface a worker's collectives (gloo, nccl) go through.

Left to themselves, gloo and nccl take the address the host's name resolves to. On Debian and
Ubuntu that is 127.0.1.1 (``/etc/hosts``): gloo then advertises a loopback address to ranks on
other hosts and the rendezvous never completes. A Dask worker's own address, as the cluster
knows it (``distributed.get_worker().address``), is the one its peers reach it by: a DDP rank
names the interface that holds that address in ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``
before its process group is made (:func:`use_worker_interface`).

A worker started with either variable set keeps it: an operator who names the interface knows
the network better than the address does (several interfaces, a bond, a dedicated fabric). The
worker's later ranks find the value its first rank set, and keep it: the same one, as the
worker's address does not change while it runs.

gloo reads ``GLOO_SOCKET_IFNAME`` each time a process group is made (a DDP job makes its own and
destroys it at the end), so the setting holds from the next group on. nccl reads
``NCCL_SOCKET_IFNAME`` once per process, when its first communicator is made: the interface set
before a worker's first rank serves all of its later ones. gloo binds to the first IP address it
finds on the interface: the worker's own where the interface holds one (the common case).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping, MutableMapping, Sequence

log = logging.getLogger(__name__)

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_told: set[str] = set()  # reasons already logged by this process (every rank would repeat them)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (an IPv6 scope such as ``%eth0`` dropped), None when it is not one
    (a hostname, a MAC address)."""
    try:
        return ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def interface_for(host: str, if_addrs: Mapping[str, Sequence[str]]) -> str | None:
    """The interface of ``if_addrs`` (name -> its addresses, as ``psutil.net_if_addrs`` lists
    them) that holds the IP address ``host``; a loopback address (any of 127.0.0.0/8, ``::1``)
    maps to the interface holding a loopback address (``lo``). None when ``host`` is not an IP
    address or no interface holds it."""
    wanted = _ip(host)
    if wanted is None:
        return None
    for name in sorted(if_addrs):  # sorted: the same answer whatever order the system lists them in
        ips = [ip for ip in map(_ip, if_addrs[name]) if ip is not None]
        if wanted in ips or (wanted.is_loopback and any(ip.is_loopback for ip in ips)):
            return name
    return None


def interface_settings(
    host: str, if_addrs: Mapping[str, Sequence[str]], environ: Mapping[str, str]
) -> tuple[dict[str, str], str | None]:
    """The ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` values to set for a worker at ``host``,
    but those ``environ`` sets already (the worker's own setting wins), and why none could be
    found (None when every variable is set, by ``environ`` or here)."""
    missing = [var for var in IFNAME_VARS if not environ.get(var)]
    if not missing:
        return {}, None
    name = interface_for(host, if_addrs)
    if name is None:
        # a name is not resolved here: on the worker's own host it may resolve to loopback
        what = "held by no network interface" if _ip(host) is not None else "not an IP address"
        return {}, (
            f"the worker's address {host!r} is {what}: {', '.join(missing)} left unset (gloo and "
            "nccl take the address the hostname resolves to)"
        )
    return dict.fromkeys(missing, name), None


def host_interfaces() -> dict[str, list[str]]:
    """This host's interfaces: name -> its addresses (IP and link-layer alike)."""
    import psutil

    return {name: [a.address for a in addrs] for name, addrs in psutil.net_if_addrs().items()}


def use_worker_interface(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the collectives' interface variables in this Dask worker's environment (``os.environ``
    unless given) to the interface holding the worker's address; returns the variables as they
    now stand (a variable unset is absent). Logs once per process why none was set."""
    from distributed import get_worker
    from distributed.comm import get_address_host

    env = os.environ if environ is None else environ
    settings, why = interface_settings(get_address_host(get_worker().address), host_interfaces(), env)
    env.update(settings)
    if why is not None and why not in _told:
        _told.add(why)
        log.warning("ddp: %s", why)
    return {var: env[var] for var in IFNAME_VARS if env.get(var)}
