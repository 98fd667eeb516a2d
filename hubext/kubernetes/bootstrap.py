"""Runs in a GPU kernel's pod before the kernel (``python -c``, so kernel images need nothing of ours).

Builds the kernel's connection file from the mounted Secret (the key) and the pod's own address
(downward API ``POD_IP``), in a private directory, then becomes the kernel.
argv: <secret file> <ports JSON> <kernel command with {connection_file}...>
"""

import json
import os
import sys
import tempfile

secret_file, ports = sys.argv[1], json.loads(sys.argv[2])
with open(secret_file) as f:
    info = json.load(f)
info.update(ports)
info["ip"] = os.environ.get("POD_IP") or "0.0.0.0"
info.setdefault("transport", "tcp")
d = tempfile.mkdtemp(prefix="kernel-")
path = os.path.join(d, "connection.json")
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
with os.fdopen(fd, "w") as f:
    json.dump(info, f)
cmd = [a.replace("{connection_file}", path) for a in sys.argv[3:]]
os.execvp(cmd[0], cmd)
