// Which UCX_TLS values let UCX's mm transports (posix, sysv, xpmem) run:
// only then does the backend shrink their receive pools
// (comm/ucx_config_defaults.h); otherwise UCX would warn about a setting
// that no transport reads.
#include <gtest/gtest.h>

#include "comm/ucx_config_defaults.h"

namespace fsdp_ext::comm {
namespace {

TEST(UcxTlsAllowsMm, UnsetOrAllOrAnAliasAllows) {
  EXPECT_TRUE(ucx_tls_allows_mm_transports(""));
  EXPECT_TRUE(ucx_tls_allows_mm_transports("all"));
  EXPECT_TRUE(ucx_tls_allows_mm_transports("self,sm,tcp"));
  EXPECT_TRUE(ucx_tls_allows_mm_transports("shm"));
  EXPECT_TRUE(ucx_tls_allows_mm_transports("tcp,mm"));
  EXPECT_TRUE(ucx_tls_allows_mm_transports("tcp,\\posix"));
  EXPECT_TRUE(ucx_tls_allows_mm_transports("sysv:aux,tcp"));
}

TEST(UcxTlsAllowsMm, AListWithoutThemRefuses) {
  EXPECT_FALSE(ucx_tls_allows_mm_transports("tcp"));
  EXPECT_FALSE(ucx_tls_allows_mm_transports("self,tcp,cma"));
  // Names that merely contain a member's letters are other transports.
  EXPECT_FALSE(ucx_tls_allows_mm_transports("self,rc_mlx5,posixx"));
}

TEST(UcxTlsAllowsMm, ExclusionsCountMembers) {
  EXPECT_TRUE(ucx_tls_allows_mm_transports("^posix"));
  // xpmem alone does not count: it is rarely installed.
  EXPECT_FALSE(ucx_tls_allows_mm_transports("^posix,sysv"));
  EXPECT_FALSE(ucx_tls_allows_mm_transports("xpmem,tcp"));
  EXPECT_FALSE(ucx_tls_allows_mm_transports("^sm"));
  EXPECT_FALSE(ucx_tls_allows_mm_transports("^tcp,mm"));
  EXPECT_TRUE(ucx_tls_allows_mm_transports("^tcp,cma"));
}

}  // namespace
}  // namespace fsdp_ext::comm
