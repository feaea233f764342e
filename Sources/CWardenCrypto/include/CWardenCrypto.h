#ifndef CWARDEN_CRYPTO_H
#define CWARDEN_CRYPTO_H

#include <stddef.h>
#include <stdint.h>

/// An immutable public key held by OpenSSL. Safe to share between threads.
typedef struct warden_key warden_key;

/// A signature checker bound to one key and one JWS algorithm. Holds mutable OpenSSL
/// contexts: use it from one thread at a time.
typedef struct warden_checker warden_checker;

/// JWS algorithms understood by the checker.
typedef enum {
    WARDEN_RS256 = 1, WARDEN_RS384, WARDEN_RS512,
    WARDEN_PS256, WARDEN_PS384, WARDEN_PS512,
    WARDEN_ES256, WARDEN_ES384, WARDEN_ES512,
    WARDEN_EDDSA
} warden_alg;

/// Big-endian modulus and exponent. Returns NULL when OpenSSL refuses the key.
warden_key *warden_rsa_key_new(const uint8_t *n, size_t n_len, const uint8_t *e, size_t e_len);
/// `curve_bits` is 256, 384 or 521; x and y are the fixed-size big-endian coordinates.
/// Returns NULL when the point is not on the curve or the sizes are wrong.
warden_key *warden_ec_key_new(int curve_bits, const uint8_t *x, size_t x_len, const uint8_t *y, size_t y_len);
/// A 32-byte Ed25519 public key.
warden_key *warden_ed25519_key_new(const uint8_t *x, size_t x_len);
void warden_key_free(warden_key *key);
/// Size of the key in bits (RSA modulus, EC field).
int warden_key_bits(const warden_key *key);

/// 1 when an RSA key's public operation runs on AVX-512 IFMA (the CPU has it and the modulus has
/// at most 2048 bits), 0 when it runs on libcrypto alone.
int warden_rsa_key_is_fast(const warden_key *key);
/// RSAVP1: m = s^e mod n for an RSA key, s and m as long as the modulus (big-endian). `fast` 1
/// on the IFMA path (0 if the key has none), 0 on libcrypto's. 1 on success, 0 when s >= n or
/// a size differs. For checking one path against the other.
int warden_rsa_public(const warden_key *key, int fast, const uint8_t *s, size_t s_len, uint8_t *m, size_t m_len);

/// Returns NULL if the key cannot be used with the algorithm.
warden_checker *warden_checker_new(const warden_key *key, warden_alg alg);
void warden_checker_free(warden_checker *checker);

/// 1: the signature is valid for the message. 0: it is not (wrong size, out of range, or a
/// failed check). Never anything else.
int warden_checker_verify(warden_checker *checker,
                          const uint8_t *message, size_t message_len,
                          const uint8_t *signature, size_t signature_len);

#endif
