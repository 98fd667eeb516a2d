"""Headless Chromium driven over the DevTools protocol (CDP), for checking pages as a person sees them.

No browser automation package is needed: Chromium is started with ``--remote-debugging-port``
and spoken to over a websocket (tornado's client). Used by the single-machine tests to log in
through the hub's own login form, open /hub/gpu, read what the page shows and keep a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tornado.websocket import websocket_connect


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page."""

    def __init__(self, width: int = 1280, height: int = 1400) -> None:
        self.width, self.height = width, height
        self.proc: subprocess.Popen | None = None
        self.profile = Path(tempfile.mkdtemp(prefix="egpu-chromium-"))
        self._ids = itertools.count(1)
        self._ws: Any = None
        self._events: list[dict[str, Any]] = []

    async def start(self, timeout: float = 30) -> Browser:
        path = chromium_path()
        if path is None:
            raise RuntimeError("chromium is not installed (apt-get install chromium)")
        self.proc = subprocess.Popen(
            [
                path,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-dev-shm-usage",
                "--no-first-run",
                f"--user-data-dir={self.profile}",
                f"--window-size={self.width},{self.height}",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().splitlines()[0])
        pages = []
        while not pages:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as resp:
                pages = [t for t in json.loads(resp.read()) if t.get("type") == "page"]
            if not pages:
                await asyncio.sleep(0.1)
        self._ws = await websocket_connect(pages[0]["webSocketDebuggerUrl"], max_message_size=64 * 1024 * 1024)
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def send(self, method: str, timeout: float = 30, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self._ws.write_message(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no answer to {method} within {timeout} s")
            raw = await asyncio.wait_for(self._ws.read_message(), remaining)
            if raw is None:
                raise RuntimeError("chromium closed the DevTools connection")
            msg = json.loads(raw)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._events.append(msg)

    async def _wait_event(self, name: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self._events):
                if event.get("method") == name:
                    return self._events.pop(i)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {name} within {timeout} s")
            raw = await asyncio.wait_for(self._ws.read_message(), remaining)
            if raw is None:
                raise RuntimeError("chromium closed the DevTools connection")
            self._events.append(json.loads(raw))

    async def goto(self, url: str, timeout: float = 30) -> None:
        self._events.clear()
        await self.send("Page.navigate", url=url)
        await self._wait_event("Page.loadEventFired", timeout)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def submit_and_wait(self, expression: str, timeout: float = 30) -> None:
        """Run a script that submits a form, and wait for the page it leads to."""
        self._events.clear()
        await self.evaluate(expression)
        await self._wait_event("Page.loadEventFired", timeout)

    async def url(self) -> str:
        return await self.evaluate("location.href")

    async def screenshot(self, path: Path) -> Path:
        result = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(result["data"]))
        return path

    async def close(self) -> None:
        if self._ws is not None:
            try:
                await self.send("Browser.close", timeout=5)
            except Exception:
                pass
            self._ws.close()
            self._ws = None
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                import os
                import signal

                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            self.proc = None
        shutil.rmtree(self.profile, ignore_errors=True)
