"""The idle-GPU culler: a JupyterHub service that reclaims idle GPU kernels."""
