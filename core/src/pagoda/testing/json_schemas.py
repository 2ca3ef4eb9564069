"""50 varied JSON schemas for testing a structured-outputs backend (nested objects, bounded arrays, enums, const,
number ranges, patterns, required / optional, anyOf / oneOf, $ref); strings and arrays are bounded so outputs stay
short. Every backend plugin's tests run the same corpus, and a third-party backend's tests can too."""

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

_I = {"type": "integer", "minimum": 0, "maximum": 99}
_B = {"type": "boolean"}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required}


SCHEMAS += [
    _obj({"title": _S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}),
    _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180,
                                                                               "maximum": 180}}),
    _obj({"first": _S, "last": _S, "middle": _S}, required=["first", "last"]),
    _obj({"level": {"enum": ["low", "mid", "high"]}, "urgent": _B}),
    _obj({"scores": {"type": "array", "items": _I, "minItems": 3, "maxItems": 3}}),
    _obj({"words": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 0, "maxItems": 4}}),
    _obj({"meta": _obj({"version": _I, "stable": _B})}),
    _obj({"a": _obj({"b": _obj({"c": _I})})}),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}, "currency": {"enum": ["EUR", "USD"]}}),
    _obj({"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}, "minItems": 3,
                  "maxItems": 3}}),
    _obj({"kind": {"const": "event"}, "id": _I, "payload": _obj({"ok": _B})}),
    _obj({"choice": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
    _obj({"names": {"type": "array", "items": _S, "maxItems": 2}}, required=[]),
    _obj({"x": _I, "y": _I, "z": _I}, required=["x"]),
    _obj({"flags": _obj({"a": _B, "b": _B}), "count": _I}),
    _obj({"people": {"type": "array", "minItems": 1, "maxItems": 2, "items": _obj({"name": _S, "age": _I})}}),
    {"$defs": {"num": {"type": "integer", "minimum": 1, "maximum": 5}}, **_obj({"lo": {"$ref": "#/$defs/num"},
                                                                                "hi": {"$ref": "#/$defs/num"}})},
    {"$defs": {"node": _obj({"label": _S, "weight": _I})},
     **_obj({"nodes": {"type": "array", "items": {"$ref": "#/$defs/node"}, "minItems": 1, "maxItems": 2}})},
    _obj({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}),
    _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}, "label": {"type": ["string", "null"],
                                                                             "maxLength": 8}}),
    _obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"}}),
    _obj({"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}, "hour": {"type": "integer",
                                                                                        "minimum": 0, "maximum": 23}}),
    _obj({"grid": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "array", "minItems": 2,
                                                                             "maxItems": 2, "items": _B}}}),
    {"type": "array", "items": _obj({"k": {"enum": ["x", "y"]}, "v": _I}), "minItems": 1, "maxItems": 3},
    {"type": "boolean"},
    {"type": "number", "minimum": -1, "maximum": 1},
    {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
    _obj({"answer": _B, "confidence": {"type": "number", "minimum": 0, "maximum": 1}, "reason": _S},
         required=["answer"]),
]
