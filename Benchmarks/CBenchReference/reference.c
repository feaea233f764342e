#include "CBenchReference.h"

#include <string.h>
#include <openssl/evp.h>
#include <openssl/rsa.h>

struct bench_reference {
    EVP_PKEY *key;
    EVP_PKEY_CTX *verify;
    unsigned char message[36];
    unsigned char signature[256];
    size_t signature_len;
};

bench_reference *bench_reference_new(void) {
    bench_reference *r = OPENSSL_zalloc(sizeof(*r));
    if (r == NULL) return NULL;
    memset(r->message, 1, sizeof(r->message));
    r->key = EVP_RSA_gen(2048);
    EVP_PKEY_CTX *sign = r->key ? EVP_PKEY_CTX_new(r->key, NULL) : NULL;
    r->signature_len = sizeof(r->signature);
    int ok = sign != NULL && EVP_PKEY_sign_init(sign) > 0 &&
             EVP_PKEY_sign(sign, r->signature, &r->signature_len, r->message, sizeof(r->message)) > 0;
    EVP_PKEY_CTX_free(sign);
    r->verify = ok ? EVP_PKEY_CTX_new(r->key, NULL) : NULL;
    if (r->verify == NULL || EVP_PKEY_verify_init(r->verify) <= 0) {
        bench_reference_free(r);
        return NULL;
    }
    return r;
}

int bench_reference_verify(bench_reference *r) {
    return EVP_PKEY_verify(r->verify, r->signature, r->signature_len, r->message, sizeof(r->message)) == 1;
}

void bench_reference_free(bench_reference *r) {
    if (r == NULL) return;
    EVP_PKEY_CTX_free(r->verify);
    EVP_PKEY_free(r->key);
    OPENSSL_free(r);
}
