// The SIMT emulator's runtime: fibers, the per-workgroup scheduler, synchronization checks, and
// the launcher the Rust `emu` backend calls (`hipkv_emu_launch`). See emu.h for the model.
#include "emu.h"

#include <algorithm>
#include <atomic>
#include <bitset>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define HIPKV_EMU_VALGRIND 1
#endif
#endif

// Context switch: saves the callee-saved registers of the running context on its stack, stores
// its stack pointer in *save, and resumes the context whose stack pointer is `load`. A few
// instructions, where glibc's swapcontext makes a system call for the signal mask.
extern "C" void hipkv_emu_switch(void **save, void *load);

#if defined(__x86_64__)
asm(R"(
    .text
    .globl hipkv_emu_switch
    .type hipkv_emu_switch, @function
hipkv_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size hipkv_emu_switch, .-hipkv_emu_switch
    .section .note.GNU-stack,"",@progbits
)");
#elif defined(__aarch64__)
asm(R"(
    .text
    .globl hipkv_emu_switch
    .type hipkv_emu_switch, %function
hipkv_emu_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size hipkv_emu_switch, .-hipkv_emu_switch
    .section .note.GNU-stack,"",@progbits
)");
#else
#error "the hipkv emulator has a context switch for x86-64 and aarch64 only"
#endif

namespace hipkv_emu {

thread_local WorkItem *current_item = nullptr;
thread_local Workgroup *current_group = nullptr;

namespace {

constexpr uint32_t kWave = 32;
constexpr size_t kStackBytes = 256 * 1024;
// Each fiber's stack starts at its own offset below the top of its allocation. The stacks are
// separate page-aligned allocations, so without this every fiber's hot frames would share the
// same few L1 and L2 sets and evict one another at every switch. Work-item i starts
// i * (4 KiB + 64 B) lower, modulo this span: a different 64-byte line and page for each.
constexpr size_t kStackColourBytes = 128 * 1024;
constexpr size_t kStackColourStep = 4096 + 64;
constexpr size_t kStackAllocBytes = kStackColourBytes + kStackBytes;

enum class State { Runnable, AtBarrier, AtLaneExchange, Done };

struct Fiber {
    WorkItem item;
    void *sp = nullptr;
    State state = State::Runnable;
    // Where the work-item waits: the barrier's call site, to tell apart different barriers.
    const void *site = nullptr;
    // The value published at a lane exchange, in the slot of the exchange's epoch parity: a lane
    // can publish its next value while a slower partner has still to read this one.
    float exchange[2] = {0.0f, 0.0f};
    // Lane exchanges and barriers passed: the lanes of a wave pass the same ones.
    uint32_t epoch = 0;
    char *stack = nullptr;
    unsigned valgrind_id = 0;
};

// The workgroup running on this OS thread.
struct Scheduler {
    std::vector<Fiber> fibers;
    Fiber *running = nullptr;
    void *scheduler_sp = nullptr;
    Entry entry = nullptr;
    const void *params = nullptr;
};

thread_local Scheduler *sched = nullptr;

// The line the trace counts in (`hipkv::cost::LINE_BYTES`).
constexpr uint64_t kLineBytes = 128;

// One wave-level load instruction of the workgroup running: its lanes' loads.
struct WaveLoadKey {
    uint32_t wave, epoch, occurrence;
    const void *site;
    bool operator==(const WaveLoadKey &o) const {
        return wave == o.wave && epoch == o.epoch && occurrence == o.occurrence && site == o.site;
    }
};
struct WaveLoadHash {
    size_t operator()(const WaveLoadKey &k) const {
        uint64_t h = reinterpret_cast<uintptr_t>(k.site);
        const uint64_t at = (uint64_t)k.wave << 40 | (uint64_t)k.epoch << 20 | k.occurrence;
        h = h * 0x9e3779b97f4a7c15ull ^ at;
        return (size_t)(h * 0xbf58476d1ce4e5b9ull >> 7);
    }
};
struct WaveLoad {
    uint32_t region = 0;
    std::vector<uint64_t> lines;
};

// A region's totals on one OS thread: the counts, and the bytes touched per line.
struct RegionTrace {
    hipkv_emu_load_counts counts{};
    std::unordered_map<uint64_t, std::bitset<kLineBytes>> touched;
};

}  // namespace

// The trace of one OS thread's workgroups (see emu.h).
struct LoadTracer {
    std::vector<uint64_t> regions;  // begin, end pairs
    std::vector<RegionTrace> totals;  // per region, then everything else
    std::unordered_map<WaveLoadKey, WaveLoad, WaveLoadHash> loads;  // the workgroup's
    // Per work-item: the epoch its occurrence counts are of, and the counts per site.
    std::vector<uint32_t> counted_epoch;
    std::vector<std::unordered_map<const void *, uint32_t>> occurrences;

