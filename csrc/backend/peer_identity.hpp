// What each rank publishes through the store at init: its UCX worker
// address, which host it runs on, its pid, and a shared-memory piece peers
// map to test whether they can share memory with it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm/shared_memory_domain.h"

namespace fsdp_ext::backend {

struct PeerIdentity {
  std::vector<uint8_t> worker_address;
  // this_host(): hostname, kernel boot id and PID namespace; equal only
  // where pids name the same processes.
  std::string host;
  pid_t pid = 0;
  comm::SharedPiece probe;
  // Address of a known value in this process, for peers to test
  // process_vm_readv on.
  uint64_t probe_address = 0;
  // Where peers on other hosts connect to watch this rank, and the token its
  // listener asks them for (peer_liveness.h: published only here, through
  // the group's store).
  std::string liveness_endpoint;
  std::string liveness_token;
  // This rank's small-op channel region (comm/small_op_channel.h), opened
  // by peers on this host through /proc/<pid>/fd; -1 when it has none.
  int32_t small_ops_fd = -1;
};

// The value at PeerIdentity::probe_address.
extern const uint64_t kProcessReadProbeValue;

std::string this_host();
// The hostname in a this_host() value.
std::string host_name_of(const std::string& host);
// The machine (hostname and boot id) in a this_host() value, without the
// PID namespace.
std::string machine_of(const std::string& host);
// `host` for messages, as seen from `mine`: its hostname, and what tells it
// apart where the two hostnames are the same.
std::string describe_host(const std::string& host, const std::string& mine);
std::vector<uint8_t> serialize(const PeerIdentity& identity);
// `peer`'s record. Throws std::runtime_error on a malformed blob, naming the
// peer and, where its build differs from this one, saying so.
PeerIdentity deserialize_peer_identity(const std::vector<uint8_t>& blob, int peer);

}  // namespace fsdp_ext::backend
