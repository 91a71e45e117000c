"""`executor.polling`: a selector that polls without waiting while its gate says so, and the
gate the server uses (serving, and no step in flight)."""

from __future__ import annotations

import asyncio
import socket
import time

from executor.polling import PollGate, PollingSelector, polling_loop_factory


class _Runtime:
    stepping = False


class _Api:
    off_loop = 0


def test_polls_until_the_timeout_while_spin_is_true_and_waits_otherwise():
    spin = [True]
    sel = PollingSelector(lambda: spin[0])
    a, b = socket.socketpair()
    try:
        sel.register(a, 1)  # EVENT_READ
        t0 = time.monotonic()
        assert sel.select(0.02) == []
        assert time.monotonic() - t0 >= 0.02 and sel.polls > 10
        b.send(b"x")
        polls = sel.polls
        ready = sel.select(1.0)
        assert [key.fileobj for key, _ in ready] == [a] and sel.polls == polls + 1
        a.recv(1)
        spin[0] = False
        polls = sel.polls
        assert sel.select(0.01) == [] and sel.polls == polls  # waited in the kernel, no polls
    finally:
        sel.close()
        a.close()
        b.close()


def test_stops_polling_when_spin_turns_false_and_waits_out_the_rest():
    calls = [0]

    def spin():
        calls[0] += 1
        return calls[0] < 5  # True for the first 4 asks

    sel = PollingSelector(spin)
    a, b = socket.socketpair()
    try:
        sel.register(a, 1)
        t0 = time.monotonic()
        assert sel.select(0.05) == []
        assert time.monotonic() - t0 >= 0.05
        assert sel.polls == 4  # polled while spin said so, then waited in the kernel
    finally:
        sel.close()
        a.close()
        b.close()


def test_the_gate_opens_once_serving_and_closes_while_a_step_runs():
    gate = PollGate()
    assert not gate()
    gate.serving = True
    assert gate()  # the API process of an engine process: no runtime here
    gate.runtime = _Runtime()
    assert gate()
    gate.runtime.stepping = True
    assert not gate()
    gate.runtime.stepping = False
    gate.api = _Api()
    assert gate()
    gate.api.off_loop = 1  # a large render in a worker thread needs the GIL
    assert not gate()
    gate.api.off_loop = 0
    gate.serving = False
    assert not gate()


def test_an_asyncio_loop_on_the_polling_selector_serves_a_socket():
    gate = PollGate()
    gate.serving = True

    async def echo():
        loop = asyncio.get_running_loop()
        assert isinstance(loop._selector, PollingSelector)  # noqa: SLF001 - the factory's selector
        server = await asyncio.start_server(lambda r, w: _echo(r, w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"ping\n")
        line = await reader.readline()
        writer.close()
        server.close()
        await server.wait_closed()
        return line, loop._selector.polls  # noqa: SLF001

    async def _echo(reader, writer):
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    with asyncio.Runner(loop_factory=polling_loop_factory(gate)) as runner:
        line, polls = runner.run(echo())
    assert line == b"ping\n" and polls > 0
