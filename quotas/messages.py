"""The sentences users read: amounts in GiB where that reads better, levels by name."""

from __future__ import annotations

from .model import GPURequest
from .tree import Level


def mib(n: int | float | None) -> str:
    """The one size formatter (sentences, pages, the CLI, the culler): 40960 -> '40 GiB',
    1536 -> '1.5 GiB', 1000 -> '1000 MiB', 10300 -> '10300 MiB' (never rounded: people compare
    these sizes with their quota), None -> '-'."""
    if n is None:
        return "-"
    n = int(n)
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024} GiB"
    if n >= 1024 and (n * 10) % 1024 == 0:
        return f"{n / 1024:.1f} GiB"
    return f"{n} MiB"


def cpus(millicores: int) -> str:
    """2000 -> '2 CPUs', 500 -> '0.5 CPU', 1 -> '0.001 CPU'."""
    if millicores % 1000 == 0:
        n = millicores // 1000
        return f"{n} CPU" if n == 1 else f"{n} CPUs"
    return f"{millicores / 1000:g} CPU"


def node_needs(cpu_millicores: int, host_memory_mib: int) -> str:
    """'2 CPUs', '16 GiB of host memory', '2 CPUs and 16 GiB of host memory'."""
    parts = []
    if cpu_millicores:
        parts.append(cpus(cpu_millicores))
    if host_memory_mib:
        parts.append(f"{mib(host_memory_mib)} of host memory")
    return " and ".join(parts) or "no CPU or host memory"


def a(text: str) -> str:
    """'a 10 GiB', 'an 8 GiB', 'an 80 GiB', 'an 11 GiB'."""
    eleven = text.startswith(("11", "18")) and not text[2:3].isdigit()
    return f"an {text}" if text.startswith("8") or eleven else f"a {text}"


def plural(n: int, word: str, words: str | None = None) -> str:
    return f"{n} {word if n == 1 else (words or word + 's')}"


def what(request: GPURequest) -> str:
    """'kernel' / 'notebook' (the word used in sentences)."""
    return request.kind if request.kind in ("kernel", "notebook") else "request"


def smaller(kind: str) -> str:
    """What to ask for instead, by what asks (:func:`what`): a notebook's user picks a profile, a
    kernel's user a GPU kernel size (a kernel has no profile)."""
    return "a smaller GPU kernel size" if kind == "kernel" else "a smaller profile"


def shape(request: GPURequest) -> str:
    """'10 GiB and 25% of a GPU', '3 GPUs with 6 GiB and 80% each', '2 whole GPUs'."""
    if request.whole:
        return plural(request.count, "whole GPU")
    each = f"{mib(request.memory_mib)} and {request.cores_percent}%"
    if request.count == 1:
        return f"{each} of a GPU"
    return f"{request.count} GPUs with {each} each"


def model_phrase(model: str | None) -> str:
    return f"{model} " if model else ""


def _in_use(n: int) -> str:
    return "is" if n == 1 else "are"


def cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def holdings(kernels: int, notebooks: int) -> str:
    """What a user holds, as 'stop one of your ...' names it: 'kernels', 'GPU servers', ...; '' for nothing."""
    if kernels and notebooks:
        return "GPU kernels or servers"
    if kernels:
        return "kernels"
    if notebooks:
        return "GPU servers"
    return ""


def quota_wait(
    level: Level,
    resource: str,
    used: int,
    limit: int,
    asked: int,
    kind: str,
    yours: str = "kernels",
    others: bool = True,
) -> str:
    """Why a request waits on a quota level, and what to do.

    ``yours``: what the requester holds within the level (:func:`holdings`; '' = nothing, so
    stopping is not advised); ``others``: whether anyone else's slices count there too.
    """
    less = smaller(kind)
    if level.kind == "user" or not others:
        todo = f"Stop one of your {yours} or pick {less}." if yours else f"Pick {less}."
    elif yours:
        todo = f"Stop one of your {yours}, wait for others in {level.label} to stop theirs, or pick {less}."
    else:
        todo = f"None of it is yours: wait for others in {level.label} to stop theirs, or pick {less}."
    if resource == "memory_mib":
        return (
            f"{cap(level.label)} has {mib(limit)} of GPU memory; {mib(used)} "
            f"are in use, so {a(mib(asked))} {kind} does not fit. {todo}"
        )
    if resource == "cores_percent":
        return (
            f"{cap(level.label)} has {limit}% of GPU compute; {used}% are in "
            f"use, so a {kind} asking {asked}% does not fit. {todo}"
        )
    return (
        f"{cap(level.label)} may hold {plural(limit, 'vGPU')}; {used} "
        f"{_in_use(used)} in use, so a {kind} asking for {asked} more does not fit. {todo}"
    )


