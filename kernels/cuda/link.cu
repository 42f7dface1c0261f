// A slower host link, emulated (kernels/src/link): a reader of host memory over the link (a
// gather, HiP's search, MagicPIG's walk and attention) is launched between `link_stamp`, which
// notes when it starts, and `link_pace`, which holds the stream until the bytes it read would
// have crossed a link of the emulated rate: from its start, or from when the link finished the
// reads before it (one link, shared by the streams of a context), whichever is later.
//
// slots (one pair per stream): [0] bytes counted by the reader itself (readers whose bytes
// only the device knows add them with atomicAdd), [1] the reader's start, ns.
// link_free (one per context): when the emulated link is next free, ns.

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Also clears the count: bytes a reader counted whose pace never came (a launch that failed
// after it) are not charged to the next.
extern "C" __global__ void link_stamp(unsigned long long* slots) {
    slots[0] = 0;
    slots[1] = global_ns();
}

// A wait is never longer than this, whatever the words say (a bound, not a rate: at 0.1 GB/s,
// the slowest rate the CLI takes, it is 1 GB).
#define MAX_WAIT_NS 10000000000ull

// `known` bytes the host counted, plus what the reader counted; `ps_per_byte` picoseconds a
// byte takes on the emulated link. The link's time is reserved with a compare-and-swap, so
// readers on two streams at once queue on it rather than share it.
extern "C" __global__ void link_pace(unsigned long long* slots, unsigned long long* link_free,
                                     unsigned long long known, double ps_per_byte) {
    const unsigned long long bytes = known + atomicExch(&slots[0], 0ull);
    const unsigned long long stamp = slots[1];
    unsigned long long wait = (unsigned long long)((double)bytes * ps_per_byte / 1000.0);
    if (wait > MAX_WAIT_NS) wait = MAX_WAIT_NS;
    unsigned long long seen = atomicAdd(link_free, 0ull), was, deadline;
    do {
        was = seen;
        deadline = (stamp > was ? stamp : was) + wait;
        seen = atomicCAS(link_free, was, deadline);
    } while (seen != was);
    const unsigned long long latest = global_ns() + MAX_WAIT_NS;
    if (deadline > latest) deadline = latest;
    while (global_ns() < deadline) __nanosleep(256);
}
