"""The ``gradleak`` command: one module per subcommand (run, check, list, demo, results, report, bench)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from gradleak import progress
from gradleak.cli import bench, check, demo, listing, report, results, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradleak", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (run, check, listing, demo, results, report, bench):
        module.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        with progress.bars(not args.quiet):  # rounds, clients, attack iterations, cache builds (with ETA)
            return int(args.handler(args))
    except (ValueError, KeyError, FileNotFoundError) as exc:  # user errors: one clear line, no traceback
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        print(f"gradleak: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
