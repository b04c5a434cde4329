#include "comm/ucx_handles.h"

#include "comm/error.h"
#include "comm/ucx_config_defaults.h"

namespace fsdp_ext::comm {

void check_ucs(ucs_status_t status, const char* what) {
  if (status != UCS_OK) {
    throw CommError(ErrorKind::kTransport,
                    std::string(what) + " failed: " + ucs_status_string(status));
  }
}

namespace {
struct UcxConfigOwner {
  ucp_config_t* config = nullptr;
  UcxConfigOwner() { check_ucs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read"); }
  ~UcxConfigOwner() {
    if (config) ucp_config_release(config);
  }
};
}  // namespace

UcxContext::UcxContext(size_t estimated_endpoints) {
  UcxConfigOwner config;
  apply_ucx_config_defaults(config.config);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  // TAG for messages, WAKEUP so the progress thread can sleep on an fd
  // instead of spinning (spinning with more ranks than cores stalls ops 30x).
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.estimated_num_eps = estimated_endpoints;
  params.mt_workers_shared = 0;
  check_ucs(ucp_init(&params, config.config, &handle_), "ucp_init");
}

UcxContext::~UcxContext() {
  if (handle_) ucp_cleanup(handle_);
}

UcxRegistration::UcxRegistration(std::shared_ptr<UcxContext> context, void* data, size_t bytes)
    : context_(std::move(context)) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = data;
  params.length = bytes;
  check_ucs(ucp_mem_map(context_->get(), &params, &handle_), "ucp_mem_map");
}

UcxRegistration::~UcxRegistration() {
  if (handle_) ucp_mem_unmap(context_->get(), handle_);
}

UcxWorker::UcxWorker(ucp_context_h context) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // One progress thread owns the worker; set-up happens before it starts.
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  check_ucs(ucp_worker_create(context, &params, &handle_), "ucp_worker_create");
  const ucs_status_t status = ucp_worker_get_efd(handle_, &event_fd_);
  if (status != UCS_OK) {
    ucp_worker_destroy(handle_);
    handle_ = nullptr;
    check_ucs(status, "ucp_worker_get_efd");
  }
}

UcxWorker::~UcxWorker() {
  if (handle_) ucp_worker_destroy(handle_);
}

std::vector<uint8_t> UcxWorker::address() const {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  check_ucs(ucp_worker_get_address(handle_, &address, &length),
            "ucp_worker_get_address");
  const auto* bytes = reinterpret_cast<const uint8_t*>(address);
  std::vector<uint8_t> copy(bytes, bytes + length);
  ucp_worker_release_address(handle_, address);
  return copy;
}

}  // namespace fsdp_ext::comm
