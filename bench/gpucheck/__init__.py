"""``./dev gpu-check``: every GPU claim of libvgpu checked on the machine it runs on, one line each.

Two targets, one code path (the claim table in :mod:`.claims`, the runner in :mod:`.__main__`):

* the GPU machine (:mod:`.target_gpu`): the machine's own ``python3`` and its PyTorch, its
  ``nvidia-smi``, the shim built with its compiler; no venv, no pip, no network;
* ``--doubles`` (:mod:`.target_doubles`): the same claims against the CUDA/NVML doubles of
  ``tests/libvgpu/double``, driven by the C probe program (what runs without PyTorch), so CI
  runs the check and it cannot rot.

Standard library only (PyTorch is imported by the GPU workloads, in child processes).

    python3 -m bench.gpucheck [--doubles] [--only NAME[,NAME...]] [--deadline SECONDS]

Prints ``gpu <claim> ok|FAIL <figures>`` per claim and a summary line; exits 1 if a claim
failed or was not run.
"""
