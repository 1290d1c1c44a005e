"""`troupe serve`: run the app under uvicorn, with troupe's own signal and engine-death handling.

1. Bind the listening socket first (so `--port 0` works and the port is printed at once:
   `troupe serve: http://HOST:PORT`), then start uvicorn on it; the app's lifespan loads the model,
   and the socket accepts connections once the engine is ready.
2. SIGTERM / SIGINT: `/health` and new generation requests answer 503, uvicorn stops accepting
   connections, in-flight requests keep running for `--shutdown-timeout` seconds and are then
   aborted (each stream ends with finish_reason "abort" and `[DONE]`); when they are done, the
   lifespan shuts the engine down and the process exits 0. A second signal aborts at once.
3. Engine death: requests get 503 at once; after `--exit-on-engine-death-after` seconds the server
   shuts down the same way and exits 1, so a supervisor can restart it (a negative value keeps
   it up, answering 503).
4. A startup failure (a model that cannot load) exits 3, uvicorn's code for it.

uvicorn's own signal handlers are not installed (it would re-raise the signal after shutting down,
so the exit status would not be 0); anyio's signal receiver is used instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from troupe.tools.parsers import TOOL_PARSERS

if TYPE_CHECKING:
    import uvicorn

    from troupe.server.state import ServerState

log = structlog.get_logger("troupe.server")

EXIT_ENGINE_DEAD = 1
_ENGINE_POLL_S = 0.2


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `serve` flags besides the engine ones (cli.py adds those)."""
    p.add_argument("model_name", nargs="?", default=None, metavar="MODEL",
                   help="model folder or the default model's name (same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients use in `model` (default: the model argument)")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (as vLLM); default: $TROUPE_API_KEY, else "
                        "$VLLM_API_KEY")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line), instead of the command line")
    g.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="answer only requests whose Host header names one of these (a 400 otherwise)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's head (request line and headers) may take to arrive")
    g.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request's body may take to arrive once its head has (a 408 past it)")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle kept-alive connection stays open")
    g.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open connections at most; past it a request gets a 503")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    g.add_argument("--exit-on-engine-death-after", type=float, default=2.0,
                   help="seconds to keep answering 503 after the engine died, then exit 1 (<0: never)")
    g.add_argument("--max-request-body-bytes", type=int, default=16 * 2**20)
    g.add_argument("--tool-call-parser", default="hermes",
                   choices=[*TOOL_PARSERS, "none"],
                   help="the format tool calls are read in for tool_choice auto (none: not at all)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: troupe parses tool calls unless --tool-call-parser none")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split the model's <think>...</think> into reasoning_content (chat) and reasoning "
                        "items (Responses)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the chat template for every request (a file, or the Jinja text itself), instead "
                        "of the model's; for models whose own template lacks tools")
    g.add_argument("--responses-store-size", type=int, default=256, metavar="N",
                   help="Responses API answers with store=true kept in memory for GET/DELETE (oldest dropped)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (refused otherwise, as vLLM)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn)")
    # vLLM compatibility: CORS (JSON lists, as vLLM's CLI takes them) and /tokenizer_info
    g.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=["*"], metavar="JSON",
                   help='CORS: origins allowed, a JSON list (default ["*"])')
    g.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"], metavar="JSON",
                   help='CORS: methods allowed, a JSON list (default ["*"])')
    g.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"], metavar="JSON",
                   help='CORS: request headers allowed, a JSON list (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's config and chat template), as vLLM")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _json_list(flag: str) -> Any:
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]'; got {text!r}")
        return value
    return parse


@dataclass
class _Run:
    state: ServerState
    server: uvicorn.Server
    shutdown_timeout: float
    exit_code: int = 0
    stopping: bool = False

    def stop(self, code: int = 0) -> None:
        self.exit_code = self.exit_code or code
        self.stopping = True
        self.state.draining = True
        self.server.should_exit = True


