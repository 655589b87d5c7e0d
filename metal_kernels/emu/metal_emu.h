// metal_emu.h: run Metal kernel bodies (MLX `mx.fast.metal_kernel` convention) as C++ on a CPU.
//
// Used by metal_kernels/emu/harness.py, which wraps a kernel body in a C++ function with the
// signature MLX would generate, compiles it with g++ (-std=c++20 -O1 -pthread) and launches it over
// the grid / threadgroup MLX would dispatch (`dispatchThreads`: non-uniform edge threadgroups).
//
// What is modelled
//  - Address spaces `device`, `constant`, `thread` (empty macros) and `threadgroup`: the harness
//    rewrites `threadgroup T name[N]...;` declarations into storage owned by the current threadgroup
//    (one copy per threadgroup, poisoned with 0xFF bytes, 32 KiB limit checked); `threadgroup` in a
//    pointer type is dropped.
//  - Concurrency: every thread of a threadgroup is a real context of its own, either a fiber
//    (ucontext, default; the scheduler runs the threads in forward, reverse or seeded random order
//    between synchronisation points, which exposes missing barriers deterministically) or an OS
//    thread (-DMETAL_EMU_OS_THREADS; true parallel execution). Threadgroups run one after another.
//  - threadgroup_barrier / simdgroup_barrier, and SIMD-group functions over 32-lane SIMD groups
//    (simd_sum/max/min/product/and/or/xor, prefix sums, shuffle, shuffle_xor/up/down/rotate,
//    broadcast, all/any/ballot). A SIMD group is 32 consecutive linear thread indices; lanes that
//    do not exist (partial groups) or have returned are inactive: reductions skip them and reading
//    their value (shuffle/broadcast) yields poison (NaN / 0x5A5A5A5A).
//  - Checks: bounds of every device/constant buffer accessed through the generated parameters (and
//    pointers derived with `auto p = buf + i`), barriers reached by a subset of the threadgroup
//    (deadlock report instead of a hang), SIMD functions called with a non-uniform operation or
//    mask/delta (divergence), threadgroup_barrier after some threads returned, outputs left
//    unwritten (the harness fills outputs with poison unless init_value is given).
//  - Types: half (IEEE binary16, every operation rounded to half), bfloat16_t (round to nearest even),
//    float2..4 / half2..4 / int2..4 / uint2..4 / short / ushort / char / uchar / bool vectors with
//    elementwise arithmetic, as_type<T>, metal:: / metal::fast:: / metal::precise:: math, atomics
//    (relaxed, GCC __atomic builtins).
//
// What is NOT modelled (see README.md)
//  - simdgroup matrix types and functions (simdgroup_float8x8, simdgroup_multiply_accumulate ...),
//    textures, samplers, quad_* functions, vector swizzles (.xy, .zyx ...), half/float literal
//    suffixes (1.0h), `threadgroup` variables with initialisers.
//  - SIMD functions inside divergent control flow (only uniform calls across the active lanes of a
//    SIMD group work; divergence is reported), and the actual reduction order of simd_sum & co. on
//    Apple GPUs (here: a pairwise tree, lane order). Kernels that need a fixed order must write the
//    shuffle_xor butterfly themselves.
//  - The memory model: device memory is coherent and sequentially consistent here; no caching,
//    no reordering of device stores across threads, no races detected on device memory.
//  - Floating point: the host compiler's IEEE single precision (no FMA contraction with
//    -ffp-contract=off); Metal's fast-math (default in MLX: safe) may contract a*b+c into fma and
//    uses approximate exp/log/divide in metal::fast. half arithmetic here rounds after every
//    operation; the GPU may keep intermediates in float.
//  - Execution width is always 32, max 1024 threads per threadgroup, 32 KiB threadgroup memory;
//    per-pipeline limits (maxTotalThreadsPerThreadgroup lower than 1024 for register-heavy kernels),
//    occupancy and timing are not modelled.
//  - Kernels that never terminate hang the emulator.
//
// cuda_emu.h maps the CUDA built-ins of the .cu twins (threadIdx, __syncthreads, __shfl_*_sync, ...)
// onto the same runtime.
#pragma once

#define METAL_EMU 1  // kernel headers pick their emulator forms of vector loads on this

#include <sys/mman.h>
#include <ucontext.h>

#include <bit>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef METAL_EMU_OS_THREADS
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#endif

#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

// ------------------------------------------------------------------------------------------------
// half and bfloat16_t
// ------------------------------------------------------------------------------------------------

struct half {
  _Float16 v;
  half() = default;
  template <class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>
  constexpr half(U x) : v(static_cast<_Float16>(static_cast<float>(x))) {}
  constexpr operator float() const { return static_cast<float>(v); }
};

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  template <class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>
  bfloat16_t(U x) : bits(from_float(static_cast<float>(x))) {}
  static uint16_t from_float(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                           // nearest even
    return uint16_t(u >> 16);
  }
  operator float() const { return std::bit_cast<float>(uint32_t(bits) << 16); }
};

typedef half float16_t;
typedef bfloat16_t bfloat;

namespace metal_emu {
template <class T>
inline constexpr bool is_small_float_v = std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>;
}

// Arithmetic on a 16-bit float type S: computed in float, rounded back to S (one rounding per op).
// Mixed with a C++ floating type the result is that type (like Metal's half + float -> float); mixed
// with an integer the integer converts to S (Metal: half + int -> half).
#define METAL_EMU_SMALL_FLOAT_OPS(S)                                                              \
  inline S operator-(S a) { return S(-float(a)); }                                                \
  inline S operator+(S a) { return a; }                                                           \
  METAL_EMU_SMALL_FLOAT_BINOP(S, +)                                                               \
  METAL_EMU_SMALL_FLOAT_BINOP(S, -)                                                               \
  METAL_EMU_SMALL_FLOAT_BINOP(S, *)                                                               \
  METAL_EMU_SMALL_FLOAT_BINOP(S, /)                                                               \
  METAL_EMU_SMALL_FLOAT_CMP(S, <)                                                                 \
  METAL_EMU_SMALL_FLOAT_CMP(S, <=)                                                                \
  METAL_EMU_SMALL_FLOAT_CMP(S, >)                                                                 \
  METAL_EMU_SMALL_FLOAT_CMP(S, >=)                                                                \
  METAL_EMU_SMALL_FLOAT_CMP(S, ==)                                                                \
  METAL_EMU_SMALL_FLOAT_CMP(S, !=)                                                                \
  inline S& operator++(S& a) { return a = S(float(a) + 1.0f); }                                   \
  inline S& operator--(S& a) { return a = S(float(a) - 1.0f); }

