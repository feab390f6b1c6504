"""API-key authentication: with a key set (`--api-key`, else the MESHTRON_API_KEY environment
variable) every route but /health and /v1/health needs `Authorization: Bearer <key>`; anything else
is answered 401 in OpenAI's error shape. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Mapping
from typing import Optional

from starlette.responses import Response

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

API_KEY_ENV = "MESHTRON_API_KEY"
# Probes (load balancers, Kubernetes) must reach these without a key; they reveal only the status.
OPEN_PATHS = frozenset({"/health", "/v1/health"})


def resolve_api_key(flag: Optional[str], environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The flag's key, else the environment's; an empty value means no key."""
    return flag or environ.get(API_KEY_ENV) or None


def bearer_token(headers: list[tuple[bytes, bytes]]) -> Optional[bytes]:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class BearerAuth:
    """ASGI middleware; `refuse(message)` builds the 401 response (and counts it)."""

    def __init__(self, app, api_key: Optional[str], refuse: Callable[[str], Response]):
        self.app, self.refuse = app, refuse
        self.key = api_key.encode("utf-8") if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = bearer_token(scope["headers"])
        if token is None:
            response = self.refuse("this server needs an API key: send the header 'Authorization: Bearer <key>'")
        elif not hmac.compare_digest(token, self.key):
            response = self.refuse("the API key is not correct")
        else:
            return await self.app(scope, receive, send)
        await response(scope, receive, send)
