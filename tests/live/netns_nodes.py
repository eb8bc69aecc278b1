"""Nodes emulated on this machine with Linux namespaces (root only), for the multi-node tests.

Each node is a network namespace with its own address on a bridge (``10.X.Y.k+1``; this machine,
the head, is ``10.X.Y.254`` on the bridge), and every command run "on" it gets a mount namespace of
its own with a private ``/dev/shm`` (its host memory: the in-memory snapshots of its ranks), and
``GLOO_SOCKET_IFNAME`` naming its interface (gloo binds there, not to the hostname's address).
Killing a node SIGKILLs every process in its namespace; its ``/dev/shm`` goes with the last of them.

``tests/live/cluster_bin/pdsh`` runs each host's command through :meth:`NetnsNodes.wrap` when
``PDSH_NETNS`` (:meth:`NetnsNodes.pdsh_env`) maps the hostfile's hosts to nodes, so a job launched
with ``ds-resilience run --hostfile`` reaches them through DeepSpeed's own pdsh runner.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time

__all__ = ["NetnsNodes", "wrap_command"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def wrap_command(netns: str, ifname: str, command: str) -> list[str]:
    """``command`` (a shell line) run on a node: in its network namespace, in a mount namespace of
    its own with a private ``/dev/shm``, gloo bound to its interface."""
    inner = (f"mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && export GLOO_SOCKET_IFNAME={ifname} && "
             f"exec bash -c {shlex.quote(command)}")
    return ["ip", "netns", "exec", netns, "unshare", "--mount", "--propagation", "private", "bash", "-c", inner]


class NetnsNodes:
    """``n`` nodes on a bridge; a context manager that tears them down (and kills what runs in them)."""

    def __init__(self, n: int) -> None:
        tag = f"dsr{os.getpid() % 100000}"
        self.bridge = f"{tag}b"
        taken = _ip("-4", "addr", check=False).stdout
        third = os.getpid() % 250
        while f"10.213.{third}." in taken:  # another job's bridge (the suite runs two files at once)
            third = (third + 1) % 250
        self.subnet = f"10.213.{third}"
        self.head_addr = f"{self.subnet}.254"
        self.netns = [f"{tag}n{i}" for i in range(n)]
        self.ifname = [f"{tag}v{i}" for i in range(n)]
        self._peer = [f"{tag}p{i}" for i in range(n)]

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def __enter__(self) -> "NetnsNodes":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.head_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.netns):
                _ip("netns", "add", ns)
                _ip("link", "add", self.ifname[i], "type", "veth", "peer", "name", self._peer[i])
                _ip("link", "set", self._peer[i], "master", self.bridge)
                _ip("link", "set", self._peer[i], "up")
                _ip("link", "set", self.ifname[i], "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", self.ifname[i])
                _ip("-n", ns, "link", "set", self.ifname[i], "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            self.__exit__(None, None, None)
            detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
            raise RuntimeError(f"cannot emulate nodes with network namespaces (root and iproute2 needed): {detail}")
        self._check_reachable()
        return self

    def _check_reachable(self) -> None:
        """Node 0 reaches the head's address over the bridge (a firewall on bridged traffic would not)."""
        with socket.socket() as server:
            server.bind((self.head_addr, 0))
            server.listen(1)
            port = server.getsockname()[1]
            probe = subprocess.run(["ip", "netns", "exec", self.netns[0], "python3", "-c",
                                    f"import socket; socket.create_connection(('{self.head_addr}', {port}), 5).close()"],
                                   capture_output=True, text=True, timeout=30)
            if probe.returncode != 0:
                raise RuntimeError(f"node 0 cannot reach {self.head_addr} over the bridge: {probe.stderr}")

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.netns[i], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, i: int) -> None:
        """Node ``i`` is lost: every process in it SIGKILLed (its private ``/dev/shm`` goes with them)."""
        for _ in range(5):
            pids = self.pids(i)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def pdsh_env(self, hosts: list[str]) -> dict[str, str]:
        """What tests/live/cluster_bin/pdsh reads to run host ``hosts[k]``'s command on node k."""
        return {"PDSH_NETNS": ",".join(f"{h}={ns}:{ifname}" for h, ns, ifname in zip(hosts, self.netns, self.ifname))}

    def __exit__(self, *exc) -> None:
        for i, ns in enumerate(self.netns):
            self.kill(i)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
