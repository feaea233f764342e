#!/usr/bin/env python3
"""Writes the bundled example: a fresh throwaway RSA key's public JWKS (examples/keys/jwks.json)
and SETs signed with it (examples/tokens/*.jwt). The private key is not kept.

Signing here uses Python's `cryptography` package, an implementation independent of Warden's,
so the examples double as cross-implementation test vectors. Run: python3 examples/make-examples.py
"""
import base64, hashlib, json, os, time, uuid
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

here = os.path.dirname(os.path.abspath(__file__))
ISSUER = "https://accounts.google.com/"
AUDIENCE = "1234-abc.apps.googleusercontent.com"
RISC = "https://schemas.openid.net/secevent/risc/event-type/"
OAUTH = "https://schemas.openid.net/secevent/oauth/event-type/"

def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

def uint(n: int) -> bytes:
    return n.to_bytes((n.bit_length() + 7) // 8, "big")

key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
numbers = key.public_key().public_numbers()
kid = "example-" + uuid.uuid4().hex[:8]
jwks = {"keys": [{"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256",
                  "n": b64url(uint(numbers.n)), "e": b64url(uint(numbers.e))}]}
with open(os.path.join(here, "keys", "jwks.json"), "w") as f:
    json.dump(jwks, f, indent=2)
    f.write("\n")

def sign(claims: dict) -> str:
    header = {"alg": "RS256", "kid": kid}
    signing_input = b64url(json.dumps(header, separators=(",", ":")).encode()) + "." + \
        b64url(json.dumps(claims, separators=(",", ":")).encode())
    signature = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return signing_input + "." + b64url(signature)

def google_set(event: str, payload: dict) -> dict:
    return {"iss": ISSUER, "aud": AUDIENCE, "iat": int(time.time()), "jti": uuid.uuid4().hex,
            "events": {event: payload}}

account = {"subject_type": "iss-sub", "iss": ISSUER, "sub": "10987654321"}
refresh_token = "1//0gAbCdEfGhIjKlMnOpQrStUvWxYz-0123456789"
double_hash = base64.b64encode(hashlib.sha512(hashlib.sha512(refresh_token.encode()).digest()).digest()).decode()
examples = {
    "sessions-revoked": google_set(RISC + "sessions-revoked", {"subject": account}),
    "account-disabled-hijacking": google_set(RISC + "account-disabled", {"subject": account, "reason": "hijacking"}),
    "token-revoked": google_set(OAUTH + "token-revoked", {"subject": {
        "subject_type": "oauth_token", "token_type": "refresh_token",
        "token_identifier_alg": "hash_base64_sha512_sha512", "token": double_hash}}),
    "verification": google_set(RISC + "verification", {"state": "state-from-stream-verify"}),
}
for name, claims in examples.items():
    with open(os.path.join(here, "tokens", name + ".jwt"), "w") as f:
        f.write(sign(claims) + "\n")

# A forged token: the sessions-revoked claims with another subject, keeping the old signature.
genuine = open(os.path.join(here, "tokens", "sessions-revoked.jwt")).read().strip().split(".")
forged_claims = dict(examples["sessions-revoked"], events={RISC + "sessions-revoked": {
    "subject": dict(account, sub="424242424242")}})
with open(os.path.join(here, "tokens", "forged.jwt"), "w") as f:
    f.write(genuine[0] + "." + b64url(json.dumps(forged_claims, separators=(",", ":")).encode()) + "." + genuine[2] + "\n")
print("wrote", os.path.join(here, "keys", "jwks.json"), "and", len(examples) + 1, "tokens, kid", kid)
