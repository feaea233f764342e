#include "CWardenCrypto.h"
#include "montgomery52.h"

#include <string.h>
#include <openssl/bn.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/ec.h>
#include <openssl/evp.h>
#include <openssl/obj_mac.h>
#include <openssl/param_build.h>
#include <openssl/rsa.h>

struct warden_key {
    EVP_PKEY *pkey;
    int kind;          /* 1 RSA, 2 EC, 3 Ed25519 */
    int curve_bits;    /* EC only */
    /* RSA only: the public key in the form the PKCS #1 v1.5 check uses. Read-only once built,
       so checkers on several threads share it. */
    BIGNUM *n;
    BIGNUM *e;
    BN_MONT_CTX *mont; /* Montgomery form of n */
    size_t modulus_len;
    /* The same key for the AVX-512 IFMA path (montgomery52.c), when the CPU has it and n has
       at most 2048 bits; NULL otherwise. */
    warden_m52 *fast;
};

struct warden_checker {
    const warden_key *key;
    warden_alg alg;
    EVP_MD *md;             /* NULL for EdDSA */
    EVP_MD_CTX *md_ctx;     /* digest (RSA/EC) or one-shot verify (EdDSA) */
    EVP_PKEY_CTX *pkey_ctx; /* PS and ES: initialised once, reused for every check */
    BIGNUM *order;          /* EC group order, for the 1 <= r, s < n check */
    size_t coordinate_len;  /* EC: bytes per R and S */
    /* RS: scratch numbers and context, reused for every check. */
    BN_CTX *bn_ctx;
    BIGNUM *s, *s_mont, *m;
    const uint8_t *digest_info; /* DER DigestInfo prefix of the algorithm's hash */
    size_t digest_info_len;
};

static warden_key *wrap(EVP_PKEY *pkey, int kind, int curve_bits) {
    if (pkey == NULL) return NULL;
    warden_key *key = OPENSSL_zalloc(sizeof(*key));
    if (key == NULL) { EVP_PKEY_free(pkey); return NULL; }
    key->pkey = pkey;
    key->kind = kind;
    key->curve_bits = curve_bits;
    return key;
}

static EVP_PKEY *from_params(const char *type, OSSL_PARAM *params) {
    EVP_PKEY *pkey = NULL;
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_from_name(NULL, type, NULL);
    if (ctx == NULL) return NULL;
    if (EVP_PKEY_fromdata_init(ctx) <= 0 ||
        EVP_PKEY_fromdata(ctx, &pkey, EVP_PKEY_PUBLIC_KEY, params) <= 0) {
        pkey = NULL;
    }
    EVP_PKEY_CTX_free(ctx);
    return pkey;
}

/* RSAVP1 (RFC 8017 §5.2.2): m = s^e mod n into `out` (k bytes), 0 when s >= n. On libcrypto's
   Montgomery multiplication, with the key's precomputed Montgomery context and the caller's
   scratch numbers: left-to-right square-and-multiply over the bits of e. */
static int public_op_libcrypto(const warden_key *key, BN_CTX *ctx, BIGNUM *s, BIGNUM *s_mont, BIGNUM *m,
                               const uint8_t *signature, size_t k, uint8_t *out) {
    if (BN_bin2bn(signature, (int)k, s) == NULL) return 0;
    if (BN_ucmp(s, key->n) >= 0) return 0;
    if (!BN_to_montgomery(s_mont, s, key->mont, ctx)) return 0;
    if (BN_copy(m, s_mont) == NULL) return 0;
    for (int bit = BN_num_bits(key->e) - 2; bit >= 0; bit--) {
        if (!BN_mod_mul_montgomery(m, m, m, key->mont, ctx)) return 0;
        if (BN_is_bit_set(key->e, bit) && !BN_mod_mul_montgomery(m, m, s_mont, key->mont, ctx)) return 0;
    }
    if (!BN_from_montgomery(m, m, key->mont, ctx)) return 0;
    return BN_bn2binpad(m, out, (int)k) == (int)k;
}

/* The same with scratch numbers of its own, off the verification path (a key's known-answer
   check, tests). */
static int public_op_libcrypto_alone(const warden_key *key, const uint8_t *signature, size_t k, uint8_t *out) {
    BN_CTX *ctx = BN_CTX_new();
    BIGNUM *a = BN_new(), *b = BN_new(), *c = BN_new();
    int ok = ctx && a && b && c && public_op_libcrypto(key, ctx, a, b, c, signature, k, out);
    BN_free(a);
    BN_free(b);
    BN_free(c);
    BN_CTX_free(ctx);
    return ok;
}

