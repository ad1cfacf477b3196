"""A cluster of test hosts on one machine: Linux network namespaces on a bridge.

Each :class:`Host` has its own network stack and address on the bridge, its own hostname (a UTS
namespace), and a private scratch disk: a mount namespace with a tmpfs over its temporary folder
and over its ``MOPFLOW_HOME``. Every host sees those two folders at the same paths, each its own,
so nothing one host writes there is seen by another (or by the test, which reads them through
the host: :meth:`Host.files`). Each host's ``/etc/hosts`` names every host, and, as Debian's
default does, maps the host's own name to 127.0.1.1 first: software that finds its address from
the hostname gets a loopback address, as it would on real machines.

The machine's services (PostgreSQL, Redis on 127.0.0.1) are forwarded to the bridge's own
address (:meth:`HostCluster.forward`); an S3 server can bind that address itself. Traffic stays
on loopback and the bridge. :meth:`Host.cut` takes a host's link down (``ip link set ... down``)
and :meth:`Host.mend` brings it back: no reset reaches either side, as when a cable is pulled.

Building it needs root and ``ip``/``unshare``/``nsenter`` (iproute2, util-linux):
:func:`namespaces_problem` says why not when they are missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

SUBNET_BASE = "10.213"  # 10.213.<n>.0/24, <n> per cluster; nothing else on the machine uses it
_USED_SUBNETS: set[str] = set()  # the subnets this process's clusters took (never taken again)
SECOND_SUBNET_BASE = "10.214"  # the second network (eth1), 10.214.<n>.0/24
OWNERS = Path("/run/mopflow-test-hosts")  # <tag>.pid: the process that built cluster <tag>


def namespaces_problem() -> str | None:
    """Why test hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "test hosts need root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"test hosts need `{tool}` (iproute2, util-linux)"
    probe = f"mfprobe{os.getpid() % 10000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Host:
    """One test host: a network, UTS and mount namespace, held open by a sleeping process."""

    def __init__(
        self,
        name: str,
        addresses: dict[str, str],
        netns: str,
        links: dict[str, str],
        init: subprocess.Popen[bytes],
    ) -> None:
        self.name, self.netns, self.init = name, netns, init
        self.addresses = addresses  # interface in the host (eth0, eth1) -> its address
        self.address = addresses["eth0"]
        self.links = links  # interface in the host -> its peer on this machine's bridge
        self.procs: list[subprocess.Popen[bytes]] = []

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host (its network, hostname and disk)."""
        return ["nsenter", "-t", str(self.init.pid), "-n", "-m", "-u", "--", *argv]

    def start(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start a long-running process on this host, its output in ``log``; stopped by
        :meth:`stop` (or the cluster's close)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                self.argv(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], env: Mapping[str, str], timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run a command on this host to its end."""
        return subprocess.run(self.argv(argv), env=dict(env), capture_output=True, text=True, timeout=timeout)

    def files(self, folder: Path | str) -> list[str]:
        """Files under ``folder`` as this host sees it (its private disk included)."""
        done = subprocess.run(
            self.argv(["find", str(folder), "-type", "f"]), capture_output=True, text=True, timeout=30
        )
        return [line for line in done.stdout.splitlines() if line]

    def processes(self) -> dict[int, str]:
        """Every process on this host (in its network namespace) but its init: pid -> command line."""
        pids = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True
        ).stdout.split()
        found = {}
        for pid in pids:
            with contextlib.suppress(OSError, ValueError):
                if int(pid) != self.init.pid:
                    found[int(pid)] = (
                        Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                    )
        return found

    def cut(self, interface: str | None = None) -> None:
        """Take this host's link (one interface's, or all) down: its packets are lost, and no
        reset reaches anyone."""
        for name, link in self.links.items():
            if interface in (None, name):
                _ip("link", "set", link, "down")

    def mend(self) -> None:
        """Bring this host's links back."""
        for link in self.links.values():
            _ip("link", "set", link, "up")

    def kill_all(self) -> None:
        """SIGKILL every process on this host (a host that dies): those started here, and what
        they started in process groups of their own (Airflow's task supervisors)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        _kill_namespace(self.netns, spare=self.init.pid)  # the host itself stays
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def stop(self, grace_s: float = 15) -> None:
        """SIGTERM every process started on this host, then SIGKILL what is left."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


