// Exchanges each rank's identity record (peer_identity.hpp) through the c10d Store the group was given
// (already namespaced per group by torch). A generation counter keeps a
// re-created group on a reused store (file://) from reading stale addresses.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <vector>

namespace fsdp_ext::backend {

std::vector<std::vector<uint8_t>> exchange_addresses(c10d::Store& store, int rank,
                                                     int size,
                                                     const std::vector<uint8_t>& mine);

}  // namespace fsdp_ext::backend
