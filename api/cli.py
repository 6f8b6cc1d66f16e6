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
import types
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

from troupe.actors.config import (
    ServeConfig,
    Setting,
    api_keys,
    check_drafting,
    model_specs,
    serve_settings,
)
from troupe.api.server import HttpServer, serve_http
from troupe.runtime import ActorSystem

log = logging.getLogger("troupe")


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
        from troupe.actors.engine import cpu_kernels
        from troupe.actors.models.blas import loaded_blas
        from troupe.actors.serving import start_serving

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
    from troupe.actors.models import blas  # lazy (api/ loads only messages and config at import)

    os.environ[blas.CHOICE_ENV] = choice
    plan = blas.preload_command(["-m", "troupe.api.cli", *sys.argv[1:]])
    if plan is not None:
        command, env = plan
        log.info("re-executing with %s preloaded (opt out: --blas openblas or bundled)",
                 env["LD_PRELOAD"])
        os.execve(sys.executable, command, env)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ``ServeConfig`` of parsed ``serve`` arguments."""
    names = {flag.field for flag in setting_flags()} | {"aliases"}
    values = {k: v for k, v in vars(args).items() if k in names}
    for flag in setting_flags():
        value = values.get(flag.field)
        if flag.one_or_many and isinstance(value, list) and len(value) == 1:
            values[flag.field] = value[0]  # given once: the one value of old
    return ServeConfig.of(**values)


def _serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    _setup_logging(config.log_level)
    try:
        api_keys(config)  # a keys file that cannot be read fails now, not after a model load
        check_drafting(config)  # contradicting flags, too
    except ValueError as exc:
        log.error("troupe serve: %s", exc)
        return 1
    _maybe_preload_openblas(args.blas)
    if config.engine.distributed:
        # Lazy: it imports MLX. Every rank but 0 follows rank 0's batch and serves no HTTP.
        from troupe.actors.distributed.launch import start_rank
        from troupe.actors.follower_disk import FollowerDisk
        from troupe.actors.serving import cache_dir

        try:
            config, follower_exit = start_rank(config, model_specs(config), cache_dir(config),
                                               FollowerDisk)
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
    from troupe.actors.models.store import resolve_model

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
    from troupe.api.top import run

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
    from troupe.tools.soak.run import main as soak_main

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


class Flag(NamedTuple):
    """A ``troupe serve`` flag built from a setting's declaration."""

    field: str
    names: list[str]
    options: dict[str, Any]  # add_argument's keyword arguments
    one_or_many: bool  # a ``str | list[str]`` field: given once, its value is that one string


_SETTINGS = serve_settings()
# Written by hand in build_parser: ``--alias NAME=MODEL`` fills a dict.
_BY_HAND = {"aliases"}


def _size_text(n: int) -> str:
    """A byte count as parse_size reads it back: ``1GiB``, ``512MiB``, else bytes."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _help(description: str, default: str) -> str:
    return f"{description} (default: {default})".replace("%", "%%")  # argparse formats with %


def _default_text(setting: Setting) -> str:
    cli = setting.cli
    if setting.default is None or setting.default == []:
        shown = cli.get("none", "none")
    elif isinstance(setting.default, bool):
        shown = "on" if setting.default else "off"
    elif cli.get("unit") == "size":
        shown = _size_text(setting.default)
    else:
        shown = str(setting.default)
    return f"${cli['env']}, else {shown}" if "env" in cli else shown


def _flag(name: str, setting: Setting) -> Flag:
    cli = setting.cli
    kinds = list(get_args(setting.type)) if get_origin(setting.type) in (
        Union, types.UnionType) else [setting.type]
    kinds = [kind for kind in kinds if kind is not type(None)]
    lists = [kind for kind in kinds if get_origin(kind) is list]
    options: dict[str, Any] = {
        "dest": name,
        "default": os.environ.get(cli["env"], setting.default) if "env" in cli
        else setting.default,
        "help": _help(setting.description, _default_text(setting)),
    }
    if lists:
        options["action"] = _CommaList if cli.get("split") else _Repeated
    elif kinds == [bool] and setting.default:
        options["action"] = argparse.BooleanOptionalAction
    elif kinds == [bool]:
        options["action"] = "store_true"
    elif get_origin(kinds[0]) is Literal:
        options["choices"] = get_args(kinds[0])
    else:
        unit = cli.get("unit")
        options["type"] = {"size": parse_size, "ms": parse_ms}.get(unit, kinds[0])
        if unit:
            options["metavar"] = unit.upper()
    if "metavar" in cli:
        options["metavar"] = cli["metavar"]
    names = [cli.get("flag", "--" + name.replace("_", "-")), *cli.get("also", [])]
    return Flag(name, names, options, one_or_many=bool(lists) and str in kinds)


def setting_flags() -> list[Flag]:
    """The ``troupe serve`` flags of every ServeConfig setting, the engine's in its place,
    each built from its declaration: name, type, default and help written once, there."""
    return [_flag(name, setting) for name, setting in _SETTINGS.items() if name not in _BY_HAND]


def build_parser() -> argparse.ArgumentParser:
    """The ``troupe`` argument parser (serve, pull, actors, bench)."""
    from troupe.actors.models import blas  # MLX-free: the --blas choices
    parser = argparse.ArgumentParser(prog="troupe", description="mlx-troupe: an LLM server for MLX")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser(
        "serve", help="serve a model over the OpenAI, Anthropic and Ollama APIs"
    )
    serve_cmd.set_defaults(run=_serve)
    for flag in setting_flags():
        serve_cmd.add_argument(*flag.names, **flag.options)
    # The flags that are not one field each, written here by hand.
    aliases = _SETTINGS["aliases"]
    serve_cmd.add_argument(
        aliases.cli["flag"], dest="aliases", action=_Aliases, metavar=aliases.cli["metavar"],
        default=aliases.default, help=_help(aliases.description, "none"),
    )
    serve_cmd.add_argument(
        "--no-prefix-cache", dest="block_size", action="store_const", const=0,
        help="turn the prefix cache off (same as --block-size 0)",
    )
    # A choice of the process (which BLAS library MLX loads), not of the server.
    serve_cmd.add_argument(
        "--blas",
        choices=blas.CHOICES,
        default=os.environ.get("TROUPE_BLAS", "auto"),
        help="auto: preload Debian's OpenBLAS when MLX would use its slow bundled reference "
        "BLAS (Linux), with troupe's batch-1 matrix-vector product in front (x86-64 with "
        "AVX2: decode about 2x faster, same results); openblas: OpenBLAS alone; bundled: "
        "never (default: $TROUPE_BLAS, else auto)",
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
