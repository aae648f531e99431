"""``worldlm-peer``: join a WorldLM swarm and train on local data.

Everything shared by the run (model, tokenizer, hyper-parameters, strategy) comes from the run
manifest in the DHT; a volunteer needs only ``--region``, ``--initial-peers`` and ``--data``.
``--config FILE`` is a TOML file with a ``[peer]`` table of the same settings as the flags
(flags win) and, optionally, manifest tables (``[model]``, ``[train]``...) which must agree with
the run manifest or the peer refuses to start.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from worldlm_p2p.cli.common import PRIVACY_FLAGS, ArgumentParser, add_flags, flag_values, install_stop_handlers, run_main
from worldlm_p2p.config import NetConfig, PeerConfig, PrivacyConfig, _build_section, load_toml
from worldlm_p2p.errors import ConfigError

PROG = "worldlm-peer"
logger = logging.getLogger(PROG)

_PEER_KEYS = {
    "region": str, "data": str, "run_id": str, "label": str, "max_steps": int, "max_tokens": int, "device": str,
    "checkpoint_dir": str, "checkpoint_every": int, "threads": int, "initial_peers": list, "host_maddrs": list,
    "announce_maddrs": list, "identity": str, "summary": str, "manifest_wait": float, "trace_dir": str, "events": str, "certificate": str,
    "wait_for_peers": int, "run_key": str, "privacy": dict, "reachability": str, "slowdown": float,
    "background_nice": int,
}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Join a WorldLM swarm and train on local data.")
    p.add_argument("--region", help="jurisdiction tag of this peer's sub-federation, e.g. eu")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="bootstrap multiaddrs (with /p2p/<id>)")
    p.add_argument("--data", metavar="PATH", help="training text: a directory of text files (train.txt/valid.txt), "
                                                  "a saved datasets directory, or a .txt/.json/.jsonl/.csv/.parquet file")
    p.add_argument("--run-id", help="run to join (needed only if the DHT serves several runs)")
    p.add_argument("--config", metavar="TOML", help="peer settings file ([peer] table + optional manifest tables)")
    p.add_argument("--label", help="short human-readable name shown in progress records (default: data dir name)")
    p.add_argument("--max-steps", type=int, help="stop after this many local steps")
    p.add_argument("--max-tokens", type=int, help="stop after this many training tokens")
    p.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints here and resume from the latest")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default 50)")
    p.add_argument("--threads", type=int, help="torch CPU threads for this process")
    p.add_argument("--host-maddrs", nargs="+", metavar="MADDR",
                   help="listen addresses (default: /ip4/127.0.0.1/tcp/0 when every initial peer is on loopback, "
                        "else /ip4/0.0.0.0/tcp/0; set a fixed PORT to open it in a firewall)")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="public addresses to advertise")
    p.add_argument("--reachability", choices=("auto", "direct", "outbound"),
                   help="auto (default): a dial-back check at start decides; direct: other peers can dial this "
                        "one; outbound: behind NAT without a port forward, this peer only dials out (it sends its "
                        "part of every round and gets the result back, but never reduces, serves or leads)")
    p.add_argument("--identity", metavar="PATH", help="private key file (created with mode 0600 if missing)")
    p.add_argument("--summary", metavar="JSON", help="write a JSON summary of this peer here at exit")
    p.add_argument("--manifest-wait", type=float, help="seconds to wait for the run manifest (default 30)")
    p.add_argument("--certificate", metavar="FILE", help="this peer's admission to its region, signed by the region's "
                                                        "key (worldlm-admit issue); needed where the run manifest "
                                                        "names a key for the region, with the --identity it names")
    p.add_argument("--events", metavar="JSONL", help="append a structured event log here: one JSON object per "
                                                     "line (joined, training, every round's outcome and time, "
                                                     "world rounds, checkpoints)")
    p.add_argument("--run-key", metavar="KEY", help="accept only a run manifest signed by this run key: its OpenSSH "
                                                   "line (ssh-rsa AAAA..., worldlm-bootstrap logs it) or a file "
                                                   "holding it (default: the run key of the bootstrap nodes joined "
                                                   "through)")
    p.add_argument("--wait-for-peers", type=int, metavar="N",
                   help="before training, wait until N peers of the region (this one included) are live, for at "
                        "most 5 minutes (default 0: start at once)")
    p.add_argument("--slowdown", type=float, metavar="F",
                   help="emulate a device F times slower (experiments with peers of different speeds): sleep "
                        "(F - 1) times each step's duration after it (default 1)")
    p.add_argument("--background-nice", type=int, metavar="N",
                   help="CPU priority of this peer's round threads, as a nice value from 0 (the training's "
                        "priority) to 19 (the lowest): with N > 0 rounds take the cycles training leaves, so on a "
                        "CPU whose cores all train they land later and training keeps its speed; the hivemind "
                        "and p2pd processes keep the peer's priority (default 0)")
    p.add_argument("--trace-dir", metavar="DIR", help=argparse_suppress())
    add_flags(p.add_argument_group("differential privacy (the region's policy: [peer.privacy] in its profile)"),
              {"privacy": PrivacyConfig}, PRIVACY_FLAGS)
    return p


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS  # audit trail of round tensors, for tests and debugging


def _merge(args, file_cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    peer = dict(file_cfg.get("peer", {}) or {})
    if not isinstance(peer, dict):
        raise ConfigError("[peer] must be a table")
    for key, value in peer.items():
        if key not in _PEER_KEYS:
            raise ConfigError(f"peer.{key}: unknown setting (known: {', '.join(sorted(_PEER_KEYS))})")
        typ = _PEER_KEYS[key]
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise ConfigError(f"peer.{key}: expected {typ.__name__}, got {value!r}")
        peer[key] = value
    for key in _PEER_KEYS:
        flag = getattr(args, key, None)
        if flag is not None and key != "privacy":
            peer[key] = flag
    # the [peer.privacy] table of a region's profile, and the flags that override it
    peer["privacy"] = {**dict(peer.get("privacy", {})), **flag_values(args, PRIVACY_FLAGS).get("privacy", {})}
    overrides = {k: v for k, v in file_cfg.items() if k != "peer"}
    return peer, overrides


def is_loopback(maddr: str) -> bool:
    parts = str(maddr).split("/")
    return len(parts) > 2 and (parts[2].startswith("127.") or parts[2] in ("localhost", "::1"))


def check_summary_path(path: str | None) -> None:
    """Before any training: the summary's directory can be made and written (else one line, exit 2,
    instead of an error after the whole run)."""
    if not path:
        return
    where = Path(path).parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe = where / f".{Path(path).name}.probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--summary {path}: cannot write in {where} ({e.strerror or e})") from None


def make_config(args) -> PeerConfig:
    file_cfg = load_toml(args.config) if args.config else {}
    peer, overrides = _merge(args, file_cfg)
    if not peer.get("region"):
        raise ConfigError("--region is required (e.g. --region eu)")
    if not peer.get("data"):
        raise ConfigError("--data is required: a directory or file with this peer's training text")
    if not peer.get("initial_peers"):
        raise ConfigError("--initial-peers is required: the multiaddr(s) printed by worldlm-bootstrap")
    net_kwargs: dict[str, Any] = dict(initial_peers=tuple(peer["initial_peers"]),
                                      identity_path=peer.get("identity"))
    if peer.get("host_maddrs"):
        net_kwargs["host_maddrs"] = tuple(peer["host_maddrs"])
    elif not all(is_loopback(m) for m in peer["initial_peers"]):
        # peers on other machines must be able to dial us for the all-reduce
        net_kwargs["host_maddrs"] = ("/ip4/0.0.0.0/tcp/0",)
    if peer.get("announce_maddrs"):
        net_kwargs["announce_maddrs"] = tuple(peer["announce_maddrs"])
    if peer.get("reachability"):
        net_kwargs["reachability"] = peer["reachability"]
    kwargs: dict[str, Any] = dict(
        region=peer["region"], data=peer["data"], net=NetConfig(**net_kwargs), run_id=peer.get("run_id"),
        label=peer.get("label", ""), max_steps=peer.get("max_steps"), max_tokens=peer.get("max_tokens"),
        checkpoint_dir=peer.get("checkpoint_dir"), torch_threads=peer.get("threads"),
        summary_path=peer.get("summary"), trace_dir=peer.get("trace_dir"), events_path=peer.get("events"),
        certificate_path=peer.get("certificate"), local_overrides=overrides,
        privacy=_build_section(PrivacyConfig, "peer.privacy", peer["privacy"]),
    )
    for key, name in (("device", "device"), ("checkpoint_every", "checkpoint_every"),
                      ("manifest_wait", "manifest_wait"), ("wait_for_peers", "wait_for_peers"),
                      ("run_key", "run_key"), ("slowdown", "slowdown"),
                      ("background_nice", "background_nice")):
        if peer.get(key) is not None:
            kwargs[name] = peer[key]
    config = PeerConfig(**kwargs)
    # cheap checks first, so that bad input fails before the heavy imports and the network
    from worldlm_p2p.errors import DataError
    from worldlm_p2p.net.dht import check_listen_addrs, parse_maddrs

    parse_maddrs(config.net.initial_peers, what="--initial-peers", require_peer_id=True)
    parse_maddrs(config.net.host_maddrs, what="--host-maddrs", require_peer_id=False)
    check_listen_addrs(config.net.host_maddrs, what="--host-maddrs")
    parse_maddrs(config.net.announce_maddrs, what="--announce-maddrs", require_peer_id=False)
    data = Path(config.data)
    if not data.exists():
        raise DataError(f"data path {config.data} does not exist")
    files = [data] if not data.is_dir() else [data / "train.txt", data / "valid.txt"]
    for f in files:
        if f.exists() and not f.is_file() and not f.is_dir():
            raise DataError(f"data path {f} is not a regular file (a FIFO or a device?)")
    return config


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def body() -> int:
        config = make_config(args)
        check_summary_path(config.summary_path)
        from worldlm_p2p.logs import setup_logging

        setup_logging()
        import torch

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        from worldlm_p2p.peer import Peer

        peer = Peer(config=config)
        install_stop_handlers(peer.stop)
        try:
            summary = peer.run()
        finally:
            peer.shutdown()
        logger.info("done: %s", json.dumps({k: summary[k] for k in ("steps", "tokens", "rounds_completed",
                                                                     "valid_loss") if k in summary}))
        return 0

    run_main(PROG, body)


if __name__ == "__main__":
    main(sys.argv[1:])
