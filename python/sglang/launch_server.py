"""`python -m sglang.launch_server --model-path ...`: start the HTTP server.

Exit status: 0 after a clean shutdown (SIGTERM drains first), 1 if start-up failed or a
child process died, 2 for bad flags.
"""

from __future__ import annotations

import sys


def main(argv=None) -> None:
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.entrypoints.launch import ChildStartError
    from sglang.srt.entrypoints.openai.chat_template import resolve_chat_template
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.flag_checks import check_one_replica

    try:
        server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
        resolve_chat_template(server_args.chat_template)  # fail before loading anything
        check_one_replica(server_args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        launch_server(server_args)
    except ChildStartError as e:
        print(f"error: the server could not start. {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C: the children are already stopped
        sys.exit(130)


if __name__ == "__main__":
    main()
