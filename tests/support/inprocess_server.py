"""An SQMServer serving on its own event loop in a thread of the test's process: a real member on real sockets
whose internals a test can still reach (to inject a failure at the log's writer, say)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from sqm.service.config import ServerConfig
from sqm.service.server import SQMServer
from tests.support.waits import wait_until


class RunningServer:
    """An SQMServer serving on its own event loop in a thread of this process."""

    def __init__(self, config: ServerConfig) -> None:
        self.server = SQMServer(config)
        self.loop = asyncio.new_event_loop()
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        ready = Path(str(config.ready_file))
        wait_until(lambda: ready.exists() or not self.thread.is_alive(), 60, "the member to serve")
        rest = json.loads(ready.read_text())["rest_port"]
        self.rest_port: int | None = int(rest) if rest else None

    def _serve(self) -> None:
        self.exit_code = self.loop.run_until_complete(self.server.run(install_signals=False))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.request_stop)
        self.thread.join(60)
        assert not self.thread.is_alive(), "the member did not stop"
        self.loop.close()

    @property
    def endpoint(self) -> tuple[str, int]:
        return ("127.0.0.1", self.server.port)
