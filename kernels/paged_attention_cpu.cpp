// Paged-attention decode on the CPU: the Triton kernel's idea (stage 4) in C++ for a CPU's cores.
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
//   so no second pool competes with the matmuls' threads.
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
      const float* q = q_all + (s * H + h * G) * D;  // the G query heads reading KV head h
      float* o = out_all + (s * H + h * G) * D;
      scores.resize(G * len);
      // Pass 1: every score, walking the block table; each K row serves all G query heads.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[s * W + t / bs];
        const float* k = k_all + ((h * num_blocks + block) * bs + t % bs) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot(q + g * D, k, D) * fscale;
      }
      // Softmax per query head: subtract the max, exponentiate, normalize.
      for (int64_t g = 0; g < G; ++g) {
        float* row = scores.data() + g * len;
        const float m = *std::max_element(row, row + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += (row[t] = std::exp(row[t] - m));
        for (int64_t t = 0; t < len; ++t) row[t] /= sum;  // divide, as softmax does, not multiply by 1/sum
        std::fill(o + g * D, o + (g + 1) * D, 0.f);
      }
      // Pass 2: the probability-weighted sum of V rows, again block by block.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[s * W + t / bs];
        const float* v = v_all + ((h * num_blocks + block) * bs + t % bs) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* og = o + g * D;
          for (int64_t d = 0; d < D; ++d) og[d] += p * v[d];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(minikv_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor k_store, Tensor v_store, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minikv_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
