#include "backend/store_address_exchange.hpp"

#include <stdexcept>
#include <string>

namespace fsdp_ext::backend {

std::vector<std::vector<uint8_t>> exchange_addresses(c10d::Store& store, int rank,
                                                     int size,
                                                     const std::vector<uint8_t>& mine,
                                                     std::chrono::milliseconds timeout) {
  // Every rank of every incarnation adds 1, so incarnation g sees values in
  // (g*size, (g+1)*size]; all ranks of one incarnation compute the same g.
  const int64_t ticket = store.add("fsdp_ext/incarnation", 1);
  const int64_t generation = (ticket - 1) / size;
  const std::string prefix = "fsdp_ext/" + std::to_string(generation) + "/address/";
  store.set(prefix + std::to_string(rank), mine);
  std::vector<std::string> others;
  for (int peer = 0; peer < size; ++peer) {
    if (peer != rank) others.push_back(prefix + std::to_string(peer));
  }
  try {
    store.wait(others, timeout);
  } catch (const c10::Error& error) {  // TCPStore's "Wait timeout" is a plain c10::Error
    // The store's own message names keys; the user needs the ranks that
    // never created the group (or created another one in its place).
    std::string missing;
    int count = 0;
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      bool published = false;
      try {
        published = store.check({prefix + std::to_string(peer)});
      } catch (const c10::Error&) {
        // The store itself is gone: say nothing of which ranks arrived.
        throw std::runtime_error("waiting for the peers' addresses in the c10d store failed: " +
                                 std::string(error.what_without_backtrace()));
      }
      if (!published) {
        missing += (count++ == 0 ? " " : ", ") + std::to_string(peer);
      }
    }
    throw std::runtime_error(
        (count == 1 ? "rank" : "ranks") + missing +
        " did not create this group within the timeout (every rank of a group must create it, "
        "in the same order of groups; set the timeout with init_process_group(timeout=...) or "
        "new_group(timeout=...)); the store said: " + error.what_without_backtrace());
  }
  std::vector<std::vector<uint8_t>> addresses(size);
  for (int peer = 0; peer < size; ++peer) {
    addresses[peer] = peer == rank ? mine : store.get(prefix + std::to_string(peer));
  }
  return addresses;
}

}  // namespace fsdp_ext::backend
