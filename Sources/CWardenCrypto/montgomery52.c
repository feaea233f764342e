/* RSA public-key operation (m = s^e mod n) for moduli of up to 2048 bits on AVX-512 IFMA.

   Numbers are held as 40 limbs of 52 bits (2080 bits), the width of the IFMA instructions'
   products (vpmadd52luq/vpmadd52huq add the low or high 52 bits of a 52 x 52-bit product to
   each of eight 64-bit lanes). Multiplication is Montgomery's with R = 2^2080, in its "almost"
   form: with R > 4n, inputs below 2n give an output below 2n, so no subtraction is needed
   between multiplications and only the final result is reduced below n.

   One multiplication runs 40 rounds, one per limb b[i] of the multiplier. Each round adds
   a * b[i] and y * n to the accumulator, with y chosen so that its lowest limb becomes a
   multiple of 2^52, then shifts the accumulator down one limb, carrying that limb's top bits
   into the next. The low halves of the products are added before the shift, the high halves
   (which belong one limb up) after it. A lane receives at most four values below 2^52 and a
   carry per round over at most 40 rounds, so no lane reaches 2^60 and nothing is lost before
   the carries are propagated at the end.

   Everything here is public (the signature, the key, the result): no step needs to run in
   constant time. Functions using the instructions carry a target attribute, and are called
   only after the CPU was seen to have them; the rest of the library is built as usual. */

#include "montgomery52.h"

#include <string.h>

#define LIMBS WARDEN_M52_LIMBS
#define MASK52 0xFFFFFFFFFFFFFULL

#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#include <immintrin.h>
#define HAVE_IFMA_BUILD 1
#else
#define HAVE_IFMA_BUILD 0
#endif

int warden_m52_cpu_supported(void) {
#if HAVE_IFMA_BUILD
    /* The compiler's runtime also checks that the OS saves the AVX-512 state. */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512ifma");
#else
    return 0;
#endif
}

/* Big-endian bytes (at most 260) into 52-bit limbs. */
static void to_limbs(uint64_t out[LIMBS], const uint8_t *be, size_t len) {
    uint64_t words[LIMBS * 52 / 64 + 2] = {0};
    for (size_t i = 0; i < len; i++) {
        size_t bit = 8 * i; /* of the byte counted from the least significant end */
        words[bit / 64] |= (uint64_t)be[len - 1 - i] << (bit % 64);
    }
    for (int j = 0; j < LIMBS; j++) {
        unsigned position = 52u * (unsigned)j;
        unsigned word = position / 64, offset = position % 64;
        uint64_t value = words[word] >> offset;
        if (offset > 12) value |= words[word + 1] << (64 - offset);
        out[j] = value & MASK52;
    }
}

/* Normalised limbs into `len` big-endian bytes; 0 if the value does not fit. */
static int from_limbs(uint8_t *be, size_t len, const uint64_t in[LIMBS]) {
    uint64_t words[LIMBS * 52 / 64 + 2] = {0};
    for (int j = 0; j < LIMBS; j++) {
        unsigned position = 52u * (unsigned)j;
        unsigned word = position / 64, offset = position % 64;
        words[word] |= in[j] << offset;
        if (offset > 12) words[word + 1] |= in[j] >> (64 - offset);
    }
    for (size_t i = 0; i < sizeof(words); i++) {
        uint8_t byte = (uint8_t)(words[i / 8] >> (8 * (i % 8)));
        if (i < len) be[len - 1 - i] = byte;
        else if (byte != 0) return 0;
    }
    return 1;
}

int warden_m52_init(warden_m52 *ctx, const uint8_t *n, size_t n_len, const uint8_t *r2, size_t r2_len,
                    uint64_t e) {
    if (n_len == 0 || n_len > 256 || r2_len > 256 || (n[n_len - 1] & 1) == 0 || e < 3) return 0;
    memset(ctx, 0, sizeof(*ctx));
    to_limbs(ctx->n, n, n_len);
    to_limbs(ctx->r2, r2, r2_len);
    /* k0 = -n^-1 mod 2^52, by Newton's iteration (each step doubles the correct low bits). */
    uint64_t n0 = ctx->n[0], inverse = 1;
    for (int i = 0; i < 6; i++) inverse *= 2 - n0 * inverse;
    ctx->k0 = (0 - inverse) & MASK52;
    ctx->e = e;
    ctx->n_len = n_len;
    return 1;
}

#if HAVE_IFMA_BUILD
#define IFMA __attribute__((target("avx512f,avx512ifma")))

/* res = a * b / R mod n, almost: a, b < 2n in normalised limbs give res < 2n, normalised.

   A round's work is ordered so that little of it waits on the round before: the products of a
   with b[i] (low and high halves) depend only on b[i]; y needs only the accumulator's lowest
   lane; the high halves of a * b[i] and y * n go into a vector of their own (T), added once the
   accumulator has shifted. y is computed in the vector unit: IFMA multiplies only the low 52
   bits of its operands, so y's lane may hold y plus a multiple of 2^52. */
