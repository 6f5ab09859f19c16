// GPT sample index builder (Megatron GPTDataset semantics), registered as torch.ops.slipway.build_sample_idx.
//
// The sample index is a [num_samples + 1, 2] array: row i holds (position in the document order, token
// offset in that document) where sample i starts; sample i ends where sample i + 1 starts, plus
// `add_extra_token` tokens (1 for GPT: S + 1 tokens per sample, neighbours share one token).
// The walk is sequential by nature (each start depends on the previous one), so it is a tight loop in C++;
// a NumPy reference (trainer/data/index_helpers.py) derives the same rows from a cumulative sum and is
// tested equal to this on random inputs.
#include <torch/extension.h>

#include <cstdint>
#include <limits>

namespace slipway {
namespace {

struct SampleIdxArgs {
  const int32_t* sizes;
  int64_t num_sizes;
  const int32_t* document_index;
  int64_t num_docs;
  int64_t seq_length;
  int64_t num_samples;
  int64_t add_extra_token;
};

template <typename T>
void fill_sample_idx(const SampleIdxArgs& a, T* out) {
  int64_t doc_pos = 0;     // index into document_index
  int64_t doc_offset = 0;  // token offset inside document_index[doc_pos]
  out[0] = 0;
  out[1] = 0;
  for (int64_t sample = 1; sample <= a.num_samples; ++sample) {
    // Each sample consumes seq_length + add_extra_token tokens, then steps back add_extra_token so that
    // the next sample starts on the shared token.
    int64_t remaining = a.seq_length + a.add_extra_token;
    while (remaining != 0) {
      const int64_t doc_len = static_cast<int64_t>(a.sizes[a.document_index[doc_pos]]) - doc_offset;
      remaining -= doc_len;
      if (remaining <= 0) {
        doc_offset += remaining + doc_len - a.add_extra_token;
        remaining = 0;
      } else {
        if (doc_pos == a.num_docs - 1) {
          // Only the trailing partial sample (drop_last_partial_sequence = false) may run off the end.
          TORCH_CHECK(sample == a.num_samples, "build_sample_idx: the document order holds fewer tokens than ",
                      "tokens_per_epoch * num_epochs claims (ran out at sample ", sample, " of ", a.num_samples,
                      "); pass the token count of the split's documents");
          doc_offset = static_cast<int64_t>(a.sizes[a.document_index[doc_pos]]) - a.add_extra_token;
          break;
        }
        ++doc_pos;
        doc_offset = 0;
      }
    }
    out[2 * sample] = static_cast<T>(doc_pos);
    out[2 * sample + 1] = static_cast<T>(doc_offset);
  }
}

void check_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "build_sample_idx: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 1, "build_sample_idx: ", name, " must be 1-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == at::kInt, "build_sample_idx: ", name, " must be int32 (numpy.int32), got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "build_sample_idx: ", name, " must be contiguous");
}

at::Tensor build_sample_idx(const at::Tensor& sizes, const at::Tensor& document_index, int64_t seq_length,
                            int64_t num_epochs, int64_t tokens_per_epoch, bool drop_last_partial_sequence,
                            int64_t add_extra_token, bool out_int64) {
  check_input(sizes, "sizes");
  check_input(document_index, "document_index");
  TORCH_CHECK(seq_length >= 1, "build_sample_idx: seq_length must be >= 1, got ", seq_length);
  TORCH_CHECK(num_epochs >= 1, "build_sample_idx: num_epochs must be >= 1, got ", num_epochs);
  TORCH_CHECK(add_extra_token == 0 || add_extra_token == 1, "build_sample_idx: add_extra_token must be 0 or 1");
  TORCH_CHECK(document_index.numel() > 0, "build_sample_idx: document_index is empty");
  const int64_t usable = num_epochs * tokens_per_epoch - add_extra_token;
  TORCH_CHECK(usable >= 0, "build_sample_idx: ", num_epochs, " epochs of ", tokens_per_epoch,
              " tokens cannot hold even one token plus the extra token");
  // Exact integer ceil (Megatron rounds through a 32-bit float here, which is off by one for large counts).
  const int64_t num_samples = drop_last_partial_sequence ? usable / seq_length
                                                         : (usable + seq_length - 1) / seq_length;

  SampleIdxArgs args{sizes.data_ptr<int32_t>(), sizes.numel(), document_index.data_ptr<int32_t>(),
                     document_index.numel(), seq_length, num_samples, add_extra_token};
  for (int64_t i = 0; i < args.num_docs; ++i) {
    const int32_t d = args.document_index[i];
    TORCH_CHECK(d >= 0 && d < args.num_sizes, "build_sample_idx: document_index[", i, "] = ", d,
                " is outside sizes (", args.num_sizes, " entries)");
  }
  TORCH_CHECK(out_int64 || args.num_docs <= std::numeric_limits<int32_t>::max(),
              "build_sample_idx: ", args.num_docs, " document positions do not fit int32; pass out_int64=True");

  auto out = at::empty({num_samples + 1, 2}, sizes.options().dtype(out_int64 ? at::kLong : at::kInt));
  if (out_int64) {
    fill_sample_idx<int64_t>(args, out.data_ptr<int64_t>());
  } else {
    fill_sample_idx<int32_t>(args, out.data_ptr<int32_t>());
  }
  return out;
}

}  // namespace
}  // namespace slipway

TORCH_LIBRARY_FRAGMENT(slipway, m) {
  m.def(
      "build_sample_idx(Tensor sizes, Tensor document_index, int seq_length, int num_epochs, "
      "int tokens_per_epoch, bool drop_last_partial_sequence, int add_extra_token, bool out_int64) -> Tensor");
}

TORCH_LIBRARY_IMPL(slipway, CPU, m) {
  m.impl("build_sample_idx", &slipway::build_sample_idx);
}
