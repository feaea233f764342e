#ifndef WARDEN_MONTGOMERY52_H
#define WARDEN_MONTGOMERY52_H

#include <stddef.h>
#include <stdint.h>

#define WARDEN_M52_LIMBS 40

/// An RSA public key of up to 2048 bits in 52-bit limbs, with its Montgomery constants
/// (R = 2^2080). Read-only once built: threads share it.
typedef struct {
    uint64_t n[WARDEN_M52_LIMBS];
    uint64_t r2[WARDEN_M52_LIMBS]; /* R^2 mod n */
    uint64_t k0;                   /* -n^-1 mod 2^52 */
    uint64_t e;
    size_t n_len;                  /* bytes of n, and of every signature */
} warden_m52;

/// 1 when this CPU (and OS) runs AVX-512 IFMA.
int warden_m52_cpu_supported(void);
/// n odd, big-endian, at most 256 bytes; r2 = 2^4160 mod n, big-endian; e >= 3. 0 if unusable.
int warden_m52_init(warden_m52 *ctx, const uint8_t *n, size_t n_len, const uint8_t *r2, size_t r2_len,
                    uint64_t e);
/// m = s^e mod n, both n_len big-endian bytes. 0 if s >= n, s is not n_len bytes, or the CPU
/// lacks the instructions (call only when `warden_m52_cpu_supported`).
int warden_m52_public(const warden_m52 *ctx, const uint8_t *s, size_t s_len, uint8_t *m);

#endif
