// All-reduce (sum) and all-gather among the ranks of one host through a shared-memory segment.
//
// The segment (created and mapped by pagoda_platform_cpu.shm_all_reduce, one per process group):
//   header  magic, a random token (attach check), world size, slot size, the initial sequence number;
//   lines   one 64-byte line per rank: its sequence counter `arrive`, the count of peers asleep on that
//           counter `sleepers`, its pid (for the liveness check) and the size / kind of its current call
//           (so ranks that disagree about a call fail instead of summing unrelated data);
//   slots   two buffers (by the parity of the sequence number) of one slot per rank, `slot_bytes` each.
//
// A round (one slot-sized chunk of a call) on rank r with sequence number s = arrive[r] + 1:
//   1. copy the chunk into slot (s & 1, r);
//   2. publish: arrive[r] = s (sequentially consistent store, a release for the copy);
//   3. wait until arrive[j] has reached s for every j (acquire loads): every slot of buffer s & 1 is full;
//   4. read every slot of the buffer: the sum in rank order 0, 1, ..., W-1, or the gathered bytes.
// Why two buffers are enough: rank r writes buffer s & 1 again in round s + 2, and it starts round s + 2
// only after step 3 of round s + 1 saw every arrive[j] >= s + 1; rank j stores arrive[j] = s + 1 after it
// finished reading buffer s & 1 in round s (program order, then release/acquire). So nobody overwrites a
// slot another rank may still read, and no "done" flag or second barrier is needed.
//
// Every rank sums the same W values of an element in the same order (rank 0 first, fp32 accumulation,
// one rounding for bf16/fp16), in the same library: the results are bitwise identical on all ranks, as
// tensor parallelism needs (each rank then computes the same next layer input).
//
// Waiting: spin for kSpinNs (the peer is usually a few microseconds behind), then sleep on a futex of the
// peer's counter. A sleeper counts itself in the peer's `sleepers` before re-checking the counter and the
// peer checks `sleepers` after its store, both sequentially consistent: either the sleeper sees the new
// count or the peer sees the sleeper and wakes it (FUTEX_WAIT itself refuses to sleep once the word has
// changed), so no wake-up is lost and a rank that publishes pays no system call when nobody sleeps.
// While asleep the waiter wakes every kCheckNs to check that the peer's process still lives: a rank that
// died (killed, crashed) turns into an error on the others instead of a hang.
//
// Sequence numbers are 32-bit and wrap; ranks are at most one round apart, so "reached" is a signed
// difference. The code is portable C++ (no intrinsics): the compiler vectorises the sums for the
// build's -march (AVX-512 or AVX2); tests also build it with -mno-avx512f.

#include <linux/futex.h>
#include <pagoda/parallel.h>
#include <pagoda/python.h>
#include <pagoda/simd.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