#define METAL_EMU_SMALL_FLOAT_BINOP(S, OP)                                                        \
  inline S operator OP(S a, S b) { return S(float(a) OP float(b)); }                              \
  template <class U, std::enable_if_t<std::is_floating_point_v<U>, int> = 0>                      \
  inline auto operator OP(S a, U b) { return U(float(a)) OP b; }                                  \
  template <class U, std::enable_if_t<std::is_floating_point_v<U>, int> = 0>                      \
  inline auto operator OP(U a, S b) { return a OP U(float(b)); }                                  \
  template <class U, std::enable_if_t<std::is_integral_v<U>, int> = 0>                            \
  inline S operator OP(S a, U b) { return a OP S(b); }                                            \
  template <class U, std::enable_if_t<std::is_integral_v<U>, int> = 0>                            \
  inline S operator OP(U a, S b) { return S(a) OP b; }                                            \
  template <class U, std::enable_if_t<std::is_arithmetic_v<U> || std::is_same_v<U, S>, int> = 0> \
  inline S& operator OP##=(S & a, U b) { return a = S(float(a) OP float(b)); }

#define METAL_EMU_SMALL_FLOAT_CMP(S, OP)                                                          \
  inline bool operator OP(S a, S b) { return float(a) OP float(b); }                              \
  template <class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>                          \
  inline bool operator OP(S a, U b) { return float(a) OP b; }                                     \
  template <class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>                          \
  inline bool operator OP(U a, S b) { return a OP float(b); }

METAL_EMU_SMALL_FLOAT_OPS(half)
METAL_EMU_SMALL_FLOAT_OPS(bfloat16_t)

// ------------------------------------------------------------------------------------------------
// vector types
// ------------------------------------------------------------------------------------------------

namespace metal_emu {

template <class T, int N>
struct vec_storage;
template <class T>
struct vec_storage<T, 2> {
  T x, y;
};
template <class T>
struct vec_storage<T, 3> {
  T x, y, z;
};
template <class T>
struct vec_storage<T, 4> {
  T x, y, z, w;
};

template <class T, int N>
struct vec : vec_storage<T, N> {
  vec() = default;
  template <class U, std::enable_if_t<std::is_arithmetic_v<U> || is_small_float_v<U>, int> = 0>
  constexpr vec(U s) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(s);
  }
  template <class... A, std::enable_if_t<(sizeof...(A) == N && N > 1), int> = 0>
  constexpr vec(A... a) {
    T vals[N] = {T(a)...};
    for (int i = 0; i < N; ++i) (*this)[i] = vals[i];
  }
  template <class U>
  explicit constexpr vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);
  }
  constexpr T& operator[](int i) {
    switch (i) {
      case 0: return this->x;
      case 1: return this->y;
      case 2: if constexpr (N > 2) return this->z; else break;
      case 3: if constexpr (N > 3) return this->w; else break;
    }
    return this->x;
  }
  constexpr const T& operator[](int i) const { return const_cast<vec&>(*this)[i]; }
};

template <class T>
struct is_vec : std::false_type {};
template <class T, int N>
struct is_vec<vec<T, N>> : std::true_type {};

#define METAL_EMU_VEC_BINOP(OP)                                                                  \
  template <class T, int N>                                                                      \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {                      \
    vec<T, N> r;                                                                                 \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]);                                          \
    return r;                                                                                    \
  }                                                                                              \
  template <class T, int N, class U, std::enable_if_t<!is_vec<U>::value, int> = 0>               \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, U b) {                                     \
    vec<T, N> r;                                                                                 \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] OP T(b));                                          \
    return r;                                                                                    \
  }                                                                                              \
  template <class T, int N, class U, std::enable_if_t<!is_vec<U>::value, int> = 0>               \
  constexpr vec<T, N> operator OP(U a, const vec<T, N>& b) {                                     \
    vec<T, N> r;                                                                                 \
    for (int i = 0; i < N; ++i) r[i] = T(T(a) OP b[i]);                                          \
    return r;                                                                                    \
  }                                                                                              \
  template <class T, int N, class U>                                                             \
  constexpr vec<T, N>& operator OP##=(vec<T, N>& a, const U& b) {                                \
    return a = a OP b;                                                                           \
  }
METAL_EMU_VEC_BINOP(+)
METAL_EMU_VEC_BINOP(-)
METAL_EMU_VEC_BINOP(*)
METAL_EMU_VEC_BINOP(/)
METAL_EMU_VEC_BINOP(%)
METAL_EMU_VEC_BINOP(&)
METAL_EMU_VEC_BINOP(|)
METAL_EMU_VEC_BINOP(^)
METAL_EMU_VEC_BINOP(<<)
METAL_EMU_VEC_BINOP(>>)
#undef METAL_EMU_VEC_BINOP

#define METAL_EMU_VEC_CMP(OP)                                                                    \
  template <class T, int N>                                                                      \
  constexpr vec<bool, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {                   \
    vec<bool, N> r;                                                                              \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i];                                             \
    return r;                                                                                    \
  }
METAL_EMU_VEC_CMP(<)
METAL_EMU_VEC_CMP(<=)
METAL_EMU_VEC_CMP(>)
METAL_EMU_VEC_CMP(>=)
METAL_EMU_VEC_CMP(==)
METAL_EMU_VEC_CMP(!=)
#undef METAL_EMU_VEC_CMP

template <class T, int N>
constexpr vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
  return r;
}

}  // namespace metal_emu

#define METAL_EMU_VEC_TYPES(T, NAME)          \
  typedef metal_emu::vec<T, 2> NAME##2;       \
  typedef metal_emu::vec<T, 3> NAME##3;       \
  typedef metal_emu::vec<T, 4> NAME##4;       \
  typedef metal_emu::vec<T, 2> packed_##NAME##2; \
  typedef metal_emu::vec<T, 3> packed_##NAME##3; \
  typedef metal_emu::vec<T, 4> packed_##NAME##4;
