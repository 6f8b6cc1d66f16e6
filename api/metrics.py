"""Prometheus metrics: one registry per application, so several apps (and tests) never collide.

Request metrics are observed by the HTTP layer as requests pass (``api.telemetry``); actor
metrics are read from ``ActorSystem.snapshot()`` at scrape time by ``ActorCollector``, so
they cost nothing between scrapes and cover actors spawned by embedding programs too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from troupe.api.errors import STATUS_OF
from troupe.runtime import ActorSystem

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    """The server's metrics and the registry that exposes them."""

    def __init__(self, system: ActorSystem) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "troupe_http_requests", "HTTP requests answered, by route, method and status.",
            ["route", "method", "status"], registry=self.registry,
        )
        # By route too: an agent's API (Claude Code's /v1/messages, Codex's /v1/responses)
        # shows whether its turns hit the prefix cache.
        self.prompt_tokens = Counter(
            "troupe_prompt_tokens", "Prompt tokens of requests that reached the scheduler.",
            ["model", "route"], registry=self.registry,
        )
        self.cached_tokens = Counter(
            "troupe_cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
            ["model", "route"], registry=self.registry,
        )
        self.generated_tokens = Counter(
            "troupe_generated_tokens", "Tokens generated.", ["model"], registry=self.registry,
        )
        self.ttft = Histogram(
            "troupe_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            ["model"], buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "troupe_inter_token_latency_seconds",
            "Time between two tokens of one streamed answer.",
            ["model"], buckets=ITL_BUCKETS, registry=self.registry,
        )
        self.registry.register(ActorCollector(system))
        self.registry.register(CacheShareCollector(self.prompt_tokens, self.cached_tokens))

    def render(self) -> bytes:
        """Every metric in Prometheus's text format."""
        return generate_latest(self.registry)


METRICS = web.AppKey("metrics", Metrics)


async def metrics_handler(request: web.Request) -> web.Response:
    """``GET /metrics``."""
    return web.Response(
        body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def report_numbers(report: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number in an actor's report, nested dicts flattened to dotted keys."""
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool | int | float):
            yield name, float(value)
        elif isinstance(value, dict):
            yield from report_numbers(value, f"{name}.")


def _is_scheduler(report: dict[str, Any]) -> bool:
    # Schedulers are known by what they report, not their class: api/ never imports them.
    return all(isinstance(report.get(k), int) for k in ("waiting", "running", "batch_size"))


def _is_admission(report: dict[str, Any]) -> bool:
    return isinstance(report.get("admitted"), int) and isinstance(report.get("refused"), dict)


class ActorCollector(Collector):
    """Per-actor runtime figures, scheduler and admission gauges, and every report number."""

    def __init__(self, system: ActorSystem) -> None:
        self.system = system

    def collect(self) -> Iterator[Metric]:
        """Read one snapshot of the actor system (called by the registry at each scrape)."""
        snapshots = self.system.snapshot()

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        depth = gauge("troupe_actor_mailbox_depth", "Messages waiting in the mailbox.", ["actor"])
        capacity = gauge("troupe_actor_mailbox_capacity", "Mailbox size.", ["actor"])
        running = gauge("troupe_actor_running", "1 while the actor runs.", ["actor"])
        handled = counter("troupe_actor_messages_handled", "Messages handled.", ["actor"])
        restarts = counter("troupe_actor_restarts", "Restarts by the supervisor.", ["actor"])
        report = gauge(
            "troupe_actor_report", "Every number an actor reports (dotted keys for nested ones).",
            ["actor", "key"],
        )
        queue = gauge("troupe_queue_depth", "Requests waiting for a batch slot.", ["actor"])
        batch = gauge("troupe_batch_size", "Sequences decoding in the batch.", ["actor"])
        in_flight = gauge("troupe_running_requests", "Requests prefilling or decoding.", ["actor"])
        admitted = counter("troupe_admission_admitted", "Requests admitted.", ["actor"])
        refusals = counter(
            "troupe_admission_refusals", "Requests admission refused, by status.",
            ["actor", "status"],
        )
        for snap in snapshots:
            name = snap.name
            depth.add_metric([name], snap.mailbox_depth)
            capacity.add_metric([name], snap.mailbox_capacity)
            running.add_metric([name], 1.0 if snap.state == "running" else 0.0)
            handled.add_metric([name], snap.messages_handled)
            restarts.add_metric([name], snap.restarts)
            if not snap.report:
                continue
            for key, value in report_numbers(snap.report):
                report.add_metric([name, key], value)
            if _is_scheduler(snap.report):
                queue.add_metric([name], snap.report["waiting"])
                batch.add_metric([name], snap.report["batch_size"])
                in_flight.add_metric([name], snap.report["running"])
            if _is_admission(snap.report):
                admitted.add_metric([name], snap.report["admitted"])
                by_status: dict[int, int] = {}
                for kind, count in snap.report["refused"].items():
                    status = STATUS_OF.get(kind, 500)
                    by_status[status] = by_status.get(status, 0) + count
                for status, count in sorted(by_status.items()):
                    refusals.add_metric([name, str(status)], count)
        yield from (depth, capacity, running, handled, restarts, report, queue, batch, in_flight,
                    admitted, refusals)


class CacheShareCollector(Collector):
    """The prefix cache's read share per route since the start: cached prompt tokens over
    prompt tokens, all models together (read from the two counters at scrape time)."""

    def __init__(self, prompt_tokens: Counter, cached_tokens: Counter) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens

    def collect(self) -> Iterator[Metric]:
        prompt, cached = _by_route(self.prompt_tokens), _by_route(self.cached_tokens)
        share = GaugeMetricFamily(
            "troupe_prefix_cache_read_share",
            "Of the prompt tokens a route's requests sent since the start, the share read "
            "from the prefix cache.",
            labels=["route"],
        )
        for route, total in sorted(prompt.items()):
            if total > 0:
                share.add_metric([route], cached.get(route, 0.0) / total)
        yield share


def _by_route(counter: Counter) -> dict[str, float]:
    """A counter labelled by model and route, summed over the models."""
    totals: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                route = sample.labels["route"]
                totals[route] = totals.get(route, 0.0) + sample.value
    return totals
