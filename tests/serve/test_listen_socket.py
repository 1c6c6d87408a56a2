"""The server's listening socket gives connections with Nagle's algorithm off.

asyncio sets ``TCP_NODELAY`` only on sockets whose protocol number is ``IPPROTO_TCP``, and an
accepted connection takes the listener's. A listener made as ``socket(AF_INET, SOCK_STREAM)``
(protocol 0) left Nagle on: on a kept-alive connection (every openai client keeps them) the
stream's small chunks waited for the client's delayed ACKs, and each later request arrived about
40 ms late with its tokens bunched.
"""

from __future__ import annotations

import asyncio
import socket

from moe_runtime.serve.command import _listen


def _nodelay_of_accepted(sock: socket.socket) -> int:
    async def main() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                raw = transport.get_extra_info("socket")
                seen.set_result(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    return asyncio.run(main())


def test_served_connections_have_nagle_off():
    sock = _listen("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    assert _nodelay_of_accepted(sock) != 0


def test_a_protocol_zero_listener_would_leave_nagle_on():
    """The control: the same server on a listener of protocol 0 gets Nagle on (so the test above
    checks what the fix changes, not what asyncio does anyway)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    assert _nodelay_of_accepted(sock) == 0