/* Whether the key's IFMA form gives libcrypto's results for two values (n - 2, whose limbs are
   near-full, and a fixed pattern): a known-answer check on this machine's CPU and build before
   the form is trusted with any signature. */
static int fast_form_agrees(const warden_key *key, const warden_m52 *fast) {
    size_t k = key->modulus_len;
    uint8_t inputs[2][256], fast_out[256], libcrypto_out[256];
    BIGNUM *t = BN_dup(key->n);
    int ok = t && BN_sub_word(t, 2) && BN_bn2binpad(t, inputs[0], (int)k) == (int)k;
    BN_free(t);
    for (size_t i = 0; i < k; i++) inputs[1][i] = (uint8_t)(i * 151 + 7);
    inputs[1][0] = 0; /* below n, whose top byte is not 0 */
    for (int v = 0; ok && v < 2; v++) {
        ok = warden_m52_public(fast, inputs[v], k, fast_out) && public_op_libcrypto_alone(key, inputs[v], k, libcrypto_out) &&
             memcmp(fast_out, libcrypto_out, k) == 0;
    }
    return ok;
}

/* The key in 52-bit limbs with R^2 mod n (R = 2^2080), checked against libcrypto; NULL if
   anything fails, and the key then runs on libcrypto alone. */
static warden_m52 *fast_form(const warden_key *key, BN_CTX *ctx) {
    const BIGNUM *n = key->n;
    warden_m52 *fast = OPENSSL_zalloc(sizeof(*fast));
    BIGNUM *r2 = BN_new();
    uint8_t n_bytes[256], r2_bytes[256];
    int n_len = BN_num_bytes(n);
    int ok = fast != NULL && r2 != NULL && n_len <= 256 &&
             BN_set_bit(r2, 2 * 52 * WARDEN_M52_LIMBS) && BN_mod(r2, r2, n, ctx) &&
             BN_bn2binpad(n, n_bytes, n_len) == n_len && BN_bn2binpad(r2, r2_bytes, n_len) == n_len &&
             warden_m52_init(fast, n_bytes, (size_t)n_len, r2_bytes, (size_t)n_len, (uint64_t)BN_get_word(key->e)) &&
             fast_form_agrees(key, fast);
    BN_free(r2);
    if (!ok) { OPENSSL_free(fast); return NULL; }
    return fast;
}

warden_key *warden_rsa_key_new(const uint8_t *n, size_t n_len, const uint8_t *e, size_t e_len) {
    EVP_PKEY *pkey = NULL;
    BIGNUM *bn_n = BN_bin2bn(n, (int)n_len, NULL);
    BIGNUM *bn_e = BN_bin2bn(e, (int)e_len, NULL);
    OSSL_PARAM_BLD *bld = OSSL_PARAM_BLD_new();
    OSSL_PARAM *params = NULL;
    BN_CTX *ctx = BN_CTX_new();
    BN_MONT_CTX *mont = BN_MONT_CTX_new();
    warden_key *key = NULL;
    /* A usable public key has an odd modulus and an odd exponent of at least 3 (e = 1 would
       make every message its own signature) and at most 64 bits, as OpenSSL also requires. */
    if (bn_n && bn_e && bld && ctx && mont &&
        BN_is_odd(bn_n) && BN_is_odd(bn_e) && !BN_is_one(bn_e) && BN_num_bits(bn_e) <= 64 &&
        BN_ucmp(bn_e, bn_n) < 0 &&
        BN_MONT_CTX_set(mont, bn_n, ctx) &&
        OSSL_PARAM_BLD_push_BN(bld, OSSL_PKEY_PARAM_RSA_N, bn_n) &&
        OSSL_PARAM_BLD_push_BN(bld, OSSL_PKEY_PARAM_RSA_E, bn_e) &&
        (params = OSSL_PARAM_BLD_to_param(bld)) != NULL) {
        pkey = from_params("RSA", params);
        key = wrap(pkey, 1, 0);
    }
    if (key != NULL) {
        key->n = bn_n;
        key->e = bn_e;
        key->mont = mont;
        key->modulus_len = (size_t)BN_num_bytes(bn_n);
        bn_n = bn_e = NULL;
        mont = NULL;
        if (warden_m52_cpu_supported() && BN_num_bits(key->n) <= 2048) key->fast = fast_form(key, ctx);
    }
    OSSL_PARAM_free(params);
    OSSL_PARAM_BLD_free(bld);
    BN_CTX_free(ctx);
    BN_MONT_CTX_free(mont);
    BN_free(bn_n);
    BN_free(bn_e);
    return key;
}