METAL_EMU_VEC_TYPES(float, float)
METAL_EMU_VEC_TYPES(half, half)
METAL_EMU_VEC_TYPES(int, int)
METAL_EMU_VEC_TYPES(uint, uint)
METAL_EMU_VEC_TYPES(short, short)
METAL_EMU_VEC_TYPES(ushort, ushort)
METAL_EMU_VEC_TYPES(char, char)
METAL_EMU_VEC_TYPES(uchar, uchar)
METAL_EMU_VEC_TYPES(bool, bool)
#undef METAL_EMU_VEC_TYPES

// ------------------------------------------------------------------------------------------------
// runtime: errors, thread contexts, barriers
// ------------------------------------------------------------------------------------------------

namespace metal_emu {

inline constexpr int kSimdWidth = 32;
inline constexpr int kMaxThreadsPerThreadgroup = 1024;
inline constexpr size_t kMaxThreadgroupMemory = 32768;
inline constexpr size_t kFiberStack = 256 * 1024;

// A tiny spin lock (GCC builtins): enough for the rare shared bookkeeping in OS-thread mode.
struct SpinLock {
  bool flag = false;
  void lock() {
    while (__atomic_test_and_set(&flag, __ATOMIC_ACQUIRE)) {
    }
  }
  void unlock() { __atomic_clear(&flag, __ATOMIC_RELEASE); }
};
struct Guard {
  SpinLock& l;
  explicit Guard(SpinLock& s) : l(s) { l.lock(); }
  ~Guard() { l.unlock(); }
};

struct ErrorState {
  SpinLock lock;
  char first[768];
  long count = 0;
};
inline ErrorState g_errors;

struct ThreadAttrs {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, dispatch_threads_per_threadgroup, threadgroups_per_grid;
  uint3 threads_per_grid, grid_origin;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup;
  uint thread_execution_width, thread_index_in_quadgroup, quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

// the generated launcher: calls the kernel for one thread
using Body = void (*)(void* ctx, const ThreadAttrs& a);

struct Group;

struct Barrier {
  int expected = 0;
  int arrived = 0;
  uint64_t gen = 0;
  uint64_t tag = 0;
  const char* what = "";
#ifdef METAL_EMU_OS_THREADS
  std::mutex mu;
  std::condition_variable cv;
#endif
};

struct Simd {
  Barrier bar;
  alignas(64) unsigned char slot[kSimdWidth][64];
  bool active[kSimdWidth];
};

struct TgBlock {
  const void* key;
  void* ptr;
  size_t bytes;
};

struct Thread {
  ThreadAttrs a;
  Group* group = nullptr;
  bool done = false;
  // fiber mode
  ucontext_t ctx;
  Barrier* wait_bar = nullptr;
  uint64_t wait_gen = 0;
};

struct Group {
  int n = 0;
  std::vector<Thread> threads;
  Barrier tg_bar;
  std::vector<Simd> simd;
  int exited = 0;  // accessed with __atomic builtins
  std::vector<TgBlock> tg_mem;
  size_t tg_bytes = 0;
  SpinLock lock;  // threadgroup memory allocation in OS-thread mode
  Body body = nullptr;
  void* body_ctx = nullptr;
  ucontext_t sched;
  bool aborted = false;
};

inline thread_local Thread* g_cur = nullptr;

inline void thread_desc(char* buf, size_t n) {
  if (!g_cur) {
    std::snprintf(buf, n, "host");
    return;
  }
  const auto& a = g_cur->a;
  std::snprintf(buf, n, "thread_position_in_grid=(%u,%u,%u) threadgroup=(%u,%u,%u)",
                a.thread_position_in_grid.x, a.thread_position_in_grid.y,
                a.thread_position_in_grid.z, a.threadgroup_position_in_grid.x,
                a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z);
}

inline void report(const char* fmt, ...) {
  char msg[512], where[160];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  thread_desc(where, sizeof where);
  Guard lk(g_errors.lock);
  if (g_errors.count++ == 0) std::snprintf(g_errors.first, sizeof g_errors.first, "%s [%s]", msg, where);
}

template <class T>
inline T poison() {
  T v;
  if constexpr (std::is_floating_point_v<T> || is_small_float_v<T>) {
    v = T(std::numeric_limits<float>::quiet_NaN());
  } else if constexpr (std::is_integral_v<T>) {
    v = T(0x5A5A5A5A);
  } else {
    std::memset(static_cast<void*>(&v), 0xFF, sizeof(T));
  }
  return v;
}

// --- fiber scheduling -----------------------------------------------------------------------------

inline void yield_to_scheduler() {
  Thread* t = g_cur;
  swapcontext(&t->ctx, &t->group->sched);
  g_cur = t;
}

inline void release(Barrier& b) {
  b.arrived = 0;
  ++b.gen;
#ifdef METAL_EMU_OS_THREADS
  b.cv.notify_all();
#endif
}

inline void barrier_wait(Barrier& b, uint64_t tag, const char* what) {
#ifdef METAL_EMU_OS_THREADS
  std::unique_lock<std::mutex> lk(b.mu);
#endif
  if (b.arrived == 0) {
    b.tag = tag;
    b.what = what;
  } else if (b.tag != tag) {
    report("divergent synchronisation: %s met %s (all threads of a SIMD group / threadgroup must "
           "call the same function with the same uniform arguments)",
           what, b.what);
  }
  uint64_t gen = b.gen;
  if (++b.arrived >= b.expected) {
    release(b);
    return;
  }
#ifdef METAL_EMU_OS_THREADS
  if (!b.cv.wait_for(lk, std::chrono::seconds(20), [&] { return b.gen != gen; })) {
    report("deadlock in %s: %d of %d threads arrived", what, b.arrived, b.expected);
    release(b);
  }
#else
  Thread* t = g_cur;
  t->wait_bar = &b;
  t->wait_gen = gen;
  yield_to_scheduler();
  t->wait_bar = nullptr;
#endif
}

inline void barrier_drop(Barrier& b) {
#ifdef METAL_EMU_OS_THREADS
  std::lock_guard<std::mutex> lk(b.mu);
#endif
  --b.expected;
  if (b.arrived > 0 && b.arrived >= b.expected) release(b);
}

// --- threadgroup memory --------------------------------------------------------------------------

inline void* tg_alloc(const void* key, size_t bytes) {
  Group& g = *g_cur->group;
  Guard lk(g.lock);
  for (auto& b : g.tg_mem)
    if (b.key == key) return b.ptr;
  g.tg_bytes = (g.tg_bytes + 15) / 16 * 16 + bytes;
  if (g.tg_bytes > kMaxThreadgroupMemory)
    report("threadgroup memory: %zu bytes declared, the limit is %zu", g.tg_bytes,
           kMaxThreadgroupMemory);
  size_t rounded = bytes ? (bytes + 63) / 64 * 64 : 64;
  void* p = std::aligned_alloc(64, rounded);
  std::memset(p, 0xFF, rounded);  // uninitialised on a GPU: poison it
  g.tg_mem.push_back({key, p, bytes});
  return p;
}

// --- device pointers with bounds checks ---------------------------------------------------------

template <class T>
T& sink() {
  using U = std::remove_const_t<T>;
  alignas(64) static thread_local unsigned char storage[sizeof(U) < 64 ? 64 : sizeof(U)];
  U v = poison<U>();
  std::memcpy(storage, static_cast<const void*>(&v), sizeof(U));
  return *reinterpret_cast<U*>(storage);
}

template <class T>
struct dptr {
  T* base = nullptr;
  ptrdiff_t off = 0;
  ptrdiff_t n = 0;
  const char* name = "?";

