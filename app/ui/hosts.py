"""Which Host headers the app answers, against DNS rebinding.

A page on another site can make its own name resolve to 127.0.0.1 and then drive the app from
the visitor's browser, same-origin: download and delete models, read local JSONL files. Such a
request still carries the page's name in its Host header, so only loopback names (and the
address the app was bound to) on the port it listens on are answered.

Knows: ASGI (http and websocket scopes), IP literals, which names are loopback. Must not know:
Gradio, the tabs. Wired in by app/ui/__init__.py through launch(app_kwargs=...).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def split_host(header: str) -> tuple[str, int | None]:
    """("name", port) of a Host header: "[::1]:7860" -> ("::1", 7860); no port -> None.

    A malformed port makes the name empty, which no check accepts."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal keeps its colons inside brackets
        name, _, rest = header[1:].partition("]")
        if rest and not rest.startswith(":"):
            return "", None
        port_text = rest[1:] if rest else None
    else:
        name, colon, port_text = header.partition(":")
        port_text = port_text if colon else None
    if port_text is None:
        return name, None
    if not (port_text.isascii() and port_text.isdigit()):
        return "", None
    return name, int(port_text)


def allowed_names(bind: str) -> frozenset[str]:
    """Loopback names, plus the address the app was bound to when that is one address."""
    bind = bind.strip("[]").lower()
    return LOOPBACK if bind in WILDCARDS else LOOPBACK | {bind}


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class LoopbackHostOnly:
    """ASGI middleware: refuse http and websocket requests whose Host names another machine.

    `bind` is the address the server listens on. On a wildcard bind (0.0.0.0, ::) the app is
    meant to be reached from other machines by address, so any IP literal is answered too:
    rebinding needs a name, never an address."""

    def __init__(self, app: ASGIApp, bind: str = "127.0.0.1") -> None:
        self.app = app
        self.names = allowed_names(bind)
        self.any_address = bind.strip("[]").lower() in WILDCARDS

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and not self.allows(scope):
            await _refuse(scope, send)
            return
        await self.app(scope, receive, send)

    def allows(self, scope: Scope) -> bool:
        hosts = [value for key, value in scope.get("headers", ()) if key == b"host"]
        if len(hosts) != 1:  # none (HTTP/1.0) or ambiguous
            return False
        name, port = split_host(hosts[0].decode("latin-1"))
        named = name in self.names or (self.any_address and is_ip_literal(name))
        return named and _port_matches(scope, port)


def _port_matches(scope: Scope, port: int | None) -> bool:
    """Whether the Host's port is the one the server listens on (absent: the scheme's)."""
    server = scope.get("server")
    if not server:  # a unix socket: there is no port to compare
        return True
    if port is None:
        port = 443 if scope.get("scheme") in ("https", "wss") else 80
    return port == server[1]


async def _refuse(scope: Scope, send: Any) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = (b"specdeck: this app answers only requests addressed to this machine "
            b"(http://127.0.0.1:PORT/ or http://localhost:PORT/); the Host header named "
            b"another site, as DNS rebinding does\n")
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def host_guard(bind: str) -> list[Any]:
    """The middleware list for gradio's launch(app_kwargs={"middleware": ...})."""
    from starlette.middleware import Middleware

    return [Middleware(LoopbackHostOnly, bind=bind)]
