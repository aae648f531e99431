#!/usr/bin/env python
"""Can two peers behind two NAT routers average through a libp2p circuit relay? A probe, below the
product: bare hivemind DHT nodes and ``DecentralizedAverager`` s in the simulated internet of
:mod:`netns_internet`.

The bootstrap host runs a plain hivemind DHT node (its p2p daemon relays by default). Each NATed
host starts a DHT client node whose daemon asks for a relay slot (``use_auto_relay``, reachability
forced private: the daemon's own AutoNAT never concludes it on this topology), waits until its
announced addresses include a ``/p2p-circuit`` one, and then both average ``--floats`` numbers
``--steps`` times: ``home1`` as a full member (it reduces), ``home2`` in client mode. ``home1``
holds 3.0, ``home2`` 1.0: an all-reduce that moved both parts gives 2.0 on both.

With ``--aux`` no libp2p relay is asked for: the bootstrap host runs an auxiliary averager (it
reduces, and sends nothing of its own) and both NATed hosts are clients that dial it, what the
product's relay does (``worldlm-bootstrap --relay``, :mod:`worldlm_p2p.peer.relay`).

    sudo python benchmarks/relay_probe.py [--floats 1000] [--steps 3] [--timeout 7] [--part-bytes 524288] [--quic] [--aux]

Needs root, iproute2 and iptables. Prints, per host, when its relayed address appeared (seconds
after its daemon started) and each step's outcome; asserts nothing. What it found is in
``benchmarks/RESULTS.md`` (internet section).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BOOT_PORT, PORT = 31337, 31338


QUIC = "quic-v1"


def _listen(port: int, quic: bool) -> list[str]:
    return [f"/ip4/0.0.0.0/tcp/{port}"] + ([f"/ip4/0.0.0.0/udp/{port}/{QUIC}"] if quic else [])


def _boot(address: str, quic: bool, aux_floats: int = 0, timeout: float = 7.0, part_bytes: int = 2 ** 19) -> None:
    import hivemind

    dht = hivemind.DHT(start=True, host_maddrs=_listen(BOOT_PORT, quic),
                       announce_maddrs=[f"/ip4/{address}/tcp/{BOOT_PORT}"]
                       + ([f"/ip4/{address}/udp/{BOOT_PORT}/{QUIC}"] if quic else []))
    print(" ".join(str(m) for m in dht.get_visible_maddrs()), flush=True)
    if not aux_floats:
        time.sleep(3600)
        return
    import torch
    from hivemind.averaging import DecentralizedAverager

    # --aux: the bootstrap host reduces the round itself (hivemind's auxiliary mode: it sends no
    # tensor of its own), the NATed hosts are clients that dial it: no relay
    averager = DecentralizedAverager([torch.zeros(aux_floats)], dht, prefix="probe", auxiliary=True,
                                     target_group_size=3, min_matchmaking_time=3.0, request_timeout=1.0,
                                     allreduce_timeout=3 * timeout, sender_timeout=timeout,
                                     reducer_timeout=2 * timeout, next_chunk_timeout=timeout,
                                     part_size_bytes=part_bytes, start=True)
    while True:
        t1 = time.monotonic()
        try:
            group = averager.step(timeout=4 * timeout + 30)
            print(f"boot (aux): a group of {len(group) if group else 0} in {time.monotonic() - t1:.1f} s", flush=True)
        except Exception as e:
            print(f"boot (aux): failed: {type(e).__name__}: {e}", flush=True)


def _home(role: str, floats: int, steps: int, timeout: float, part_bytes: int, quic: bool, aux: bool,
          boot: list[str]) -> None:
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager

    t0 = time.monotonic()
    dht = hivemind.DHT(start=True, initial_peers=boot, client_mode=True, use_relay=not aux, use_auto_relay=not aux,
                       force_reachability="private", host_maddrs=_listen(PORT, quic))
    while not aux:
        circuit = [str(m) for m in dht.get_visible_maddrs(latest=True) if "/p2p-circuit" in str(m)]
        if circuit or time.monotonic() - t0 > 420:
            break
        time.sleep(2.0)
    if not aux:
        print(f"{role}: relayed address after {time.monotonic() - t0:.1f} s: {circuit or 'none'}", flush=True)
    client = aux or role == "home2"
    averager = DecentralizedAverager([torch.full((floats,), 3.0 if role == "home1" else 1.0)], dht, prefix="probe",
                                     target_group_size=3 if aux else 2, min_matchmaking_time=3.0, request_timeout=1.0,
                                     allreduce_timeout=3 * timeout, sender_timeout=timeout,
                                     reducer_timeout=2 * timeout, next_chunk_timeout=timeout, client_mode=client,
                                     part_size_bytes=part_bytes, start=True)
    for i in range(steps):
        t1 = time.monotonic()
        try:
            group = averager.step(timeout=4 * timeout + 30)
            with averager.get_tensors() as tensors:
                mean = float(tensors[0].mean())
            print(f"{role}: step {i}: group of {len(group) if group else 0}, mean {mean:.3f} "
                  f"({'both parts' if abs(mean - 2.0) < 1e-3 else 'a part missing'}), {time.monotonic() - t1:.1f} s",
                  flush=True)
        except Exception as e:
            print(f"{role}: step {i}: failed after {time.monotonic() - t1:.1f} s: {type(e).__name__}: {e}", flush=True)
    averager.shutdown()
    dht.shutdown()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session``)."""
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--floats", type=int, default=1000, help="numbers each peer averages (float32)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=7.0,
                    help="seconds a sender or the next chunk may take (the all-reduce gets three times that)")
    ap.add_argument("--part-bytes", type=int, default=2 ** 19,
                    help="the size of the messages a part of the all-reduce is streamed in (hivemind's default 512 KiB)")
    ap.add_argument("--quic", action="store_true", help="every node also listens on QUIC (UDP), the relay's included")
    ap.add_argument("--aux", action="store_true",
                    help="no libp2p relay: the bootstrap host reduces every round as an auxiliary averager (it "
                         "sends nothing of its own) and both NATed hosts are clients that dial it")
    args = ap.parse_args()
    for name in ("floats", "steps", "timeout", "part_bytes"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    sys.path.insert(0, str(HERE))
    from netns_internet import Internet, unavailable

    why = unavailable()
    if why:
        sys.exit(f"relay_probe.py: {why}")
    with Internet() as net:
        boot = net.popen("boot", [sys.executable, __file__, "--role", "boot", net.address("boot"), str(int(args.quic)),
                                  str(args.floats if args.aux else 0), str(args.timeout), str(args.part_bytes)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        homes: list[subprocess.Popen] = []
        try:
            maddrs = [m for m in boot.stdout.readline().decode().split() if net.address("boot") in m]
            homes = [net.popen(h, [sys.executable, __file__, "--role", h, str(args.floats), str(args.steps),
                                   str(args.timeout), str(args.part_bytes), str(int(args.quic)), str(int(args.aux)),
                                   *maddrs],
                               stderr=subprocess.DEVNULL, start_new_session=True) for h in ("home1", "home2")]
            for p in homes:
                try:
                    p.wait(timeout=420 + (5 * args.timeout + 40) * args.steps)
                except subprocess.TimeoutExpired:
                    _kill_group(p)
        finally:
            for p in [boot, *homes]:
                _kill_group(p)  # its DHT and averager processes and p2p daemons too, not the interpreter alone


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        if sys.argv[2] == "boot":
            _boot(sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7]))
        else:
            _home(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]),
                  sys.argv[7] == "1", sys.argv[8] == "1", sys.argv[9:])
    else:
        main()