  dptr() = default;
  dptr(T* b, ptrdiff_t count, const char* nm) : base(b), off(0), n(count), name(nm) {}
  template <class U, std::enable_if_t<std::is_convertible_v<U*, T*> && !std::is_same_v<U, T>, int> = 0>
  dptr(const dptr<U>& o) : base(o.base), off(o.off), n(o.n), name(o.name) {}

  T& at(ptrdiff_t i) const {
    ptrdiff_t k = off + i;
    if (k < 0 || k >= n) {
      report("out-of-bounds access to '%s': element %td of %td", name, k, n);
      return sink<T>();
    }
    return base[k];
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  T& operator[](I i) const { return at(static_cast<ptrdiff_t>(i)); }
  T& operator*() const { return at(0); }
  T* operator->() const { return &at(0); }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr operator+(I i) const { dptr r = *this; r.off += static_cast<ptrdiff_t>(i); return r; }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr operator-(I i) const { dptr r = *this; r.off -= static_cast<ptrdiff_t>(i); return r; }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr& operator+=(I i) { off += static_cast<ptrdiff_t>(i); return *this; }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr& operator-=(I i) { off -= static_cast<ptrdiff_t>(i); return *this; }
  dptr& operator++() { ++off; return *this; }
  dptr& operator--() { --off; return *this; }
  dptr operator++(int) { dptr r = *this; ++off; return r; }
  dptr operator--(int) { dptr r = *this; --off; return r; }
  ptrdiff_t operator-(const dptr& o) const { return (base + off) - (o.base + o.off); }
  operator T*() const { return base + off; }  // escape hatch: unchecked raw pointer
};
template <class I, class T, std::enable_if_t<std::is_integral_v<I>, int> = 0>
dptr<T> operator+(I i, const dptr<T>& p) { return p + i; }

// --- SIMD-group data exchange -------------------------------------------------------------------

enum : uint64_t {
  kOpSum = 1, kOpMax, kOpMin, kOpProd, kOpAnd, kOpOr, kOpXor, kOpPrefixEx, kOpPrefixIn,
  kOpShuffle, kOpShuffleXor, kOpShuffleUp, kOpShuffleDown, kOpRotUp, kOpRotDown, kOpBroadcast,
  kOpBroadcastFirst, kOpAll, kOpAny, kOpBallot, kOpSimdBarrier, kOpPrefixExProd, kOpPrefixInProd
};

inline const char* op_name(uint64_t op) {
  static const char* names[] = {"?", "simd_sum", "simd_max", "simd_min", "simd_product",
                                "simd_and", "simd_or", "simd_xor", "simd_prefix_exclusive_sum",
                                "simd_prefix_inclusive_sum", "simd_shuffle", "simd_shuffle_xor",
                                "simd_shuffle_up", "simd_shuffle_down", "simd_shuffle_rotate_up",
                                "simd_shuffle_rotate_down", "simd_broadcast",
                                "simd_broadcast_first", "simd_all", "simd_any", "simd_ballot",
                                "simdgroup_barrier", "simd_prefix_exclusive_product",
                                "simd_prefix_inclusive_product"};
  return op < sizeof(names) / sizeof(names[0]) ? names[op] : "?";
}

// Every lane deposits its value, waits for the SIMD group, computes its result from the slots,
// and waits again so that no lane overwrites a slot another lane still reads.
template <class T, class F>
T simd_exchange(const T& v, uint64_t op, uint64_t uniform_arg, F&& compute) {
  static_assert(sizeof(T) <= 64, "SIMD-group value too large for the emulator");
  Thread* t = g_cur;
  Simd& s = t->group->simd[t->a.simdgroup_index_in_threadgroup];
  uint lane = t->a.thread_index_in_simdgroup;
  std::memcpy(s.slot[lane], static_cast<const void*>(&v), sizeof(T));
  uint64_t tag = op * 0x100000001ull + uniform_arg;
  barrier_wait(s.bar, tag, op_name(op));
  auto get = [&](int l) -> T {
    if (l < 0 || l >= kSimdWidth || !s.active[l]) return poison<T>();
    T r;
    std::memcpy(static_cast<void*>(&r), s.slot[l], sizeof(T));
    return r;
  };
  T r = compute(get, (int)lane, s.active);
  barrier_wait(s.bar, tag, op_name(op));
  return r;
}

// pairwise tree over lane order (what a shuffle_xor 1,2,4,8,16 butterfly computes)
template <class T, class G, class Op>
T tree_reduce(G& get, const bool* active, Op op) {
  T vals[kSimdWidth];
  bool has[kSimdWidth];
  for (int l = 0; l < kSimdWidth; ++l) {
    has[l] = active[l];
    if (has[l]) vals[l] = get(l);
  }
  for (int step = 1; step < kSimdWidth; step *= 2) {
    for (int l = 0; l + step < kSimdWidth; l += 2 * step) {
      if (has[l] && has[l + step]) {
        vals[l] = op(vals[l], vals[l + step]);
      } else if (has[l + step]) {
        vals[l] = vals[l + step];
        has[l] = true;
      }
    }
  }
  return has[0] ? vals[0] : poison<T>();
}

// --- launch ----------------------------------------------------------------------------------------

enum Schedule { kForward = 0, kReverse = 1, kRandom = 2 };

inline void finish_thread(Thread* t) {
  Group& g = *t->group;
  __atomic_add_fetch(&g.exited, 1, __ATOMIC_SEQ_CST);
  Simd& s = g.simd[t->a.simdgroup_index_in_threadgroup];
  s.active[t->a.thread_index_in_simdgroup] = false;
  barrier_drop(s.bar);
  if (int waiting = __atomic_load_n(&g.tg_bar.arrived, __ATOMIC_SEQ_CST); waiting > 0)
    report("a thread returned while %d thread(s) wait at threadgroup_barrier", waiting);
  barrier_drop(g.tg_bar);
  t->done = true;
}

inline void fiber_entry() {
  Thread* t = g_cur;
  t->group->body(t->group->body_ctx, t->a);
  finish_thread(t);
  swapcontext(&t->ctx, &t->group->sched);
}

struct Stacks {
  char* mem = nullptr;
  size_t bytes = 0;
  explicit Stacks(int n) : bytes(size_t(n) * kFiberStack) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    mem = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  ~Stacks() {
    if (mem) munmap(mem, bytes);
  }
};

inline uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline void run_group_fibers(Group& g, Stacks& stacks, int schedule, uint64_t& rng) {
  for (int i = 0; i < g.n; ++i) {
    Thread& t = g.threads[i];
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = stacks.mem + size_t(i) * kFiberStack;
    t.ctx.uc_stack.ss_size = kFiberStack;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, fiber_entry, 0);
  }
  std::vector<int> order(g.n);
  for (int i = 0; i < g.n; ++i) order[i] = schedule == kReverse ? g.n - 1 - i : i;
  int alive = g.n;
  while (alive > 0) {
    if (schedule == kRandom) {
      for (int i = g.n - 1; i > 0; --i) std::swap(order[i], order[splitmix64(rng) % uint64_t(i + 1)]);
    }
    bool progress = false;
    for (int i : order) {
      Thread& t = g.threads[i];
      if (t.done) continue;
      if (t.wait_bar && t.wait_bar->gen == t.wait_gen) continue;  // still blocked
      progress = true;
      g_cur = &t;
      swapcontext(&g.sched, &t.ctx);
      g_cur = nullptr;
      if (t.done) --alive;
    }
    if (!progress) {
      int at_tg = 0, at_simd = 0;
      for (auto& t : g.threads) {
        if (t.done) continue;
        (t.wait_bar == &g.tg_bar ? at_tg : at_simd)++;
      }
      report("deadlock: %d threads wait at threadgroup_barrier, %d at SIMD-group functions, %d "
             "returned (barrier or SIMD function in divergent control flow?)",
             at_tg, at_simd, g.exited);
      g.aborted = true;
      return;
    }
  }
}

#ifdef METAL_EMU_OS_THREADS
inline void run_group_threads(Group& g) {
  std::vector<std::thread> ts;
  ts.reserve(g.n);
  for (int i = 0; i < g.n; ++i) {
    ts.emplace_back([&g, i] {
      Thread* t = &g.threads[i];
      g_cur = t;
      g.body(g.body_ctx, t->a);
      finish_thread(t);
      g_cur = nullptr;
    });
  }
  for (auto& t : ts) t.join();
}
#endif

inline long long min_ll(long long a, long long b) { return a < b ? a : b; }

// grid and threadgroup sizes as MLX passes them: grid counts threads; the threadgroup is clipped to
// the grid per dimension; edge threadgroups may be partial (non-uniform dispatch).
inline int launch(const long long* grid_in, const long long* tg_in, int schedule, uint64_t seed,
                  Body body, void* body_ctx, char* err, size_t errlen) {
  {
    Guard lk(g_errors.lock);
    g_errors.first[0] = 0;
    g_errors.count = 0;
  }
  long long grid[3], tg[3], ngroups[3];
  for (int d = 0; d < 3; ++d) {
    grid[d] = grid_in[d];
    tg[d] = min_ll(tg_in[d], grid_in[d]);
    if (grid[d] <= 0 || tg[d] <= 0) {
      std::snprintf(err, errlen, "grid and threadgroup sizes must be positive");
      return 1;
    }
    ngroups[d] = (grid[d] + tg[d] - 1) / tg[d];
  }
  long long tg_total = tg[0] * tg[1] * tg[2];
  if (tg_total > kMaxThreadsPerThreadgroup) {
    std::snprintf(err, errlen, "threadgroup of %lld threads exceeds %d", tg_total,
                  kMaxThreadsPerThreadgroup);
    return 1;
  }
#ifndef METAL_EMU_OS_THREADS
  Stacks stacks{int(tg_total)};
  if (!stacks.mem) {
    std::snprintf(err, errlen, "could not allocate fiber stacks");
    return 1;
  }
#endif
  uint64_t rng = seed;
  bool aborted = false;
  for (long long gz = 0; gz < ngroups[2] && !aborted; ++gz)
    for (long long gy = 0; gy < ngroups[1] && !aborted; ++gy)
      for (long long gx = 0; gx < ngroups[0] && !aborted; ++gx) {
        long long gpos[3] = {gx, gy, gz};
        uint dims[3];
        for (int d = 0; d < 3; ++d) dims[d] = uint(min_ll(tg[d], grid[d] - gpos[d] * tg[d]));
        Group g;
        g.n = int(dims[0] * dims[1] * dims[2]);
        g.body = body;
        g.body_ctx = body_ctx;
        g.threads.resize(g.n);
        int nsimd = (g.n + kSimdWidth - 1) / kSimdWidth;
        g.simd = std::vector<Simd>(nsimd);
        g.tg_bar.expected = g.n;
        for (int s = 0; s < nsimd; ++s) {
          int left = g.n - s * kSimdWidth;
          g.simd[s].bar.expected = left < kSimdWidth ? left : kSimdWidth;
          for (int l = 0; l < kSimdWidth; ++l) g.simd[s].active[l] = s * kSimdWidth + l < g.n;
        }
        uint dsg = uint((tg_total + kSimdWidth - 1) / kSimdWidth);
        for (int i = 0; i < g.n; ++i) {
          ThreadAttrs& a = g.threads[i].a;
          g.threads[i].group = &g;
          uint lx = uint(i) % dims[0], ly = (uint(i) / dims[0]) % dims[1],
               lz = uint(i) / (dims[0] * dims[1]);
          a.thread_position_in_threadgroup = uint3(lx, ly, lz);
          a.threadgroup_position_in_grid = uint3(uint(gx), uint(gy), uint(gz));
          a.thread_position_in_grid =
              uint3(uint(gx * tg[0] + lx), uint(gy * tg[1] + ly), uint(gz * tg[2] + lz));
          a.threads_per_threadgroup = uint3(dims[0], dims[1], dims[2]);
          a.dispatch_threads_per_threadgroup = uint3(uint(tg[0]), uint(tg[1]), uint(tg[2]));
          a.threadgroups_per_grid = uint3(uint(ngroups[0]), uint(ngroups[1]), uint(ngroups[2]));
          a.threads_per_grid = uint3(uint(grid[0]), uint(grid[1]), uint(grid[2]));
          a.grid_origin = uint3(0u);
          a.thread_index_in_threadgroup = uint(i);
          a.thread_index_in_simdgroup = uint(i) % kSimdWidth;
          a.simdgroup_index_in_threadgroup = uint(i) / kSimdWidth;
          a.simdgroups_per_threadgroup = uint(nsimd);
          a.dispatch_simdgroups_per_threadgroup = dsg;
          a.threads_per_simdgroup = kSimdWidth;
          a.thread_execution_width = kSimdWidth;
          a.thread_index_in_quadgroup = uint(i) % 4;
          a.quadgroup_index_in_threadgroup = uint(i) / 4;
          a.quadgroups_per_threadgroup = uint((g.n + 3) / 4);
          a.dispatch_quadgroups_per_threadgroup = uint((tg_total + 3) / 4);
        }
#ifdef METAL_EMU_OS_THREADS
        (void)schedule;
        (void)rng;
        run_group_threads(g);
#else
        run_group_fibers(g, stacks, schedule, rng);
#endif
        for (auto& b : g.tg_mem) std::free(b.ptr);
        aborted = g.aborted;
      }
  Guard lk(g_errors.lock);
  if (g_errors.count) {
    std::snprintf(err, errlen, "%s (%ld error(s))", g_errors.first, g_errors.count);
    return 1;
  }
  return 0;
}

}  // namespace metal_emu

// ------------------------------------------------------------------------------------------------
// the metal:: namespace: math, synchronisation, SIMD-group functions, atomics
// ------------------------------------------------------------------------------------------------

namespace metal {

using metal_emu::vec;

template <class T>
using numeric_limits = std::numeric_limits<T>;

enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none) {
  metal_emu::Thread* t = metal_emu::g_cur;
  if (int ex = __atomic_load_n(&t->group->exited, __ATOMIC_SEQ_CST); ex > 0)
    metal_emu::report("threadgroup_barrier reached after %d thread(s) of the threadgroup returned",
                      ex);
  metal_emu::barrier_wait(t->group->tg_bar, 0, "threadgroup_barrier");
}
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none) {
  metal_emu::simd_exchange(0, metal_emu::kOpSimdBarrier, 0,
                           [](auto&, int, const bool*) { return 0; });
}