def quota_never(level: Level, resource: str, limit: int, asked: int, kind: str) -> str:
    """Why a request is above a level's whole quota."""
    todo = f"Pick {smaller(kind)} or ask an admin to raise the quota."
    if resource == "memory_mib":
        return (
            f"{cap(level.label)} has {mib(limit)} of GPU memory in all, so "
            f"{a(mib(asked))} {kind} can never fit. {todo}"
        )
    if resource == "cores_percent":
        return (
            f"{cap(level.label)} has {limit}% of GPU compute in all, so a {kind} "
            f"asking {asked}% can never fit. {todo}"
        )
    return (
        f"{cap(level.label)} may hold {plural(limit, 'vGPU')} in all, so a {kind} "
        f"asking for {asked} can never fit. {todo}"
    )


def memory_size(memory_mib: int, memory_limit_mib: int = 0) -> str:
    """A slice's GPU memory as pages, the CLI and the API show it: '20 GiB' for a fixed slice,
    '20 GiB guaranteed, up to 40 GiB' for an elastic one (a limit above its request)."""
    if memory_limit_mib and memory_limit_mib > memory_mib:
        return f"{mib(memory_mib)} guaranteed, up to {mib(memory_limit_mib)}"
    return mib(memory_mib)


def compute_size(cores_percent: int, cores_limit_percent: int = 0) -> str:
    """A slice's compute: '25%' for a fixed slice, '25% guaranteed, up to 100%' for an elastic one."""
    if cores_limit_percent and cores_limit_percent > cores_percent:
        return f"{cores_percent}% guaranteed, up to {cores_limit_percent}%"
    return f"{cores_percent}%"


def asked(request: GPURequest) -> str:
    """A request's whole size in few words: '10 GiB', '2 x 10 GiB', '2 whole GPUs'."""
    if request.whole:
        return plural(request.count, "whole GPU")
    return f"{request.count} x {mib(request.memory_mib)}" if request.count > 1 else mib(request.memory_mib)


def queue_place(ahead: int) -> str:
    """A place in the GPU queue as every page, notice and status says it (``ahead``: requests
    ahead of it): 'position 1 in the GPU queue (0 requests ahead)', 'position 2 in the GPU queue
    (1 request ahead)', 'position 21 in the GPU queue (20 requests ahead)'."""
    return f"position {ahead + 1} in the GPU queue ({plural(ahead, 'request')} ahead)"


def moved_for(request: GPURequest, waited_s: float) -> str:
    """Why a slice is moved (swapped out): the waiting request it makes room for."""
    return (
        f"moved to make room for {request.request_id or 'a request'} of {request.owner.user} "
        f"({asked(request)}) waiting {waited_s:.0f} s"
    )


def held_for(request: GPURequest, waited_s: float) -> str:
    """Why a request waits behind an overdue head that holds the cards it could use."""
    return (
        f"A request for {asked(request)} has waited {waited_s:.0f} s for room on the GPUs this one could use "
        "and goes first: nothing of its priority or lower starts there before it does. Wait a moment "
        "or try again."
    )


def swap_over_host_cap(host_mib: int, total_mib: int, cap_mib: int, percent: float,
                       node_ram_mib: int | None = None) -> str:
    """Why a kernel is not swapped out: its GPU memory would take what swapped-out kernels hold in
    host memory over the cap (on the hub's machine, or on a node of ``node_ram_mib`` RAM)."""
    where = "host memory" if node_ram_mib is None else "this node's host memory"
    ram = "this machine's RAM" if node_ram_mib is None else f"the node's {mib(node_ram_mib)} of RAM"
    return (
        f"its {mib(host_mib)} of GPU memory would bring what swapped-out kernels hold in {where} to "
        f"{mib(total_mib)}, over the cap of {mib(cap_mib)} ({percent:g}% of {ram})"
    )


def claims_full(uuid: str, hubs: str, memory_mib: int, cap_mib: int, cores: int, cap_cores: int) -> str:
    """Why the cluster-wide ledger refuses a claim: the hubs' slices together overfill a card."""
    return (
        f"GPU {uuid} has no room left: hubs {hubs} together claim {mib(memory_mib)} of {mib(cap_mib)} "
        f"and {cores} of {cap_cores} % of its compute."
    )


def claim_lapsed(allocation_id: str, ttl_seconds: float, why: str) -> str:
    """Why a hub gives up a grant: it did not renew its claim in time, and the room is gone."""
    return (
        f"GPU slice {allocation_id} was given up: this hub did not renew its claim for over "
        f"claims_ttl_seconds ({ttl_seconds:.0f} s; the hub was overloaded or could not reach the "
        f"Kubernetes API), so other hubs took it for gone and gave its room out. {why}"
    )


_RESOURCE_WORDS = {"memory_mib": "GPU memory", "cores_percent": "GPU compute", "gpus": "vGPU"}


