// All-reduce of a sparse COO tensor (DDP over nn.Embedding(sparse=True)),
// summed the way gloo sums it, so a model trains to the same bits over
// either backend:
//   1. each rank coalesces its tensor;
//   2. the ranks all-gather a fixed-size header (nnz, dimensions, sizes) and
//      check that every rank's tensor has the same shape;
//   3. they all-gather every rank's indices and values (one bucket; the
//      sizes differ per rank: the uneven all-gather);
//   4. each rank adds the ranks' tensors in rank order and coalesces the sum,
//      which replaces the input's contents and is the Work's result.
// Only SUM is defined for sparse tensors (as in gloo).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>

#include "backend/fsdp_ext_backend.hpp"
#include "backend/tensor_validation.hpp"
#include "backend/type_mapping.hpp"
#include "comm/error.h"

namespace fsdp_ext::backend {
namespace {

// The header: nnz, sparse_dim, dense_dim, dim, then the sizes (padded).
constexpr int64_t kMaxSparseDims = 32;
constexpr int64_t kHeaderFields = 4;
constexpr int64_t kHeaderLength = kHeaderFields + kMaxSparseDims;

at::Tensor sparse_header(const at::Tensor& coalesced) {
  at::Tensor header = at::zeros({kHeaderLength}, at::kLong);
  int64_t* h = header.data_ptr<int64_t>();
  h[0] = coalesced._nnz();
  h[1] = coalesced.sparse_dim();
  h[2] = coalesced.dense_dim();
  h[3] = coalesced.dim();
  for (int64_t d = 0; d < coalesced.dim(); ++d) h[kHeaderFields + d] = coalesced.size(d);
  return header;
}

std::string describe_shape(const int64_t* h) {
  std::ostringstream text;
  text << "sizes [";
  for (int64_t d = 0; d < h[3]; ++d) text << (d ? ", " : "") << h[kHeaderFields + d];
  text << "], sparse_dim " << h[1] << ", dense_dim " << h[2];
  return text.str();
}

comm::MutableSpan bytes_of(const at::Tensor& tensor) {
  return comm::MutableSpan{tensor.data_ptr(), tensor.nbytes()};
}

}  // namespace

c10::intrusive_ptr<c10d::Work> FsdpExtBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const OpLabel l = label("all_reduce");
  check_count(l, tensors.size(), 1, "tensor");
  at::Tensor tensor = tensors[0];
  TORCH_CHECK_VALUE(tensor.defined() && tensor.layout() == at::kSparse, l.prefix(),
                    "a sparse all-reduce needs a sparse COO tensor, got layout ",
                    tensor.defined() ? c10::str(tensor.layout()) : std::string("undefined"));
  TORCH_CHECK_VALUE(tensor.device().is_cpu(), l.prefix(),
                    "sparse tensors are summed on the CPU only; this one is on ",
                    tensor.device());
  TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM, l.prefix(),
                    "sparse tensors can only be summed (ReduceOp.SUM), got ",
                    reduce_op_name(opts.reduceOp));
  TORCH_CHECK_VALUE(tensor.dim() <= kMaxSparseDims, l.prefix(), "the sparse tensor has ",
                    tensor.dim(), " dimensions; at most ", kMaxSparseDims, " are supported");
  const at::Tensor input = tensor.coalesce();
  const at::Tensor indices = input._indices().contiguous();
  const at::Tensor values = input._values().contiguous();
  const at::Tensor header = sparse_header(input);
  const int size = size_;
  const int rank = rank_;
  auto body = [tensor, input, indices, values, header, size, rank](comm::OpContext& context) {
    const at::Tensor headers = at::empty({size, kHeaderLength}, at::kLong);
    std::vector<comm::MutableSpan> header_spans;
    for (int r = 0; r < size; ++r) header_spans.push_back(bytes_of(headers[r]));
    comm::allgather(context, comm::ConstSpan{header.data_ptr(), header.nbytes()}, header_spans);
    const int64_t* own = header.data_ptr<int64_t>();
    for (int r = 0; r < size; ++r) {
      const int64_t* theirs = headers[r].data_ptr<int64_t>();
      if (!std::equal(own + 1, own + kHeaderLength, theirs + 1)) {
        throw comm::CommError(comm::ErrorKind::kMismatch,
                              context.description() + ": rank " + std::to_string(r) +
                                  "'s sparse tensor has " + describe_shape(theirs) +
                                  " but rank " + std::to_string(rank) + "'s has " +
                                  describe_shape(own));
      }
    }
    context.begin_next_collective();
    std::vector<at::Tensor> rank_indices(size);
    std::vector<at::Tensor> rank_values(size);
    std::vector<comm::AllgatherMember> bucket(2);
    bucket[0].input = {indices.data_ptr(), indices.nbytes()};
    bucket[1].input = {values.data_ptr(), values.nbytes()};
    for (int r = 0; r < size; ++r) {
      const int64_t nnz = headers[r].data_ptr<int64_t>()[0];
      rank_indices[r] = at::empty({indices.size(0), nnz}, indices.options());
      std::vector<int64_t> value_sizes = values.sizes().vec();
      value_sizes[0] = nnz;
      rank_values[r] = at::empty(value_sizes, values.options());
      bucket[0].outputs.push_back(bytes_of(rank_indices[r]));
      bucket[1].outputs.push_back(bytes_of(rank_values[r]));
    }
    comm::allgather(context, bucket);
    at::NoGradGuard no_grad;
    at::Tensor sum = at::sparse_coo_tensor(rank_indices[0], rank_values[0], input.sizes(),
                                           input.options());
    for (int r = 1; r < size; ++r) {
      sum = sum + at::sparse_coo_tensor(rank_indices[r], rank_values[r], input.sizes(),
                                        input.options());
    }
    tensor.copy_(sum.coalesce());
  };
  return enqueue(l, c10d::OpType::ALLREDUCE, "fsdp_ext:all_reduce", true,
                 resolve_timeout(opts.timeout), {tensor}, {tensor}, std::move(body));
}

}  // namespace fsdp_ext::backend