// --- math (templates so that an exact non-template overload from the C library wins ties) ------

namespace detail {
template <class T>
using F = std::conditional_t<std::is_floating_point_v<T>, T, float>;
template <class T, class Fn>
inline T map1(T x, Fn fn) {
  if constexpr (metal_emu::is_vec<T>::value) {
    T r;
    for (int i = 0; i < int(sizeof(T) / sizeof(r[0])); ++i) r[i] = map1(x[i], fn);
    return r;
  } else {
    return T(fn(F<T>(x)));
  }
}
template <class T, class Fn>
inline T map2(T x, T y, Fn fn) {
  if constexpr (metal_emu::is_vec<T>::value) {
    T r;
    for (int i = 0; i < int(sizeof(T) / sizeof(r[0])); ++i) r[i] = map2(x[i], y[i], fn);
    return r;
  } else {
    return T(fn(F<T>(x), F<T>(y)));
  }
}
}  // namespace detail

#define METAL_EMU_MATH1(NAME, EXPR)                                                    \
  template <class T>                                                                   \
  inline T NAME(T x) {                                                                 \
    return detail::map1(x, [](auto v) { return EXPR; });                               \
  }
#define METAL_EMU_MATH_ALL1                                  \
  METAL_EMU_MATH1(exp, std::exp(v))                          \
  METAL_EMU_MATH1(exp2, std::exp2(v))                        \
  METAL_EMU_MATH1(exp10, std::pow(decltype(v)(10), v))       \
  METAL_EMU_MATH1(log, std::log(v))                          \
  METAL_EMU_MATH1(log2, std::log2(v))                        \
  METAL_EMU_MATH1(log10, std::log10(v))                      \
  METAL_EMU_MATH1(sqrt, std::sqrt(v))                        \
  METAL_EMU_MATH1(rsqrt, decltype(v)(1) / std::sqrt(v))      \
  METAL_EMU_MATH1(sin, std::sin(v))                          \
  METAL_EMU_MATH1(cos, std::cos(v))                          \
  METAL_EMU_MATH1(tan, std::tan(v))                          \
  METAL_EMU_MATH1(tanh, std::tanh(v))                        \
  METAL_EMU_MATH1(floor, std::floor(v))                      \
  METAL_EMU_MATH1(ceil, std::ceil(v))                        \
  METAL_EMU_MATH1(round, std::round(v))                      \
  METAL_EMU_MATH1(rint, std::rint(v))                        \
  METAL_EMU_MATH1(trunc, std::trunc(v))                      \
  METAL_EMU_MATH1(fabs, std::fabs(v))                        \
  METAL_EMU_MATH1(erf, std::erf(v))                          \
  METAL_EMU_MATH1(log1p, std::log1p(v))                      \
  METAL_EMU_MATH1(expm1, std::expm1(v))                      \
  METAL_EMU_MATH1(saturate, v < decltype(v)(0) ? decltype(v)(0) : (v > decltype(v)(1) ? decltype(v)(1) : v))

