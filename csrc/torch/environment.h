// The environment variables the ops read, in one place.
#pragma once

#include <cstdlib>
#include <cstring>

namespace sageattention2 {

// Whether sageattn_wgmma and sageattn_mma launch each step as a programmatic dependent of the
// one before (common/launch.cuh): on unless SAGEATTN_PDL=0 (benchmarks: the same process with
// and without).
inline bool programmatic_launches() {
  const char* forced = std::getenv("SAGEATTN_PDL");
  return forced == nullptr || std::strcmp(forced, "0") != 0;
}

}  // namespace sageattention2