IFMA static void multiply(uint64_t res[LIMBS], const uint64_t a[LIMBS], const uint64_t b[LIMBS],
                          const warden_m52 *ctx) {
    const uint64_t *n = ctx->n;
    const __m512i A0 = _mm512_loadu_si512(a), A1 = _mm512_loadu_si512(a + 8), A2 = _mm512_loadu_si512(a + 16),
                  A3 = _mm512_loadu_si512(a + 24), A4 = _mm512_loadu_si512(a + 32);
    const __m512i N0 = _mm512_loadu_si512(n), N1 = _mm512_loadu_si512(n + 8), N2 = _mm512_loadu_si512(n + 16),
                  N3 = _mm512_loadu_si512(n + 24), N4 = _mm512_loadu_si512(n + 32);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i K = _mm512_set1_epi64((long long)ctx->k0), a0 = _mm512_set1_epi64((long long)a[0]);
    __m512i R0 = zero, R1 = zero, R2 = zero, R3 = zero, R4 = zero;
    for (int i = 0; i < LIMBS; i++) {
        const __m512i B = _mm512_set1_epi64((long long)b[i]);
        /* y = (R[0] + lo(a0 * b[i])) * k0 mod 2^52 = R[0] * k0 + lo(a0 * b[i]) * k0 (mod 2^52),
           the second term without waiting on R. */
        const __m512i W = _mm512_madd52lo_epu64(zero, _mm512_madd52lo_epu64(zero, a0, B), K);
        const __m512i Y = _mm512_madd52lo_epu64(W, _mm512_broadcastq_epi64(_mm512_castsi512_si128(R0)), K);
        __m512i T0 = _mm512_madd52hi_epu64(zero, A0, B), T1 = _mm512_madd52hi_epu64(zero, A1, B),
                T2 = _mm512_madd52hi_epu64(zero, A2, B), T3 = _mm512_madd52hi_epu64(zero, A3, B),
                T4 = _mm512_madd52hi_epu64(zero, A4, B);
        R0 = _mm512_madd52lo_epu64(R0, A0, B);
        R1 = _mm512_madd52lo_epu64(R1, A1, B);
        R2 = _mm512_madd52lo_epu64(R2, A2, B);
        R3 = _mm512_madd52lo_epu64(R3, A3, B);
        R4 = _mm512_madd52lo_epu64(R4, A4, B);
        R0 = _mm512_madd52lo_epu64(R0, N0, Y);
        R1 = _mm512_madd52lo_epu64(R1, N1, Y);
        R2 = _mm512_madd52lo_epu64(R2, N2, Y);
        R3 = _mm512_madd52lo_epu64(R3, N3, Y);
        R4 = _mm512_madd52lo_epu64(R4, N4, Y);
        T0 = _mm512_madd52hi_epu64(T0, N0, Y);
        T1 = _mm512_madd52hi_epu64(T1, N1, Y);
        T2 = _mm512_madd52hi_epu64(T2, N2, Y);
        T3 = _mm512_madd52hi_epu64(T3, N3, Y);
        T4 = _mm512_madd52hi_epu64(T4, N4, Y);
        /* The lowest lane is now a multiple of 2^52: its quotient carries into the next limb. */
        const __m512i carry = _mm512_maskz_srli_epi64(1, R0, 52);
        R0 = _mm512_alignr_epi64(R1, R0, 1);
        R1 = _mm512_alignr_epi64(R2, R1, 1);
        R2 = _mm512_alignr_epi64(R3, R2, 1);
        R3 = _mm512_alignr_epi64(R4, R3, 1);
        R4 = _mm512_alignr_epi64(zero, R4, 1);
        R0 = _mm512_add_epi64(_mm512_add_epi64(R0, carry), T0);
        R1 = _mm512_add_epi64(R1, T1);
        R2 = _mm512_add_epi64(R2, T2);
        R3 = _mm512_add_epi64(R3, T3);
        R4 = _mm512_add_epi64(R4, T4);
    }
    uint64_t t[LIMBS];
    _mm512_storeu_si512(t, R0);
    _mm512_storeu_si512(t + 8, R1);
    _mm512_storeu_si512(t + 16, R2);
    _mm512_storeu_si512(t + 24, R3);
    _mm512_storeu_si512(t + 32, R4);
    uint64_t carry = 0;
    for (int j = 0; j < LIMBS; j++) {
        uint64_t v = t[j] + carry;
        res[j] = v & MASK52;
        carry = v >> 52;
    }
    /* res < 2n < 2^2049: nothing is left above the top limb. */
}

IFMA int warden_m52_public(const warden_m52 *ctx, const uint8_t *s, size_t s_len, uint8_t *m) {
    if (s_len != ctx->n_len) return 0;
    uint64_t base[LIMBS], x[LIMBS], one[LIMBS] = {1};
    to_limbs(x, s, s_len);
    /* s < n is checked here too: every caller relies on it. */
    int below = 0;
    for (int j = LIMBS - 1; j >= 0; j--) {
        if (x[j] != ctx->n[j]) { below = x[j] < ctx->n[j]; break; }
    }
    if (!below) return 0;
    multiply(base, x, ctx->r2, ctx); /* s R mod n */
    memcpy(x, base, sizeof(x));
    int top = 63 - __builtin_clzll(ctx->e);
    for (int bit = top - 1; bit >= 0; bit--) {
        multiply(x, x, x, ctx);
        if ((ctx->e >> bit) & 1) multiply(x, x, base, ctx);
    }
    multiply(x, x, one, ctx); /* out of Montgomery form: below n + 1 */
    /* Reduce below n: subtract n once if x >= n. */
    int geq = 1;
    for (int j = LIMBS - 1; j >= 0; j--) {
        if (x[j] != ctx->n[j]) { geq = x[j] > ctx->n[j]; break; }
    }
    if (geq) {
        uint64_t borrow = 0;
        for (int j = 0; j < LIMBS; j++) {
            uint64_t v = x[j] - ctx->n[j] - borrow;
            borrow = v >> 63;
            x[j] = v & MASK52;
        }
    }
    return from_limbs(m, ctx->n_len, x);
}
#else
int warden_m52_public(const warden_m52 *ctx, const uint8_t *s, size_t s_len, uint8_t *m) {
    (void)ctx; (void)s; (void)s_len; (void)m;
    return 0;
}
#endif
