#include "backend/peer_identity.hpp"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <stdexcept>

namespace fsdp_ext::backend {
namespace {

void put_bytes(std::vector<uint8_t>& out, const void* data, size_t bytes) {
  const size_t at = out.size();
  out.resize(at + bytes);
  if (bytes != 0) std::memcpy(out.data() + at, data, bytes);
}

template <typename T>
void put(std::vector<uint8_t>& out, const T& value) {
  put_bytes(out, &value, sizeof(T));
}

class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& blob) : blob_(blob) {}
  void get_bytes(void* data, size_t bytes) {
    if (offset_ + bytes > blob_.size()) {
      throw std::runtime_error("a peer published a truncated identity record (another build of "
                               "torch_fsdp_ext of the same wire format?)");
    }
    std::memcpy(data, blob_.data() + offset_, bytes);
    offset_ += bytes;
  }
  template <typename T>
  T get() {
    T value;
    get_bytes(&value, sizeof(T));
    return value;
  }

 private:
  const std::vector<uint8_t>& blob_;
  size_t offset_ = 0;
};

}  // namespace

const uint64_t kProcessReadProbeValue = 0x66736470'65787431ull;

namespace {
// Every identity record starts with these, so that ranks running different
// builds of the package find out at group creation, by name, instead of
// misreading each other's records (or, worse, agreeing on a record and then
// on nothing else: tags, message layouts and shared-memory headers change
// between versions too).
constexpr uint64_t kIdentityMagic = 0x74786570'64736631ull;  // "1fsdpext", little-endian
// Raise it with any change to what ranks exchange: this record, the tag
// layout (comm/tag_scheme.h), message or shared-memory header layouts.
constexpr uint32_t kWireFormat = 3;
}  // namespace

std::string this_host() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  // The PID namespace too: two containers of one machine may share a
  // hostname (Kubernetes pods on the host's network, `docker --uts=host`)
  // and not their PIDs. A peer's pid names nothing here then (or, worse,
  // another process), so it cannot be watched through a pidfd, its memory
  // read or its shared segments opened through /proc/<pid>/fd: such peers
  // are on another host to us (watched over TCP, data through UCX).
  char pid_namespace[64] = {};
  if (readlink("/proc/self/ns/pid", pid_namespace, sizeof(pid_namespace) - 1) < 0) {
    pid_namespace[0] = '\0';  // no /proc: the machine alone decides
  }
  return std::string(name) + "/" + boot_id + "/" + pid_namespace;
}

std::string host_name_of(const std::string& host) { return host.substr(0, host.find('/')); }

std::string machine_of(const std::string& host) { return host.substr(0, host.rfind('/')); }

std::string describe_host(const std::string& host, const std::string& mine) {
  std::string text = host_name_of(host);
  if (host != mine && text == host_name_of(mine)) {
    text += machine_of(host) == machine_of(mine) ? " (another PID namespace)"
                                                 : " (another machine of that name)";
  }
  return text;
}

std::vector<uint8_t> serialize(const PeerIdentity& identity) {
  std::vector<uint8_t> out;
  put<uint64_t>(out, kIdentityMagic);
  put<uint32_t>(out, kWireFormat);
  put<uint32_t>(out, static_cast<uint32_t>(identity.worker_address.size()));
  put_bytes(out, identity.worker_address.data(), identity.worker_address.size());
  put<uint32_t>(out, static_cast<uint32_t>(identity.host.size()));
  put_bytes(out, identity.host.data(), identity.host.size());
  put<int32_t>(out, identity.pid);
  put(out, identity.probe);
  put(out, identity.probe_address);
  put<uint32_t>(out, static_cast<uint32_t>(identity.liveness_endpoint.size()));
  put_bytes(out, identity.liveness_endpoint.data(), identity.liveness_endpoint.size());
  put<uint32_t>(out, static_cast<uint32_t>(identity.liveness_token.size()));
  put_bytes(out, identity.liveness_token.data(), identity.liveness_token.size());
  put<int32_t>(out, identity.small_ops_fd);
  return out;
}

PeerIdentity deserialize_peer_identity(const std::vector<uint8_t>& blob, int peer) {
  const std::string who = "rank " + std::to_string(peer);
  uint64_t magic = 0;
  uint32_t format = 0;
  if (blob.size() >= sizeof(magic) + sizeof(format)) {
    std::memcpy(&magic, blob.data(), sizeof(magic));
    std::memcpy(&format, blob.data() + sizeof(magic), sizeof(format));
  }
  if (magic != kIdentityMagic) {
    throw std::runtime_error(
        who + " published an address record this build cannot read: it runs another version "
              "of torch_fsdp_ext (older than this one's wire format " +
        std::to_string(kWireFormat) + "), or its store key was written by something else. "
        "Install the same torch_fsdp_ext on every host");
  }
  if (format != kWireFormat) {
    throw std::runtime_error(who + " runs a torch_fsdp_ext of wire format " +
                             std::to_string(format) + ", this rank one of wire format " +
                             std::to_string(kWireFormat) +
                             ": the two cannot talk. Install the same torch_fsdp_ext on every host");
  }
  Reader reader(blob);
  reader.get<uint64_t>();
  reader.get<uint32_t>();
  PeerIdentity identity;
  identity.worker_address.resize(reader.get<uint32_t>());
  reader.get_bytes(identity.worker_address.data(), identity.worker_address.size());
  identity.host.resize(reader.get<uint32_t>());
  reader.get_bytes(identity.host.data(), identity.host.size());
  identity.pid = reader.get<int32_t>();
  identity.probe = reader.get<comm::SharedPiece>();
  identity.probe_address = reader.get<uint64_t>();
  identity.liveness_endpoint.resize(reader.get<uint32_t>());
  reader.get_bytes(identity.liveness_endpoint.data(), identity.liveness_endpoint.size());
  identity.liveness_token.resize(reader.get<uint32_t>());
  reader.get_bytes(identity.liveness_token.data(), identity.liveness_token.size());
  identity.small_ops_fd = reader.get<int32_t>();
  return identity;
}

}  // namespace fsdp_ext::backend
