"""``worldlm-admit``: region keys and peer certificates, for the institutions that admit peers to
a region and for the volunteers they admit.

    worldlm-admit keygen --key eu-region.key          # an institution: prints the manifest line
    worldlm-admit peer-id --identity me.key           # a volunteer: prints the id to send them
    worldlm-admit issue --key eu-region.key --run-id demo --region eu --peer-id 12D3... \\
        --days 30 --out me.cert                       # the institution signs it
    worldlm-peer --region eu --identity me.key --certificate me.cert ...

    worldlm-admit show --certificate me.cert [--run-config run.toml]   # what it says, and if it holds

Only the key line, the peer id and what ``show`` says go to stdout; log lines go to stderr.
"""

from __future__ import annotations

import logging
import sys
import time

from worldlm_p2p.cli.common import ArgumentParser, run_main

PROG = "worldlm-admit"
logger = logging.getLogger(PROG)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Region keys and peer certificates (admission per region).")
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    k = sub.add_parser("keygen", help="create a region key (mode 0600) and print its public line for the "
                                      "run manifest's [admission.regions]")
    k.add_argument("--key", required=True, metavar="FILE", help="the region key file (created if missing)")
    k.add_argument("--region", default="REGION", help="the region, to print the manifest line with it")
    i = sub.add_parser("peer-id", help="create (if missing) a peer identity and print its peer id")
    i.add_argument("--identity", required=True, metavar="FILE", help="the identity the peer runs with (--identity)")
    s = sub.add_parser("issue", help="sign a certificate that admits a peer to a region")
    s.add_argument("--key", required=True, metavar="FILE", help="the region key")
    s.add_argument("--run-id", required=True)
    s.add_argument("--region", required=True)
    s.add_argument("--peer-id", required=True, help="the peer's id (worldlm-admit peer-id prints it)")
    s.add_argument("--days", type=float, default=30.0, help="validity in days (default 30)")
    s.add_argument("--out", required=True, metavar="FILE", help="the certificate file to write")
    w = sub.add_parser("show", help="print a certificate and, with --run-config, whether it admits its peer")
    w.add_argument("--certificate", required=True, metavar="FILE")
    w.add_argument("--run-config", metavar="TOML", help="the run manifest that names the region keys")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from worldlm_p2p.config import check_name
        from worldlm_p2p.errors import ConfigError
        from worldlm_p2p.logs import setup_logging
        from worldlm_p2p.net import admission
        from worldlm_p2p.net.dht import ensure_identity

        # what this tool prints (a key line, a peer id) goes to stdout alone, so that scripts can
        # capture it; its log lines go to stderr
        setup_logging(hivemind=False, stream=sys.stderr)
        if args.command == "keygen":
            if args.region != "REGION":
                check_name("region", args.region)
            key = ensure_identity(args.key)
            print(f'{args.region} = "{admission.public_key_text(key)}"')
        elif args.command == "peer-id":
            print(admission.peer_id_of(ensure_identity(args.identity).get_public_key()))
        elif args.command == "issue":
            check_name("run id", args.run_id)
            check_name("region", args.region)
            if not args.days > 0:
                raise ConfigError("--days must be > 0")
            if not (40 <= len(args.peer_id) <= 60 and args.peer_id.isalnum()):
                raise ConfigError(f"--peer-id {args.peer_id!r} is not a libp2p peer id (worldlm-admit peer-id prints one)")
            from pathlib import Path

            if not Path(args.key).is_file():
                raise ConfigError(f"--key {args.key}: no such region key (create it with worldlm-admit keygen)")
            cert = admission.issue(ensure_identity(args.key), run_id=args.run_id, region=args.region,
                                   peer_id=args.peer_id, expires=time.time() + args.days * 86400)
            cert.save(args.out)
            logger.info("admitted peer %s to region %s of run %s until %s: %s", args.peer_id, args.region,
                        args.run_id, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(cert.expires)), args.out)
        else:
            cert = admission.Certificate.load(args.certificate)
            print(f"run {cert.run_id}, region {cert.region}, peer {cert.peer_id}, expires "
                  f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(cert.expires))}")
            if args.run_config:
                from worldlm_p2p.config import RunManifest

                manifest = RunManifest.from_toml(args.run_config)
                line = manifest.admission.key_of(cert.region)
                if line is None:
                    print(f"region {cert.region} of run {manifest.run_id} is open: no certificate is needed")
                    return 0
                why = admission.check(cert, region_key=admission.load_public_key(
                    line, what=f"admission.regions.{cert.region}"), run_id=manifest.run_id, region=cert.region,
                    peer_id=cert.peer_id)
                print("valid" if why is None else f"not valid: {why}")
                return 0 if why is None else 1
        sys.stdout.flush()
        return 0

    run_main(PROG, body)


if __name__ == "__main__":
    main()
