// Paged-attention decode on the CPU: the Triton kernel's idea (stage 4) in C++ for a CPU's cores; below it, a
// prompt's causal attention over itself (a prefill's first chunk), which reads no cache at all.
//
// The engine's PyTorch path gathers each sequence's blocks into a contiguous copy, in every layer,
// every step, and then multiplies: the copy writes as many bytes as the cache holds for the batch
// and reads them again. Here each (sequence, KV head) pair reads its keys and values where they lie,
// block by block through the block table, and nothing is copied:
//
// * one work item per (sequence, KV head), handling all G query heads that share that KV head, so
//   each cached K/V row is loaded once for G dot products (grouped-query attention);
// * exact two-pass softmax per item: scores for every key into a small buffer, then max, exp, sum,
//   then the weighted sum of V rows; the same operations in the same order as the reference's
//   softmax(q k^T * scale) v, up to how a dot product of head_dim terms is summed;
// * ATen's parallel_for spreads the items over PyTorch's own thread pool (torch.get_num_threads()),
//   so no second pool competes with the matmuls' threads;
// * the loops walk the block table a block at a time: no division per token to find its block;
// * where the compiler targets AVX-512 (x86 with -march=native on such a CPU) and head_dim is 64 or 128,
//   an item with G <= 8 runs `item_avx512<G, NV>` (NV = head_dim / 16 vectors a row): each dot product's
//   16 lanes are summed by a shuffle tree (a running sum over the lanes is 16 dependent scalar adds), and
//   pass 2 keeps all G output rows in registers while it reads each V row once, in order. Pass 2's sums
//   keep their order (token by token, one fused multiply-add each);
// * the AVX-512 path's softmax takes 16 exponentials at a time (`exp16`, Cephes' expf, within 2 ulp of
//   std::exp) and sums them in 16 lanes: in one process on SmolLM2's shapes it took 23-27% off the kernel's
//   time against the scalar std::exp loop, whose outputs it matches to 1e-5;
// * decode attention is a stream of K/V from memory, and a block of one head (16 rows of 64 floats) is
//   one 4 KiB page, where the CPU's own prefetcher stops: while a block is read, the next block of the
//   table is prefetched row by row, so the memory's latency overlaps the arithmetic.
//
// fp32 only (the CPU's parity path); the runner keeps the PyTorch path for other dtypes.
// Layouts, as the runner stores them:
//   query        [S, H, D]                 contiguous
//   k/v store    [KVH, blocks, block_size, D]  contiguous (head-major: a block of one head is a
//                                          contiguous [block_size, D] matrix)
//   block_tables [S, W] int32, seq_lens [S] int32;   out [S, H, D]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;  // partial sums the compiler keeps in one vector register (AVX-512: 16 floats)

// q . k over d terms, in kLanes interleaved partial sums so that the loop vectorizes without
// -ffast-math (which would let the compiler reorder anything, anywhere).
inline float dot(const float* q, const float* k, int64_t d) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += q[i + j] * k[i + j];
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  for (; i < d; ++i) sum += q[i] * k[i];
  return sum;
}

// Softmax of each of the G rows of `scores` ([G, len]) in place: subtract the max, exponentiate, normalize.
inline void softmax_rows(float* scores, int64_t G, int64_t len) {
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * len;
    const float m = *std::max_element(row, row + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) sum += (row[t] = std::exp(row[t] - m));
    for (int64_t t = 0; t < len; ++t) row[t] /= sum;  // divide, as softmax does, not multiply by 1/sum
  }
}

#if defined(__AVX512F__)
// exp of 16 floats as Cephes' expf computes one: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts so that n ln2
// is exact), e^r by its degree-7 Taylor-like minimax polynomial, times 2^n by the exponent (scalef, which
// flushes far-negative x to 0 as std::exp does). Within 2 ulp of std::exp; 16 at a time instead of one.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// softmax_rows, 16 scores at a time (the last < 16 under a mask): the same max, exponentials within 2 ulp,
// a sum in 16 lanes, and the same division.
inline void softmax_rows_avx512(float* scores, int64_t G, int64_t len) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % 16)) - 1);
  const int64_t full = len - len % 16;
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * len;
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < full; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + t));
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, tail, row + full));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < full; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), mx));
      _mm512_storeu_ps(row + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + full), mx)));
    _mm512_mask_storeu_ps(row + full, tail, e);
    const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_add_ps(sum, e)));
    for (int64_t t = 0; t < full; t += 16) _mm512_storeu_ps(row + t, _mm512_div_ps(_mm512_loadu_ps(row + t), total));
    _mm512_mask_storeu_ps(row + full, tail, _mm512_div_ps(_mm512_maskz_loadu_ps(tail, row + full), total));
  }
}
#endif

