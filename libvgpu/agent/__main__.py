"""``python -m libvgpu.agent``: the node agent (see :mod:`libvgpu.agent.app`)."""

from .app import main

main()
