"""LocalGPUSpawner: JupyterHub's local-process spawner with fractional GPUs, quotas and queueing.

The GPU logic (profiles' ``gpu`` sections, ``allowed_groups``, quota owner, admission,
queueing, release, progress) is :class:`hubext.gpu_spawner.GPUSpawnerMixin`, shared with the
Kubernetes spawner. This module adds what is local: the profile form, the shim's environment
(``LD_PRELOAD``, ``LIBVGPU_CONFIG`` pointing to a read-only limits file written by the hub,
``CUDA_VISIBLE_DEVICES``) and binding the slice to the server's process id.

``profile_list`` is KubeSpawner's format; per profile (and per ``profile_options`` choice)
``spawner_override`` sets traits of this spawner (``default_url``, ``environment``,
``mem_limit``, ...), dicts merged like KubeSpawner's ``kubespawner_override``::

    c.LocalGPUSpawner.profile_list = [
        {"display_name": "CPU only", "slug": "cpu", "default": True},
        {"display_name": "1/4 H100 — 20 GiB", "slug": "h100-quarter",
         "allowed_groups": ["vision"],
         "gpu": {"memory_mib": 20480, "cores_percent": 25}},
    ]
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from tornado.gen import maybe_future
from traitlets import Callable as CallableTrait
from traitlets import HasTraits, List, TraitError, Unicode, Union, default, validate

from quotas.messages import compute_size, memory_size, mib

from ..gpu_spawner import GPUSpawnerMixin, GPUSpawnError, check_forged_options
from ..requests import check_profile_limits, validate_gpu_section

TEMPLATES = Path(__file__).parent.parent / "templates"
FORM_PREFIX = "profile-option-"
PROFILE_KEYS = {
    "display_name",
    "slug",
    "description",
    "default",
    "allowed_groups",
    "gpu",
    "profile_options",
    "spawner_override",
    "kubespawner_override",
}

_jinja = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=select_autoescape(["html"]))


def slugify(text: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug or "profile"


def normalize_profile_list(profiles: Any) -> list[dict[str, Any]]:
    """Check an admin's profile_list and fill in slugs; raise ValueError naming the bad entry."""
    if isinstance(profiles, Mapping):  # KubeSpawner also accepts {key: profile}
        profiles = list(profiles.values())
    if not isinstance(profiles, list):
        raise ValueError(f"profile_list must be a list of profiles, got {type(profiles).__name__}")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, profile in enumerate(profiles):
        where = f"profile_list[{i}]"
        if not isinstance(profile, Mapping):
            raise ValueError(f"{where} must be a mapping, got {profile!r}")
        if not isinstance(profile.get("display_name"), str) or not profile["display_name"]:
            raise ValueError(f"{where} needs a display_name (a non-empty string)")
        unknown = sorted(set(profile) - PROFILE_KEYS)
        if unknown:
            raise ValueError(
                f"{where} ('{profile['display_name']}') has unknown key(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(PROFILE_KEYS))}"
            )
        p = dict(profile)
        p["slug"] = str(p.get("slug") or slugify(p["display_name"]))
        where = f"profile '{p['slug']}'"
        if p["slug"] in seen:
            raise ValueError(f"{where}: slug is used by two profiles; slugs must be unique")
        seen.add(p["slug"])
        if p.get("gpu") is not None:
            validate_gpu_section(p["gpu"], where)
        groups = p.get("allowed_groups")
        if groups is not None and (not isinstance(groups, list) or not all(isinstance(g, str) for g in groups)):
            raise ValueError(f"{where}.allowed_groups must be a list of group names, got {groups!r}")
        options = p.get("profile_options") or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"{where}.profile_options must be a mapping of option name -> option")
        for name, option in options.items():
            choices = (option or {}).get("choices") if isinstance(option, Mapping) else None
            if not isinstance(choices, Mapping) or not choices:
                raise ValueError(f"{where}.profile_options.{name} needs a non-empty 'choices' mapping")
            if (option.get("unlisted_choice") or {}).get("enabled"):
                raise ValueError(
                    f"{where}.profile_options.{name}.unlisted_choice is not supported by the local "
                    "spawner (free-form values could bypass GPU quotas); list the choices instead"
                )
            for cname, choice in choices.items():
                if not isinstance(choice, Mapping):
                    raise ValueError(f"{where}.profile_options.{name}.choices.{cname} must be a mapping")
                if choice.get("gpu") is not None:
                    validate_gpu_section(choice["gpu"], f"{where} option '{name}' choice '{cname}'")
        check_profile_limits(p, where)
        for key in ("spawner_override", "kubespawner_override"):
            if p.get(key) is not None and not isinstance(p[key], Mapping):
                raise ValueError(f"{where}.{key} must be a mapping of trait name -> value")
        out.append(p)
    return out