static const char *group_name(int curve_bits) {
    switch (curve_bits) {
    case 256: return "prime256v1";
    case 384: return "secp384r1";
    case 521: return "secp521r1";
    default: return NULL;
    }
}

static size_t coordinate_len(int curve_bits) { return (size_t)((curve_bits + 7) / 8); }

warden_key *warden_ec_key_new(int curve_bits, const uint8_t *x, size_t x_len, const uint8_t *y, size_t y_len) {
    const char *group = group_name(curve_bits);
    size_t len = coordinate_len(curve_bits);
    if (group == NULL || x_len != len || y_len != len) return NULL;
    uint8_t point[1 + 2 * 66];
    point[0] = 0x04;
    memcpy(point + 1, x, len);
    memcpy(point + 1 + len, y, len);

    OSSL_PARAM params[3];
    params[0] = OSSL_PARAM_construct_utf8_string(OSSL_PKEY_PARAM_GROUP_NAME, (char *)group, 0);
    params[1] = OSSL_PARAM_construct_octet_string(OSSL_PKEY_PARAM_PUB_KEY, point, 1 + 2 * len);
    params[2] = OSSL_PARAM_construct_end();
    EVP_PKEY *pkey = from_params("EC", params);
    if (pkey == NULL) return NULL;

    /* Refuse points that are not on the curve (or are the point at infinity). */
    EVP_PKEY_CTX *check = EVP_PKEY_CTX_new_from_pkey(NULL, pkey, NULL);
    int ok = check != NULL && EVP_PKEY_public_check(check) == 1;
    EVP_PKEY_CTX_free(check);
    if (!ok) { EVP_PKEY_free(pkey); return NULL; }
    return wrap(pkey, 2, curve_bits);
}

warden_key *warden_ed25519_key_new(const uint8_t *x, size_t x_len) {
    if (x_len != 32) return NULL;
    return wrap(EVP_PKEY_new_raw_public_key_ex(NULL, "ED25519", NULL, x, x_len), 3, 0);
}

void warden_key_free(warden_key *key) {
    if (key == NULL) return;
    EVP_PKEY_free(key->pkey);
    BN_free(key->n);
    BN_free(key->e);
    BN_MONT_CTX_free(key->mont);
    OPENSSL_free(key->fast);
    OPENSSL_free(key);
}

int warden_key_bits(const warden_key *key) { return EVP_PKEY_get_bits(key->pkey); }

static const char *digest_name(warden_alg alg) {
    switch (alg) {
    case WARDEN_RS256: case WARDEN_PS256: case WARDEN_ES256: return "SHA256";
    case WARDEN_RS384: case WARDEN_PS384: case WARDEN_ES384: return "SHA384";
    case WARDEN_RS512: case WARDEN_PS512: case WARDEN_ES512: return "SHA512";
    default: return NULL;
    }
}

static int expected_kind(warden_alg alg) {
    switch (alg) {
    case WARDEN_RS256: case WARDEN_RS384: case WARDEN_RS512:
    case WARDEN_PS256: case WARDEN_PS384: case WARDEN_PS512: return 1;
    case WARDEN_ES256: case WARDEN_ES384: case WARDEN_ES512: return 2;
    case WARDEN_EDDSA: return 3;
    }
    return 0;
}

static int expected_curve(warden_alg alg) {
    switch (alg) {
    case WARDEN_ES256: return 256;
    case WARDEN_ES384: return 384;
    case WARDEN_ES512: return 521;
    default: return 0;
    }
}

/* DER of DigestInfo up to the hash value, for SHA-256, -384, -512 (RFC 8017 §9.2, note 1). */
static const uint8_t digest_info_sha256[] = {
    0x30, 0x31, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01, 0x05, 0x00, 0x04, 0x20};
static const uint8_t digest_info_sha384[] = {
    0x30, 0x41, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x02, 0x05, 0x00, 0x04, 0x30};
static const uint8_t digest_info_sha512[] = {
    0x30, 0x51, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x03, 0x05, 0x00, 0x04, 0x40};

static void digest_info(warden_alg alg, const uint8_t **prefix, size_t *len) {
    switch (alg) {
    case WARDEN_RS384: *prefix = digest_info_sha384; *len = sizeof(digest_info_sha384); break;
    case WARDEN_RS512: *prefix = digest_info_sha512; *len = sizeof(digest_info_sha512); break;
    default: *prefix = digest_info_sha256; *len = sizeof(digest_info_sha256); break;
    }
}