METAL_EMU_MATH_ALL1
template <class T>
inline T pow(T x, T y) { return detail::map2(x, y, [](auto a, auto b) { return std::pow(a, b); }); }
template <class T>
inline T powr(T x, T y) { return pow(x, y); }
template <class T>
inline T fmax(T x, T y) { return detail::map2(x, y, [](auto a, auto b) { return std::fmax(a, b); }); }
template <class T>
inline T fmin(T x, T y) { return detail::map2(x, y, [](auto a, auto b) { return std::fmin(a, b); }); }
template <class T>
inline T fmod(T x, T y) { return detail::map2(x, y, [](auto a, auto b) { return std::fmod(a, b); }); }
template <class T>
inline T copysign(T x, T y) {
  return detail::map2(x, y, [](auto a, auto b) { return std::copysign(a, b); });
}
template <class T>
inline T divide(T x, T y) { return x / y; }

namespace fast {
METAL_EMU_MATH_ALL1
using metal::copysign;
using metal::divide;
using metal::fmax;
using metal::fmin;
using metal::pow;
using metal::powr;
}  // namespace fast
namespace precise {
METAL_EMU_MATH_ALL1
using metal::copysign;
using metal::divide;
using metal::fmax;
using metal::fmin;
using metal::pow;
using metal::powr;
}  // namespace precise
#undef METAL_EMU_MATH_ALL1
#undef METAL_EMU_MATH1