class HostCluster:
    """``names`` test hosts on one bridge (their ``eth0``), and with ``second_network`` on a
    second one too (``eth1``: a link that can be cut alone); :meth:`close` removes every trace
    of them."""

    def __init__(self, names: Sequence[str], root: Path, second_network: bool = False) -> None:
        remove_abandoned_clusters()
        tag = uuid.uuid4().hex[:5]
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / f"{tag}.pid").write_text(str(os.getpid()))
        self.root = root
        self.bridge = f"mfb{tag}"
        self.subnet = self._free_subnet()
        self.second_subnet = (
            self.subnet.replace(SUBNET_BASE, SECOND_SUBNET_BASE, 1) if second_network else None
        )
        self.gateway = f"{self.subnet}.1"
        self.private_tmp = root / "private" / "tmp"  # each host's own tmpfs, at the same path
        self.private_home = root / "private" / "home"
        self.hosts: dict[str, Host] = {}
        self._forwarders: list[_Forwarder] = []
        self._cleanup = contextlib.ExitStack()
        try:
            self._build(names, tag)
        except BaseException:
            self.close()
            raise

    def _free_subnet(self) -> str:
        """A subnet no cluster routes now and none built by this process used before: sockets
        bound to a closed cluster's gateway can outlive it for a while (a relay's listener, a
        connection a host left open), and a new cluster on the same addresses could not bind its
        relays there (EADDRINUSE)."""
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        for n in range(10, 250):
            subnet = f"{SUBNET_BASE}.{n}"
            if f"{subnet}.0/24" not in routes and subnet not in _USED_SUBNETS:
                _USED_SUBNETS.add(subnet)
                return subnet
        raise RuntimeError("no free 10.213.x.0/24 subnet for test hosts")

    def _build(self, names: Sequence[str], tag: str) -> None:
        self._cleanup.callback((OWNERS / f"{tag}.pid").unlink, missing_ok=True)
        _ip("link", "add", self.bridge, "type", "bridge")
        self._cleanup.callback(subprocess.run, ["ip", "link", "del", self.bridge], capture_output=True)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        if self.second_subnet:
            _ip("link", "add", f"{self.bridge}x", "type", "bridge")
            self._cleanup.callback(
                subprocess.run, ["ip", "link", "del", f"{self.bridge}x"], capture_output=True
            )
            _ip("link", "set", f"{self.bridge}x", "up")
        for folder in (self.private_tmp, self.private_home):
            folder.mkdir(parents=True, exist_ok=True)
        addresses = {name: f"{self.subnet}.{10 + i}" for i, name in enumerate(names)}
        table = "".join(f"{addr} {name}\n" for name, addr in addresses.items())
        for i, (name, address) in enumerate(addresses.items()):
            netns = f"mf{tag}h{i}"
            _ip("netns", "add", netns)
            self._cleanup.callback(subprocess.run, ["ip", "netns", "del", netns], capture_output=True)
            _ip("-n", netns, "link", "set", "lo", "up")
            addrs, links = {"eth0": address}, {"eth0": f"mf{tag}v{i}"}
            if self.second_subnet:
                addrs["eth1"], links["eth1"] = f"{self.second_subnet}.{10 + i}", f"mf{tag}x{i}"
            for interface, link in links.items():
                _ip("link", "add", link, "type", "veth", "peer", "name", interface, "netns", netns)
                _ip("link", "set", link, "master", self.bridge + ("x" if interface == "eth1" else ""))
                _ip("link", "set", link, "up")
                _ip("-n", netns, "addr", "add", f"{addrs[interface]}/24", "dev", interface)
                _ip("-n", netns, "link", "set", interface, "up")
            hosts_file = self.root / "etc" / f"hosts.{name}"
            hosts_file.parent.mkdir(parents=True, exist_ok=True)
            hosts_file.write_text(
                f"127.0.0.1 localhost\n127.0.1.1 {name}\n{self.gateway} services\n{table}"
            )  # as Debian's: the host's own name on a loopback address first
            script = (
                f"hostname {name} && "
                f"mount -t tmpfs -o size=4g tmpfs {self.private_tmp} && "
                f"mount -t tmpfs -o size=4g tmpfs {self.private_home} && "
                f"mount --bind {hosts_file} /etc/hosts && "
                "echo ready && exec sleep infinity"
            )
            init = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    netns,
                    "unshare",
                    "--mount",
                    "--uts",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    script,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            self._cleanup.callback(_end, init)
            assert init.stdout is not None
            if init.stdout.readline().strip() != b"ready":
                raise RuntimeError(
                    f"host {name} did not start: {init.stderr.read().decode() if init.stderr else ''}"
                )
            self.hosts[name] = Host(name, addrs, netns, links, init)

    def add_name(self, host: str, name: str, address: str) -> None:
        """Let ``host`` (only) resolve ``name`` to ``address``: a name the other hosts do not know,
        as a split-horizon DNS gives."""
        with open(self.root / "etc" / f"hosts.{host}", "a") as hosts_file:  # the same file, bind-mounted
            hosts_file.write(f"{address} {name}\n")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def forward(self, port: int, target: tuple[str, int] | None = None) -> tuple[str, int]:
        """Serve ``target`` (127.0.0.1:``port`` by default) on the bridge's address, so that the
        hosts reach a service of this machine; returns the address the hosts use."""
        forwarder = _Forwarder((self.gateway, port), target or ("127.0.0.1", port))
        self._forwarders.append(forwarder)
        return self.gateway, port

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with the host's private folders as its temporary folder and MOPFLOW_HOME."""
        return dict(base) | {"TMPDIR": str(self.private_tmp), "MOPFLOW_HOME": str(self.private_home)}

    def stop(self) -> None:
        """Stop every process started on the hosts (the hosts stay up)."""
        for host in self.hosts.values():
            host.stop()

    def close(self) -> None:
        """Stop everything and remove the namespaces, links and bridge."""
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                host.mend()
            host.stop()
        for host in self.hosts.values():  # what was started there by other means (daemons)
            _kill_namespace(host.netns)
        for forwarder in self._forwarders:
            forwarder.close()
        self._cleanup.close()


