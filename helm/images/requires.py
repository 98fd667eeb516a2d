"""Print the requirements of the installed jupyterhub-elastic-gpu, less the named projects.

The images install the wheel with ``--no-deps`` and then only what they run: the node agent needs
neither JupyterHub nor JupyterLab (the culler runs from the hub image), the hub no JupyterLab or jupyter-server
(those serve the single-machine mode's notebooks). The version ranges stay those of
pyproject.toml; an image names only what it leaves out.

    python requires.py jupyterhub jupyterlab ... > requirements.txt
"""

from __future__ import annotations

import importlib.metadata
import re
import sys


def requirements(without: set[str], dist: str = "jupyterhub-elastic-gpu") -> list[str]:
    """The distribution's unconditional requirements whose project is not in ``without``."""
    norm = {re.sub(r"[-_.]+", "-", n).lower() for n in without}
    kept = []
    for req in importlib.metadata.requires(dist) or []:
        if ";" in req:  # an extra's ([test]) or an environment marker's: not an image's
            continue
        name = re.split(r"[\s<>=!~\[(]", req, maxsplit=1)[0]
        if re.sub(r"[-_.]+", "-", name).lower() not in norm:
            kept.append(req)
    return kept


if __name__ == "__main__":
    print("\n".join(requirements(set(sys.argv[1:]))))
