"""The aiohttp application: middlewares, shared state and the route modules.

Route modules (OpenAI's, Anthropic's, /actors, /metrics) each register their routes on the
application built here, so the error shape, the body limit, API keys, CORS, the access log
and the graceful shutdown apply to all of them alike.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from troupe.actors.config import ServeConfig, api_keys
from troupe.api.anthropic import AnthropicRoutes
from troupe.api.cache_namespace import CACHE_NAMESPACE, key_namespace
from troupe.api.dashboard import PUBLIC_PATHS, DashboardRoutes
from troupe.api.decode import read_body
from troupe.api.embeddings import EmbeddingRoutes
from troupe.api.errors import ApiError, error_middleware
from troupe.api.introspection import IntrospectionRoutes
from troupe.api.metrics import METRICS, Metrics, metrics_handler
from troupe.api.ollama import OllamaRoutes
from troupe.api.openai import OpenAIRoutes
from troupe.api.openapi import OpenApiRoute
from troupe.api.responses import ResponsesRoutes
from troupe.api.shutdown import INFLIGHT, SHUTTING_DOWN, Inflight
from troupe.api.telemetry import telemetry_middleware
from troupe.runtime import ActorRef, ActorSystem

SYSTEM = web.AppKey("system", ActorSystem)
ADMISSION = web.AppKey("admission", ActorRef)
CONFIG = web.AppKey("config", ServeConfig)

# Everything but /health needs the key (introspection and metrics show what the server
# does); load balancers and probes call /health without one. The dashboard's page holds no
# data (its stream, /actors/events, wants the key): a browser cannot send one to load it.
_OPEN_PATHS = frozenset({"/health", *PUBLIC_PATHS})


# The introspection routes (and the dashboard's): what the server does and holds, for its
# operators. With an admin key set, they take that key and no other.
_ADMIN_PREFIXES = ("/actors", "/metrics", "/dashboard")

_NO_KEY = "Missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'."


def _is_admin_route(request: web.Request) -> bool:
    """True for the introspection routes (by the route matched, else by the path)."""
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else request.path
    return any(path == prefix or path.startswith(prefix + "/") for prefix in _ADMIN_PREFIXES)


def _presented_keys(request: web.Request) -> list[bytes]:
    """The keys a request sends (``x-api-key``, ``Authorization: Bearer``), as raw bytes.

    Raw: a header that is not UTF-8 is a wrong key, not an error. Exact: ``Bearer`` and one
    space, then the key; anything around it (more spaces, a tab) makes it another key.
    """
    keys = []
    for name, value in request.raw_headers:
        name = name.lower()
        if name == b"x-api-key":
            keys.append(value)
        elif name == b"authorization":
            scheme, space, token = value.partition(b" ")
            if space and scheme.lower() == b"bearer":
                keys.append(token)
    return keys


def _holds(keys: list[bytes], expected: bytes | None) -> bool:
    """Whether one of ``keys`` is ``expected``, compared in constant time."""
    if expected is None:
        return False
    found = False
    for key in keys:
        # compare_digest: the time taken must not reveal how much of the key matched.
        found |= hmac.compare_digest(key, expected)
    return found


def _match(keys: list[bytes], expected: list[tuple[bytes, str]]) -> str | None:
    """The namespace of the expected key one of ``keys`` is, or None. Every pair is
    compared, in constant time: the time taken reveals neither which key matched nor how
    much of one."""
    found = None
    for key, namespace in expected:
        if _holds(keys, key) and found is None:
            found = namespace
    return found


def _key_bytes(key: str | None) -> bytes | None:
    # surrogateescape: a key passed as bytes that are not UTF-8 (argv, the environment)
    # compares as those bytes.
    return key.encode("utf-8", "surrogateescape") if key else None


def _api_key_middleware(accepted: list[str], admin_api_key: str | None,
                        shared_cache: bool = False) -> Middleware:
    """Refuse requests without a key, sent as a Bearer token or as ``x-api-key``.

    The ``accepted`` API keys (any of them) guard every route but the open ones;
    ``admin_api_key``, when set, guards the introspection routes instead (and is taken
    wherever an API key is). A request with a valid key gets the key's cache namespace
    (``api.cache_namespace``), unless ``shared_cache``.
    """
    admin = _key_bytes(admin_api_key)
    # Every key the other routes take (the admin key too), with its cache namespace; none
    # without API keys: those routes are open.
    api = [(key, key_namespace(key)) for key in [*map(_key_bytes, accepted), admin]
           if key is not None] if accepted else []

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        # Browsers send CORS preflights without credentials.
        if request.path in _OPEN_PATHS or request.method == "OPTIONS":
            return await handler(request)
        # OpenAI clients send a Bearer token, Anthropic's send x-api-key.
        keys = _presented_keys(request)
        if admin is not None and _is_admin_route(request):
            if not _holds(keys, admin):
                if _match(keys, api) is not None:
                    raise ApiError(403, "This route needs the admin API key.",
                                   code="admin_key_required")
                raise ApiError(401, _NO_KEY, code="invalid_api_key")
        elif api:
            namespace = _match(keys, api)
            if namespace is None:
                raise ApiError(401, _NO_KEY, code="invalid_api_key")
            if not shared_cache:
                request[CACHE_NAMESPACE] = namespace
        return await handler(request)

    return check_api_key


def _body_middleware(config: ServeConfig) -> Middleware:
    """Read a request's body before its handler runs, within ``config.body_timeout``.

    The handler's own ``request.read()`` then returns it at once. A body that is too large,
    too slow or still arriving when the server begins to stop is answered here (413, 408,
    503) and never holds a handler, the shutdown or a batch slot.
    """

    @web.middleware
    async def read_body_first(request: web.Request, handler: Handler) -> web.StreamResponse:
        # No route (404, 405): aiohttp answers without reading.
        if request.can_read_body and request.match_info.http_exception is None:
            await read_body(request, max_bytes=config.max_body_bytes,
                            timeout=config.body_timeout, stopping=request.app[INFLIGHT].stopping)
        return await handler(request)

    return read_body_first


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
    Anthropic's (``/v1/messages``, ``/v1/messages/count_tokens``), Ollama's (``/api/...``),
    ``/actors``,
    ``/metrics`` and ``/health``. Shutting the application down (``AppRunner.cleanup``)
    gives requests in flight ``config.shutdown_grace`` seconds, then ends them cleanly.
    """
    metrics = Metrics(system)
    # The order is the nesting: the access log sees every answer, errors included.
    middlewares: list[Middleware] = [telemetry_middleware(metrics), error_middleware]
    cors = _Cors(config.allowed_origins) if config.allowed_origins else None
    if cors is not None:
        middlewares.append(cors.preflight)
    keys = api_keys(config)
    if keys or config.admin_api_key:
        middlewares.append(_api_key_middleware(keys, config.admin_api_key,
                                               config.shared_cache))
    # After the key: a body is read only for a client that may send one.
    middlewares.append(_body_middleware(config))
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
    EmbeddingRoutes(admission).register(app.router)
    AnthropicRoutes(admission, config).register(app.router)
    OllamaRoutes(admission, config).register(app.router)
    ResponsesRoutes(admission, config).register(app)
    # Before the introspection routes: /actors/events must win over /actors/{name}.
    DashboardRoutes(system).register(app)
    IntrospectionRoutes(system).register(app.router)
    OpenApiRoute(config, open_paths=_OPEN_PATHS).register(app.router)
    return app
