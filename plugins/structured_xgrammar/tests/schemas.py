"""Varied JSON schemas for the structured-outputs tests; strings and arrays are bounded so outputs stay short."""

from __future__ import annotations

from typing import Any

_S = {"type": "string", "maxLength": 12}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": _S},
     "required": ["id"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                          "maximum": 5}},
     "required": ["status", "count"]},
    {"$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": _S},
                       "required": ["kind", "name"]}},
     "type": "object", "properties": {"pet": {"$ref": "#/$defs/pet"}}, "required": ["pet"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                                          {"type": "null"}]}}, "required": ["value"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "minItems": 1, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 2}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"city": _S, "country": {"enum": ["FR", "DE", "JP", "US"]},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
     "required": ["city", "country"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "null"}},
     "required": ["a", "b", "c"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": _S, "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                "required": ["zip"]}}, "required": ["name", "address"]}}, "required": ["user"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": [1, 2, 3, "other"]}}, "required": ["answer"]},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
]
