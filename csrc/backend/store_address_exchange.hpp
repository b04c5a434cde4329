// Exchanges each rank's identity record (peer_identity.hpp) through the c10d Store the group was given
// (already namespaced per group by torch). A generation counter keeps a
// re-created group on a reused store (file://) from reading stale addresses.
// Waits at most `timeout` (the group's) for the others; ranks that did not
// publish by then are named in the std::runtime_error it throws.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <vector>

namespace fsdp_ext::backend {

std::vector<std::vector<uint8_t>> exchange_addresses(c10d::Store& store, int rank,
                                                     int size,
                                                     const std::vector<uint8_t>& mine,
                                                     std::chrono::milliseconds timeout);

}  // namespace fsdp_ext::backend
