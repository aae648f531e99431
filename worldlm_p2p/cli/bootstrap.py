"""``worldlm-bootstrap``: host a DHT bootstrap node and publish a run manifest."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from worldlm_p2p.cli.common import ArgumentParser, install_stop_handlers, run_main
from worldlm_p2p.config import NetConfig, RunManifest
from worldlm_p2p.errors import ConfigError

PROG = "worldlm-bootstrap"
logger = logging.getLogger(PROG)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Host a WorldLM bootstrap node (DHT only, no model).")
    p.add_argument("--run-config", metavar="TOML", help="run manifest to publish (see bootstrap/run.example.toml)")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/31337"], metavar="MADDR",
                   help="addresses to listen on (default: all interfaces, TCP port 31337)")
    p.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                   help="public addresses to advertise, e.g. /ip4/203.0.113.7/tcp/31337")
    p.add_argument("--identity", metavar="PATH",
                   help="private key file; created with mode 0600 if missing, so the peer id survives restarts")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                   help="other bootstrap nodes of the swarm, for redundancy")
    p.add_argument("--manifest-ttl", type=float, default=120.0, help="seconds a published manifest lives")
    p.add_argument("--run-key", metavar="FILE",
                   help="the run key that signs the manifest (created with mode 0600 if missing; every bootstrap "
                        "node of a run uses the same one); default: the --identity, or a key made for this process")
    p.add_argument("--remember-peers", metavar="FILE",
                   help="where the node remembers the peers it is connected to, to rejoin them when restarted "
                        "(default with --identity: IDENTITY.peers.json; 'none': do not remember)")
    p.add_argument("--relay", action="store_true",
                   help="also reduce the region rounds of regions whose members are all behind NAT (outbound-only), "
                        "which nobody else can; needs --run-config (the node endorses itself with the run key)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from worldlm_p2p.net.dht import check_listen_addrs, parse_maddrs

        manifest = RunManifest.from_toml(args.run_config) if args.run_config else None
        if manifest is not None:  # a region key that does not parse would lock that region's peers out
            from worldlm_p2p.net.admission import RegionAdmission

            RegionAdmission.of(manifest)
        identity_existed = bool(args.identity) and Path(args.identity).exists()
        net = NetConfig(initial_peers=tuple(args.initial_peers), host_maddrs=tuple(args.host_maddrs),
                        announce_maddrs=tuple(args.announce_maddrs), identity_path=args.identity)
        parse_maddrs(net.initial_peers, what="--initial-peers", require_peer_id=True)
        parse_maddrs(net.host_maddrs, what="--host-maddrs", require_peer_id=False)
        check_listen_addrs(net.host_maddrs, what="--host-maddrs")
        parse_maddrs(net.announce_maddrs, what="--announce-maddrs", require_peer_id=False)

        from worldlm_p2p.bootstrap import BootstrapConfig, BootstrapNode
        from worldlm_p2p.logs import setup_logging
        from worldlm_p2p.net import records

        setup_logging("ERROR")  # the multiaddrs must be the first output
        if args.run_key and Path(args.run_key).is_dir():
            raise ConfigError(f"--run-key {args.run_key} is a directory, expected a key file")
        peers_path = args.remember_peers or (f"{args.identity}.peers.json" if args.identity else None)
        node = BootstrapNode(config=BootstrapConfig(net=net, manifest=manifest, manifest_ttl=args.manifest_ttl,
                                                    run_key_path=args.run_key,
                                                    peers_path=None if peers_path == "none" else peers_path,
                                                    relay=args.relay))
        install_stop_handlers(node.stop)
        try:
            maddrs = node.start()
            print("To join this swarm: worldlm-peer --region REGION --initial-peers " + " ".join(maddrs), flush=True)
            setup_logging()
            if node.rejoining is not None and node.rejoining[1]:
                logger.info("rejoining the swarm: %d of the %d peers remembered in %s answer", *node.rejoining,
                            node.config.peers_path)
            if args.identity and not identity_existed:
                logger.info("created identity %s (mode 0600): keep it private and back it up", args.identity)
            if manifest is not None:
                logger.info("publishing run %s (manifest %s, model %s, strategy %s)", manifest.run_id,
                            manifest.fingerprint(), manifest.model.preset, manifest.aggregation.strategy)
                logger.info("the manifest is signed by run key %s; peers may pin it with --run-key '%s'",
                            records.run_key_id(node.run_key_text), node.run_key_text)
            else:
                logger.info("no --run-config: serving the DHT only")
            if node.relay is not None:
                logger.info("relaying: the rounds of regions whose members are all outbound-only go through this node")
            logger.info("bootstrap node %s is serving; Ctrl-C to stop", node.peer_id)
            node.serve()
        finally:
            node.shutdown()
        logger.info("bootstrap node stopped")
        return 0

    run_main(PROG, body)


if __name__ == "__main__":
    main(sys.argv[1:])
