#!/usr/bin/env python3
"""Validates JSON instances against Warden's schemas (JSON Schema 2020-12).

Usage: validate.py CASES.json
CASES.json is a list of {"schema": <$id>, "instance": <JSON>, "valid": true|false}. Prints one
line per case whose outcome differs from "valid" and exits 1 if there is any.
"""
import glob, json, os, sys
from jsonschema import Draft202012Validator, RefResolver

here = os.path.dirname(os.path.abspath(__file__))
store = {}
for path in glob.glob(os.path.join(here, "**", "*.schema.json"), recursive=True):
    with open(path) as f:
        schema = json.load(f)
    Draft202012Validator.check_schema(schema)
    store[schema["$id"]] = schema

failures = 0
with open(sys.argv[1]) as f:
    cases = json.load(f)
for i, case in enumerate(cases):
    schema = store[case["schema"]]
    validator = Draft202012Validator(schema, resolver=RefResolver(case["schema"], schema, store=store))
    errors = list(validator.iter_errors(case["instance"]))
    if bool(errors) == case["valid"]:
        failures += 1
        detail = errors[0].message if errors else "accepted"
        print(f"case {i} ({case['schema']}): expected {'valid' if case['valid'] else 'invalid'}, got: {detail}")
print(f"{len(cases) - failures} passed, {failures} failed")
sys.exit(1 if failures else 0)