void warden_checker_free(warden_checker *c) {
    if (c == NULL) return;
    EVP_MD_free(c->md);
    EVP_MD_CTX_free(c->md_ctx);
    EVP_PKEY_CTX_free(c->pkey_ctx);
    BN_free(c->order);
    BN_free(c->s);
    BN_free(c->s_mont);
    BN_free(c->m);
    BN_CTX_free(c->bn_ctx);
    OPENSSL_free(c);
}

warden_checker *warden_checker_new(const warden_key *key, warden_alg alg) {
    if (key == NULL || expected_kind(alg) != key->kind) return NULL;
    if (key->kind == 2 && expected_curve(alg) != key->curve_bits) return NULL;

    warden_checker *c = OPENSSL_zalloc(sizeof(*c));
    if (c == NULL) return NULL;
    c->key = key;
    c->alg = alg;
    c->md_ctx = EVP_MD_CTX_new();
    if (c->md_ctx == NULL) goto fail;
    if (alg == WARDEN_EDDSA) return c;

    c->md = EVP_MD_fetch(NULL, digest_name(alg), NULL);
    if (c->md == NULL) goto fail;
    if (alg == WARDEN_RS256 || alg == WARDEN_RS384 || alg == WARDEN_RS512) {
        c->bn_ctx = BN_CTX_new();
        c->s = BN_new();
        c->s_mont = BN_new();
        c->m = BN_new();
        if (c->bn_ctx == NULL || c->s == NULL || c->s_mont == NULL || c->m == NULL) goto fail;
        digest_info(alg, &c->digest_info, &c->digest_info_len);
        /* The encoded message must fit: k >= tLen + 11 (RFC 8017 §9.2 step 3). */
        if (key->modulus_len < c->digest_info_len + (size_t)EVP_MD_get_size(c->md) + 11) goto fail;
        return c;
    }
    c->pkey_ctx = EVP_PKEY_CTX_new_from_pkey(NULL, key->pkey, NULL);
    if (c->md == NULL || c->pkey_ctx == NULL) goto fail;
    if (EVP_PKEY_verify_init(c->pkey_ctx) <= 0) goto fail;
    if (EVP_PKEY_CTX_set_signature_md(c->pkey_ctx, c->md) <= 0) goto fail;

    switch (alg) {
    case WARDEN_PS256: case WARDEN_PS384: case WARDEN_PS512:
        /* RFC 7518 §3.5: MGF1 with the same hash, salt as long as the hash output. */
        if (EVP_PKEY_CTX_set_rsa_padding(c->pkey_ctx, RSA_PKCS1_PSS_PADDING) <= 0 ||
            EVP_PKEY_CTX_set_rsa_mgf1_md(c->pkey_ctx, c->md) <= 0 ||
            EVP_PKEY_CTX_set_rsa_pss_saltlen(c->pkey_ctx, RSA_PSS_SALTLEN_DIGEST) <= 0) goto fail;
        break;
    case WARDEN_ES256: case WARDEN_ES384: case WARDEN_ES512: {
        int nid = key->curve_bits == 256 ? NID_X9_62_prime256v1
                : key->curve_bits == 384 ? NID_secp384r1 : NID_secp521r1;
        EC_GROUP *group = EC_GROUP_new_by_curve_name(nid);
        if (group == NULL) goto fail;
        c->order = BN_dup(EC_GROUP_get0_order(group));
        EC_GROUP_free(group);
        if (c->order == NULL) goto fail;
        c->coordinate_len = coordinate_len(key->curve_bits);
        break;
    }
    default:
        goto fail;
    }
    return c;
fail:
    warden_checker_free(c);
    return NULL;
}

/* JWS carries ECDSA signatures as R || S of fixed size (RFC 7518 §3.4); OpenSSL wants DER.
   Both halves must lie in [1, n-1] (CVE-2022-21449). Returns the DER length or 0. */
static int ecdsa_der(const warden_checker *c, const uint8_t *sig, size_t sig_len,
                     uint8_t *out, size_t out_cap) {
    if (sig_len != 2 * c->coordinate_len) return 0;
    int result = 0;
    ECDSA_SIG *esig = NULL;
    BIGNUM *r = BN_bin2bn(sig, (int)c->coordinate_len, NULL);
    BIGNUM *s = BN_bin2bn(sig + c->coordinate_len, (int)c->coordinate_len, NULL);
    if (r == NULL || s == NULL) goto done;
    if (BN_is_zero(r) || BN_is_zero(s) || BN_cmp(r, c->order) >= 0 || BN_cmp(s, c->order) >= 0) goto done;
    esig = ECDSA_SIG_new();
    if (esig == NULL || ECDSA_SIG_set0(esig, r, s) != 1) goto done;
    r = s = NULL; /* owned by esig now */
    int len = i2d_ECDSA_SIG(esig, NULL);
    if (len <= 0 || (size_t)len > out_cap) goto done;
    uint8_t *p = out;
    result = i2d_ECDSA_SIG(esig, &p);
done:
    BN_free(r);
    BN_free(s);
    ECDSA_SIG_free(esig);
    return result > 0 ? result : 0;
}