    explicit LoadTracer(const hipkv_emu_trace &t)
        : regions(t.regions, t.regions + 2 * t.num_regions), totals(t.num_regions + 1) {}

    uint32_t region_of(uint64_t a) const {
        for (size_t r = 0; r * 2 < regions.size(); ++r)
            if (a >= regions[2 * r] && a < regions[2 * r + 1]) return (uint32_t)r;
        return (uint32_t)(regions.size() / 2);
    }

    void record(uint32_t item, uint32_t epoch, const void *site, uint64_t a, uint32_t bytes) {
        if (item >= occurrences.size()) {
            occurrences.resize(item + 1);
            counted_epoch.resize(item + 1, ~0u);
        }
        if (counted_epoch[item] != epoch) {
            occurrences[item].clear();
            counted_epoch[item] = epoch;
        }
        const uint32_t k = occurrences[item][site]++;
        WaveLoad &w = loads[WaveLoadKey{item / kWave, epoch, k, site}];
        if (w.lines.empty()) w.region = region_of(a);
        RegionTrace &t = totals[w.region];
        t.counts.lane_loads += 1;
        t.counts.bytes += bytes;
        // Each line the load spans, and its bytes in that line: one lookup per line, not byte.
        for (uint64_t b = a, end = a + bytes; b < end;) {
            const uint64_t line = b / kLineBytes;
            const uint64_t line_end = std::min(end, (line + 1) * kLineBytes);
            w.lines.push_back(line);
            std::bitset<kLineBytes> &bits = t.touched[line];
            for (; b < line_end; ++b) bits.set(b % kLineBytes);
        }
    }