def _server_class() -> type[uvicorn.Server]:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # troupe handles signals itself
            yield

    return Server


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def _on_signals(run: _Run) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:
            async for sig in signals:
                if not run.stopping:
                    log.info("shutting down", signal=signal.Signals(sig).name,
                             in_flight=run.state.num_in_flight, grace_s=run.shutdown_timeout)
                    run.stop(0)
                    tg.start_soon(_abort_after, run, run.shutdown_timeout)
                else:
                    log.warning("second signal: aborting every request now")
                    await run.state.abort_all()


async def _abort_after(run: _Run, delay: float) -> None:
    await anyio.sleep(delay)
    if run.state.num_in_flight:
        log.warning("shutdown grace over: aborting", in_flight=run.state.num_in_flight)
        await run.state.abort_all()


async def _watch_engine(run: _Run, exit_after: float) -> None:
    """Poll for engine death (no event to wait on); then 503 for `exit_after` s and shut down."""
    while not (run.state.llm is not None and run.state.llm.errored):  # noqa: ASYNC110 (AsyncLLM has no death event)
        await anyio.sleep(_ENGINE_POLL_S)
    log.error("engine died; /health answers 503", exit_after_s=exit_after if exit_after >= 0 else None,
              error=str(run.state.llm.dead_error) if run.state.llm else None)
    if exit_after < 0:
        return
    await anyio.sleep(exit_after)
    if not run.stopping:  # a shutdown already under way keeps its exit code
        run.stop(EXIT_ENGINE_DEAD)


async def serve_async(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """Serve until a signal or engine death; returns the exit code."""
    import uvicorn

    from troupe.facades.async_llm import AsyncLLM
    from troupe.server.app import build_app
    from troupe.server.edge import edge_protocol
    from troupe.server.state import ServerSettings

    names = args.served_model_name or [engine_options["model"]]
    settings = ServerSettings(served_model_names=names, api_key=api_key(args),
                              max_body_bytes=args.max_request_body_bytes, body_timeout_s=args.body_timeout,
                              allowed_hosts=args.allowed_hosts,
                              tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
                              trust_request_chat_template=args.trust_request_chat_template,
                              reasoning_parser=args.reasoning_parser, chat_template=chat_template(args.chat_template),
                              responses_store_size=args.responses_store_size,
                              allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                              allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                              enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint)
    app = build_app(settings, lambda: AsyncLLM(**engine_options))
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"troupe serve: http://{host}:{port}", flush=True)
    grace = max(0.0, args.shutdown_timeout)
    config = uvicorn.Config(app, lifespan="on", log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=grace + 5.0, http=edge_protocol(args.header_timeout, args.limit_concurrency),
                            timeout_keep_alive=args.timeout_keep_alive)
    run = _Run(app.state.troupe, _server_class()(config), grace)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_on_signals, run)
        tg.start_soon(_watch_engine, run, args.exit_on_engine_death_after)
        try:
            await run.server.serve(sockets=[sock])
        except SystemExit as exc:  # uvicorn exits 3 when the lifespan (model load) fails
            run.exit_code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sock.close()
            tg.cancel_scope.cancel()
    return run.exit_code


def chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is no file (a Jinja template)."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"troupe serve: --chat-template: {exc}") from None
    if "{" not in value:
        raise SystemExit(f"troupe serve: --chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def api_key(args: argparse.Namespace) -> str | None:
    """The key: --api-key, else the first line of --api-key-file, else $TROUPE_API_KEY / $VLLM_API_KEY."""
    if args.api_key is not None and args.api_key_file is not None:
        raise SystemExit("troupe serve: give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file) as f:
                key = f.readline().strip()
        except OSError as exc:
            raise SystemExit(f"troupe serve: --api-key-file: {exc}") from None
        if not key:
            raise SystemExit(f"troupe serve: --api-key-file: {args.api_key_file} has no key on its first line")
        return key
    return args.api_key or os.environ.get("TROUPE_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def serve(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """`troupe serve` with parsed `args`; `engine_options` are EngineConfig fields (MODEL wins)."""
    if args.model_name is not None:
        engine_options = {**engine_options, "model": args.model_name}
    code = anyio.run(serve_async, args, engine_options, backend="asyncio")
    print(f"troupe serve: exit {code}", file=sys.stderr, flush=True)
    return code
