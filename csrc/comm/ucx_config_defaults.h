// Where the backend departs from UCX's own defaults. Applied to the
// configuration a group's UCX context is created from; a setting the user
// made (an environment variable, or UCX_TLS leaving the transport out) wins.
#pragma once

#include <ucp/api/ucp.h>

#include <string>

namespace fsdp_ext::comm {

// Shrinks the receive pools of UCX's shared-memory transports (posix and
// sysv, the "mm" family): UCX grows them 512 segments of 8 KiB at a time,
// so every worker takes about 4 MiB of /dev/shm (posix) and as much again of
// System V memory when it starts, and every group of every rank has a worker
// of its own. 64 segments is the 1.13 FIFO's length (the descriptors a
// worker needs at start); under load the pools still grow, by 64.
// Skipped where the user set any UCX_<TRANSPORT>_RX_BUFS_GROW, or where the
// effective UCX_TLS leaves the mm transports out (UCX warns about a setting
// no transport reads).
void apply_ucx_config_defaults(ucp_config_t* config);

// Whether a UCX_TLS value (as UCX reads it: a comma list, "^" in front to
// exclude, aliases "all", "sm", "shm", "mm") lets posix or sysv run.
bool ucx_tls_allows_mm_transports(const std::string& tls);

}  // namespace fsdp_ext::comm
