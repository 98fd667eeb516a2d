"""Print the requirements of jupyterhub-elastic-gpu, less the named projects.

The images install the wheel with ``--no-deps`` and then only what they run: the node agent needs
neither JupyterHub nor JupyterLab (the culler runs from the hub image), the hub no JupyterLab or jupyter-server
(those serve the single-machine mode's notebooks). The version ranges stay those of
pyproject.toml; an image names only what it leaves out.

    python requires.py jupyterhub jupyterlab ... > requirements.txt
    python requires.py --pyproject pyproject.toml jupyterhub ... > requirements.txt

With ``--pyproject`` they are read from that file instead of the installed distribution, so an
image can install them in a layer of its own, before the wheel (which changes with every commit).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys


def requirements(without: set[str], dist: str = "jupyterhub-elastic-gpu", pyproject: str = "") -> list[str]:
    """The distribution's unconditional requirements whose project is not in ``without``."""
    norm = {re.sub(r"[-_.]+", "-", n).lower() for n in without}
    if pyproject:
        import tomllib  # Python 3.11+, as in every image

        with open(pyproject, "rb") as f:
            declared = tomllib.load(f)["project"]["dependencies"]
    else:
        declared = importlib.metadata.requires(dist) or []
    kept = []
    for req in declared:
        if ";" in req:  # an extra's ([test]) or an environment marker's: not an image's
            continue
        name = re.split(r"[\s<>=!~\[(]", req, maxsplit=1)[0]
        if re.sub(r"[-_.]+", "-", name).lower() not in norm:
            kept.append(req)
    return kept


if __name__ == "__main__":
    args = sys.argv[1:]
    source = args[1] if args[:1] == ["--pyproject"] else ""
    print("\n".join(requirements(set(args[2:] if source else args), pyproject=source)))