template <class T>
inline T abs(T x) {
  if constexpr (metal_emu::is_vec<T>::value) {
    return detail::map1(x, [](auto v) { return v < 0 ? -v : v; });
  } else if constexpr (std::is_integral_v<T>) {
    return x < 0 ? T(-x) : x;
  } else {
    return T(std::fabs(float(x)));
  }
}
template <class T>
inline T max(T a, T b) {
  if constexpr (metal_emu::is_vec<T>::value) {
    T r;
    for (int i = 0; i < int(sizeof(T) / sizeof(r[0])); ++i) r[i] = max(a[i], b[i]);
    return r;
  } else if constexpr (std::is_integral_v<T>) {
    return a > b ? a : b;
  } else {
    return T(std::fmax(float(a), float(b)));
  }
}
template <class T>
inline T min(T a, T b) {
  if constexpr (metal_emu::is_vec<T>::value) {
    T r;
    for (int i = 0; i < int(sizeof(T) / sizeof(r[0])); ++i) r[i] = min(a[i], b[i]);
    return r;
  } else if constexpr (std::is_integral_v<T>) {
    return a < b ? a : b;
  } else {
    return T(std::fmin(float(a), float(b)));
  }
}
template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T>
inline T fma(T a, T b, T c) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) return std::fma(a, b, c);
  else return T(std::fma(float(a), float(b), float(c)));
}
template <class T>
inline T mix(T x, T y, T a) { return x + (y - x) * a; }
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T>
inline bool isnan(T x) { return std::isnan(float(x)); }
template <class T>
inline bool isinf(T x) { return std::isinf(float(x)); }
template <class T>
inline bool isfinite(T x) { return std::isfinite(float(x)); }
template <class T>
inline bool signbit(T x) { return std::signbit(float(x)); }

template <class To, class From>
inline To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
  To r;
  std::memcpy(static_cast<void*>(&r), static_cast<const void*>(&x), sizeof(To));
  return r;
}

// --- SIMD-group functions -------------------------------------------------------------------------

template <class T>
inline T simd_sum(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpSum, 0, [](auto& get, int, const bool* act) {
    return metal_emu::tree_reduce<T>(get, act, [](T a, T b) { return T(a + b); });
  });
}
template <class T>
inline T simd_product(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpProd, 0, [](auto& get, int, const bool* act) {
    return metal_emu::tree_reduce<T>(get, act, [](T a, T b) { return T(a * b); });
  });
}
template <class T>
inline T simd_max(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpMax, 0, [](auto& get, int, const bool* act) {
    return metal_emu::tree_reduce<T>(get, act, [](T a, T b) { return metal::max(a, b); });
  });
}
template <class T>
inline T simd_min(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpMin, 0, [](auto& get, int, const bool* act) {
    return metal_emu::tree_reduce<T>(get, act, [](T a, T b) { return metal::min(a, b); });
  });
}
template <class T>
inline T simd_and(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpAnd, 0, [](auto& get, int, const bool* act) {
    return metal_emu::tree_reduce<T>(get, act, [](T a, T b) { return T(a & b); });
  });
}
template <class T>
inline T simd_or(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpOr, 0, [](auto& get, int, const bool* act) {
    return metal_emu::tree_reduce<T>(get, act, [](T a, T b) { return T(a | b); });
  });
}
template <class T>
inline T simd_xor(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpXor, 0, [](auto& get, int, const bool* act) {
    return metal_emu::tree_reduce<T>(get, act, [](T a, T b) { return T(a ^ b); });
  });
}
template <class T>
inline T simd_prefix_exclusive_sum(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpPrefixEx, 0,
                                  [](auto& get, int lane, const bool* act) {
                                    T acc = T(0);
                                    for (int l = 0; l < lane; ++l)
                                      if (act[l]) acc = T(acc + get(l));
                                    return acc;
                                  });
}
template <class T>
inline T simd_prefix_inclusive_sum(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpPrefixIn, 0,
                                  [](auto& get, int lane, const bool* act) {
                                    T acc = T(0);
                                    for (int l = 0; l <= lane; ++l)
                                      if (act[l]) acc = T(acc + get(l));
                                    return acc;
                                  });
}
template <class T>
inline T simd_prefix_exclusive_product(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpPrefixExProd, 0,
                                  [](auto& get, int lane, const bool* act) {
                                    T acc = T(1);
                                    for (int l = 0; l < lane; ++l)
                                      if (act[l]) acc = T(acc * get(l));
                                    return acc;
                                  });
}
template <class T>
inline T simd_prefix_inclusive_product(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpPrefixInProd, 0,
                                  [](auto& get, int lane, const bool* act) {
                                    T acc = T(1);
                                    for (int l = 0; l <= lane; ++l)
                                      if (act[l]) acc = T(acc * get(l));
                                    return acc;
                                  });
}
template <class T, class I>
inline T simd_shuffle(T x, I src) {
  int s = int(src);
  return metal_emu::simd_exchange(x, metal_emu::kOpShuffle, 0,
                                  [s](auto& get, int, const bool*) { return get(s); });
}
template <class T, class I>
inline T simd_broadcast(T x, I src) {
  int s = int(src);
  return metal_emu::simd_exchange(x, metal_emu::kOpBroadcast, uint64_t(s),
                                  [s](auto& get, int, const bool*) { return get(s); });
}
template <class T>
inline T simd_broadcast_first(T x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpBroadcastFirst, 0,
                                  [](auto& get, int, const bool* act) {
                                    for (int l = 0; l < metal_emu::kSimdWidth; ++l)
                                      if (act[l]) return get(l);
                                    return metal_emu::poison<T>();
                                  });
}
template <class T, class I>
inline T simd_shuffle_xor(T x, I mask) {
  int m = int(mask);
  return metal_emu::simd_exchange(x, metal_emu::kOpShuffleXor, uint64_t(m),
                                  [m](auto& get, int lane, const bool*) { return get(lane ^ m); });
}
template <class T, class I>
inline T simd_shuffle_down(T x, I delta) {
  int d = int(delta);
  return metal_emu::simd_exchange(x, metal_emu::kOpShuffleDown, uint64_t(d),
                                  [d, x](auto& get, int lane, const bool*) {
                                    return lane + d < metal_emu::kSimdWidth ? get(lane + d) : x;
                                  });
}
template <class T, class I>
inline T simd_shuffle_up(T x, I delta) {
  int d = int(delta);
  return metal_emu::simd_exchange(x, metal_emu::kOpShuffleUp, uint64_t(d),
                                  [d, x](auto& get, int lane, const bool*) {
                                    return lane - d >= 0 ? get(lane - d) : x;
                                  });
}
template <class T, class I>
inline T simd_shuffle_rotate_down(T x, I delta) {
  int d = int(delta);
  return metal_emu::simd_exchange(x, metal_emu::kOpRotDown, uint64_t(d),
                                  [d](auto& get, int lane, const bool*) {
                                    return get((lane + d) % metal_emu::kSimdWidth);
                                  });
}
template <class T, class I>
inline T simd_shuffle_rotate_up(T x, I delta) {
  int d = int(delta);
  return metal_emu::simd_exchange(
      x, metal_emu::kOpRotUp, uint64_t(d), [d](auto& get, int lane, const bool*) {
        return get(((lane - d) % metal_emu::kSimdWidth + metal_emu::kSimdWidth) %
                   metal_emu::kSimdWidth);
      });
}
inline bool simd_all(bool x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpAll, 0, [](auto& get, int, const bool* act) {
    for (int l = 0; l < metal_emu::kSimdWidth; ++l)
      if (act[l] && !get(l)) return false;
    return true;
  });
}
inline bool simd_any(bool x) {
  return metal_emu::simd_exchange(x, metal_emu::kOpAny, 0, [](auto& get, int, const bool* act) {
    for (int l = 0; l < metal_emu::kSimdWidth; ++l)
      if (act[l] && get(l)) return true;
    return false;
  });
}
struct simd_vote {
  using vote_t = ulong;
  vote_t v = 0;
  explicit operator vote_t() const { return v; }
  bool all() const { return v == ~vote_t(0) >> (64 - metal_emu::kSimdWidth); }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool x) {
  ulong bits = metal_emu::simd_exchange(
      ulong(x), metal_emu::kOpBallot, 0, [](auto& get, int, const bool* act) {
        ulong r = 0;
        for (int l = 0; l < metal_emu::kSimdWidth; ++l)
          if (act[l] && get(l)) r |= ulong(1) << l;
        return r;
      });
  simd_vote v;
  v.v = bits;
  return v;
}