def amount(resource: str, n: int) -> str:
    """A quota figure in its resource's words: memory_mib 20480 -> '20 GiB', cores_percent 50 -> '50%'."""
    if resource == "memory_mib":
        return mib(n)
    if resource == "cores_percent":
        return f"{n}%"
    return str(n)


def over_quota(level: Level, resource: str, used: int, limit: int) -> str:
    """"workspace 'vision' is over the GPU memory quota (20 GiB of 20 GiB in use)"."""
    return (
        f"{level.label} is over the {_RESOURCE_WORDS[resource]} quota "
        f"({amount(resource, used)} of {amount(resource, limit)} in use)"
    )


def borrowed(level: Level, resource: str, used: int, limit: int) -> str:
    """Why a grant of a borrowing priority class may be taken back."""
    return (
        f"Borrowed idle capacity: {over_quota(level, resource, used, limit)}; this allocation is "
        "preempted first when the capacity is needed back."
    )


def borrowing_waits(level: Level, resource: str, used: int, limit: int, class_name: str, why: str) -> str:
    """A borrowing class over its quota waits for idle capacity; ``why``: the pool's sentence."""
    return (
        f"{cap(over_quota(level, resource, used, limit))}; priority class '{class_name}' may borrow "
        f"idle capacity, but none is free. {why}"
    )


def preempted(victims: list[tuple[str, str, str]], class_name: str) -> str:
    """A grant that preempts: ``victims`` as (allocation id, user, what it ran as)."""
    parts = [f"'{aid}' of user '{user}' ({as_what})" for aid, user, as_what in victims]
    return (
        f"Granted by preempting {plural(len(victims), 'allocation')}: {', '.join(parts)}; "
        f"the request runs at priority class '{class_name}'."
    )


# ---- a request within its quotas waits for room in the pool --------------------------------------
# ``own``: what the requester holds when nothing but its own slices stand in the way (holdings(),
# '' otherwise): the advice is then to stop one of them.


def _todo(todo: str, own: str, kind: str) -> str:
    return f"Only your own {own} hold GPUs: stop one of them or pick {smaller(kind)}." if own else todo


def pinned_full(request: GPURequest, node: str, kind: str, own: str = "") -> str:
    """A swapped-out kernel whose state can only go back to its card (or one of a few), all full."""
    if len(request.pinned_uuids) > request.count:
        return (
            f"None of the GPUs this kernel's state can go back to ({', '.join(request.pinned_uuids)} on "
            f"node {node}) has room for {shape(request)} right now. "
            + _todo("It resumes when one of them has room again.", own, kind)
        )
    return (
        f"The GPU this kernel's state can only go back to ({', '.join(request.pinned_uuids)} on "
        f"node {node}) has no room for {shape(request)} right now. "
        + _todo("It resumes when that GPU has room again.", own, kind)
    )


def node_short(request: GPURequest, kind: str) -> str:
    """GPUs have room, but no node with it has the CPU and host memory the request also needs."""
    return (
        f"GPUs have room for {shape(request)}, but no node with that room has "
        f"{node_needs(request.cpu_millicores, request.host_memory_mib)} free right now. "
        f"Wait for a server to stop or pick {smaller(kind)}."
    )


def no_whole_cards(request: GPURequest, model: str | None, most_on_a_node: int, kind: str, own: str = "") -> str:
    """Not enough free cards on one node for a request of whole cards."""
    k = request.count
    todo = "Wait for a kernel to stop or ask for " + ("fewer GPUs." if k > 1 else "a slice of a GPU instead.")
    return (
        f"No node has {plural(k, 'free ' + model_phrase(model) + 'GPU')} to give out whole right "
        f"now (at most {most_on_a_node} on one node). " + _todo(todo, own, kind)
    )


def no_card(request: GPURequest, model: str | None, free_mib: int, free_cores: int, kind: str, own: str = "") -> str:
    """No card has room for a one-card slice; ``free_mib``/``free_cores``: the most free on one."""
    return (
        f"No {model_phrase(model)}GPU has {mib(request.memory_mib)} of memory and "
        f"{request.cores_percent}% of compute free right now (the most free on one "
        f"card is {mib(max(free_mib, 0))} and {max(free_cores, 0)}%). "
        + _todo(f"Wait for a kernel to stop or pick {smaller(kind)}.", own, kind)
    )


def no_cards(request: GPURequest, model: str | None, kind: str, own: str = "") -> str:
    """No node has the request's several cards with room each."""
    return (
        f"No node has {request.count} {model_phrase(model)}GPUs with {mib(request.memory_mib)} and "
        f"{request.cores_percent}% free each right now. "
        + _todo(f"Wait for kernels to stop, ask for fewer GPUs or pick {smaller(kind)}.", own, kind)
    )



