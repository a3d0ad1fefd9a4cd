"""The project's own test hosts: Linux network namespaces, each behind a router namespace of
its own, joined by veth pairs (root 10.213.N.1/30 -- .2 router .5/30 -- .6 host), that a test
cuts, heals and slows (``tc netem``) in the router, where the hosts' TCP stacks see none of it.

Only the addresses on these pairs are used: ``Host.gateway`` (root's end, where a test's control
plane listens) and ``Host.address`` (inside the host); root gets one route, to the host's /30
through the router, gone with the veth. Making them takes root; a test asks ``unavailable()``
(and ``netem_unavailable()`` to slow a link) first and skips with its reason. ``host()`` always
removes what it made, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PREFIX = "pst"  # names: pst{pid}{kind}{index}, each under 15 characters (IFNAMSIZ)


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(command)}: {done.stderr.strip()}")


def _ip(*args: str, netns: str | None = None) -> None:
    _run(["ip", *(("-n", netns) if netns else ()), *args])


def _tc(*args: str, netns: str | None = None) -> None:
    _run([*(("ip", "netns", "exec", netns) if netns else ()), "tc", *args])


@dataclass(frozen=True)
class Host:
    """A network namespace behind a router namespace of its own: root -- router -- host."""

    namespace: str
    router: str  # the router's namespace, where the link is cut or slowed
    outside: str  # root's veth end (to the router)
    links: tuple[str, str]  # the router's two ends: to root, to the host
    gateway: str  # root's address on its veth: the one a test's server listens on
    address: str  # the host's address

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the host."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def _qdisc(self, *spec: str) -> None:
        for link in self.links:
            _tc("qdisc", "replace", "dev", link, "root", *spec, netns=self.router)

    def shape(self, netem: Sequence[str]) -> None:
        """Both directions through ``tc netem`` with ``netem`` (e.g. ``delay 200ms loss 5%``),
        in the router: the packets of each direction are held or lost on the way."""
        self._qdisc("netem", *netem)

    def cut(self) -> None:
        """Drop every packet both ways in the router, silently, as a switch that failed between
        two hosts that stay up: each of its queues holds none (``pfifo limit 0``). The hosts
        see nothing (no link down, no reset, no ICMP, no local drop their TCP would count)."""
        self._qdisc("pfifo", "limit", "0")

    def heal(self) -> None:
        """The link as it was: no cut, no netem."""
        for link in self.links:
            with contextlib.suppress(OSError):  # none there
                _tc("qdisc", "del", "dev", link, "root", netns=self.router)


def unavailable() -> str | None:
    """Why test hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool} command (iproute2)"
    try:
        with host(99):
            pass
    except OSError as error:
        return f"cannot make a network namespace with a veth pair: {error}"
    return None


def netem_unavailable() -> str | None:
    """Why ``Host.shape`` cannot work here (a kernel without ``sch_netem``), or None."""
    reason = unavailable()
    if reason is not None:
        return reason
    try:
        with host(98) as probe:
            probe.shape(["delay", "1ms"])
    except OSError as error:
        return f"tc netem is not available in this kernel: {error}"
    return None


@contextlib.contextmanager
def host(index: int) -> Iterator[Host]:
    """Host ``index`` (0-255) and its router: root 10.213.{index}.1/30 -- .2 router .5/30 --
    .6 host; root reaches the host's /30 through the router, the host only root's /30."""
    tag = f"{PREFIX}{os.getpid() % 100000}"
    net = f"10.213.{index}"
    made = Host(
        namespace=f"{tag}h{index}",
        router=f"{tag}g{index}",
        outside=f"{tag}r{index}",
        links=(f"{tag}a{index}", f"{tag}b{index}"),
        gateway=f"{net}.1",
        address=f"{net}.6",
    )
    inside = f"{tag}i{index}"
    router, hosted = made.router, made.namespace
    try:
        _ip("netns", "add", router)
        _ip("netns", "add", hosted)
        _ip("link", "add", made.outside, "type", "veth", "peer", "name", made.links[0])
        _ip("link", "set", made.links[0], "netns", router)
        _ip("link", "add", made.links[1], "netns", router, "type", "veth", "peer", "name", inside,
            "netns", hosted)  # fmt: skip
        _ip("addr", "add", f"{net}.1/30", "dev", made.outside)
        _ip("link", "set", made.outside, "up")
        _ip("addr", "add", f"{net}.2/30", "dev", made.links[0], netns=router)
        _ip("addr", "add", f"{net}.5/30", "dev", made.links[1], netns=router)
        _ip("addr", "add", f"{net}.6/30", "dev", inside, netns=hosted)
        for netns, device in ((router, made.links[0]), (router, made.links[1]), (hosted, inside)):
            _ip("link", "set", device, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=hosted)
        _ip("route", "add", f"{net}.4/30", "via", f"{net}.2", "dev", made.outside)
        _ip("route", "add", f"{net}.0/30", "via", f"{net}.5", netns=hosted)
        _run(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        made.cut()  # the queue discipline a cut takes is there, or OSError now
        made.heal()
        yield made
    finally:
        with contextlib.suppress(OSError):  # never made, or gone with its namespace
            _ip("link", "del", made.outside)
        for netns in (hosted, router):
            with contextlib.suppress(OSError):
                _ip("netns", "del", netns)
