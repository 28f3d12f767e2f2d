"""API keys (main process): with --api-key, every API route needs `Authorization: Bearer KEY`;
/health and /metrics stay open for probes and scrapers unless --api-key-protect-metrics."""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web

from tokenmill.frontend.api.common import ApiError

OPEN_PATHS = frozenset({"/health", "/openapi.json"})


def auth_middleware(api_key: str, protect_metrics: bool) -> Any:
    expected = f"Bearer {api_key}".encode()
    open_paths = OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in open_paths:
            given = request.headers.get("Authorization", "").encode()
            # NOTE: constant time: how much of a guess matched must not show in the timing.
            if not hmac.compare_digest(given, expected):
                raise ApiError(
                    "invalid or missing API key: send `Authorization: Bearer KEY`",
                    status=401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return middleware
