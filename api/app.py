"""The aiohttp application: middlewares, shared state and the route modules.

Route modules (OpenAI's, Anthropic's, /actors, /metrics) each register their routes on the
application built here, so the error shape, the body limit, API keys, CORS, the access log
and the graceful shutdown apply to all of them alike.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from actors.config import ServeConfig
from api.anthropic import AnthropicRoutes
from api.errors import ApiError, error_middleware
from api.introspection import IntrospectionRoutes
from api.metrics import METRICS, Metrics, metrics_handler
from api.openai import OpenAIRoutes
from api.responses import ResponsesRoutes
from api.shutdown import INFLIGHT, SHUTTING_DOWN, Inflight
from api.telemetry import telemetry_middleware
from runtime import ActorRef, ActorSystem

SYSTEM = web.AppKey("system", ActorSystem)
ADMISSION = web.AppKey("admission", ActorRef)
CONFIG = web.AppKey("config", ServeConfig)

# Everything but /health needs the key (introspection and metrics show what the server
# does); load balancers and probes call /health without one.
_OPEN_PATHS = frozenset({"/health"})


def _api_key_middleware(api_key: str) -> Middleware:
    """Refuse requests without the key, sent as a Bearer token or as ``x-api-key``."""
    expected = api_key.encode()

    def matches(token: str) -> bool:
        # compare_digest: the time taken must not reveal how much of the key matched.
        return hmac.compare_digest(token.strip().encode(), expected)

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        # Browsers send CORS preflights without credentials.
        if request.path not in _OPEN_PATHS and request.method != "OPTIONS":
            scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
            # OpenAI clients send a Bearer token, Anthropic's send x-api-key.
            if not (
                (scheme.lower() == "bearer" and matches(bearer))
                or matches(request.headers.get("x-api-key", ""))
            ):
                raise ApiError(
                    401,
                    "Missing or invalid API key: send 'Authorization: Bearer <key>' "
                    "or 'x-api-key: <key>'.",
                    code="invalid_api_key",
                )
        return await handler(request)

    return check_api_key


_ALLOW_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version"


class _Cors:
    """CORS for the origins in ``ServeConfig.allowed_origins`` (``*`` allows any)."""

    def __init__(self, origins: list[str]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin in self.origins)

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Answer preflights here: routes do not register OPTIONS."""
        if (
            request.method == "OPTIONS"
            and "Access-Control-Request-Method" in request.headers
            and self.allows(request.headers.get("Origin"))
        ):
            requested = request.headers.get("Access-Control-Request-Headers")
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": requested or _ALLOW_HEADERS,
                    "Access-Control-Max-Age": "600",
                },
            )
        return await handler(request)

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: runs for every response, streamed ones included."""
        origin = request.headers.get("Origin")
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers.add("Vary", "Origin")


async def _health(request: web.Request) -> web.Response:
    """``GET /health``: 200 while the server accepts requests, 503 otherwise."""
    if request.app[INFLIGHT].draining:
        raise ApiError(503, SHUTTING_DOWN)
    if not request.app[ADMISSION].alive:
        raise ApiError(503, "The admission actor is not running.")
    return web.json_response({"status": "ok"})


async def _drain(app: web.Application) -> None:
    """on_shutdown: runs once the listener is closed and idle connections are gone."""
    await app[INFLIGHT].shutdown(app[CONFIG].shutdown_grace)


def create_app(*, system: ActorSystem, admission: ActorRef, config: ServeConfig) -> web.Application:
    """Build the HTTP application serving through ``admission`` (a running actor).

    Its routes: OpenAI's (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``),
    Anthropic's (``/v1/messages``, ``/v1/messages/count_tokens``), ``/actors``,
    ``/metrics`` and ``/health``. Shutting the application down (``AppRunner.cleanup``)
    gives requests in flight ``config.shutdown_grace`` seconds, then ends them cleanly.
    """
    metrics = Metrics(system)
    # The order is the nesting: the access log sees every answer, errors included.
    middlewares: list[Middleware] = [telemetry_middleware(metrics), error_middleware]
    cors = _Cors(config.allowed_origins) if config.allowed_origins else None
    if cors is not None:
        middlewares.append(cors.preflight)
    if config.api_key:
        middlewares.append(_api_key_middleware(config.api_key))
    # client_max_size: aiohttp refuses larger bodies with 413 when the handler reads them.
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[SYSTEM] = system
    app[ADMISSION] = admission
    app[CONFIG] = config
    app[METRICS] = metrics
    app[INFLIGHT] = Inflight()
    if cors is not None:
        app.on_response_prepare.append(cors.add_headers)
    app.on_shutdown.append(_drain)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", metrics_handler)
    OpenAIRoutes(admission, config).register(app.router)
    AnthropicRoutes(admission, config).register(app.router)
    ResponsesRoutes(admission, config).register(app.router)
    IntrospectionRoutes(system).register(app.router)
    return app