// Where one work item reads: KV head `k_head`/`v_head` ([blocks, bs, D]) through the sequence's `table`.
struct Item {
  const float *q, *k_head, *v_head;  // q: the G query heads [G, D]
  const int32_t* table;
  int64_t len, bs, D;
  float scale;
  float *scores, *o;  // scores: [G, len] scratch; o: the G output heads [G, D]
};

// Calls fn(row offset, token) for every token of the item, a block at a time.
template <class Fn>
inline void for_each_row(const Item& it, Fn fn) {
  for (int64_t start = 0, b = 0; start < it.len; start += it.bs, ++b) {
    const int64_t base = static_cast<int64_t>(it.table[b]) * it.bs * it.D, n = std::min(it.bs, it.len - start);
    for (int64_t j = 0; j < n; ++j) fn(base + j * it.D, start + j);
  }
}

void item_generic(const Item& it, int64_t G) {
  const int64_t D = it.D, len = it.len;
  // Pass 1: every score; each K row serves all G query heads.
  for_each_row(it, [&](int64_t row, int64_t t) {
    for (int64_t g = 0; g < G; ++g) it.scores[g * len + t] = dot(it.q + g * D, it.k_head + row, D) * it.scale;
  });
  softmax_rows(it.scores, G, len);
  // Pass 2: the probability-weighted sum of V rows.
  std::fill(it.o, it.o + G * D, 0.f);
  for_each_row(it, [&](int64_t row, int64_t t) {
    const float* v = it.v_head + row;
    for (int64_t g = 0; g < G; ++g) {
      const float p = it.scores[g * len + t];
      float* og = it.o + g * D;
      for (int64_t d = 0; d < D; ++d) og[d] += p * v[d];
    }
  });
}

#if defined(__AVX512F__)
// for_each_row over one head's rows, prefetching: while row j of a block is handed to fn, row j of the
// table's next block is asked for (its NV cache lines), so the next page is in cache when fn gets there.
template <int NV, class Fn>
inline void for_each_row_prefetching(const Item& it, const float* head, Fn fn) {
  for (int64_t start = 0, b = 0; start < it.len; start += it.bs, ++b) {
    const int64_t base = static_cast<int64_t>(it.table[b]) * it.bs * it.D, n = std::min(it.bs, it.len - start);
    const bool more = start + it.bs < it.len;
    const float* next = head + (more ? static_cast<int64_t>(it.table[b + 1]) * it.bs * it.D : 0);
    for (int64_t j = 0; j < n; ++j) {
      if (more)
        for (int l = 0; l < NV; ++l) _mm_prefetch(reinterpret_cast<const char*>(next + j * it.D + 16 * l), _MM_HINT_T0);
      fn(base + j * it.D, start + j);
    }
  }
}

// The same item with AVX-512 registers: G query heads and head_dim = 16 * NV known at compile time.
template <int G, int NV>
void item_avx512(const Item& it) {
  constexpr int D = 16 * NV;
  const int64_t len = it.len;
  __m512 q[G][NV];
  for (int g = 0; g < G; ++g)
    for (int l = 0; l < NV; ++l) q[g][l] = _mm512_loadu_ps(it.q + g * D + 16 * l);
  for_each_row_prefetching<NV>(it, it.k_head, [&](int64_t row, int64_t t) {
    const float* k = it.k_head + row;
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int l = 0; l < NV; ++l) {  // lane j sums terms j, j+16, ...: as `dot` does
      const __m512 kv = _mm512_loadu_ps(k + 16 * l);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(q[g][l], kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) it.scores[g * len + t] = _mm512_reduce_add_ps(acc[g]) * it.scale;
  });
  softmax_rows_avx512(it.scores, G, len);
  __m512 acc[G][NV];  // the G output rows, in registers over every V row
  for (int g = 0; g < G; ++g)
    for (int l = 0; l < NV; ++l) acc[g][l] = _mm512_setzero_ps();
  for_each_row_prefetching<NV>(it, it.v_head, [&](int64_t row, int64_t t) {
    __m512 vv[NV];
    for (int l = 0; l < NV; ++l) vv[l] = _mm512_loadu_ps(it.v_head + row + 16 * l);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(it.scores[g * len + t]);
      for (int l = 0; l < NV; ++l) acc[g][l] = _mm512_fmadd_ps(p, vv[l], acc[g][l]);
    }
  });
  for (int g = 0; g < G; ++g)
    for (int l = 0; l < NV; ++l) _mm512_storeu_ps(it.o + g * D + 16 * l, acc[g][l]);
}

