"""The single-machine pool's node regions (``regions/node``): the hub's, read-only to users.

A card's node region holds one entry per slice on the card (priority, memory in use, launches,
bursts, reclaims) and every shim on the card believes it. Were it writable by users (as it was:
a 1777 directory of 0666 files), a user's code could rewrite another slice's entry: zero its
memory in use, fake its launches, hold it for a "higher priority". So, as on Kubernetes, the
directory (0755) and its files (0644) are the hub's account's: a shim of another account cannot
open them for writing and writes its entry's fields into its own container region instead
(``card[]``), and the hub relays them into the node regions every
:attr:`~hubext.local.pool.LocalPool.relay_interval_seconds` with the node agent's relay
(:class:`libvgpu.agent.relay.Relay`, given the slices' container regions it knows).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from libvgpu.priorities import PRIORITY_TABLE
from libvgpu.regions import RegionError, prepare_node_regions


def prepare_node_dir(directory: Path, uuids: Sequence[str], log: logging.Logger, shim: bool) -> None:
    """Make ``directory`` the hub's (0755) with a 0644 node region of each card in ``uuids`` (made
    with the shim's own code when ``shim``). What another account left there (the directory was
    everyone's before) is removed: a file it owns it could still make writable."""
    directory.mkdir(parents=True, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise RegionError(f"{directory} is not a directory")
    if st.st_uid != os.geteuid():
        os.chown(directory, os.geteuid(), os.getegid())
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode) or ".tmp." in path.name:
            log.warning("GPU node regions: removing %s (not the hub's: left from before they were read-only)", path)
            path.unlink(missing_ok=True)
        elif path.name != PRIORITY_TABLE and st.st_mode & 0o022:
            os.chmod(path, 0o644)
    if not shim:
        return
    missing = [u for u in uuids if not (directory / f"{u}.region").exists()]
    if not missing:
        return
    # made in a directory only the hub reaches, made read-only, then linked into place: a user's
    # process never sees one writable (the shim makes them 0666)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=".node-") as scratch:
        os.chmod(scratch, 0o700)
        prepare_node_regions(scratch, missing)
        for uuid in missing:
            made = Path(scratch) / f"{uuid}.region"
            os.chmod(made, 0o644)
            try:
                os.link(made, directory / made.name)
            except FileExistsError:  # a shim of the hub's account made it meanwhile
                os.chmod(directory / made.name, 0o644)
