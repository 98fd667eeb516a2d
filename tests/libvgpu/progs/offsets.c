/* Prints the region layout as the C compiler sees it, for libvgpu/regions.py's LAYOUT check. */
#include <stddef.h>
#include <stdio.h>

#include "../../../libvgpu/src/vgpu.h"

#define P(name, value) printf("%s %zu\n", name, (size_t)(value))
#define C(f) offsetof(struct vgpu_container_region, f)
#define S(f) offsetof(struct vgpu_slot, f)
#define N(f) offsetof(struct vgpu_node_region, f)
#define E(f) offsetof(struct vgpu_node_entry, f)
#define A(f) offsetof(struct vgpu_activity, f)
#define K(f) offsetof(struct vgpu_compute, f)

int main(void) {
    P("head.version", C(version));
    P("head.kind", C(kind));
    P("head.size", C(size));
    P("head.created_ns", C(created_ns));
    P("container.container_id", C(container_id));
    P("container.max_devices", C(max_devices));
    P("container.max_procs", C(max_procs));
    P("container.slot_size", C(slot_size));
    P("container.slots_offset", C(slots_offset));
    P("container.priority", C(priority));
    P("container.hwm", C(hwm));
    P("container.last_launch_ns", C(last_launch_ns));
    P("container.used", C(used));
    P("container.limit", C(limit));
    P("container.cores_percent", C(cores_percent));
    P("container.compute", C(compute));
    P("container.name", C(name));
    P("container.card", C(card));
    P("card.uuid", offsetof(struct vgpu_card, uuid));
    P("card.last_launch_ns", offsetof(struct vgpu_card, last_launch_ns));
    P("card.held_since_ns", offsetof(struct vgpu_card, held_since_ns));
    P("card.reclaim", offsetof(struct vgpu_card, reclaim));
    P("card.size", sizeof(struct vgpu_card));
    P("container.size", sizeof(struct vgpu_container_region));
    P("compute.size", sizeof(struct vgpu_compute));
    P("compute.cost_ns", K(cost_ns));
    P("compute.util_permille", K(util_permille));
    P("slot.pid", S(pid));
    P("slot.host_pid", S(host_pid));
    P("slot.attached_ns", S(attached_ns));
    P("slot.last_launch_ns", S(last_launch_ns));
    P("slot.launches", S(launches));
    P("slot.comm", S(comm));
    P("slot.used", S(used));
    P("slot.overhead", S(overhead));
    P("slot.size", sizeof(struct vgpu_slot));
    P("node.uuid", N(uuid));
    P("node.max_entries", N(max_entries));
    P("node.entry_size", N(entry_size));
    P("node.entries_offset", N(entries_offset));
    P("node.size", sizeof(struct vgpu_node_region));
    P("entry.container_id", E(container_id));
    P("entry.priority", E(priority));
    P("entry.cores_percent", E(cores_percent));
    P("entry.memory_limit", E(memory_limit));
    P("entry.memory_used", E(memory_used));
    P("entry.last_launch_ns", E(last_launch_ns));
    P("entry.held_since_ns", E(held_since_ns));
    P("entry.attached_ns", E(attached_ns));
    P("entry.reclaim", E(reclaim));
    P("entry.name", E(name));
    P("entry.size", sizeof(struct vgpu_node_entry));
    P("activity.container_id", A(container_id));
    P("activity.last_launch_ns", A(last_launch_ns));
    P("activity.launches", A(launches));
    P("activity.updated_ns", A(updated_ns));
    P("activity.used", A(used));
    P("activity.compute_burst_ns", A(compute_burst_ns));
    P("activity.size", sizeof(struct vgpu_activity));
    return 0;
}
