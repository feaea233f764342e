#ifndef CBENCH_REFERENCE_H
#define CBENCH_REFERENCE_H

/// The operation `openssl speed rsa2048` times for verify/s, reproduced in-process so the
/// benchmark can interleave it with Warden's own verification: a 2048-bit RSA key (e = 65537),
/// a PKCS#1 v1.5 signature over a 36-byte buffer, and EVP_PKEY_verify on a prepared context.
typedef struct bench_reference bench_reference;

bench_reference *bench_reference_new(void);
/// 1 when the signature verifies (it always should).
int bench_reference_verify(bench_reference *reference);
void bench_reference_free(bench_reference *reference);

#endif