namespace pagoda_shm {

constexpr uint64_t kMagic = 0x31524153474150ull;  // "PAGSAR1"
constexpr int64_t kLine = 64;
constexpr int64_t kSpinNs = 20000;      // spin this long before sleeping
constexpr int64_t kCheckNs = 50000000;  // asleep, check the peer's process this often
constexpr int64_t kReduceBlock = 512;   // elements summed per block (an fp32 accumulator on the stack)

// Error codes (negative; the rank concerned is encoded so Python can name it).
constexpr int64_t kPeerDied = -1000;      // -1000 - j: rank j's process is gone
constexpr int64_t kPeerDisagrees = -2000; // -2000 - j: rank j runs another call (size or kind)
constexpr int64_t kBadSegment = -3;

struct Header {
  uint64_t magic;
  uint64_t token;
  uint32_t world;
  uint32_t initial_seq;
  uint64_t slot_bytes;
};

struct Line {
  // the current call of a round, by the round's parity (the slots' argument: a rank rewrites parity p only
  // after every peer has published the round after its last read of parity p)
  uint64_t op_bytes[2];
  uint32_t arrive;    // the last round this rank published
  uint32_t sleepers;  // peers asleep on `arrive`
  int32_t pid;
  uint32_t op_kind[2];
  char pad[kLine - 36];
};
static_assert(sizeof(Line) == kLine, "one cache line per rank");

PAGODA_INLINE int64_t header_bytes(int64_t world) {
  const int64_t raw = kLine + world * kLine;
  return (raw + 4095) / 4096 * 4096;  // slots page-aligned
}
PAGODA_INLINE Header* header(void* base) { return static_cast<Header*>(base); }
PAGODA_INLINE Line* line(void* base, int64_t rank) {
  return reinterpret_cast<Line*>(static_cast<char*>(base) + kLine + rank * kLine);
}
PAGODA_INLINE char* slot(void* base, uint32_t seq, int64_t rank) {
  const Header* h = header(base);
  const int64_t index = static_cast<int64_t>(seq & 1u) * h->world + rank;
  return static_cast<char*>(base) + header_bytes(h->world) + index * static_cast<int64_t>(h->slot_bytes);
}

PAGODA_INLINE int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000ll + ts.tv_nsec;
}

PAGODA_INLINE void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

PAGODA_INLINE bool reached(uint32_t value, uint32_t seq) { return static_cast<int32_t>(value - seq) >= 0; }

// The process is gone or a zombie (killed, not yet reaped by its parent).
bool process_alive(int32_t pid) {
  if (pid <= 0) return true;  // not attached yet: nothing to check
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return errno != ENOENT;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');  // the command name may hold spaces and parentheses
  return close == nullptr || close[1] == '\0' || close[2] != 'Z';
}

void futex_wait(uint32_t* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1000000000ll), static_cast<long>(timeout_ns % 1000000000ll)};
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

// Wait until rank j published round `seq`; 0, or kPeerDied - j.
int64_t wait_for(void* base, int64_t j, uint32_t seq) {
  Line* peer = line(base, j);
  if (reached(__atomic_load_n(&peer->arrive, __ATOMIC_ACQUIRE), seq)) return 0;
  const int64_t start = now_ns();
  do {
    for (int k = 0; k < 32; ++k) cpu_relax();
    if (reached(__atomic_load_n(&peer->arrive, __ATOMIC_ACQUIRE), seq)) return 0;
  } while (now_ns() - start < kSpinNs);
  for (;;) {
    __atomic_fetch_add(&peer->sleepers, 1u, __ATOMIC_SEQ_CST);
    const uint32_t value = __atomic_load_n(&peer->arrive, __ATOMIC_SEQ_CST);
    if (!reached(value, seq)) futex_wait(&peer->arrive, value, kCheckNs);
    __atomic_fetch_sub(&peer->sleepers, 1u, __ATOMIC_SEQ_CST);
    if (reached(__atomic_load_n(&peer->arrive, __ATOMIC_ACQUIRE), seq)) return 0;
    if (!process_alive(__atomic_load_n(&peer->pid, __ATOMIC_RELAXED))) return kPeerDied - j;
  }
}

void publish(void* base, int64_t rank, uint32_t seq) {
  Line* mine = line(base, rank);
  __atomic_store_n(&mine->arrive, seq, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&mine->sleepers, __ATOMIC_SEQ_CST) != 0) futex_wake(&mine->arrive);
}

// One round: this rank's chunk is in its slot; publish, wait for all, check they run the same call.
int64_t barrier(void* base, int64_t rank, uint32_t seq, uint32_t kind, uint64_t bytes) {
  const Header* h = header(base);
  Line* mine = line(base, rank);
  mine->op_kind[seq & 1u] = kind;  // published by the release in publish()
  mine->op_bytes[seq & 1u] = bytes;
  publish(base, rank, seq);
  for (int64_t j = 0; j < h->world; ++j) {
    if (j == rank) continue;
    const int64_t rc = wait_for(base, j, seq);
    if (rc != 0) return rc;
    const Line* peer = line(base, j);
    if (peer->op_kind[seq & 1u] != kind || peer->op_bytes[seq & 1u] != bytes) return kPeerDisagrees - j;
  }
  return 0;
}

