"""The app answers only requests addressed to this machine (DNS rebinding, issue 16 item 5).

The middleware is driven with raw ASGI scopes, then the real `specdeck ui` launch is asked
through its socket with a foreign Host header.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from app.ui.hosts import LoopbackHostOnly, split_host

PORT = 7860


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def answer(host: str | list[str] | None, bind: str = "127.0.0.1", kind: str = "http",
           port: int = PORT) -> dict:
    """The first message the guarded app sends for one request with this Host header."""
    hosts = [] if host is None else [host] if isinstance(host, str) else host
    scope = {"type": kind, "scheme": "http" if kind == "http" else "ws", "path": "/",
             "server": ("127.0.0.1", port), "headers": [(b"host", h.encode()) for h in hosts]}
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": f"{kind}.request" if kind == "http" else "websocket.connect"}

    asyncio.run(LoopbackHostOnly(_ok, bind=bind)(scope, receive, send))
    return sent[0]


@pytest.mark.parametrize("host", ["127.0.0.1:7860", "localhost:7860", "LocalHost:7860",
                                  "[::1]:7860"])
def test_loopback_names_on_the_bound_port_are_answered(host):
    assert answer(host)["status"] == 200


@pytest.mark.parametrize("host", [
    "evil.example:7860", "evil.example", "localhost.evil.example:7860", "127.0.0.1.nip.io:7860",
    "127.0.0.1:7861", "127.0.0.1", "localhost:80", "[::1]", "[::1]x:7860", "::1:7860",
    "127.0.0.1:\uff17\uff18\uff16\uff10", "127.0.0.1:-7860", "", "192.168.1.5:7860",
    ["127.0.0.1:7860", "evil.example:7860"]])
def test_other_names_ports_and_malformed_hosts_are_refused(host):
    message = answer(host)
    assert message["status"] == 403
    assert (b"content-type", b"text/plain; charset=utf-8") in message["headers"]


def test_a_request_without_a_host_header_is_refused():
    assert answer(None)["status"] == 403


def test_a_websocket_from_another_name_is_closed_before_it_opens():
    assert answer("evil.example:7860", kind="websocket") == {"type": "websocket.close",
                                                             "code": 1008}
    assert answer("localhost:7860", kind="websocket")["status"] == 200  # passed through


def test_a_host_without_a_port_is_answered_on_the_default_port():
    assert answer("localhost", port=80)["status"] == 200


def test_the_bound_address_is_answered_and_a_wildcard_bind_takes_addresses_not_names():
    assert answer("192.168.1.5:7860", bind="192.168.1.5")["status"] == 200
    assert answer("10.0.0.1:7860", bind="192.168.1.5")["status"] == 403
    assert answer("192.168.1.5:7860", bind="0.0.0.0")["status"] == 200
    assert answer("[fe80::1]:7860", bind="::")["status"] == 200
    assert answer("evil.example:7860", bind="0.0.0.0")["status"] == 403


def test_split_host():
    assert split_host("[::1]:7860") == ("::1", 7860)
    assert split_host("LOCALHOST") == ("localhost", None)
    assert split_host("127.0.0.1:x") == ("", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_launched_app_refuses_a_rebound_name_and_serves_localhost(monkeypatch, tmp_path):
    """`specdeck ui` itself: a page whose name resolves to 127.0.0.1 gets 403, no app."""
    import gradio as gr

    from app.cli import main

    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    port = free_port()
    seen: dict[str, int] = {}

    def ask(demo) -> None:
        url = f"http://127.0.0.1:{port}/config"
        seen["foreign"] = httpx.get(url, headers={"Host": f"evil.example:{port}"}).status_code
        seen["local"] = httpx.get(url).status_code
        seen["localhost"] = httpx.get(url, headers={"Host": f"localhost:{port}"}).status_code

    monkeypatch.setattr(gr.Blocks, "block_thread", ask)
    assert main(["ui", "--port", str(port)]) == 0
    assert seen == {"foreign": 403, "local": 200, "localhost": 200}
