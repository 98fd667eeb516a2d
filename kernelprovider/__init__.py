"""The notebook-server side: a jupyter_client kernel provisioner that runs GPU kernels through the broker."""