PAGODA_INLINE float load(const float* p, int64_t i) { return p[i]; }
PAGODA_INLINE float load(const pagoda::bf16* p, int64_t i) { return static_cast<float>(p[i]); }
PAGODA_INLINE float load(const pagoda::half* p, int64_t i) { return static_cast<float>(p[i]); }

// out[i] = slot_0[i] + slot_1[i] + ... + slot_{W-1}[i] over [lo, hi), in that order, fp32, rounded once.
template <typename T>
void sum_slots(void* base, uint32_t seq, int64_t world, T* out, int64_t lo, int64_t hi) {
  float acc[kReduceBlock];
  for (int64_t b = lo; b < hi; b += kReduceBlock) {
    const int64_t n = std::min<int64_t>(kReduceBlock, hi - b);
    const T* s0 = reinterpret_cast<const T*>(slot(base, seq, 0)) + b;
    for (int64_t i = 0; i < n; ++i) acc[i] = load(s0, i);
    for (int64_t j = 1; j < world; ++j) {
      const T* sj = reinterpret_cast<const T*>(slot(base, seq, j)) + b;
      for (int64_t i = 0; i < n; ++i) acc[i] += load(sj, i);
    }
    for (int64_t i = 0; i < n; ++i) out[b + i] = T(acc[i]);
  }
}

template <typename T>
int64_t all_reduce(void* base, int64_t rank, T* data, int64_t numel, int threads) {
  const Header* h = header(base);
  const int64_t per_round = static_cast<int64_t>(h->slot_bytes) / static_cast<int64_t>(sizeof(T));
  const uint32_t kind = sizeof(T) == 4 ? 1u : (std::is_same_v<T, pagoda::bf16> ? 2u : 3u);
  for (int64_t start = 0; start < numel; start += per_round) {
    const int64_t n = std::min(per_round, numel - start);
    const uint32_t seq = __atomic_load_n(&line(base, rank)->arrive, __ATOMIC_RELAXED) + 1u;
    std::memcpy(slot(base, seq, rank), data + start, static_cast<size_t>(n) * sizeof(T));
    const int64_t rc = barrier(base, rank, seq, kind, static_cast<uint64_t>(numel));
    if (rc != 0) return rc;
    T* out = data + start;
    // elements split among threads: each element's sum keeps its order, so the result does not depend on threads
    pagoda::parallel_for(0, n, 16384, threads,
                         [&](int64_t lo, int64_t hi) { sum_slots(base, seq, h->world, out, lo, hi); });
  }
  return 0;
}

}  // namespace pagoda_shm

using namespace pagoda_shm;

PAGODA_EXPORT const char* pagoda_shm_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

PAGODA_EXPORT int64_t pagoda_shm_segment_bytes(int64_t world, int64_t slot_bytes) {
  return header_bytes(world) + 2 * world * slot_bytes;
}

// Map `bytes` of the open shared-memory file `fd` (read-write, shared); the address (an integer), or 0.
PAGODA_EXPORT int64_t pagoda_shm_map(int64_t fd, int64_t bytes) {
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, static_cast<int>(fd), 0);
  return p == MAP_FAILED ? 0 : static_cast<int64_t>(reinterpret_cast<intptr_t>(p));
}

PAGODA_EXPORT int64_t pagoda_shm_unmap(void* base, int64_t bytes) {
  return munmap(base, static_cast<size_t>(bytes)) == 0 ? 0 : -errno;
}