    // Ends a workgroup: its wave-level loads into the totals.
    void end_workgroup() {
        // Per region, wave and epoch: the lines loaded (for `span_lines`).
        std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<uint64_t>> spans;
        for (auto &entry : loads) {
            std::vector<uint64_t> &lines = entry.second.lines;
            std::sort(lines.begin(), lines.end());
            lines.erase(std::unique(lines.begin(), lines.end()), lines.end());
            hipkv_emu_load_counts &c = totals[entry.second.region].counts;
            c.wave_loads += 1;
            c.line_reads += lines.size();
            std::vector<uint64_t> &span =
                spans[{entry.second.region, entry.first.wave, entry.first.epoch}];
            span.insert(span.end(), lines.begin(), lines.end());
        }
        for (auto &entry : spans) {
            std::vector<uint64_t> &lines = entry.second;
            std::sort(lines.begin(), lines.end());
            const uint64_t n = (uint64_t)(std::unique(lines.begin(), lines.end()) - lines.begin());
            uint64_t &most = totals[std::get<0>(entry.first)].counts.span_lines;
            most = std::max(most, n);
        }
        loads.clear();
        counted_epoch.assign(counted_epoch.size(), ~0u);
    }
};

thread_local LoadTracer *load_tracer = nullptr;

void record_load(const void *p, uint32_t bytes) {
    Fiber *f = sched->running;
    load_tracer->record(static_cast<uint32_t>(f - sched->fibers.data()), f->epoch,
                        __builtin_return_address(0), reinterpret_cast<uintptr_t>(p), bytes);
}

namespace {

// The first runnable work-item from `from` on, or null.
Fiber *first_runnable(Fiber *from) {
    Fiber *const end = sched->fibers.data() + sched->fibers.size();
    for (; from != end; ++from)
        if (from->state == State::Runnable) return from;
    return nullptr;
}

// Saves the current context in *save and runs work-item `f`.
void resume(void **save, Fiber &f) {
    sched->running = &f;
    current_item = &f.item;
    hipkv_emu_switch(save, f.sp);
}

// Suspends the running work-item and resumes the next runnable one after it, or the scheduler
// after the last: a round of the scheduler is one chain of direct switches, not a return to it
// between work-items (each switch is a mispredicted return, the emulator's main cost).
void suspend() {
    Fiber *f = sched->running;
    if (Fiber *next = first_runnable(f + 1)) {
        resume(&f->sp, *next);
    } else {
        hipkv_emu_switch(&f->sp, sched->scheduler_sp);
    }
}

[[noreturn]] void fiber_main() {
    sched->entry(sched->params);
    sched->running->state = State::Done;
    suspend();
    abort();  // a finished fiber is never resumed
}

// A fresh context for work-item `item` on `stack` that starts in fiber_main.
void *initial_sp(char *stack, uint32_t item) {
    const size_t colour = (size_t)item * kStackColourStep % kStackColourBytes;
    const uintptr_t end = reinterpret_cast<uintptr_t>(stack) + kStackAllocBytes;
    uintptr_t top = (end - colour) & ~uintptr_t(15);
    void **sp = reinterpret_cast<void **>(top);
#if defined(__x86_64__)
    *--sp = nullptr;                                         // fiber_main's return address slot
    *--sp = reinterpret_cast<void *>(&fiber_main);           // `ret` target of the switch
    for (int i = 0; i < 6; ++i) *--sp = nullptr;             // rbp rbx r12 r13 r14 r15
#else
    sp -= 22;                                                // the 176-byte save area
    for (int i = 0; i < 22; ++i) sp[i] = nullptr;
    sp[11] = reinterpret_cast<void *>(&fiber_main);          // x30 (link register)
#endif
    return sp;
}

const char *state_name(State s) {
    switch (s) {
        case State::Runnable: return "running";
        case State::AtBarrier: return "at a barrier";
        case State::AtLaneExchange: return "at a lane exchange";
        case State::Done: return "finished";
    }
    return "?";
}

// Runs one workgroup to completion; returns an empty string or what went wrong.
std::string run_workgroup(Scheduler &s, Workgroup &group, std::vector<char *> &stacks) {
    const uint32_t n = group.block_dim.x * group.block_dim.y * group.block_dim.z;
    s.fibers.assign(n, Fiber{});
    while (stacks.size() < n) stacks.push_back(static_cast<char *>(malloc(kStackAllocBytes)));
    for (uint32_t i = 0; i < n; ++i) {
        Fiber &f = s.fibers[i];
        f.item.thread_idx = {i % group.block_dim.x, (i / group.block_dim.x) % group.block_dim.y,
                             i / (group.block_dim.x * group.block_dim.y)};
        f.stack = stacks[i];
        f.sp = initial_sp(f.stack, i);
#ifdef HIPKV_EMU_VALGRIND
        f.valgrind_id = VALGRIND_STACK_REGISTER(f.stack, f.stack + kStackAllocBytes);
#endif
    }
    current_group = &group;
    std::string error;
    for (;;) {
        // One round: the first runnable work-item runs, and each one it passes on to (above).
        if (Fiber *first = first_runnable(s.fibers.data())) resume(&s.scheduler_sp, *first);
        // Every work-item is now waiting or done: release what may go on.
        uint32_t done = 0, at_barrier = 0;
        for (const Fiber &f : s.fibers) {
            done += f.state == State::Done;
            at_barrier += f.state == State::AtBarrier;
        }
        if (done == n) break;
        bool released = false;
        for (uint32_t w = 0; w * kWave < n; ++w) {
            const uint32_t lo = w * kWave, hi = lo + kWave < n ? lo + kWave : n;
            uint32_t exchanging = 0;
            for (uint32_t i = lo; i < hi; ++i)
                exchanging += s.fibers[i].state == State::AtLaneExchange;
            if (exchanging == 0) continue;
            if (exchanging != kWave) {
                for (uint32_t i = lo; i < hi; ++i)
                    if (s.fibers[i].state != State::AtLaneExchange) {
                        error = "lane exchange in wave " + std::to_string(w) + " while lane " +
                                std::to_string(i - lo) + " is " + state_name(s.fibers[i].state) +
                                " (lanes of a wave32 must exchange in lockstep)";
                        break;
                    }
                break;
            }
            for (uint32_t i = lo; i < hi; ++i) s.fibers[i].state = State::Runnable;
            released = true;
        }
        if (!error.empty()) break;
        if (released) continue;
        if (at_barrier == n) {
            const void *site = s.fibers[0].site;
            for (uint32_t i = 1; i < n; ++i)
                if (s.fibers[i].site != site) {
                    error = "work-items 0 and " + std::to_string(i) +
                            " wait at different barriers (divergent __syncthreads)";
                    break;
                }
            if (!error.empty()) break;
            for (Fiber &f : s.fibers) f.state = State::Runnable;
            continue;
        }
        for (uint32_t i = 0; i < n; ++i)
            if (s.fibers[i].state == State::Done) {
                error = "work-item " + std::to_string(i) +
                        " finished while others wait at a barrier (divergent __syncthreads)";
                break;
            }
        if (error.empty()) error = "deadlock: no work-item can proceed";
        break;
    }
#ifdef HIPKV_EMU_VALGRIND
    for (Fiber &f : s.fibers) VALGRIND_STACK_DEREGISTER(f.valgrind_id);
#endif
    current_item = nullptr;
    current_group = nullptr;
    return error;
}

struct Kernel {
    Entry entry;
    uint32_t params_size;
};

std::map<std::string, Kernel> &registry() {
    static std::map<std::string, Kernel> kernels;
    return kernels;
}

void copy_message(const std::string &msg, char *out, size_t out_len) {
    if (out_len == 0) return;
    const size_t n = msg.size() < out_len - 1 ? msg.size() : out_len - 1;
    memcpy(out, msg.data(), n);
    out[n] = '\0';
}

}  // namespace

void barrier() {
    Fiber *f = sched->running;
    f->state = State::AtBarrier;
    f->site = __builtin_return_address(0);
    f->epoch += 1;
    suspend();
}

float shfl_xor(float x, int mask) {
    Fiber *f = sched->running;
    const uint32_t id = static_cast<uint32_t>(f - sched->fibers.data());
    const uint32_t partner = (id & ~(kWave - 1)) | ((id & (kWave - 1)) ^ (uint32_t)mask);
    f->epoch += 1;
    const uint32_t slot = f->epoch & 1;
    f->exchange[slot] = x;
    f->state = State::AtLaneExchange;
    suspend();  // every lane has published its value
    // The partner writes this slot again two epochs later at the earliest, and it cannot get
    // there before this lane has reached the next exchange or barrier: this read comes first.
    return sched->fibers[partner].exchange[slot];
}

Registrar::Registrar(const char *name, Entry entry, uint32_t params_size) {
    registry()[name] = Kernel{entry, params_size};
}

}  // namespace hipkv_emu