int warden_rsa_key_is_fast(const warden_key *key) { return key != NULL && key->fast != NULL; }

int warden_rsa_public(const warden_key *key, int fast, const uint8_t *s, size_t s_len, uint8_t *m, size_t m_len) {
    if (key == NULL || key->kind != 1 || s_len != key->modulus_len || m_len != s_len) return 0;
    if (fast) return key->fast != NULL && warden_m52_public(key->fast, s, s_len, m);
    return public_op_libcrypto_alone(key, s, s_len, m);
}

/* RSASSA-PKCS1-v1_5 verification as RFC 8017 §8.2.2 specifies it: m = s^e mod n, then the
   whole encoded message is compared with the one built from the digest. Nothing in the
   recovered message is parsed, so no padding or DigestInfo variant can slip through. The
   exponentiation runs on AVX-512 IFMA where the key has that form (montgomery52.c), else on
   libcrypto; all inputs are public. */
static int pkcs1_v15_verify(warden_checker *c, const uint8_t *signature, size_t signature_len,
                            const uint8_t *digest, size_t digest_len) {
    const warden_key *key = c->key;
    size_t k = key->modulus_len;
    if (signature_len != k || k > 2048) return 0;
    if (k < c->digest_info_len + digest_len + 11) return 0;
    uint8_t recovered[2048], expected[2048];
    int computed = key->fast != NULL
        ? warden_m52_public(key->fast, signature, k, recovered)
        : public_op_libcrypto(key, c->bn_ctx, c->s, c->s_mont, c->m, signature, k, recovered);
    if (!computed) return 0;
    /* EM = 0x00 || 0x01 || PS (0xff…, at least 8) || 0x00 || DigestInfo || H */
    size_t t_len = c->digest_info_len + digest_len;
    expected[0] = 0x00;
    expected[1] = 0x01;
    memset(expected + 2, 0xff, k - t_len - 3);
    expected[k - t_len - 1] = 0x00;
    memcpy(expected + k - t_len, c->digest_info, c->digest_info_len);
    memcpy(expected + k - digest_len, digest, digest_len);
    return CRYPTO_memcmp(recovered, expected, k) == 0;
}

int warden_checker_verify(warden_checker *c, const uint8_t *message, size_t message_len,
                          const uint8_t *signature, size_t signature_len) {
    if (c == NULL || signature_len == 0) return 0;

    if (c->alg == WARDEN_EDDSA) {
        if (signature_len != 64) return 0;
        if (EVP_MD_CTX_reset(c->md_ctx) != 1) return 0;
        if (EVP_DigestVerifyInit_ex(c->md_ctx, NULL, NULL, NULL, NULL, c->key->pkey, NULL) != 1) return 0;
        return EVP_DigestVerify(c->md_ctx, signature, signature_len, message, message_len) == 1;
    }

    uint8_t digest[EVP_MAX_MD_SIZE];
    unsigned int digest_len = 0;
    if (EVP_DigestInit_ex2(c->md_ctx, c->md, NULL) != 1 ||
        EVP_DigestUpdate(c->md_ctx, message, message_len) != 1 ||
        EVP_DigestFinal_ex(c->md_ctx, digest, &digest_len) != 1) return 0;

    if (c->order != NULL) {
        uint8_t der[160];
        int der_len = ecdsa_der(c, signature, signature_len, der, sizeof(der));
        if (der_len == 0) return 0;
        return EVP_PKEY_verify(c->pkey_ctx, der, (size_t)der_len, digest, digest_len) == 1;
    }
    /* RSA: the signature is exactly as long as the modulus (RFC 7518 §3.3). */
    if (signature_len != (size_t)EVP_PKEY_get_size(c->key->pkey)) return 0;
    if (c->pkey_ctx != NULL) {
        return EVP_PKEY_verify(c->pkey_ctx, signature, signature_len, digest, digest_len) == 1;
    }
    return pkcs1_v15_verify(c, signature, signature_len, digest, digest_len);
}
