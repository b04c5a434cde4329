// RAII owners for UCX objects. Each owner releases exactly what it created,
// in its destructor, so an exception during set-up never leaks a context,
// worker or worker address.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp_ext::comm {

// Throws CommError(kTransport) naming the failed UCX call.
void check_ucs(ucs_status_t status, const char* what);

class UcxContext {
 public:
  explicit UcxContext(size_t estimated_endpoints);
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  ucp_context_h get() const { return handle_; }

 private:
  ucp_context_h handle_ = nullptr;
};

// A memory range registered with UCX (ucp_mem_map of existing memory), so
// transfers from or into it skip per-message registration (which matters for
// RDMA transports). Holds the context it was registered with.
class UcxRegistration {
 public:
  UcxRegistration(std::shared_ptr<UcxContext> context, void* data, size_t bytes);
  ~UcxRegistration();
  UcxRegistration(const UcxRegistration&) = delete;
  UcxRegistration& operator=(const UcxRegistration&) = delete;

 private:
  std::shared_ptr<UcxContext> context_;
  ucp_mem_h handle_ = nullptr;
};

class UcxWorker {
 public:
  explicit UcxWorker(ucp_context_h context);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;
  ucp_worker_h get() const { return handle_; }
  std::vector<uint8_t> address() const;
  int event_fd() const { return event_fd_; }

 private:
  ucp_worker_h handle_ = nullptr;
  int event_fd_ = -1;  // owned by the worker; closed by ucp_worker_destroy
};

}  // namespace fsdp_ext::comm