// --- atomics (relaxed) ----------------------------------------------------------------------------

enum memory_order { memory_order_relaxed = 0 };
template <class T>
struct atomic {
  T v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;

namespace detail {
template <class T>
inline atomic<T>* raw(atomic<T>* p) { return p; }
template <class T>
inline atomic<T>* raw(const metal_emu::dptr<atomic<T>>& p) { return &p.at(0); }
template <class P>
using atomic_value_t = std::remove_reference_t<decltype(raw(std::declval<P>())->v)>;
}  // namespace detail

template <class P, class U>
inline auto atomic_fetch_add_explicit(P obj, U val, memory_order) {
  using T = detail::atomic_value_t<P>;
  T* p = &detail::raw(obj)->v;
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(p, T(val), __ATOMIC_RELAXED);
  } else {
    T old;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    while (true) {
      T next = T(old + T(val));
      if (__atomic_compare_exchange(p, &old, &next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) break;
    }
    return old;
  }
}
template <class P, class U>
inline auto atomic_fetch_sub_explicit(P obj, U val, memory_order o) {
  using T = detail::atomic_value_t<P>;
  return atomic_fetch_add_explicit(obj, T(-T(val)), o);
}
template <class P, class U>
inline auto atomic_fetch_max_explicit(P obj, U val, memory_order) {
  using T = detail::atomic_value_t<P>;
  T* p = &detail::raw(obj)->v;
  T old;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  T v = T(val);
  while (old < v && !__atomic_compare_exchange(p, &old, &v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <class P, class U>
inline auto atomic_fetch_min_explicit(P obj, U val, memory_order) {
  using T = detail::atomic_value_t<P>;
  T* p = &detail::raw(obj)->v;
  T old;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  T v = T(val);
  while (old > v && !__atomic_compare_exchange(p, &old, &v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <class P>
inline auto atomic_load_explicit(P obj, memory_order) {
  using T = detail::atomic_value_t<P>;
  T r;
  __atomic_load(&detail::raw(obj)->v, &r, __ATOMIC_RELAXED);
  return r;
}
template <class P, class U>
inline void atomic_store_explicit(P obj, U val, memory_order) {
  using T = detail::atomic_value_t<P>;
  T v = T(val);
  __atomic_store(&detail::raw(obj)->v, &v, __ATOMIC_RELAXED);
}

}  // namespace metal

using namespace metal;

// Threadgroup storage: `threadgroup T name[N][M];` is rewritten by the harness into
// METAL_EMU_TG_DECL(T, name, [N][M]): one block per threadgroup, shared by its threads.
#define METAL_EMU_TG_DECL(T, NAME, DIMS)                                                        \
  typedef T metal_emu_tg_type_##NAME DIMS;                                                      \
  static const char metal_emu_tg_key_##NAME = 0;                                                \
  auto& NAME = *static_cast<metal_emu_tg_type_##NAME*>(                                         \
      metal_emu::tg_alloc(&metal_emu_tg_key_##NAME, sizeof(metal_emu_tg_type_##NAME)))

// Address-space qualifiers for kernel code. The generated launcher #undefs them after the kernel.
#define device
#define constant
#define thread
#define threadgroup
