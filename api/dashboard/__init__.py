"""The live dashboard: ``GET /dashboard`` (``/`` redirects there) and its event stream,
``GET /actors/events``.

The page is one HTML file with its own script and stylesheet, served from package data
(``api/static``): no build step, no CDN, works offline. It reads one Server-Sent Events
stream: a snapshot of the whole server (actors, requests, cache, memory, models, the last ten
minutes of throughput and TTFT) every ``INTERVAL_S`` and as soon as an actor changes state
(a restart, a stop, a mailbox backing up) or a request starts, moves on or finishes.
``troupe top`` (``api.top``) reads the same stream.

One ``EventHub`` per application samples the actor system and builds each snapshot once,
whatever the number of viewers. Each viewer holds at most one snapshot not yet sent: a slow
one misses snapshots (they are dropped, never queued), and nothing waits for it, so no actor
and no other viewer is ever slowed by it.

The page itself holds no data, so it and its two files are served without the API key (a
browser cannot send a header when it navigates); the stream wants the key like every other
route. The page sends it with ``fetch`` streaming (``EventSource`` cannot send headers), so
the key never travels in a URL.

The package, by concern: ``board`` (the requests in flight and the last finished, fed by a
middleware), ``views`` (what the actors' reports say of the cache, memory and models: pure),
``history`` (the charts' time series), ``hub`` (one snapshot built per sample, offered to every
viewer) and ``routes`` (the page, its files and the stream).
"""

from troupe.api.dashboard.routes import PUBLIC_PATHS, DashboardRoutes

__all__ = ["PUBLIC_PATHS", "DashboardRoutes"]