def gpu_summary(section: Mapping[str, Any] | None) -> str:
    """'20 GiB, 25 % of an H100-80GB' style text for a gpu section ('' for none)."""
    if not section:
        return ""
    count = section.get("count", 1)
    model = section.get("model") or "GPU"
    if section.get("whole"):
        return f"{count} whole {model}{'s' if count != 1 else ''}"
    memory, cores = section.get("memory_mib", 0), section.get("cores_percent", 0)
    memory_limit, cores_limit = section.get("memory_limit_mib", 0), section.get("cores_limit_percent", 0)
    if memory_limit > memory or cores_limit > cores:  # elastic: 'X guaranteed, up to Y'
        text = f"{memory_size(memory, memory_limit)} · compute {compute_size(cores, cores_limit)}"
    else:
        text = f"{mib(memory)}, {cores} % compute"
    if count != 1:
        text += f" on each of {count} {model}s"
    elif section.get("model"):
        text += f" · {model}"
    return text


class LocalGPUSpawner(GPUSpawnerMixin, LocalProcessSpawner):
    """Local single-user servers whose profiles may carry a ``gpu`` section (see hubext.gpu_spawner)."""

    if not issubclass(GPUSpawnerMixin, HasTraits):
        # an older hubext core whose mixin is a plain class: traitlets would neither name nor
        # configure the traits it declares unless they are registered on this HasTraits class
        gpu_owner_mapping = GPUSpawnerMixin.gpu_owner_mapping
        gpu_max_wait_seconds = GPUSpawnerMixin.gpu_max_wait_seconds

    profile_list = Union(
        [List(), CallableTrait()],
        default_value=[],
        config=True,
        help="""Server profiles a user picks from, in KubeSpawner's format: display_name,
        slug, description, default, allowed_groups (who sees it), gpu (memory_mib,
        cores_percent, count, model, priority_class, whole — per GPU; memory_limit_mib and
        cores_limit_percent, optional: how far the slice may grow into what its card leaves
        idle, at least the request, compute at most 100), profile_options (choices
        may carry gpu and spawner_override) and spawner_override (traits of this spawner to set).
        A callable (spawner) -> list is called at spawn time. Empty (default): one CPU server.""",
    )

    @validate("profile_list")
    def _validate_profile_list(self, proposal: Any) -> Any:
        value = proposal.value
        if callable(value):
            return value
        try:
            return normalize_profile_list(value)
        except ValueError as e:
            raise TraitError(f"LocalGPUSpawner.{e}") from None

    @default("options_form")
    def _options_form_default(self) -> Any:
        return self._render_options_form if self.profile_list else ""

    @default("options_from_form")
    def _options_from_form_default(self) -> Any:
        return self._options_from_form

    # ---- profiles ---------------------------------------------------------------------------

    async def gpu_profiles(self) -> list[dict[str, Any]]:
        """Profiles this user may use (allowed_groups applied), validated."""
        profiles = self.profile_list
        if callable(profiles):
            try:
                profiles = normalize_profile_list(await maybe_future(profiles(self)))
            except ValueError as e:
                raise GPUSpawnError(
                    f"The server profiles are misconfigured ({e}). Ask an admin to fix them.", 500
                ) from None
        return [p for p in profiles if self.gpu_profile_visible(p)]

    def gpu_selected_profile(self) -> dict | None:
        return self.__dict__.get("_gpu_profile")

    async def _select_profile(self) -> dict | None:
        """Resolve user_options to one visible profile; refuse unknown or forged options."""
        profiles = await self.gpu_profiles()
        options = dict(self.user_options or {})
        all_profiles = self.profile_list if not callable(self.profile_list) else profiles
        if not profiles:
            if all_profiles:
                raise GPUSpawnError(
                    "No server profile is available to you. Ask an admin to add you to a group that may use one.",
                    403,
                )
            if options:
                raise GPUSpawnError(
                    f"This hub has no server profiles, so it takes no options; got {', '.join(sorted(options))}."
                )
            return None
        slug = options.pop("profile", None)
        if slug is None:
            profile = next((p for p in profiles if p.get("default")), profiles[0])
        else:
            profile = next((p for p in profiles if p["slug"] == slug), None)
            if profile is None:
                raise GPUSpawnError(
                    f"No server profile {slug!r} is available to you. "
                    f"Choose one of: {', '.join(p['slug'] for p in profiles)}."
                )
        allowed = set(profile.get("profile_options") or {})
        unknown = sorted(k for k in options if k not in allowed)
        if unknown:
            hint = f"'profile' and this profile's options: {', '.join(sorted(allowed))}" if allowed else "'profile'"
            raise GPUSpawnError(
                f"Unknown server option(s) {', '.join(repr(k) for k in unknown)} for profile "
                f"'{profile['slug']}'. Allowed: {hint}."
            )
        check_forged_options(profile, options)
        return profile

    def _apply_profile_overrides(self, profile: Mapping[str, Any]) -> None:
        overrides: dict[str, Any] = {}
        for key in ("kubespawner_override", "spawner_override"):
            overrides.update(profile.get(key) or {})
        for name, option in (profile.get("profile_options") or {}).items():
            choices = option.get("choices") or {}
            choice = (self.user_options or {}).get(name)
            if choice is None:
                choice = next((k for k, c in choices.items() if c.get("default")), next(iter(choices), None))
            for key in ("kubespawner_override", "spawner_override"):
                overrides.update((choices.get(choice) or {}).get(key) or {})
        for trait, value in overrides.items():
            if callable(value):
                value = value(self)
            if not self.has_trait(trait):
                self.log.warning(
                    "Profile '%s' sets %s, which %s does not have; ignored", profile["slug"], trait, type(self).__name__
                )
                continue
            current = getattr(self, trait)
            if isinstance(value, Mapping) and isinstance(current, Mapping):
                value = {**current, **value}
            setattr(self, trait, value)

    # ---- the form -----------------------------------------------------------------------------

    async def _render_options_form(self, spawner: Any = None) -> str:
        profiles = await self.gpu_profiles()
        backend = self.gpu_allocator.backend
        await self.gpu_allocator.ensure_started()
        previous = self.user_options or {}
        selected = previous.get("profile") if isinstance(previous, Mapping) else None
        if selected not in {p["slug"] for p in profiles}:
            selected = next(
                (p["slug"] for p in profiles if p.get("default")), profiles[0]["slug"] if profiles else None
            )
        views = []
        for p in profiles:
            views.append(
                {
                    "slug": p["slug"],
                    "display_name": p["display_name"],
                    "description": p.get("description", ""),
                    "gpu": gpu_summary(p.get("gpu")),
                    "options": [
                        {
                            "name": name,
                            "display_name": option.get("display_name", name),
                            "choices": [
                                {
                                    "value": cname,
                                    "display_name": c.get("display_name", cname),
                                    "gpu": gpu_summary(c.get("gpu")),
                                    "selected": (
                                        previous.get(name) == cname
                                        if selected == p["slug"] and name in previous
                                        else bool(c.get("default"))
                                    ),
                                }
                                for cname, c in option["choices"].items()
                            ],
                        }
                        for name, option in (p.get("profile_options") or {}).items()
                    ],
                }
            )
        pool = await backend.inventory()
        models: dict[str, int] = {}
        for gpu in (g for node in pool.nodes for g in node.gpus):
            models[gpu.model] = models.get(gpu.model, 0) + 1
        return _jinja.get_template("local_options_form.html").render(
            profiles=views,
            selected=selected,
            simulated=bool(getattr(backend, "simulated", False)),
            gpus=", ".join(f"{n} × {m}" for m, n in models.items()) or "no GPU",
            prefix=FORM_PREFIX,
        )

    def _options_from_form(self, formdata: Mapping[str, list[str]]) -> dict[str, Any]:
        """{'profile': [slug], 'profile-option-<slug>--<name>': [choice]} -> {'profile': slug, name: choice}."""
        slug = (formdata.get("profile") or [None])[0]
        options: dict[str, Any] = {}
        if slug:
            options["profile"] = slug
            prefix = f"{FORM_PREFIX}{slug}--"
            for key, values in formdata.items():
                if key.startswith(prefix) and values:
                    options[key[len(prefix) :]] = values[0]
        return options

    # ---- start / stop ---------------------------------------------------------------------------

    def gpu_user_ids(self) -> tuple[int | None, int | None]:
        """The uid/gid the server runs as (for the region directory), or (None, None) if the hub's own."""
        import pwd

        try:
            entry = pwd.getpwnam(self.user.name)
        except KeyError:
            return None, None
        return entry.pw_uid, entry.pw_gid

    async def start(self) -> Any:
        self.gpu_reset_progress()
        self.__dict__["_gpu_env"] = {}
        try:
            profile = await self._select_profile()
            self.__dict__["_gpu_profile"] = profile
            if profile is not None:
                self._apply_profile_overrides(profile)
            allocation = await self.gpu_admit()
            if allocation is not None:
                backend = self.gpu_allocator.backend
                if backend.mode != "local":
                    raise GPUSpawnError(
                        f"LocalGPUSpawner needs the local GPU pool (GPUAllocator.pool_backend_class = 'local'), "
                        f"not the {backend.mode or type(backend).__name__!r} one.",
                        500,
                    )
                uid, gid = self.gpu_user_ids()
                self.__dict__["_gpu_env"] = backend.holder_env(
                    allocation, self.gpu_allocator.priority_value(allocation.priority_class), uid, gid
                )
                self.gpu_progress("Starting the server with its GPU slice", 30)
            result = await super().start()
            self.gpu_allocator.backend.server_running(self.pid, self.user.name)  # GPU or not: see the backstop
            if allocation is not None:
                await self.gpu_allocator.bind(allocation.id, str(self.pid))
            return result
        except BaseException:
            self.gpu_admission_finished()
            await self.gpu_release("spawn failed")
            raise

    async def poll(self) -> int | None:
        status = await super().poll()
        if status is None and self.pid:  # also the hub's first poll of a server that outlived it
            self.gpu_allocator.backend.server_running(self.pid, self.user.name)
        if status is not None and self._gpu_allocation_id:
            await self.gpu_release(f"server exited ({status})")
        return status

    def get_env(self) -> dict[str, str]:
        env = super().get_env()
        gpu_env = self.__dict__.get("_gpu_env") or {}
        if gpu_env:
            env.update(gpu_env)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU server sees no GPU (GPU kernels get theirs from the broker)
        return env

    async def progress(self) -> Any:
        async for event in self.gpu_progress_events():
            yield event
        yield {"message": "Waiting for the server to answer", "progress": 50}

    def get_state(self) -> dict:
        return self.gpu_get_state(super().get_state())

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.gpu_load_state(state)


