"""Writes a copy of the Hopper kernel header that stamps every KV-loop tile of each CTA's first
work item: per consumer warpgroup (its first thread) and tile, the clock before the K wait,
after both GEMMs are issued, when S is ready, and when P is packed, into the LSE buffer (which
this build no longer fills). Shows how the two warpgroups' GEMM and softmax phases lie against
each other. Experiment tooling, not a build option; the anchors are lines of
csrc/attention_wgmma_kernel.cuh and the script stops (AssertionError) when one has changed;
tests/test_sass.py applies it to the header in CI so that a kernel change updates it too.

    python3 scripts/make_tile_traced_kernel.py csrc/attention_wgmma_kernel.cuh   (in place, on the device)

SIDES="A B" bash scripts/device_trace_tiles.sh 4096,128,0 builds each side traced and runs
scripts/trace_wgmma_tiles.py on it.
"""
import sys

path = sys.argv[1]
src = open(path).read()


def rep(a: str, b: str) -> None:
    global src
    assert a in src, a[:80]
    src = src.replace(a, b, 1)


rep('''template <typename T, int kHeadDim, bool kCausal>
struct AttentionWgmmaKernel {''', '''__device__ __forceinline__ uint32_t tile_trace_clock() { uint32_t c; asm volatile("mov.u32 %0, %%clock;" : "=r"(c) :: "memory"); return c; }
constexpr int kTraceCtas = 32, kTraceTiles = 64;
template <typename T, int kHeadDim, bool kCausal>
struct AttentionWgmmaKernel {''')
rep('''    auto step = [&](int it, const Slot& r, const TileMask& mask, auto masked) {
      constexpr bool kMasked = decltype(masked)::value;''', '''    uint32_t* trace = (seq == 0 && threadIdx.x % 128 == 0 && blockIdx.x < kTraceCtas && p.lse != nullptr)
                          ? reinterpret_cast<uint32_t*>(p.lse) + (blockIdx.x * 2 + consumer) * kTraceTiles * 4
                          : nullptr;
    auto step = [&](int it, const Slot& r, const TileMask& mask, auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
      uint32_t* tr = trace != nullptr && it < kTraceTiles ? trace + it * 4 : nullptr;
      if (tr) tr[0] = tile_trace_clock();''')
rep('''      issue_pv(racc, pa, r.v_desc);
      const float prev_scale''', '''      issue_pv(racc, pa, r.v_desc);
      if (tr) tr[1] = tile_trace_clock();
      const float prev_scale''')
rep('''      ptx::wgmma_wait<kMasked ? 0 : 1>();  // S(it) is ready; unmasked, PV(it - 1) may still run
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) ptx::register_fence(sacc[i]);''', '''      ptx::wgmma_wait<kMasked ? 0 : 1>();  // S(it) is ready; unmasked, PV(it - 1) may still run
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) ptx::register_fence(sacc[i]);
      if (tr) tr[2] = tile_trace_clock();''')
rep('''      pack_p(x, pa);
      alpha_prev[0] = alpha[0];''', '''      pack_p(x, pa);
      if (tr) tr[3] = tile_trace_clock() | (static_cast<uint32_t>(pa[0][0]) & 0u);
      alpha_prev[0] = alpha[0];''')
rep('''      if (p.lse != nullptr && t == 0 && query < p.q_len) {''', '''      if (false) {''')
open(path, "w").write(src)
