// AMX tile state shared by the kernels that run tile products (linear.cpp's bf16 matmul,
// paged_attention.cpp's prefill attention): whether the build and the kernel allow it,
// the one tile configuration both use, and the per-thread configure/release.
#pragma once
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define FLOTILLA_AMX 1
#else
#define FLOTILLA_AMX 0
#endif

#if FLOTILLA_AMX
namespace flotilla::amx {

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: an A tile is 16 rows x 32 bf16, a B tile 16 pairs x 16
// columns, a C tile 16 x 16 float32. A static: GCC's _tile_loadconfig declares only an
// 8-byte read of the 64, so a local config's other bytes could be dropped as dead stores.
inline const Config& config() {
  static const Config cfg = [] {
    Config c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  return cfg;
}

// Linux hands out the tile state only on request; asked once per process, on first use
// (once granted, every signal frame of the process grows by the 8 KB of tile state).
inline bool granted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The tiles, configured for the calling thread (a parallel region's start) and released
// at its end, so a context switch does not save 8 KB of tile state.
struct Tiles {
  Tiles() { _tile_loadconfig(&config()); }
  ~Tiles() { _tile_release(); }
};

}  // namespace flotilla::amx
#endif
