"""OpenAI-compatible server: ``python -m engine.serve [MODEL] [flags]`` (vLLM's serve flags); no model: the
tiny V4.1.

Routes: /v1/models, /v1/completions, /v1/chat/completions (streaming or not), /tokenize, /detokenize,
/health and /metrics (docs/serving.md). This module binds the port and hands over to
engine/server/launch.py; the app is engine/server/app.py, the flags engine/server/args.py.
"""

from __future__ import annotations

import logging
import socket
import sys

from engine.server.args import ignored_notes, parse_args

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made before anything loads: a port in use fails at once, naming it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {err.strerror}") from None
    return sock


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    for note in ignored_notes(args):
        log.warning(note)
    sock = bind(args.host, args.port)
    args.port = sock.getsockname()[1]  # --port 0: the one the system picked, for the start-up line
    try:
        # Only now torch and the model code load (seconds): a port in use has already failed.
        from engine.server.launch import serve

        serve(args, sock)
    except KeyboardInterrupt:  # Ctrl-C before uvicorn took the signals over: no traceback, 128 + SIGINT
        print("interrupted while starting", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