using namespace hipkv_emu;

// Launches kernel `name` over `grid` workgroups of `block` work-items, `threads` workgroups at a
// time on OS threads, and returns when all are done: 0, or -1 with the reason in `err`. With a
// `trace` (else null), counts the launch's global loads into it (emu.h).
extern "C" int hipkv_emu_launch(const char *name, const void *params, uint32_t params_size,
                                const uint32_t grid[3], const uint32_t block[3],
                                uint32_t threads, const hipkv_emu_trace *trace, char *err,
                                size_t err_len) {
    auto it = registry().find(name);
    if (it == registry().end()) {
        copy_message(std::string("no kernel named ") + name + " in the emulator", err, err_len);
        return -1;
    }
    if (it->second.params_size != params_size) {
        copy_message(std::string("kernel ") + name + " takes " +
                         std::to_string(it->second.params_size) + " bytes of params, not " +
                         std::to_string(params_size),
                     err, err_len);
        return -1;
    }
    const uint64_t groups = (uint64_t)grid[0] * grid[1] * grid[2];
    const uint32_t items = block[0] * block[1] * block[2];
    if (items == 0 || items > 1024 || items % kWave != 0) {
        copy_message("workgroups must hold a positive multiple of 32 work-items, at most 1024",
                     err, err_len);
        return -1;
    }
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex error_lock;
    std::string first_error;
    const Entry entry = it->second.entry;
    // The threads' traces, merged as each thread finishes.
    std::vector<RegionTrace> traced(trace != nullptr ? trace->num_regions + 1 : 0);
    auto worker = [&]() {
        Scheduler s;
        s.entry = entry;
        s.params = params;
        sched = &s;
        std::unique_ptr<LoadTracer> tracer;
        if (trace != nullptr) tracer = std::make_unique<LoadTracer>(*trace);
        load_tracer = tracer.get();
        std::vector<char *> stacks;
        for (uint64_t g; !failed.load() && (g = next.fetch_add(1)) < groups;) {
            Workgroup group;
            group.grid_dim = {grid[0], grid[1], grid[2]};
            group.block_dim = {block[0], block[1], block[2]};
            group.block_idx = {(uint32_t)(g % grid[0]), (uint32_t)((g / grid[0]) % grid[1]),
                               (uint32_t)(g / ((uint64_t)grid[0] * grid[1]))};
            std::string e = run_workgroup(s, group, stacks);
            if (tracer != nullptr) tracer->end_workgroup();
            if (!e.empty()) {
                std::lock_guard<std::mutex> lock(error_lock);
                if (!failed.exchange(true))
                    first_error = "workgroup (" + std::to_string(group.block_idx.x) + ", " +
                                  std::to_string(group.block_idx.y) + ", " +
                                  std::to_string(group.block_idx.z) + ") of " + name + ": " + e;
            }
        }
        for (char *p : stacks) free(p);
        sched = nullptr;
        load_tracer = nullptr;
        if (tracer != nullptr) {
            std::lock_guard<std::mutex> lock(error_lock);
            for (size_t r = 0; r < traced.size(); ++r) {
                const hipkv_emu_load_counts &c = tracer->totals[r].counts;
                hipkv_emu_load_counts &t = traced[r].counts;
                t.lane_loads += c.lane_loads;
                t.wave_loads += c.wave_loads;
                t.bytes += c.bytes;
                t.line_reads += c.line_reads;
                t.span_lines = std::max(t.span_lines, c.span_lines);
                for (const auto &line : tracer->totals[r].touched) traced[r].touched[line.first] |= line.second;
            }
        }
    };
    const uint32_t n = threads == 0 ? 1 : threads;
    std::vector<std::thread> pool;
    for (uint32_t i = 1; i < n && i < groups; ++i) pool.emplace_back(worker);
    worker();
    for (std::thread &t : pool) t.join();
    for (size_t r = 0; r < traced.size(); ++r) {
        hipkv_emu_load_counts c = traced[r].counts;
        c.lines = traced[r].touched.size();
        for (const auto &line : traced[r].touched) c.unique_bytes += line.second.count();
        trace->counts[r] = c;
    }
    if (failed.load()) {
        copy_message(first_error, err, err_len);
        return -1;
    }
    return 0;
}
