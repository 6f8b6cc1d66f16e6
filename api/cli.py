"""The ``troupe`` command: ``serve``, ``pull``, ``actors`` and ``bench``.

Everything that loads MLX is imported inside the command that needs it, so ``troupe --help``
and ``troupe actors`` start fast and work on machines without MLX.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

from actors.config import ServeConfig, api_keys
from api.server import HttpServer, serve_http
from runtime import ActorSystem

log = logging.getLogger("troupe")

_DEFAULTS = ServeConfig()
_LOG_LEVELS = ("debug", "info", "warning", "error")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# --- serve ---------------------------------------------------------------------------------


# What stops the server gracefully: Ctrl-C, a service manager's stop, and the end of the
# terminal or SSH session it was started from (SIGHUP's default would kill it at once).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


async def serve(config: ServeConfig) -> None:
    """Run the server until SIGINT, SIGTERM or SIGHUP, then shut down in order and return.

    On the signal new connections are refused at once; requests already running get up to
    ``config.shutdown_grace`` seconds, then end cleanly (a stream gets an error event); a
    second signal cuts the grace short. Then the actor system stops, each actor in reverse
    start order, draining its mailbox (where actors flush what they hold).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()
    assert main_task is not None  # serve() always runs inside a task
    server: HttpServer | None = None

    def on_signal(sig: signal.Signals) -> None:
        log.info("received %s", sig.name)
        if server is None:
            # The model is still downloading or loading: nothing to drain, give up at once.
            main_task.cancel()
        elif not stop.is_set():
            stop.set()
        else:
            server.hurry()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        # Lazy: the serving actors import MLX, which the rest of this module must not.
        from actors.engine import cpu_kernels
        from actors.models.blas import loaded_blas
        from actors.serving import start_serving

        async with ActorSystem() as system:
            handles = await start_serving(system, config)
            async with serve_http(system, config, handles) as server:
                model = ", ".join(card.id for card in handles.models) or config.model
                log.info("serving %s on %s (BLAS: %s; CPU kernels: %s)", model, server.url,
                         loaded_blas(), cpu_kernels.describe())
                await stop.wait()
                log.info(
                    "shutting down: finishing in-flight requests (up to %.0fs)",
                    config.shutdown_grace,
                )
            log.info("stopping the actors")
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def _maybe_preload_openblas(choice: str) -> None:
    """Re-execute this command with OpenBLAS preloaded when MLX would otherwise run on the
    reference BLAS of the mlx-cpu wheel (prefill about 25x slower). Before MLX is imported:
    a preload only works at process start."""
    from actors.models import blas  # lazy (api/ loads only messages and config at import)

    os.environ[blas.CHOICE_ENV] = choice
    plan = blas.preload_command(["-m", "api.cli", *sys.argv[1:]])
    if plan is not None:
        command, env = plan
        log.info("re-executing with %s preloaded (opt out: --blas openblas or bundled)",
                 env["LD_PRELOAD"])
        os.execve(sys.executable, command, env)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ``ServeConfig`` of parsed ``serve`` arguments (flags not given keep its defaults)."""
    fields = {f.name for f in msgspec.structs.fields(ServeConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    for name in ("model", "api_key"):
        if isinstance(values.get(name), list) and len(values[name]) == 1:
            values[name] = values[name][0]  # given once: the one value of old
    return ServeConfig(**values)


def _serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    _setup_logging(config.log_level)
    try:
        api_keys(config)  # a keys file that cannot be read fails now, not after a model load
    except ValueError as exc:
        log.error("troupe serve: %s", exc)
        return 1
    _maybe_preload_openblas(args.blas)
    if config.distributed:
        # Lazy: it imports MLX. Every rank but 0 follows rank 0's batch and serves no HTTP.
        from actors.distributed import start_rank

        try:
            config, follower_exit = start_rank(config)
        except Exception as exc:
            log.error("troupe serve --distributed failed: %s", exc,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            return 1
        if follower_exit is not None:
            return follower_exit
    try:
        asyncio.run(serve(config))
    except (asyncio.CancelledError, KeyboardInterrupt):
        log.info("stopped before the server started")
    except Exception as exc:  # a bad model or a busy port: say what, not where
        log.error("troupe serve failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1
    return 0


# --- pull ----------------------------------------------------------------------------------


def _pull(args: argparse.Namespace) -> int:
    _setup_logging("info")
    # Lazy: resolving may convert weights with MLX.
    from actors.models.store import resolve_model

    print(f"resolving {args.model or 'the default model'} ...", file=sys.stderr)
    try:
        resolved = resolve_model(args.model)
    except Exception as exc:  # a bad spec or a failed download: say what, not where
        print(f"troupe pull: {exc}", file=sys.stderr)
        return 1
    print(f"{resolved.name} ({resolved.source})", file=sys.stderr)
    print(resolved.path)  # the last line of stdout, for scripts: MODEL_DIR=$(troupe pull X)
    return 0


# --- actors --------------------------------------------------------------------------------


def _actor_row(actor: dict[str, Any]) -> list[str]:
    """One ``ActorSnapshot`` (as JSON) as table cells."""
    error = actor.get("last_error")
    return [
        str(actor.get("name", "?")),
        str(actor.get("actor_class", "?")),
        str(actor.get("state", "?")),
        actor.get("thread") or "-",
        f"{actor.get('mailbox_depth', '?')}/{actor.get('mailbox_capacity', '?')}",
        str(actor.get("messages_handled", "?")),
        str(actor.get("restarts", "?")),
        f"{error['type']}: {error['message']}" if error else "-",
    ]


_ACTOR_HEADER = ["NAME", "CLASS", "STATE", "THREAD", "MAILBOX", "HANDLED", "RESTARTS", "LAST ERROR"]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain-text table, each column padded to its widest cell."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


_INTROSPECTION_KEY = "default: $TROUPE_ADMIN_API_KEY, else $TROUPE_API_KEY"


def _introspection_key() -> str | None:
    """The key the introspection commands send: a server with an admin key wants that one on
    /actors and its stream; one without takes the API key."""
    return os.environ.get("TROUPE_ADMIN_API_KEY") or os.environ.get("TROUPE_API_KEY")


def _actors(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/actors"
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if args.api_key:
        request.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            actors = json.load(response)
    except urllib.error.HTTPError as err:
        if err.code == 404:
            print(f"{args.url} has no introspection endpoint (GET /actors)", file=sys.stderr)
        elif err.code in (401, 403):
            print(f"{args.url} wants {'its admin' if err.code == 403 else 'an API'} key: pass "
                  "--api-key or set TROUPE_ADMIN_API_KEY (or TROUPE_API_KEY)", file=sys.stderr)
        else:
            print(f"GET {url} failed: HTTP {err.code}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as err:
        print(f"could not reach {url}: {err}", file=sys.stderr)
        return 1
    print(format_table(_ACTOR_HEADER, [_actor_row(actor) for actor in actors]))
    return 0


# --- top -----------------------------------------------------------------------------------


def _top(args: argparse.Namespace) -> int:
    # Lazy: rich is only needed here.
    from api.top import run

    return run(args.url, args.api_key, once=args.once)


# --- bench ---------------------------------------------------------------------------------

_HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py"


def _bench(args: argparse.Namespace) -> int:
    """Run the serving harness in a child process: it loads MLX, which this module must not,
    and re-executes itself with the BLAS that `troupe serve` would use."""
    if not _HARNESS.is_file():
        print("troupe bench needs a source checkout (benchmarks/harness.py)", file=sys.stderr)
        return 1
    try:
        return subprocess.call([sys.executable, str(_HARNESS), *args.harness_args])
    except KeyboardInterrupt:  # the child got the same SIGINT and stops on its own
        return 130


# --- soak ----------------------------------------------------------------------------------


def _soak(args: argparse.Namespace) -> int:
    # Lazy: a client of its own (aiohttp, a `troupe serve` subprocess), with its own flags.
    from tools.soak.run import main as soak_main

    return soak_main(args.soak_args)


# --- entry point ---------------------------------------------------------------------------


class _CommaList(argparse.Action):
    """Collect comma-separated values across repeats: ``--x a,b --x c`` gives [a, b, c]."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.extend(item.strip() for item in str(values).split(",") if item.strip())
        setattr(namespace, self.dest, items)