def remove_abandoned_clusters() -> None:
    """Remove the hosts, links and bridges of clusters whose test process died (killed before
    its cleanup ran), with every process still on them."""
    for owner in OWNERS.glob("*.pid") if OWNERS.is_dir() else ():
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(owner.read_text()), 0)
            continue  # its builder still runs
        tag = owner.stem
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for netns in (line.split()[0] for line in listed.splitlines() if line.startswith(f"mf{tag}h")):
            pids = subprocess.run(
                ["ip", "netns", "pids", netns], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        for bridge in (f"mfb{tag}", f"mfb{tag}x"):
            subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        owner.unlink(missing_ok=True)


def _kill_namespace(netns: str, spare: int | None = None) -> None:
    """SIGKILL every process in network namespace ``netns`` but ``spare``."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            if int(pid) != spare:
                os.kill(int(pid), signal.SIGKILL)


def _end(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class _Forwarder:
    """A TCP relay from ``listen`` to ``target``, one thread per direction of each connection."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(listen, reuse_port=False)
        self.server.settimeout(0.5)
        self.closed = False
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name=f"forward-{listen[1]}").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.server.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def host_cluster(names: Sequence[str], root: Path, second_network: bool = False) -> Iterator[HostCluster]:
    """A :class:`HostCluster` for the ``with`` block."""
    cluster = HostCluster(names, root, second_network)
    try:
        yield cluster
    finally:
        cluster.close()
