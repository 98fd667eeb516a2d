"""Runs in a GPU kernel's pod before the kernel (``python -c``, so kernel images need nothing of ours).

Builds the kernel's connection file from the mounted Secret (the key) and the pod's own address
(downward API ``POD_IP``), in a private directory, then becomes the kernel. With a resume hook
(the source of ``kernelprovider/resume.py``), writes it there as the module ``elastic_gpu_resume``
on the kernel's ``PYTHONPATH`` (the kernel command loads it: ``--ext=elastic_gpu_resume``).
argv: <secret file> <ports JSON> <resume hook source, or ""> <kernel command with {connection_file}...>
"""

import json
import os
import sys
import tempfile

secret_file, ports, hook = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
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
if hook:
    fd = os.open(os.path.join(d, "elastic_gpu_resume.py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(hook)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (d, os.environ.get("PYTHONPATH", "")) if p)
cmd = [a.replace("{connection_file}", path) for a in sys.argv[4:]]
os.execvp(cmd[0], cmd)
