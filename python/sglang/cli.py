"""The `sglang` console script: `sglang serve ...`, `sglang version`."""

from __future__ import annotations

import sys


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print("usage: sglang serve [server flags] | sglang version")
        return
    if args[0] == "serve":
        from sglang.launch_server import main as serve

        serve(args[1:])
    elif args[0] == "version":
        from sglang.version import __version__

        print(__version__)
    else:
        print(f"unknown command {args[0]!r}; try `sglang serve --help`", file=sys.stderr)
        sys.exit(2)