// The creator's set-up of a zero-filled segment, before any other rank maps it.
PAGODA_EXPORT void pagoda_shm_init(void* base, int64_t world, int64_t slot_bytes, uint64_t token, int64_t initial_seq) {
  Header* h = header(base);
  h->world = static_cast<uint32_t>(world);
  h->slot_bytes = static_cast<uint64_t>(slot_bytes);
  h->token = token;
  h->initial_seq = static_cast<uint32_t>(initial_seq);
  for (int64_t r = 0; r < world; ++r) line(base, r)->arrive = static_cast<uint32_t>(initial_seq);
  __atomic_store_n(&h->magic, kMagic, __ATOMIC_RELEASE);
}

// A rank joins: the segment must be the one the creator announced; records this rank's pid.
PAGODA_EXPORT int64_t pagoda_shm_attach(void* base, int64_t rank, int64_t world, int64_t slot_bytes, uint64_t token,
                                        int64_t pid) {
  const Header* h = header(base);
  if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != kMagic || h->token != token ||
      h->world != static_cast<uint32_t>(world) || h->slot_bytes != static_cast<uint64_t>(slot_bytes) || rank < 0 ||
      rank >= world) {
    return kBadSegment;
  }
  __atomic_store_n(&line(base, rank)->pid, static_cast<int32_t>(pid), __ATOMIC_RELEASE);
  return 0;
}

// The sequence number of rank `rank`'s last round (tests read it to see the counters wrap).
PAGODA_EXPORT int64_t pagoda_shm_sequence(void* base, int64_t rank) {
  return __atomic_load_n(&line(base, rank)->arrive, __ATOMIC_ACQUIRE);
}

// In-place sum over the ranks of `numel` elements at `data`; dtype 0 float32, 1 bfloat16, 2 float16.
// 0, or a negative code (kPeerDied - j, kPeerDisagrees - j, kBadSegment).
PAGODA_EXPORT int64_t pagoda_shm_all_reduce(void* base, int64_t rank, void* data, int64_t numel, int64_t dtype,
                                            int64_t threads) {
  const int t = static_cast<int>(std::max<int64_t>(1, threads));
  switch (dtype) {
    case 0:
      return all_reduce(base, rank, static_cast<float*>(data), numel, t);
    case 1:
      return all_reduce(base, rank, static_cast<pagoda::bf16*>(data), numel, t);
    case 2:
      return all_reduce(base, rank, static_cast<pagoda::half*>(data), numel, t);
    default:
      return kBadSegment;
  }
}

// Every rank's `bytes` at `in` into `out` ([world * bytes], rank order).
PAGODA_EXPORT int64_t pagoda_shm_all_gather(void* base, int64_t rank, const void* in, void* out, int64_t bytes) {
  const Header* h = header(base);
  const int64_t per_round = static_cast<int64_t>(h->slot_bytes);
  for (int64_t start = 0; start < bytes; start += per_round) {
    const int64_t n = std::min(per_round, bytes - start);
    const uint32_t seq = __atomic_load_n(&line(base, rank)->arrive, __ATOMIC_RELAXED) + 1u;
    std::memcpy(slot(base, seq, rank), static_cast<const char*>(in) + start, static_cast<size_t>(n));
    const int64_t rc = barrier(base, rank, seq, 4u, static_cast<uint64_t>(bytes));
    if (rc != 0) return rc;
    for (int64_t j = 0; j < h->world; ++j) {
      std::memcpy(static_cast<char*>(out) + j * bytes + start, slot(base, seq, j), static_cast<size_t>(n));
    }
  }
  return 0;
}

PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_shm_isa), PAGODA_FUNCTION(pagoda_shm_segment_bytes),
                     PAGODA_FUNCTION(pagoda_shm_map), PAGODA_FUNCTION(pagoda_shm_unmap),
                     PAGODA_FUNCTION(pagoda_shm_init), PAGODA_FUNCTION(pagoda_shm_attach),
                     PAGODA_FUNCTION(pagoda_shm_sequence), PAGODA_FUNCTION(pagoda_shm_all_reduce),
                     PAGODA_FUNCTION(pagoda_shm_all_gather))
