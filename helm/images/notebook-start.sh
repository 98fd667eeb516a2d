#!/bin/sh
# The notebook image's entrypoint. In a user's server that JupyterHub started (it sets
# JUPYTERHUB_API_URL and the server's own JUPYTERHUB_API_TOKEN), install one GPU kernelspec per
# size the hub offers this user (`python -m kernelprovider install-kernelspecs --user`: in the
# user's home, sizes the hub no longer offers removed), then run what z2jh passes as the
# container's arguments (singleuser.cmd, default jupyterhub-singleuser). A hub that does not
# answer costs the GPU kernelspecs, not the server.
if [ -n "${JUPYTERHUB_API_URL:-}" ] && [ -n "${JUPYTERHUB_API_TOKEN:-}" ]; then
  python -m kernelprovider install-kernelspecs --user \
    || echo "elastic-gpu: no GPU kernelspecs installed (above: why); the server starts without them" >&2
fi
exec "$@"