class _Repeated(argparse.Action):
    """Collect a flag's repeats into a list: the first one given replaces the default (taken
    from the environment), each next one adds to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(given if isinstance(given, list) else []), values])


class _Aliases(argparse.Action):
    """Collect ``--alias NAME=MODEL`` repeats into a dict, in the order given (the order in
    which glob patterns are tried)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        name, equals, model = str(values).partition("=")
        name, model = name.strip(), model.strip()
        if not equals or not name or not model:
            parser.error(f"{option_string} wants NAME=MODEL, not {values!r}")
        aliases = dict(getattr(namespace, self.dest, None) or {})
        if name in aliases:
            parser.error(f"{option_string} {name!r} is given twice")
        aliases[name] = model
        setattr(namespace, self.dest, aliases)


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes from a size such as ``800MB``, ``6GB``, ``1.5GiB`` or ``1048576``."""
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGTIB")
    unit = raw[len(number):]
    if unit not in _SIZE_UNITS or not number:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 800MB, 6GB or 1GiB)")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size cannot be negative: {text!r}")
    return int(value * _SIZE_UNITS[unit])


def parse_ms(text: str) -> float:
    """Milliseconds, 0 or more (a finite number)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"milliseconds must be 0 or more: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``troupe`` argument parser (serve, pull, actors, bench)."""
    from actors.models import blas  # MLX-free: the --blas choices
    parser = argparse.ArgumentParser(prog="troupe", description="mlx-troupe: an LLM server for MLX")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser(
        "serve", help="serve a model over the OpenAI and Anthropic APIs"
    )
    serve_cmd.set_defaults(run=_serve)
    # SUPPRESS: a flag not given leaves ServeConfig's own default, the one documented place.
    opt = argparse.SUPPRESS
    serve_cmd.add_argument(
        "--model",
        action="append",
        default=opt,
        help="model directory, .gguf file or Hugging Face repo id (default: the bundled model); "
        "repeat it to serve several models, each loaded on its first request",
    )
    serve_cmd.add_argument(
        "--alias",
        dest="aliases",
        action=_Aliases,
        metavar="NAME=MODEL",
        default=opt,
        help="serve requests naming NAME with MODEL, a served model's id (repeatable; NAME may "
        "be a glob pattern such as 'claude-*-haiku-*'); with one model served, every name is "
        "served by it",
    )
    serve_cmd.add_argument("--host", default=opt, help=f"default: {_DEFAULTS.host}")
    serve_cmd.add_argument("--port", type=int, default=opt, help=f"default: {_DEFAULTS.port}")
    serve_cmd.add_argument(
        "--max-batch-size",
        type=int,
        metavar="N",
        default=opt,
        help=f"most sequences decoding at once (default: {_DEFAULTS.max_batch_size})",
    )
    serve_cmd.add_argument(
        "--prefill-batch-size",
        type=int,
        metavar="N",
        default=opt,
        help=f"prompts prefilled together (default: {_DEFAULTS.prefill_batch_size})",
    )
    serve_cmd.add_argument(
        "--prefill-step-size",
        type=int,
        metavar="N",
        default=opt,
        help=f"prompt tokens per prefill chunk (default: {_DEFAULTS.prefill_step_size})",
    )
    serve_cmd.add_argument(
        "--prefill-interleave",
        type=float,
        metavar="R",
        default=opt,
        help="while sequences decode, hold a step's prefill to about R decode steps' time, "
        "so streams keep flowing past a long prompt; 0: whole chunks "
        f"(default: {_DEFAULTS.prefill_interleave})",
    )
    serve_cmd.add_argument(
        "--step-budget-ms",
        dest="step_budget_ms",
        type=parse_ms,
        metavar="MS",
        default=opt,
        help="while others wait on a step (streams decoding, a short prompt beside a long "
        "one), size its prefill chunk from the measured prefill rate so the step takes about "
        f"MS; 0: no bound (default: {_DEFAULTS.step_budget_ms})",
    )
    serve_cmd.add_argument(
        "--arrival-window",
        dest="arrival_window_ms",
        type=float,
        metavar="MS",
        default=opt,
        help="an idle server waits this long after a request arrives before its first step, "
        f"so a burst is prefilled together; 0: at once (default: {_DEFAULTS.arrival_window_ms})",
    )
    serve_cmd.add_argument(
        "--mixed-step",
        action=argparse.BooleanOptionalAction,
        default=opt,
        help="while sequences decode, run the prefill chunk in the decode step's forward pass "
        f"(one model call a step; llama-shaped models) (default: {_DEFAULTS.mixed_step})",
    )
    serve_cmd.add_argument(
        "--max-queue",
        type=int,
        metavar="N",
        default=opt,
        help=f"requests waiting for a batch slot before 429 (default: {_DEFAULTS.max_queue})",
    )
    serve_cmd.add_argument(
        "--default-max-tokens",
        type=int,
        metavar="N",
        default=opt,
        help=f"max_tokens when a request sends none (default: {_DEFAULTS.default_max_tokens})",
    )
    serve_cmd.add_argument(
        "--max-tokens-limit",
        type=int,
        metavar="N",
        default=opt,
        help="the most tokens any answer may have: a request asking for more is served with "
        "N (default: no limit but the model's context)",
    )
    serve_cmd.add_argument(
        "--template-timeout",
        type=float,
        metavar="SECONDS",
        default=opt,
        help="seconds the chat template may take to render a request; a longer render is "
        f"cut and the request refused with 400 (default: {_DEFAULTS.template_timeout})",
    )
    serve_cmd.add_argument(
        "--responses-store",
        type=int,
        metavar="N",
        default=opt,
        help="Responses API: responses kept in memory for previous_response_id, the least "
        f"recently used dropped first (default: {_DEFAULTS.responses_store}; 0: none)",
    )
    serve_cmd.add_argument(
        "--blas",
        choices=blas.CHOICES,
        default=os.environ.get("TROUPE_BLAS", "auto"),
        help="auto: preload Debian's OpenBLAS when MLX would use its slow bundled reference "
        "BLAS (Linux), with troupe's batch-1 matrix-vector product in front (x86-64 with "
        "AVX2: decode about 2x faster, same results); openblas: OpenBLAS alone; bundled: "
        "never (default: $TROUPE_BLAS, else auto)",
    )
    serve_cmd.add_argument(
        "--cpu-kernels",
        choices=("native", "mlx"),
        default=opt,
        help="native: MLX's kernels built for this CPU and a faster prefill attention, same "
        f"results; mlx: MLX's own (default: {_DEFAULTS.cpu_kernels})",
    )
    serve_cmd.add_argument(
        "--block-size",
        type=int,
        metavar="TOKENS",
        default=opt,
        help=f"prefix-cache block size in tokens (default: {_DEFAULTS.block_size}; 0: off)",
    )
    serve_cmd.add_argument(
        "--no-prefix-cache",
        dest="block_size",
        action="store_const",
        const=0,
        default=opt,
        help="turn the prefix cache off (same as --block-size 0)",
    )
    serve_cmd.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=opt,
        help="where prefix-cache blocks are kept on disk (default: $TROUPE_HOME/kv-cache)",
    )
    serve_cmd.add_argument(
        "--cache-ram-max",
        type=parse_size,
        metavar="SIZE",
        default=opt,
        help=f"RAM for prefix-cache blocks, e.g. 2GB (default: {_DEFAULTS.cache_ram_max} bytes)",
    )
    serve_cmd.add_argument(
        "--cache-disk-max",
        type=parse_size,
        metavar="SIZE",
        default=opt,
        help=f"disk for prefix-cache blocks (default: {_DEFAULTS.cache_disk_max} bytes)",
    )
    serve_cmd.add_argument(
        "--max-body-bytes",
        type=int,
        metavar="N",
        default=opt,
        help=f"largest request body accepted (default: {_DEFAULTS.max_body_bytes})",
    )
    serve_cmd.add_argument(
        "--api-key",
        action=_Repeated,
        metavar="KEY",
        default=os.environ.get("TROUPE_API_KEY", opt),
        help="require this key on every route but /health; repeat it for several clients, "
        "each with a prefix-cache namespace of its own (default: $TROUPE_API_KEY, else none)",
    )
    serve_cmd.add_argument(
        "--api-keys-file",
        metavar="PATH",
        default=opt,
        help="take the keys in this file too, one a line (# comments)",
    )
    serve_cmd.add_argument(
        "--shared-cache",
        action="store_true",
        default=opt,
        help="let every API key's requests share prefix-cache blocks (each key then can "
        "probe, through cached token counts, what the others' prompts begin with)",
    )
    serve_cmd.add_argument(
        "--admin-api-key",
        metavar="KEY",
        default=os.environ.get("TROUPE_ADMIN_API_KEY", opt),
        help="require this key, and no other, on /actors and /metrics "
        "(default: $TROUPE_ADMIN_API_KEY, else they take --api-key)",
    )
    serve_cmd.add_argument(
        "--idle-timeout",
        type=float,
        metavar="SECONDS",
        default=opt,
        help="close a connection that has not sent a complete request head this long after "
        f"opening or after its last response (default: {_DEFAULTS.idle_timeout})",
    )
    serve_cmd.add_argument(
        "--body-timeout",
        type=float,
        metavar="SECONDS",
        default=opt,
        help=f"a request body must arrive within this (default: {_DEFAULTS.body_timeout})",
    )
    serve_cmd.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        default=opt,
        help="connections open at once; more get 503 (default: 3/4 of the open-file limit)",
    )
    serve_cmd.add_argument(
        "--max-header-bytes",
        type=int,
        metavar="N",
        default=opt,
        help=f"longest request line or header (default: {_DEFAULTS.max_header_bytes})",
    )
    serve_cmd.add_argument(
        "--allowed-origins",
        "--allowed-origin",
        dest="allowed_origins",
        metavar="ORIGINS",
        action=_CommaList,
        default=opt,
        help="allow browser requests from these origins, comma-separated (repeatable; '*': any)",
    )
    serve_cmd.add_argument(
        "--shutdown-grace",
        type=float,
        metavar="SECONDS",
        default=opt,
        help=f"seconds in-flight requests get on shutdown (default: {_DEFAULTS.shutdown_grace})",
    )
    serve_cmd.add_argument(
        "--log-level", choices=_LOG_LEVELS, default=opt, help=f"default: {_DEFAULTS.log_level}"
    )
    serve_cmd.add_argument(
        "--memory-limit",
        type=parse_size,
        metavar="SIZE",
        default=opt,
        help="MLX memory to stay under, e.g. 6GB (default: 75%% of the RAM available at start, "
        "or 90%% of Metal's recommended working set)",
    )
    serve_cmd.add_argument(
        "--memory-poll",
        dest="memory_poll_ms",
        type=int,
        metavar="MS",
        default=opt,
        help=f"how often memory is read, in ms (default: {_DEFAULTS.memory_poll_ms})",
    )
    serve_cmd.add_argument(
        "--no-prefill-guard",
        dest="prefill_guard",
        action="store_false",
        default=opt,
        help="do not refuse (413) or stop prompts whose prefill would pass the memory limit",
    )
    serve_cmd.add_argument(
        "--models-memory",
        type=parse_size,
        metavar="SIZE",
        default=opt,
        help="weights the loaded models may take; loading one more unloads the least recently "
        "used idle one (default: no budget)",
    )
    serve_cmd.add_argument(
        "--pin",
        action="append",
        metavar="MODEL",
        default=opt,
        help="never unload this model (repeatable)",
    )
    serve_cmd.add_argument(
        "--idle-ttl",
        type=float,
        metavar="SECONDS",
        default=opt,
        help="unload a model idle this long (default: never)",
    )
    serve_cmd.add_argument(
        "--distributed",
        choices=["tensor", "pipeline"],
        default=opt,
        help="shard the model over the ranks `mlx.launch` started (docs/distributed.md); rank 0 "
        "serves HTTP, the others follow its batch; every rank needs the group's shared secret "
        "in $TROUPE_DISTRIBUTED_SECRET (default: one process)",
    )
    serve_cmd.add_argument(
        "--distributed-port",
        type=int,
        metavar="PORT",
        default=opt,
        help="port on rank 0's host where the other ranks take each step's plan "
        f"(default: {_DEFAULTS.distributed_port})",
    )

    pull_cmd = commands.add_parser("pull", help="download/convert a model; print its directory")
    pull_cmd.set_defaults(run=_pull)
    pull_cmd.add_argument("model", nargs="?", default=None, help="default: the bundled model")

    actors_cmd = commands.add_parser("actors", help="show a running server's actors")
    actors_cmd.set_defaults(run=_actors)
    actors_cmd.add_argument("--url", default="http://127.0.0.1:8000", help="the server's URL")
    actors_cmd.add_argument("--api-key", default=_introspection_key(), help=_INTROSPECTION_KEY)

    top_cmd = commands.add_parser(
        "top", help="a running server live in the terminal: actors, requests, cache, memory"
    )
    top_cmd.set_defaults(run=_top)
    top_cmd.add_argument("--url", default="http://127.0.0.1:8000", help="the server's URL")
    top_cmd.add_argument("--api-key", default=_introspection_key(), help=_INTROSPECTION_KEY)
    top_cmd.add_argument("--once", action="store_true", help="print one snapshot and exit")

    # Every flag after `bench` goes to the harness (main() passes them through), --help too.
    bench_cmd = commands.add_parser(
        "bench",
        add_help=False,
        help="benchmark against mlx_lm.server (flags: troupe bench --help)",
    )
    bench_cmd.set_defaults(run=_bench)
    # Likewise every flag after `soak` goes to tools/soak/run.py.
    soak_cmd = commands.add_parser(
        "soak",
        add_help=False,
        help="a bounded soak-and-fault run against a real server (flags: troupe soak --help)",
    )
    soak_cmd.set_defaults(run=_soak)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``troupe`` console script; returns the exit status."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        args.harness_args = rest
    elif args.command == "soak":
        args.soak_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
