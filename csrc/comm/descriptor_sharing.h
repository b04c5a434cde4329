// File descriptors handed from one process of a host to another, over a
// Unix-domain socket (SCM_RIGHTS).
//
// What the device room needs it for: GPU memory made with cuMemCreate is
// shared as a file descriptor (cuMemExportToShareableHandle), and a file
// descriptor means nothing in another process until the kernel copies it
// there. pidfd_getfd would do that without a server, but it needs ptrace
// rights over the owner (refused for sibling processes under Yama's default
// ptrace_scope=1 and by many sandboxes' seccomp filters); a socket needs
// nothing but a shared network namespace.
//
// The owner runs a DescriptorServer: a thread that answers each connection
// with the descriptor offered under the id asked for. Peers call
// fetch_descriptor with the server's address (exchanged through the group's
// host transport) and the id. Only processes of the server's own user are
// served (SO_PEERCRED): an abstract socket is reachable by every process of
// the network namespace.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "comm/unique_fd.h"

namespace fsdp_ext::comm {

class DescriptorServer {
 public:
  // Listens on a fresh abstract socket and starts the serving thread.
  // Throws CommError (kTransport) naming the call that failed.
  DescriptorServer();
  // Stops the thread; closes the socket and the descriptors still offered.
  ~DescriptorServer();
  DescriptorServer(const DescriptorServer&) = delete;
  DescriptorServer& operator=(const DescriptorServer&) = delete;

  // The socket's abstract name (without its leading NUL), at most
  // kMaxAddressBytes long: what fetch_descriptor takes.
  const std::string& address() const { return address_; }
  static constexpr size_t kMaxAddressBytes = 100;

  // Offers a duplicate of `fd` under `id` (the caller keeps `fd`); an id
  // offered before is replaced. Throws CommError when `fd` cannot be duplicated.
  void offer(uint64_t id, int fd);
  // No longer offers `id` (its duplicate is closed); unknown ids are ignored.
  void withdraw(uint64_t id);
  // Descriptors handed out so far (a counter for tests and diagnostics).
  uint64_t served() const;

 private:
  void serve();
  void answer(int connection);

  std::string address_;
  UniqueFd listener_;
  UniqueFd stop_;  // an eventfd: written once, on destruction
  mutable std::mutex mutex_;
  std::map<uint64_t, UniqueFd> offered_;
  uint64_t served_ = 0;
  std::thread thread_;
};

// The descriptor offered as `id` by the DescriptorServer at `address`, as a
// new descriptor of this process. Throws CommError naming the address, the
// id and what failed: no server there (its process exited or is in another
// network namespace), the id not offered, or no answer within `timeout`.
UniqueFd fetch_descriptor(const std::string& address, uint64_t id,
                          std::chrono::milliseconds timeout);

}  // namespace fsdp_ext::comm
