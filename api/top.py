"""``troupe top``: the dashboard's event stream (``GET /actors/events``) in a terminal.

Actors, requests, the prefix cache, memory and models, redrawn in place with ``rich`` at each
snapshot; ``q`` quits (Ctrl-C too). A thread reads the stream and reconnects by itself when
the server goes away; the main thread draws and reads the keyboard. ``--once`` prints one
snapshot and exits, for scripts.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import termios
import threading
import time
import tty
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

RECONNECT_S = 1.0
# No snapshot for this long (the server sends one every 500 ms): the connection is dead.
READ_TIMEOUT_S = 10.0
FINISHED_SHOWN = 8
_SPARKS = "▁▂▃▄▅▆▇█"
_STATE_STYLE = {"running": "green", "starting": "yellow", "restarting": "yellow",
                "stopped": "dim", "failed": "bold red"}
_PRESSURE_STYLE = {"ok": "green", "soft": "yellow", "hard": "bold red"}


class Unauthorized(Exception):
    """The server wants an API key (or another one)."""


def sse_snapshots(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """The snapshots in an ``/actors/events`` stream, given its lines."""
    name, data = None, []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].removeprefix(" "))
        elif not line:
            if data and name == "snapshot":
                yield json.loads("\n".join(data))
            name, data = None, []


class Feed:
    """Reads the stream on a thread, reconnecting; the newest snapshot waits in ``latest``."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/") + "/actors/events"
        self.api_key = api_key
        self.latest: dict[str, Any] | None = None
        self.status = "connecting"
        self.error: str | None = None
        self.fatal: Exception | None = None
        self.changed = threading.Event()
        self._stop = threading.Event()
        # A daemon: a read blocked on a silent server must not keep the command alive.
        self._thread = threading.Thread(target=self._run, name="troupe-top-feed", daemon=True)

    def start(self) -> Feed:
        """Start reading."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reconnecting (the thread ends with its current read)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._read()
            except Unauthorized as exc:
                self.fatal = exc
                self.changed.set()
                return
            except (OSError, ValueError, urllib.error.URLError) as exc:
                self.error = str(exc)
            if self._stop.is_set():
                return
            self.status = "reconnecting"
            self.changed.set()
            self._stop.wait(RECONNECT_S)

    def _read(self) -> None:
        request = urllib.request.Request(self.url, headers={"Accept": "text/event-stream"})
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            response = urllib.request.urlopen(request, timeout=READ_TIMEOUT_S)
        except urllib.error.HTTPError as err:
            if err.code in (401, 403):
                which = "its admin" if err.code == 403 else "an API"
                raise Unauthorized(
                    f"{self.url} wants {which} key: pass --api-key or set TROUPE_ADMIN_API_KEY "
                    "(or TROUPE_API_KEY)"
                ) from None
            raise
        with response:
            self.status, self.error = "live", None
            for snapshot in sse_snapshots(response):
                self.latest = snapshot
                self.changed.set()
                if self._stop.is_set():
                    return


# -- drawing --------------------------------------------------------------------------------


def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _num(n: float | None, digits: int = 1) -> str:
    return "–" if n is None else f"{n:.{digits}f}"


def _bar(fraction: float, width: int = 10, style: str = "cyan") -> Text:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return Text("█" * filled, style=style) + Text("░" * (width - filled), style="dim")


def _spark(values: list[float | None], width: int) -> str:
    points = [v or 0.0 for v in values][-width:]
    top = max(points, default=0.0)
    if top <= 0:
        return _SPARKS[0] * len(points)
    return "".join(_SPARKS[min(7, int(v / top * 7.999))] for v in points)


def _short(request_id: str) -> str:
    head, dash, tail = request_id.rpartition("-")
    return f"{head}-{tail[:6]}…" if dash and len(tail) > 8 else request_id


def _actors(snap: dict[str, Any]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False)
    for column in ("actor", "thread", "state", "mailbox", "handled", "restarts", "last error"):
        justify = "right" if column in ("handled", "restarts") else "left"
        table.add_column(column, justify=justify, no_wrap=True,
                         overflow="ellipsis", ratio=2 if column == "last error" else None)
    backed = set(snap.get("backed_up") or [])
    for actor in snap.get("actors") or []:
        depth, capacity = actor["mailbox_depth"], actor["mailbox_capacity"]
        is_backed = actor["name"] in backed
        style = "bold red" if is_backed else "cyan"
        mailbox = _bar(depth / capacity if capacity else 0.0, 8, style)
        mailbox += Text(f" {depth}/{capacity}", style=style if is_backed else "")
        error = actor.get("last_error")
        table.add_row(
            Text(actor["name"], style="bold"),
            actor.get("thread") or "loop",
            Text(actor["state"], style=_STATE_STYLE.get(actor["state"], "")),
            mailbox,
            f"{actor['messages_handled']:,}",
            Text(str(actor["restarts"]), style="yellow" if actor["restarts"] else ""),
            Text(f"{error['type']}: {error['message']}" if error else "", style="red"),
        )
    return table


def _requests(snap: dict[str, Any]) -> Group:
    requests = snap.get("requests") or {}
    running = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, title="in flight",
                    title_justify="left", title_style="bold")
    for column, justify in (("id", "left"), ("model", "left"), ("stage", "left"),
                            ("tokens", "right"), ("tok/s", "right"), ("age", "right")):
        running.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in requests.get("in_flight") or []:
        stage = f"{row['stage']} {row['detail']}".strip()
        running.add_row(_short(row["id"]), row.get("model") or "–", stage, str(row["tokens"]),
                        _num(row.get("tokens_per_s")), f"{row['age_s']:.1f}s")
    finished = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, title="finished",
                     title_justify="left", title_style="bold")
    for column, justify in (("id", "left"), ("outcome", "left"), ("TTFT ms", "right"),
                            ("tokens", "right"), ("cached", "right"), ("tok/s", "right")):
        finished.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in (requests.get("finished") or [])[:FINISHED_SHOWN]:
        style = "red" if row["status"] >= 400 else ""
        finished.add_row(_short(row["id"]), Text(row["outcome"], style=style),
                         _num(row.get("ttft_ms"), 0), str(row.get("completion_tokens", 0)),
                         str(row.get("cached_tokens") or 0), _num(row.get("tokens_per_s")))
    return Group(running, finished)


def _side(snap: dict[str, Any], width: int) -> Group:
    parts: list[RenderableType] = []
    history = snap.get("history") or {}
    spark = _spark(history.get("tokens_per_s") or [], max(10, width - 4))
    parts.append(Text("tokens/s, last 10 min", style="bold"))
    parts.append(Text(spark or "–", style="cyan"))
    for engine in snap.get("cache") or []:
        parts.append(Text(f"\nprefix cache {engine.get('model') or ''}".rstrip(), style="bold"))
        for tier in ("ram", "disk"):
            used, quota = engine[f"{tier}_bytes"], engine[f"{tier}_max_bytes"]
            parts.append(Text(f"{tier:>4} ") + _bar(used / quota if quota else 0.0)
                         + Text(f" {engine[f'{tier}_blocks']} blocks {_bytes(used)}"
                                f" / {_bytes(quota)}"))
        parts.append(Text(f"hit rate {engine['hit_rate'] * 100:.0f}%  writes queued "
                          f"{engine['writes_queued']} dropped {engine['writes_dropped']}"))
    memory = snap.get("memory")
    if memory:
        used, limit = memory["usage_bytes"], memory["limit_bytes"]
        pressure = memory["pressure"]
        parts.append(Text("\nmemory", style="bold"))
        parts.append(_bar(used / limit if limit else 0.0, 16, _PRESSURE_STYLE.get(pressure, ""))
                     + Text(f" {_bytes(used)} / {_bytes(limit)} ")
                     + Text(pressure, style=_PRESSURE_STYLE.get(pressure, "")))
    models = (snap.get("models") or {}).get("models") or []
    if models:
        parts.append(Text("\nmodels", style="bold"))
        for model in models:
            pinned = " pinned" if model["pinned"] else ""
            parts.append(Text(f"{model['id']}  {model['state']}{pinned}  "
                              f"{_bytes(model.get('weights_bytes'))}"))
    return Group(*parts)


def render(snap: dict[str, Any] | None, feed_status: str, url: str, width: int = 120) -> Group:
    """One screen: a header, the actors, then requests beside cache, memory and models."""
    if snap is None:
        return Group(Text(f"troupe top — {url} — {feed_status}…   (q quits)"))
    totals = snap.get("totals") or {}
    caches = snap.get("cache") or []
    hit = sum(c["hit_tokens"] for c in caches)
    looked = hit + sum(c["miss_tokens"] for c in caches)
    status_style = "green" if feed_status == "live" else "yellow"
    header = Text.assemble(
        ("troupe top ", "bold"), (url, "dim"), "  ", (feed_status, status_style), "   ",
        f"{totals.get('tokens_per_s', 0):.1f} tok/s  ",
        f"{totals.get('generated_tokens', 0):,} tokens  ",
        f"{totals.get('in_flight', 0)} in flight  {totals.get('finished', 0)} finished  ",
        f"cache hits {100 * hit / looked:.0f}%" if looked else "cache hits –",
        ("   q quits", "dim"),
    )
    side_width = max(30, width // 3)
    lower = Table.grid(expand=True, padding=(0, 2))
    lower.add_column(ratio=2)
    lower.add_column(width=side_width)
    lower.add_row(_requests(snap), _side(snap, side_width))
    return Group(header, Panel(_actors(snap), title="actors", title_align="left",
                               box=box.ROUNDED, padding=(0, 1)), lower)


# -- the command ----------------------------------------------------------------------------


@contextlib.contextmanager
def _keys() -> Iterator[int | None]:
    """The terminal in cbreak mode (keys arrive one by one, unechoed); None when not a tty."""
    if not sys.stdin.isatty():
        yield None
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(fd: int | None, timeout: float) -> bool:
    if fd is None:
        time.sleep(timeout)
        return False
    ready, _, _ = select.select([fd], [], [], timeout)
    return bool(ready) and os.read(fd, 32).lower().startswith(b"q")


def run(url: str, api_key: str | None, *, once: bool = False) -> int:
    """Show the server at ``url`` until ``q``; returns the exit status."""
    console = Console()
    feed = Feed(url, api_key).start()
    try:
        if once:
            return _once(console, feed, url)
        with _keys() as fd, Live(render(None, feed.status, url), console=console, screen=True,
                                 auto_refresh=False, redirect_stderr=False) as live:
            while True:
                if feed.fatal is not None:
                    break
                if feed.changed.is_set():
                    feed.changed.clear()
                    live.update(render(feed.latest, feed.status, url, console.width),
                                refresh=True)
                if _quit_pressed(fd, 0.1):
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        feed.stop()
    print(f"troupe top: {feed.fatal}", file=sys.stderr)
    return 1


def _once(console: Console, feed: Feed, url: str) -> int:
    deadline = time.monotonic() + READ_TIMEOUT_S
    while feed.latest is None and feed.fatal is None and time.monotonic() < deadline:
        feed.changed.wait(0.1)
    if feed.latest is None:
        why = feed.fatal or feed.error or "no snapshot came"
        print(f"troupe top: {why}", file=sys.stderr)
        return 1
    console.print(render(feed.latest, "live", url, console.width))
    return 0
