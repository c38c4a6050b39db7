"""Writes a traced copy of the Hopper kernel header: clock stamps per work item (Q wait, Q
quantization, Q staging + barrier, first K wait, tile 0, the KV loop with its barrier waits, the
last tile + PV, the epilogue) into the LSE buffer, which the traced build no longer fills.
Experiment tooling, not a build option: the anchors below are lines of
csrc/attention_wgmma_kernel.cuh and the script stops (AssertionError) when one has changed;
tests/test_sass.py applies it to the header in CI so that a kernel change updates it too.

    python3 scripts/make_traced_kernel.py csrc/attention_wgmma_kernel.cuh   (in place, on the device)

scripts/device_trace_wgmma.sh runs it, builds, and prints scripts/trace_wgmma.py's breakdown.
"""
import sys
f=sys.argv[1]
s=open(f).read()
def rep(a,b):
    global s
    assert a in s, a[:80]
    s=s.replace(a,b,1)
rep('''template <typename T, int kHeadDim, bool kCausal>
struct AttentionWgmmaKernel {''','''__device__ __forceinline__ uint32_t trace_clock() { uint32_t c; asm volatile("mov.u32 %0, %%clock;" : "=r"(c)); return c; }
__device__ __forceinline__ uint32_t trace_gtimer() { uint64_t c; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(c)); return (uint32_t)c; }
constexpr int kTraceItems = 4, kTraceSlots = 16;
template <typename T, int kHeadDim, bool kCausal>
struct AttentionWgmmaKernel {''')
rep('''    uint32_t seq = 0;  // tiles consumed so far: the ring position
    while (have) {''','''    uint32_t seq = 0;  // tiles consumed so far: the ring position
    int item_no = 0;
    uint32_t* trace_base = reinterpret_cast<uint32_t*>(p.lse);
    while (have) {
      uint32_t* tr = (trace_base != nullptr && threadIdx.x % 128 == 0 && item_no < kTraceItems)
                         ? trace_base + ((static_cast<int64_t>(blockIdx.x) * 2 + consumer) * kTraceItems + item_no) * kTraceSlots
                         : nullptr;
      if (tr) { tr[8] = trace_clock(); tr[12] = trace_gtimer(); tr[0] = w.kv_tiles; tr[14] = 0xA5A50000u | item_no; }
      ++item_no;''')
rep('''      ptx::cp_async_wait<0>();
''','''      ptx::cp_async_wait<0>();
      if (tr) tr[1] = trace_clock();
''')
rep('''      if (have_next) stage_q(''','''      if (tr) tr[13] = trace_clock();
      if (have_next) stage_q(''')
rep('''      attend(p, s, w, q, seq, consumer);''','''      if (tr) tr[2] = trace_clock();
      attend(p, s, w, q, seq, consumer, tr);
      if (tr) { tr[7] = trace_clock(); tr[15] = trace_gtimer(); }''')
rep('''const QInfo& q, uint32_t seq,
                                int consumer) {''','''const QInfo& q, uint32_t seq,
                                int consumer, uint32_t* tr) {''')
rep('''    issue_qk(sacc, q_desc, ptx::kmajor_descriptor<kHeadDim>(s.k[stage0]));''','''    if (tr) tr[3] = trace_clock();
    uint32_t wait_k = 0, wait_v = 0, wait_s = 0;
    issue_qk(sacc, q_desc, ptx::kmajor_descriptor<kHeadDim>(s.k[stage0]));''')
rep('''    if (consumer == 0) ptx::named_barrier_arrive<3, 256>();  // one arrival per item, as warpgroup 1 syncs
''','''    if (consumer == 0) ptx::named_barrier_arrive<3, 256>();  // one arrival per item, as warpgroup 1 syncs
    if (tr) tr[4] = trace_clock();
''')
rep('''      ptx::mbarrier_wait(&s.full_k[stage], phase);
      // The tile's K group scale (keys 8i + 2t + {0, 1} are group t): read while QK(it) runs.
      const float early_k_scale = kEarlyKScale ? s.k_scale[stage][t] : 0.0f;
      auto k_scale = [&] { return kEarlyKScale ? early_k_scale : s.k_scale[stage][t]; };
      issue_qk(sacc, q_desc, r.k_desc);
      ptx::mbarrier_wait(&s.full_v[prev], prev_phase);
      issue_pv(racc, pa, r.v_desc);''','''      uint32_t c0 = trace_clock();
      ptx::mbarrier_wait(&s.full_k[stage], phase);
      uint32_t c1 = trace_clock();
      const float early_k_scale = kEarlyKScale ? s.k_scale[stage][t] : 0.0f;
      auto k_scale = [&] { return kEarlyKScale ? early_k_scale : s.k_scale[stage][t]; };
      issue_qk(sacc, q_desc, r.k_desc);
      uint32_t c2 = trace_clock();
      ptx::mbarrier_wait(&s.full_v[prev], prev_phase);
      uint32_t c3 = trace_clock();
      issue_pv(racc, pa, r.v_desc);
      wait_k += c1 - c0; wait_v += c3 - c2;''')
rep('''    if (last > 0) {''','''    if (tr) { tr[5] = trace_clock(); tr[9] = wait_k; tr[10] = wait_v; tr[11] = wait_s; }
    if (last > 0) {''')
rep('''      release_and_fold(stage, last_scale);
    }
''','''      release_and_fold(stage, last_scale);
    }
    if (tr) tr[6] = trace_clock();
''')
rep('''      if (p.lse != nullptr && t == 0 && query < p.q_len) {''','''      if (false) {''')
open(f,'w').write(s)
