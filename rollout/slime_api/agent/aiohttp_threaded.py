"""`slime.agent.aiohttp_threaded`: serve an aiohttp application from a daemon thread of its own.

slime's synchronous rollout code (a `generate` hook, a singleton service) needs an HTTP server,
an adapter the sandboxed agent dials back to, without owning an event loop: `run_app_in_thread`
starts one loop in a thread, serves the app there, and returns once the socket listens, with the
port it got (`port=0` asks the kernel for a free one). `AppHandle.stop()` shuts it down from any
thread.

`FilteredAccessLogger` keeps the access log to what is worth reading under agent load: requests
that failed or were slow, not the thousands of fast 200s and health-check HEADs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger


class FilteredAccessLogger(AccessLogger):
    """An access logger that drops HEAD requests and 200 answers given within `SLOW_THRESHOLD_SEC`."""

    SLOW_THRESHOLD_SEC = 120.0

    def log(self, request: Any, response: Any, time: float) -> None:
        if request.method == "HEAD":
            return
        if response.status == 200 and time <= self.SLOW_THRESHOLD_SEC:
            return
        super().log(request, response, time)


@dataclasses.dataclass
class AppHandle:
    """A served application: where it listens and what runs it (its thread, loop and runner)."""

    host: str
    port: int
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner

    def stop(self, timeout: float = 10.0) -> None:
        """Clean up the runner (closing connections and the app), then end the loop and its thread.

        Safe to call twice and after the loop has already ended."""
        if not self.loop.is_closed() and self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout)
            except Exception:  # a failed clean-up must not keep the thread alive
                pass
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # the loop closed in between
                pass
        self.thread.join(timeout=timeout)


def run_app_in_thread(
    app: web.Application,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    thread_name: str = "aiohttp-app",
    start_timeout_sec: float = 15.0,
    runner_kwargs: dict[str, Any] | None = None,
) -> AppHandle:
    """Serve `app` on `host:port` from a new daemon thread; return once it listens.

    `runner_kwargs` go to `web.AppRunner` (slime's agent passes `handler_cancellation=True`, so a
    client that hangs up cancels its handler, and `access_log_class=FilteredAccessLogger`). An
    error while starting (the port taken, say) is raised here; so is a start that takes longer
    than `start_timeout_sec`, as TimeoutError.
    """
    ready = threading.Event()
    lock = threading.Lock()  # the caller's give-up and the thread's report do not interleave
    started: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(app, **(runner_kwargs or {}))
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, host, port).start())
            with lock:
                if started.get("abandoned"):  # the caller gave up waiting: nobody will stop us
                    raise TimeoutError("abandoned")
                started.update(loop=loop, runner=runner, port=int(runner.addresses[0][1]))
                ready.set()
        except BaseException as exc:
            started.setdefault("error", exc)
            loop.run_until_complete(runner.cleanup())
            loop.close()
            ready.set()
            return
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=serve, name=thread_name, daemon=True)
    thread.start()
    ready.wait(timeout=start_timeout_sec)
    with lock:
        if "port" not in started and "error" not in started:
            started["abandoned"] = True
    if started.get("abandoned"):
        raise TimeoutError(
            f"{thread_name}: the app did not start listening on {host}:{port} within {start_timeout_sec}s"
        )
    if "error" in started:
        raise started["error"]
    return AppHandle(
        host=host, port=started["port"], thread=thread, loop=started["loop"], runner=started["runner"]
    )
