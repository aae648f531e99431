"""A small simulated internet of Linux network namespaces, for the NAT test and benchmark.

The topology (after ``../shared/tools/netns-internet.sh``, rebuilt here in Python)::

    <p>-inet     the "internet": bridge br0 with PUB.1; it never forwards (ip_forward 0, FORWARD DROP),
                 so an address outside PUB.0/24 is silently unreachable, as on the real internet
    <p>-boot     PUB.10          the bootstrap host (public)
    <p>-pub1     PUB.20          a volunteer with a public address
    <p>-pub2     PUB.30          a second public volunteer
    <p>-late     PUB.50          a late volunteer
    <p>-nat1     PUB.40          home router 1: MASQUERADE, unsolicited inbound dropped (no RST)
    <p>-home1    192.168.77.10   a volunteer behind nat1
    <p>-nat2     PUB.41          home router 2, the same rules
    <p>-home2    192.168.88.10   a volunteer behind nat2

Every link is made inside these namespaces: no veth end is ever in the host's namespace, no route
leads out of them, so nothing can reach the host's interfaces or the outside world. The names
carry a prefix unique to the process (``wlm<pid>``) and :meth:`Internet.down` removes them all
(also the ones a crashed earlier run of the same prefix left). PUB is not one of the
documentation ranges (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24): libp2p classes those as
unroutable and would never hand such addresses out.

Needs root, ``ip`` (iproute2) and ``iptables``; :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

PUB = "11.0.0"
HOSTS = {"boot": 10, "pub1": 20, "pub2": 30, "late": 50}
NATS = {"nat1": (40, "home1", "192.168.77"), "nat2": (41, "home2", "192.168.88")}


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 iptables)"
    probe = f"wlmprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip() or r.returncode}"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-L", "-n"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"iptables does not work in a namespace: {(r.stderr.strip() or str(r.returncode))[:120]}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str) -> None:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")


@dataclass
class Internet:
    """The namespaces above, named ``<prefix>-<host>``. Use as a context manager."""

    prefix: str = field(default_factory=lambda: f"wlm{os.getpid()}")
    forwards: list[tuple[str, int]] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    @property
    def names(self) -> list[str]:
        return [self.ns(h) for h in ("inet", *HOSTS, *NATS, *(home for _, home, _ in NATS.values()))]

    def address(self, host: str) -> str:
        """The host's own IP address (a home host's is private: 192.168.x.10)."""
        if host in HOSTS:
            return f"{PUB}.{HOSTS[host]}"
        for router, (octet, home, lan) in NATS.items():
            if host == router:
                return f"{PUB}.{octet}"
            if host == home:
                return f"{lan}.10"
        raise KeyError(host)

    def public_address(self, host: str) -> str:
        """Where the internet sees the host (a home host: its router's address)."""
        for router, (_, home, _) in NATS.items():
            if host == home:
                return self.address(router)
        return self.address(host)

    def router_of(self, host: str) -> str | None:
        return next((r for r, (_, home, _) in NATS.items() if home == host), None)

    # ------------------------------------------------------------------ up / down
    def up(self) -> "Internet":
        self.down()
        for n in self.names:
            _sh("ip", "netns", "add", n)
            self.run(n, "ip", "link", "set", "lo", "up")
        inet = self.ns("inet")
        _sh("ip", "-n", inet, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", inet, "addr", "add", f"{PUB}.1/24", "dev", "br0")
        _sh("ip", "-n", inet, "link", "set", "br0", "up")
        self.run(inet, "sysctl", "-qw", "net.ipv4.ip_forward=0")
        self.run(inet, "iptables", "-P", "FORWARD", "DROP")
        for key in ("net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables"):
            # (with br_netfilter loaded, bridged packets between the hosts would meet that FORWARD DROP)
            self.run(inet, "sysctl", "-qw", f"{key}=0", check=False)
        for host, octet in HOSTS.items():
            self._attach(host, f"{PUB}.{octet}")
        for router, (octet, home, lan) in NATS.items():
            self._nat_site(router, f"{PUB}.{octet}", home, lan)
        return self

    def _attach(self, host: str, addr: str) -> None:
        inet, n = self.ns("inet"), self.ns(host)
        _sh("ip", "-n", inet, "link", "add", f"p-{host}", "type", "veth", "peer", "name", "eth0", "netns", n)
        _sh("ip", "-n", inet, "link", "set", f"p-{host}", "master", "br0", "up")
        _sh("ip", "-n", n, "addr", "add", f"{addr}/24", "dev", "eth0")
        _sh("ip", "-n", n, "link", "set", "eth0", "up")
        _sh("ip", "-n", n, "route", "add", "default", "via", f"{PUB}.1")  # the simulated core, not the host

    def _nat_site(self, router: str, uplink: str, home: str, lan: str) -> None:
        self._attach(router, uplink)
        r, h = self.ns(router), self.ns(home)
        _sh("ip", "-n", r, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", h)
        _sh("ip", "-n", r, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _sh("ip", "-n", r, "link", "set", "lan0", "up")
        _sh("ip", "-n", h, "addr", "add", f"{lan}.10/24", "dev", "eth0")
        _sh("ip", "-n", h, "link", "set", "eth0", "up")
        _sh("ip", "-n", h, "route", "add", "default", "via", f"{lan}.1")
        ipt = ("iptables",)
        self.run(r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.run(r, *ipt, "-t", "nat", "-A", "POSTROUTING", "-s", f"{lan}.0/24", "-o", "eth0", "-j", "MASQUERADE")
        self.run(r, *ipt, "-P", "FORWARD", "DROP")
        self.run(r, *ipt, "-A", "FORWARD", "-i", "lan0", "-o", "eth0", "-j", "ACCEPT")
        self.run(r, *ipt, "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-m", "conntrack", "--ctstate",
                 "ESTABLISHED,RELATED", "-j", "ACCEPT")
        # a home router: unsolicited inbound packets are dropped silently (no RST)
        self.run(r, *ipt, "-A", "INPUT", "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                 "-j", "ACCEPT")
        self.run(r, *ipt, "-A", "INPUT", "-i", "eth0", "-j", "DROP")

    def forward_port(self, router: str, port: int) -> None:
        """A port forward on ``router``: its public PORT goes to its home host's PORT (TCP)."""
        _, _, lan = NATS[router]
        r = self.ns(router)
        self.run(r, "iptables", "-t", "nat", "-A", "PREROUTING", "-i", "eth0", "-p", "tcp", "--dport", str(port),
                 "-j", "DNAT", "--to-destination", f"{lan}.10:{port}")
        self.run(r, "iptables", "-I", "FORWARD", "1", "-i", "eth0", "-o", "lan0", "-p", "tcp", "-d", f"{lan}.10",
                 "--dport", str(port), "-j", "ACCEPT")
        self.forwards.append((router, port))

    def down(self) -> None:
        """Remove every namespace of this prefix (processes still inside keep theirs alive: stop them first)."""
        existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for n in existing:
            if n.startswith(f"{self.prefix}-"):
                subprocess.run(["ip", "netns", "del", n], capture_output=True)

    def __enter__(self) -> "Internet":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ processes
    def run(self, ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"[{ns}] {' '.join(argv)}: {r.stderr.strip() or r.returncode}")
        return r

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (``ip netns exec``; the process is the namespace's, its files the host's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **kwargs)