template <int NV>
bool run_avx512(const Item& it, int64_t G) {
  switch (G) {
    case 1: item_avx512<1, NV>(it); return true;
    case 2: item_avx512<2, NV>(it); return true;
    case 3: item_avx512<3, NV>(it); return true;
    case 4: item_avx512<4, NV>(it); return true;
    case 5: item_avx512<5, NV>(it); return true;
    case 6: item_avx512<6, NV>(it); return true;
    case 7: item_avx512<7, NV>(it); return true;
    case 8: item_avx512<8, NV>(it); return true;
    default: return false;
  }
}
#endif

// One (sequence, KV head) item, on the fastest path this build and these shapes allow.
void run_item(const Item& it, int64_t G) {
#if defined(__AVX512F__)
  if ((it.D == 64 && run_avx512<4>(it, G)) || (it.D == 128 && run_avx512<8>(it, G))) return;
#endif
  item_generic(it, G);
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& k_store, const at::Tensor& v_store,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_store.dim() == 4 && v_store.sizes() == k_store.sizes(),
              "paged_decode: query [S, H, D], stores [KVH, blocks, block_size, D]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_store.scalar_type() == at::kFloat &&
                  v_store.scalar_type() == at::kFloat, "paged_decode: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: block_tables and seq_lens are int32");
  TORCH_CHECK(query.is_contiguous() && k_store.is_contiguous() && v_store.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(), "paged_decode: contiguous inputs");
  const int64_t S = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = k_store.size(0), num_blocks = k_store.size(1), bs = k_store.size(2);
  const int64_t W = block_tables.size(1);
  TORCH_CHECK(k_store.size(3) == D && H % KVH == 0 && block_tables.size(0) == S && seq_lens.size(0) == S,
              "paged_decode: shapes disagree");
  const int64_t G = H / KVH;
  auto out = at::empty_like(query);
  const float* q_all = query.data_ptr<float>();
  const float* k_all = k_store.data_ptr<float>();
  const float* v_all = v_store.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* out_all = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // Checked here, before the threads start: every block a sequence will read lies in the pool.
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= 1 && (lens[s] + bs - 1) / bs <= W, "paged_decode: sequence ", s, " has length ",
                lens[s], ", which its ", W, "-block table cannot hold");
    for (int64_t b = 0; b < (lens[s] + bs - 1) / bs; ++b)
      TORCH_CHECK(tables[s * W + b] >= 0 && tables[s * W + b] < num_blocks, "paged_decode: sequence ", s,
                  " reads block ", tables[s * W + b], ", outside the pool of ", num_blocks);
  }

  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, h = item % KVH, len = lens[s];
      scores.resize(G * len);
      // The G query heads reading KV head h, and where their outputs go.
      const Item it{q_all + (s * H + h * G) * D, k_all + h * num_blocks * bs * D, v_all + h * num_blocks * bs * D,
                    tables + s * W, len, bs, D, fscale, scores.data(), out_all + (s * H + h * G) * D};
      run_item(it, G);
    }
  });
  return out;
}

