"""Two simulated machines on one: network namespaces joined by a veth pair, rate-limited with tc.

    with NamespacePair(rate="100mbit") as pair:
        subprocess.run([*pair.exec_prefix(0), "ip", "addr"])
        pair.tx_bytes(0)

Each namespace gets one end of a veth pair (``10.<net>.0.1`` and ``10.<net>.0.2``) and its own
loopback, so processes inside one namespace talk over loopback and everything between the
two crosses the veth link, where ``tc tbf`` shapes the egress of both ends. Names carry the
creating process id, so parallel runs do not collide; everything is removed on exit, on
an exception, and on SIGINT/SIGTERM. Needs root and iproute2; :func:`unavailable_reason`
says why not when it cannot work.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

# tbf needs a bucket that holds a few packets at the rate; these were checked on this kernel.
BURST = {"100mbit": "32kbit", "1gbit": "256kbit"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"fdmprobe{os.getpid()}"
    created = _ip("netns", "add", probe, check=False)
    if created.returncode != 0:
        return f"`ip netns add` failed: {created.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NamespacePair:
    """Namespaces ``<prefix>a`` and ``<prefix>b`` joined by veth, egress shaped to ``rate`` (None: unlimited)."""

    def __init__(self, rate: str | None = None, net: int = 231):
        if rate is not None and rate not in BURST:
            raise ValueError(f"rate={rate!r} is invalid; choose one of {sorted(BURST)} or None for unlimited.")
        self.rate = rate
        tag = os.getpid() % 100_000
        self.namespaces = (f"fdm{tag}a", f"fdm{tag}b")
        self.interfaces = (f"fdv{tag}a", f"fdv{tag}b")
        self.addresses = (f"10.{net}.0.1", f"10.{net}.0.2")
        self._previous_handlers: dict[int, object] = {}
        self._created: list[str] = []
        """Namespaces this object made: only these are ever removed."""
        self._veth_in_root = False

    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program inside namespace ``node`` (0 or 1)."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def tx_bytes(self, node: int) -> int:
        """Bytes sent so far on ``node``'s veth end (what crossed the link from that side)."""
        out = _ip("-n", self.namespaces[node], "-s", "-j", "link", "show", "dev", self.interfaces[node]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def __enter__(self) -> NamespacePair:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._interrupted)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _interrupted(self, signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def _create(self) -> None:
        a, b = self.namespaces
        va, vb = self.interfaces
        for ns in self.namespaces:
            _ip("netns", "add", ns)  # fails if the name exists: then it is not ours to remove
            self._created.append(ns)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        self._veth_in_root = True
        for ns, dev, address in zip(self.namespaces, self.interfaces, self.addresses):
            _ip("link", "set", dev, "netns", ns)
            self._veth_in_root = dev == va  # the peer is still in the root namespace until it moves too
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate is not None:
                tbf = ["tbf", "rate", self.rate, "burst", BURST[self.rate], "latency", "50ms"]
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf],
                    check=True,
                    capture_output=True,
                )

    def close(self) -> None:
        """Stop what still runs inside, remove the namespaces this object made, restore signal handlers."""
        for ns in self._created:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # a namespace with live processes outlives `ip netns del`
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns, check=False)  # its veth end goes with it
        self._created.clear()
        if self._veth_in_root:  # creation failed halfway: a veth end was left in the root namespace
            _ip("link", "del", self.interfaces[0], check=False)
            _ip("link", "del", self.interfaces[1], check=False)
            self._veth_in_root = False
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()
