"""The five JSON Schemas of issue #17's structured-output test and benchmark, with a prompt for each.

Nested objects, enums, arrays and numbers with bounds. Strings carry maxLength and arrays maxItems, so a
valid answer always fits the token budget the tests give it (a 135M model asked for free text may otherwise
ramble until max_new_tokens cuts it, and a cut answer is not valid JSON whatever the constraint did).
"""

from __future__ import annotations

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                   "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "zip", "geo"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "address"],
    "additionalProperties": False,
}

ENUMS = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        "status": {"const": "ok"},
        "in_stock": {"type": "boolean"},
    },
    "required": ["color", "size", "status", "in_stock"],
    "additionalProperties": False,
}

ARRAYS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 10},
                 "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 2, "maxItems": 4},
        "matrix": {"type": "array", "maxItems": 2,
                   "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                             "minItems": 2, "maxItems": 2}},
    },
    "required": ["tags", "scores", "matrix"],
    "additionalProperties": False,
}

NUMBERS = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
        # multipleOf bounds the digits: a plain "number" may grow fraction digits until max_new_tokens cuts it
        # (seen once in 50 sampled requests at max_new_tokens 96), and a cut answer is not JSON. A power of two:
        # jsonschema checks multipleOf in floating point, and finds 0.29 no multiple of 0.01 (0.29 / 0.01 =
        # 28.999999999999996).
        "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1000},
    },
    "required": ["age", "temperature", "ratio", "count"],
    "additionalProperties": False,
}

MIXED = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "priority": {"enum": ["low", "normal", "high"]},
        "items": {
            "type": "array", "minItems": 1, "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "priority", "items", "gift"],
    "additionalProperties": False,
}

SCHEMAS = {"nested": NESTED, "enums": ENUMS, "arrays": ARRAYS, "numbers": NUMBERS, "mixed": MIXED}
"""By name, in a fixed order."""

PROMPTS = {
    "nested": "Give a person's name and address (city, zip code, coordinates) as JSON.",
    "enums": "Describe a T-shirt in stock as JSON: its color, size and status.",
    "arrays": "Give some tags, test scores and a small matrix of digits as JSON.",
    "numbers": "Give a person's age, today's temperature, a ratio and a count as JSON.",
    "mixed": "Write a shop order as JSON: id, priority, items with SKU codes and quantities, gift flag.",
}