// -- Prompt attention: a prompt's first chunk attends to itself, causally ------------------------------
//
// The same attention for T query positions at once, with nothing cached before them (a prefill's first
// chunk; the runner's `fresh`): out[i] = softmax(q[i] k[0..i]^T * scale) v[0..i], for every query head.
// PyTorch's SDPA does it with a flash kernel over MKL matmuls, one query head at a time; here:
//
// * one work item per (KV head, tile of kTile query positions): its G * kTile query rows (the G heads that
//   share the KV head, at kTile positions) read the same keys 0 .. the tile's last position;
// * both passes work on register blocks of query rows (12 rows in pass 1, 24 / NV in pass 2), so each key or
//   V row loaded from cache serves a dozen or half a dozen FMAs;
// * the keys of each KV head are first laid out transposed ([D, T], zero-padded: see Tpad), so pass 1
//   computes scores 32 keys at a time: two accumulators a row, each FMA a broadcast query element times 16
//   keys' elements, summed over d in order;
// * the exact two-pass softmax of the decode kernel, row by row over the row's own keys (0 .. its position);
//   the keys after it get probability 0;
// * pass 2 sums probability-weighted V rows into output rows held in registers, one V row read per key for
//   all of them;
// * the tiles are handed out cheap and dear alternately (the last positions read the most keys), so that
//   the threads' contiguous shares of the items cost about the same.
//
// Layouts: query [T, H, D], key/value [T, KVH, D], out [T, H, D], contiguous, fp32.

constexpr int64_t kTile = 16;  // query positions per work item

// One work item: query rows (position i0 + r / G, head g = r % G of KV head h) for r < n.
struct PromptItem {
  const float *q, *kt, *v;  // q at (i0, first head of h); kt: KV head h's transposed keys [D, Tpad]; v at (0, h)
  int64_t i0, n, G, H, KVH, D, Tpad;
  float scale;
  float *scores, *o;  // scores: [n, Lpad] scratch; o at (i0, first head of h)
  int64_t Lpad;
  const float* qrow(int64_t r) const { return q + ((r / G) * H + r % G) * D; }
  float* orow(int64_t r) const { return o + ((r / G) * H + r % G) * D; }
  int64_t len(int64_t r) const { return i0 + r / G + 1; }  // keys row r may read: 0 .. its position
};

void prompt_generic(const PromptItem& it) {
  for (int64_t r = 0; r < it.n; ++r) {
    const int64_t len = it.len(r);
    float* row = it.scores + r * it.Lpad;
    const float* q = it.qrow(r);
    for (int64_t j = 0; j < len; ++j) {
      float acc = 0.f;
      for (int64_t d = 0; d < it.D; ++d) acc += q[d] * it.kt[d * it.Tpad + j];
      row[j] = acc * it.scale;
    }
    softmax_rows(row, 1, len);
    float* o = it.orow(r);
    std::fill(o, o + it.D, 0.f);
    for (int64_t j = 0; j < len; ++j) {
      const float* v = it.v + j * it.KVH * it.D;
      for (int64_t d = 0; d < it.D; ++d) o[d] += row[j] * v[d];
    }
  }
}

#if defined(__AVX512F__)
// Pass 1 for R rows from r0: their scores against keys 0 .. the last row's length, 32 keys at a time.
template <int R, int NV>
inline void prompt_scores(const PromptItem& it, int64_t r0) {
  constexpr int D = 16 * NV;
  const float* q[R];
  for (int r = 0; r < R; ++r) q[r] = it.qrow(r0 + r);
  const int64_t keys = it.len(r0 + R - 1);
  for (int64_t j = 0; j < keys; j += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float* k = it.kt + j;
    for (int d = 0; d < D; ++d, k += it.Tpad) {
      const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 qd = _mm512_set1_ps(q[r][d]);
        acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
      }
    }
    const __m512 scale = _mm512_set1_ps(it.scale);
    for (int r = 0; r < R; ++r) {
      float* row = it.scores + (r0 + r) * it.Lpad + j;
      _mm512_storeu_ps(row, _mm512_mul_ps(acc[r][0], scale));
      _mm512_storeu_ps(row + 16, _mm512_mul_ps(acc[r][1], scale));
    }
  }
}