def out_of_service(cards: list[tuple[str, str, str, str]]) -> str:
    """Cards (uuid, node, 'Xid 79 (the GPU has fallen off the bus)', how to clear) that take no
    new slice: 'GPU-1 on node n is out of service after Xid 79 (...); an admin clears it with ...'."""
    return " ".join(
        f"{uuid} on node {node} is out of service after {xid}; an admin clears it, once the card is "
        f"reset, with `{clear}`." for uuid, node, xid, clear in cards
    )


def only_out_of_service(request: GPURequest, cards: list[tuple[str, str, str, str]], kind: str) -> str:
    """The only cards that could hold a request are out of service (a fatal Xid): waiting for a
    kernel to stop cannot help, an admin must clear them (:func:`out_of_service` names them)."""
    return (
        f"The only GPUs that could hold {shape(request)} are out of service: {out_of_service(cards)} "
        f"This {kind} waits until then."
    )


# ---- a request no card or node of the pool can ever hold (InvalidRequest, quotas/checks.py) ------


def unknown_model(model: str, known: list[str]) -> str:
    names = ", ".join(f"'{n}'" for n in sorted(known)) or "none"
    return f"No GPU of model '{model}' is in the pool (models: {names}). Pick one of these or leave the model open."


def no_whole_card_at_all(model: str | None) -> str:
    return (
        f"No {model_phrase(model)}GPU in the pool can be given out whole (they are all MIG). "
        "Ask for a slice instead."
    )


def too_many_whole(count: int, model: str | None, most: int) -> str:
    return (
        f"No node has {count} {model_phrase(model)}GPUs that can be given out whole; the most on "
        f"one node is {most}. Ask for fewer GPUs."
    )


def no_shared_slices(model: str | None) -> str:
    return (
        f"No {model_phrase(model)}GPU in the pool takes shared slices (they are whole-card or MIG "
        "only). Ask for whole GPUs instead."
    )


def limit_larger_than_cards(limit_mib: int, model: str | None, largest_mib: int) -> str:
    return (
        f"A slice that may grow to {mib(limit_mib)} is larger than any {model_phrase(model)}GPU in the "
        f"pool (the largest holds {mib(largest_mib)}). Pick a profile with a smaller memory limit."
    )


def slice_larger_than_cards(request: GPURequest, model: str | None, largest_mib: int) -> str:
    return (
        f"A {mib(request.memory_mib)} slice is larger than any {model_phrase(model)}GPU in the pool "
        f"(the largest holds {mib(largest_mib)}). Pick {smaller(what(request))}."
    )


def compute_above_cards(request: GPURequest, model: str | None, most_percent: int) -> str:
    return (
        f"{request.cores_percent}% of compute is more than any {model_phrase(model)}GPU in the pool "
        f"offers ({most_percent}% at most). Pick {smaller(what(request))}."
    )


def too_many_slices(request: GPURequest, model: str | None, most: int) -> str:
    return (
        f"No node has {request.count} {model_phrase(model)}GPUs that can hold {mib(request.memory_mib)} "
        f"and {request.cores_percent}% each; the most on one node is {most}. Ask for fewer GPUs or a "
        "smaller slice."
    )


def nodes_too_small(request: GPURequest, most_cpu: int, most_hmem_mib: int) -> str:
    """No node with room for the request's GPUs has its CPU and host memory;
    ``most_cpu``/``most_hmem_mib``: the most such a node offers (0: not asked)."""
    return (
        f"No node with room for {shape(request)} has "
        f"{node_needs(request.cpu_millicores, request.host_memory_mib)} to give (such nodes offer at "
        f"most {node_needs(most_cpu, most_hmem_mib)}). Pick {smaller(what(request))} or ask an admin "
        "for larger nodes."
    )


#: the broker's answer to a kernel's owner about a GPU kernel the hub stopped: this, then who stopped it
#: and why (:func:`kernel_stopped`, hubext/broker/handlers.py); the owner's server reads it back
#: (:func:`stopped_by_hub`, kernelprovider/provisioner.py)
KERNEL_STOPPED = "The hub stopped this GPU kernel: "
#: how the kernel's server words that reason (JupyterLab's page reads it: kernelprovider/labstatus.py)
HUB_STOPPED_IT = "the hub stopped it"


def kernel_stopped(why: str) -> str:
    """'The hub stopped this GPU kernel: kernel shut down by admin: maintenance.'"""
    return f"{KERNEL_STOPPED}{why}."


def stopped_by_hub(message: str) -> str:
    """The reason a server keeps for a kernel the hub stopped, from the broker's answer: 'the hub
    stopped it: <who and why>' when the answer is :func:`kernel_stopped`'s, else 'the hub stopped it'."""
    if message.startswith(KERNEL_STOPPED):
        return f"{HUB_STOPPED_IT}: {message[len(KERNEL_STOPPED):].rstrip('.')}"
    return HUB_STOPPED_IT