class HubUserGPUSpawner(LocalGPUSpawner, SimpleLocalProcessSpawner):
    """LocalGPUSpawner that runs every user's server as one system account, never as root.

    For one person's workstation, or a trusted team with hub-only accounts (first-use
    passwords): users need no system account, each gets ``home_dir_template`` as home. The
    account is the hub's own, or ``run_as_account`` (required when the hub runs as root). There
    is no isolation between users; use :class:`LocalGPUSpawner` with PAM for that.
    """

    run_as_account = Unicode(
        "",
        config=True,
        help="""The system account every user's server (and its GPU kernels) runs as. '' (default): the
        hub's own account, which is refused when the hub runs as root: a user's code must never run as
        root. `elastic-gpu up` as root sets 'elastic-gpu' (an unprivileged account it creates).""",
    )

    def _account(self) -> Any:
        import pwd

        if not self.run_as_account:
            if os.geteuid() == 0:
                raise GPUSpawnError(
                    "This hub runs as root and would run your server as root, which it refuses. An admin must set "
                    "HubUserGPUSpawner.run_as_account to an unprivileged account (or use PAM).",
                    500,
                )
            return None
        try:
            account = pwd.getpwnam(self.run_as_account)
        except KeyError:
            raise GPUSpawnError(
                f"HubUserGPUSpawner.run_as_account is {self.run_as_account!r}, which is not an account on this "
                "machine. Ask an admin to create it.",
                500,
            ) from None
        if account.pw_uid == 0:
            raise GPUSpawnError(
                f"HubUserGPUSpawner.run_as_account {self.run_as_account!r} is root; servers never run as root.", 500
            )
        return account

    def gpu_user_ids(self) -> tuple[int | None, int | None]:
        account = self._account()
        return (account.pw_uid, account.pw_gid) if account is not None else (None, None)

    async def start(self) -> Any:
        account = self._account()
        if account is not None:  # the hub (root) makes the home the account cannot create under data/home
            home = Path(self.home_dir)
            home.mkdir(parents=True, exist_ok=True)
            if home.stat().st_uid != account.pw_uid:
                os.chown(home, account.pw_uid, account.pw_gid)
            os.chmod(home, 0o700)
        return await super().start()

    def make_preexec_fn(self, name: str) -> Any:
        if not self.run_as_account:
            return super().make_preexec_fn(name)
        from jupyterhub.spawner import set_user_setuid

        become = set_user_setuid(self.run_as_account, chdir=False)
        home = self.home_dir

        def preexec() -> None:
            become()
            os.chdir(home)

        return preexec

    def user_env(self, env: dict[str, str]) -> dict[str, str]:
        env = super().user_env(env)
        if self.run_as_account:
            env["LOGNAME"] = self.run_as_account
        return env
