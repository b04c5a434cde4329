// The 64-bit UCX tag layout. Each process group owns its own UCX worker, so
// tags only need to keep apart the operations of one group:
//
//   bit 63      : 1 = user point-to-point message, 0 = collective
//   collective  : bits 62..59 the op's CollectiveKind (comm/collective_kind.h:
//                 ranks in different collectives never match), bits 58..36
//                 op sequence number (23 bits, wraps harmlessly: ops complete
//                 in order), bits 35..20 step within the op, bits 19..0
//                 sender rank
//   p2p         : bits 51..20 the user's tag (32 bits), bits 19..0 sender rank
//   notice      : bit 63 and bit 62 set, bits 19..0 sender rank: a failing
//                 rank's notice to its peers (comm/failure_notice.h); bit 62
//                 is never set in a user's tag, so no user receive takes it
//
// The sender rank is in the low bits so a receive from any source can mask it
// out and read the actual sender back from the matched tag.
#pragma once

#include <cstdint>

#include "comm/collective_kind.h"

namespace fsdp_ext::comm::tag {

constexpr uint64_t kP2PBit = uint64_t{1} << 63;
constexpr uint64_t kNoticeBit = uint64_t{1} << 62;
constexpr int kRankBits = 20;
constexpr uint64_t kRankMask = (uint64_t{1} << kRankBits) - 1;
constexpr int kStepShift = kRankBits;
constexpr int kStepBits = 16;
constexpr uint64_t kStepMask = (uint64_t{1} << kStepBits) - 1;
constexpr int kSeqShift = kStepShift + kStepBits;
constexpr uint64_t kSeqMask = (uint64_t{1} << 23) - 1;
constexpr int kKindShift = kSeqShift + 23;
constexpr uint64_t kKindMask = 0xf;
constexpr uint64_t kMatchAll = ~uint64_t{0};
constexpr uint64_t kMatchAnySender = ~kRankMask;
// Collective messages from one sender, whatever their kind, op and step.
constexpr uint64_t kMatchCollectiveSender = kP2PBit | kRankMask;
static_assert(kCollectiveKindCount <= 16, "CollectiveKind has four bits in a tag");
constexpr int kMaxRanks = 1 << kRankBits;
constexpr uint32_t kMaxSteps = 1u << kStepBits;

inline uint64_t collective(uint64_t seq, uint32_t step, int sender,
                           CollectiveKind kind = CollectiveKind::kUnnamed) {
  return ((static_cast<uint64_t>(kind) & kKindMask) << kKindShift) |
         ((seq & kSeqMask) << kSeqShift) |
         ((uint64_t{step} & kStepMask) << kStepShift) |
         (static_cast<uint64_t>(sender) & kRankMask);
}

inline uint64_t point_to_point(int user_tag, int sender) {
  return kP2PBit |
         (uint64_t{static_cast<uint32_t>(user_tag)} << kRankBits) |
         (static_cast<uint64_t>(sender) & kRankMask);
}

inline uint64_t failure_notice(int sender) {
  return kP2PBit | kNoticeBit | (static_cast<uint64_t>(sender) & kRankMask);
}

inline int sender_of(uint64_t t) { return static_cast<int>(t & kRankMask); }
inline uint64_t seq_of(uint64_t t) { return (t >> kSeqShift) & kSeqMask; }
inline CollectiveKind kind_of(uint64_t t) {
  return static_cast<CollectiveKind>((t >> kKindShift) & kKindMask);
}

}  // namespace fsdp_ext::comm::tag
