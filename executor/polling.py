"""Busy polling for the server's event loops (`python -m executor.serve --busy-poll`).

Why: on the H200 machine (a VM whose vCPUs halt when idle) a thread or process woken after
an idle spell of 20 ms answered in 150-230 us, against 18-33 us back to back, and the Python
it then ran was several times slower than the same code run back to back: the API process
rendered a 2,035-row chat in 0.53 ms while serving the 27B warm turns, against 76 us in a
loop on a 2-core CPU VM (bench/RESULTS.md, session 22). A request's first token crosses
several such wake-ups (client to API process, API to engine, the step's hand-off and back).
A loop that polls its sockets without waiting keeps its CPU running and its caches warm.

How: `PollingSelector` is a `selectors.DefaultSelector` whose `select(timeout)` asks the
kernel without waiting (timeout 0) again and again until something is ready or `timeout`
has passed, while `spin()` says so; otherwise it waits as usual. SGLang's scheduler loop
polls the same way by default (its `--sleep-on-idle` turns it off). The cost is one CPU
core per polling loop, all the time it polls.

`spin` must be False while another thread of the process needs the GIL for long: a
polling loop takes the GIL back after every poll, so a waiting thread gets it only at
the interpreter's switch interval (5 ms). The server polls only once it serves, in a process
that steps the backend only while no step runs (`Runtime.stepping`), and in the API process
only while no large request renders in a worker thread (`Api.off_loop`).

On a machine with few cores, polling takes a core from the work it waits for: on a 2-core
CPU VM an engine process's reference backend decoded 200 tokens in 1.41-1.48 s with
`--busy-poll` against 0.74 s without (the API process polls while the engine computes).
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable


class PollGate:
    """When a server process's loop polls: once it serves (`serving`), while its runtime runs
    no step (`runtime.stepping`; runtime None in the API process of an engine process) and
    no render runs in a worker thread (`api.off_loop`; api None in the engine process)."""

    def __init__(self) -> None:
        self.serving = False
        self.runtime = None
        self.api = None

    def __call__(self) -> bool:
        return (self.serving and (self.runtime is None or not self.runtime.stepping)
                and (self.api is None or not self.api.off_loop))


class PollingSelector(selectors.DefaultSelector):
    """A selector that polls without waiting while `spin()` is True (module docstring).

    spin: called once per `select`; True: poll until an event or the timeout (seconds; None:
    no limit); False: the base selector's wait."""

    def __init__(self, spin: Callable[[], bool]) -> None:
        super().__init__()
        self.spin = spin
        self.polls = 0
        """Polls without waiting so far (for tests)."""

    def select(self, timeout: float | None = None):
        if (timeout is not None and timeout <= 0) or not self.spin():
            return super().select(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = super().select(0)
            self.polls += 1
            if ready or (deadline is not None and time.monotonic() >= deadline):
                return ready
            if not self.spin():  # stop polling as soon as the owner says so
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                return super().select(remaining)


def polling_loop_factory(spin: Callable[[], bool]) -> Callable[[], asyncio.AbstractEventLoop]:
    """A `loop_factory` (asyncio.Runner) for a selector event loop on a `PollingSelector`."""
    return lambda: asyncio.SelectorEventLoop(PollingSelector(spin))