// Pass 2 for R rows from r0: the probability-weighted sum of V rows 0 .. the last row's length.
template <int R, int NV>
inline void prompt_values(const PromptItem& it, int64_t r0) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < NV; ++l) acc[r][l] = _mm512_setzero_ps();
  const int64_t keys = it.len(r0 + R - 1);
  const float* p[R];
  for (int r = 0; r < R; ++r) p[r] = it.scores + (r0 + r) * it.Lpad;
  for (int64_t j = 0; j < keys; ++j) {
    const float* v = it.v + j * it.KVH * 16 * NV;
    __m512 vv[NV];
    for (int l = 0; l < NV; ++l) vv[l] = _mm512_loadu_ps(v + 16 * l);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r][j]);
      for (int l = 0; l < NV; ++l) acc[r][l] = _mm512_fmadd_ps(pr, vv[l], acc[r][l]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < NV; ++l) _mm512_storeu_ps(it.orow(r0 + r) + 16 * l, acc[r][l]);
}

// Rows r0 .. n in register blocks of R, then of fewer (4, 2, 1) for the rest: pass 1 (Scores) or pass 2.
template <int R, int NV, bool Scores>
inline void prompt_rows(const PromptItem& it, int64_t r0, int64_t n) {
  for (; r0 + R <= n; r0 += R) {
    if constexpr (Scores) prompt_scores<R, NV>(it, r0); else prompt_values<R, NV>(it, r0);
  }
  if constexpr (R > 1) prompt_rows<(R > 4 ? 4 : R / 2), NV, Scores>(it, r0, n);
}

template <int NV>
void prompt_avx512(const PromptItem& it) {
  prompt_rows<12, NV, true>(it, 0, it.n);  // 24 accumulators, 2 key vectors, a broadcast: 27 of 32 registers
  for (int64_t r = 0; r < it.n; ++r) {  // each row's softmax over its own keys; the later ones weigh nothing
    float* row = it.scores + r * it.Lpad;
    const int64_t len = it.len(r);
    softmax_rows_avx512(row, 1, len);
    std::fill(row + len, row + it.len(it.n - 1), 0.f);
  }
  prompt_rows<24 / NV, NV, false>(it, 0, it.n);  // 24 accumulators (6 rows of 4 vectors at head_dim 64), NV V vectors
}
#endif

at::Tensor prompt_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(),
              "prompt_attention: query [T, H, D], key and value [T, KVH, D]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat, "prompt_attention: float32 only");
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous(),
              "prompt_attention: contiguous inputs");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2), KVH = key.size(1);
  TORCH_CHECK(key.size(0) == T && key.size(2) == D && KVH > 0 && H % KVH == 0, "prompt_attention: shapes disagree");
  // Tpad: 32-key blocks and 16 more columns, so the d-th rows of the transposed keys (pass 1 reads 64 or 128 of
  // them per block) are an odd number of cache lines apart and fall in different sets of the L1 cache.
  const int64_t G = H / KVH, Tpad = (T + 31) / 32 * 32 + 16, tiles = (T + kTile - 1) / kTile;
  auto out = at::empty_like(query);
  if (T == 0) return out;
  // Each KV head's keys transposed, [KVH, D, Tpad], zero beyond T: pass 1 reads 32 keys' d-th elements at once.
  auto kt = at::zeros({KVH, D, Tpad}, key.options());
  kt.narrow(2, 0, T).copy_(key.permute({1, 2, 0}));
  const float *q_all = query.data_ptr<float>(), *kt_all = kt.data_ptr<float>(), *v_all = value.data_ptr<float>();
  float* out_all = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, tiles * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t k = item / KVH, h = item % KVH;
      const int64_t tile = k % 2 == 0 ? k / 2 : tiles - 1 - k / 2;  // 0, last, 1, last - 1, ...
      const int64_t i0 = tile * kTile, n = std::min(kTile, T - i0) * G;
      const int64_t Lpad = (i0 + n / G + 31) / 32 * 32;
      scores.resize(n * Lpad);
      const PromptItem it{q_all + (i0 * H + h * G) * D, kt_all + h * D * Tpad, v_all + h * D, i0, n, G, H, KVH, D,
                          Tpad, fscale, scores.data(), out_all + (i0 * H + h * G) * D, Lpad};
#if defined(__AVX512F__)
      if (D == 64) { prompt_avx512<4>(it); continue; }
      if (D == 128) { prompt_avx512<8>(it); continue; }
#endif
      prompt_generic(it);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(minikv_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor k_store, Tensor v_store, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("prompt_attention(Tensor query, Tensor key, Tensor value, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minikv_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("prompt_attention", &prompt_attention);
}
