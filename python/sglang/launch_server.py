"""`python -m sglang.launch_server --model-path ...`: start the HTTP server."""

from __future__ import annotations

import sys


def main(argv=None) -> None:
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    try:
        server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    launch_server(server_args)


if __name__ == "__main__":
    main()
