#include "backend/store_address_exchange.hpp"

#include <string>

namespace fsdp_ext::backend {

std::vector<std::vector<uint8_t>> exchange_addresses(c10d::Store& store, int rank,
                                                     int size,
                                                     const std::vector<uint8_t>& mine) {
  // Every rank of every incarnation adds 1, so incarnation g sees values in
  // (g*size, (g+1)*size]; all ranks of one incarnation compute the same g.
  const int64_t ticket = store.add("fsdp_ext/incarnation", 1);
  const int64_t generation = (ticket - 1) / size;
  const std::string prefix = "fsdp_ext/" + std::to_string(generation) + "/address/";
  store.set(prefix + std::to_string(rank), mine);
  std::vector<std::vector<uint8_t>> addresses(size);
  for (int peer = 0; peer < size; ++peer) {
    addresses[peer] = peer == rank ? mine : store.get(prefix + std::to_string(peer));
  }
  return addresses;
}

}  // namespace fsdp_ext::backend
