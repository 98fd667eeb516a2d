"""An IPython extension in a GPU kernel: before a cell runs, a swapped-out kernel gets its GPU back.

The hub suspends an idle GPU kernel (its GPU memory goes to host memory, its slice back to the
pool) and leaves a file where ``$ELASTIC_GPU_SWAP_FILE`` says. Before every cell this extension
looks for that file (one ``stat``); when it is there it asks the hub for the resume
(``$ELASTIC_GPU_RESUME_URL``, authenticated by the kernel's own connection key) and waits,
printing into the cell's output where it stands ("position 2 in the GPU queue"), then the cell
runs on the restored GPU state. Every execute request passes here, whichever client sent it.
When the GPU cannot be had back (refused, the hub out of reach), the cell is not run: it ends
with ``InputRejected`` and the reason (run, its first CUDA call would wait on the locked driver
for ever); the next cell asks again.

The hub may also move a kernel *while* a cell runs (a live move: it makes room for a waiting
request and resumes the kernel at once on another card); the cell's GPU calls wait on the locked
driver meanwhile. Such a cell ends with the hub's one line saying so and how long it paused
(``$ELASTIC_GPU_SWAP_FILE`` + ".moved", written at the resume).

Loaded by the hub's local kernels (``--ext=kernelprovider.resume`` in their command line) and by
kernel pods (their bootstrap writes this file as ``elastic_gpu_resume``; ``--ext=elastic_gpu_resume``).
"""

from __future__ import annotations

import ast
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

#: seconds one request to the hub may wait for the resume to end; the hub answers at once when
#: the kernel's place in the GPU queue changes, so this only bounds a quiet wait
POLL_SECONDS = 10.0
#: the culler's notices ("will be shut down ...") are no cells of the user's: no resume for them
#: (culler/hub.py NOTICE_USERNAME; this module runs in the kernel and imports nothing of the hub)
NOTICE_USERNAME = "elastic-gpu-culler"


def _from_culler(ip: Any) -> bool:
    try:
        parent = ip.kernel.get_parent("shell")
    except Exception:
        return False
    return (parent or {}).get("header", {}).get("username") == NOTICE_USERNAME


def _key_text() -> str:
    from ipykernel.connect import get_connection_info

    key = get_connection_info(unpack=True)["key"]
    return key.decode() if isinstance(key, bytes) else str(key)


def _ask(url: str, key: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{url}?wait={POLL_SECONDS:g}", data=b"", method="POST", headers={"Authorization": f"kernel-key {key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=POLL_SECONDS + 30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {"message": f"the hub answered HTTP {e.code}"}


def resume_if_swapped(say: Any = print) -> bool:
    """If this kernel is swapped out, wait for its GPU to come back; False when it could not."""
    marker, url = os.environ.get("ELASTIC_GPU_SWAP_FILE"), os.environ.get("ELASTIC_GPU_RESUME_URL")
    if not marker or not url or not os.path.exists(marker):
        return True
    key, started, shown = _key_text(), time.monotonic(), None
    while True:
        try:
            status, model = _ask(url, key)
        except OSError as e:
            say(f"The GPU of this kernel is swapped out and the hub cannot be reached ({e}); try again.")
            return False
        if status != 200:
            say(model.get("message") or f"The GPU could not be resumed (HTTP {status}).")
            return False
        if not model.get("gpu_swapped"):
            if shown is not None:
                say(f"GPU resumed after {time.monotonic() - started:.1f} s.")
            return True
        swap = model.get("swap") or {}
        position = swap.get("position")
        line = (
            f"The GPU of this kernel was swapped out; waiting for a GPU slice: position {position + 1} in the GPU "
            f"queue ({position} request{'s' if position != 1 else ''} ahead)."
            + (f" {swap['waiting_reason']}" if swap.get("waiting_reason") else "")
            if position is not None
            else "The GPU of this kernel was swapped out; resuming it..."
        )
        if line != shown:
            say(line)
            shown = line


class _Unresumed(ast.NodeTransformer):
    """Rejects the cell whose GPU could not be had back (IPython's documented way for an AST
    transformer to keep a cell from running: raise ``InputRejected``)."""

    reason = ""

    def visit(self, node: ast.AST) -> ast.AST:
        reason, self.reason = self.reason, ""
        if reason:
            from IPython.core.error import InputRejected

            raise InputRejected(reason)
        return node


def mark_cell(running: bool) -> None:
    """Say in ``$ELASTIC_GPU_CELL_FILE`` (the hub's file, this kernel's to write) whether a cell runs:
    a running cell does not come back here, so the hub moves a kernel in a cell only where it must,
    and then resumes it at once (a live move)."""
    path = os.environ.get("ELASTIC_GPU_CELL_FILE")
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"1" if running else b"0")
        finally:
            os.close(fd)
    except OSError:
        pass


def moved_note(since: float) -> str:
    """The hub's line for a cell that a live move of its kernel paused, written since ``since``
    (time.time()); '' when there is none."""
    marker = os.environ.get("ELASTIC_GPU_SWAP_FILE")
    if not marker:
        return ""
    try:
        with open(marker + ".moved") as note:
            return note.read().strip() if os.fstat(note.fileno()).st_mtime >= since else ""
    except OSError:
        return ""


def load_ipython_extension(ip: Any) -> None:
    guard = _Unresumed()
    started = [0.0]

    def after_cell(result: Any = None) -> None:
        mark_cell(False)
        note = moved_note(started[0])
        if note:
            print(note, flush=True)

    def before_cell(info: Any = None) -> None:
        started[0] = time.time()
        mark_cell(True)  # before the swap marker is looked at: the hub writes them the other way round
        if _from_culler(ip):
            return
        said: list[str] = []

        def say(text: str) -> None:
            print(text, flush=True)
            said.append(text)

        if not resume_if_swapped(say):
            guard.reason = said[-1] if said else "The GPU of this kernel is swapped out and could not be resumed."

    ip.events.register("pre_run_cell", before_cell)
    ip.events.register("post_run_cell", after_cell)
    ip.ast_transformers.append(guard)
