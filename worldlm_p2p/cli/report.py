"""``worldlm-report``: loss against tokens per region (PNG) and a Markdown summary.

    worldlm-report runs/demo --out runs/demo                       # a worldlm-swarm run
    worldlm-report worldlm.json fedavg.json local.json --out cmp   # worldlm-simulate results compared

Writes ``DIR/report.png`` and ``DIR/report.md``; see :mod:`worldlm_p2p.report`.
"""

from __future__ import annotations

import logging
import sys

from worldlm_p2p.cli.common import ArgumentParser, run_main

PROG = "worldlm-report"
logger = logging.getLogger(PROG)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Plot loss against tokens per region (and per strategy) and "
                                              "write a Markdown summary beside the plot.")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="a worldlm-swarm run directory (or its summary.json), or worldlm-simulate results "
                        "JSON files (several: strategies compared region by region)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory for report.png and report.md")
    p.add_argument("--title", help="title of the figure and the summary")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from worldlm_p2p.logs import setup_logging
        from worldlm_p2p.report import load_report, write_report

        report = load_report(args.sources, title=args.title)
        setup_logging(hivemind=False)
        png, md = write_report(report, args.out)
        logger.info("report written to %s and %s", png, md)
        return 0

    run_main(PROG, body)


if __name__ == "__main__":
    main(sys.argv[1:])
