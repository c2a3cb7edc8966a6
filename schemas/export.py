"""JSON Schemas of the wire records, for producers and consumers in other languages.

`llm-worker schema` writes them to schemas/json/ (checked in); `llm-worker schema --check` exits 1 when the
checked-in files no longer match the code, so CI catches a record changed without its schema.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from schemas.control import ControlRecord
from schemas.dead_letter import DeadLetterRecord
from schemas.progress import ProgressRecord
from schemas.request import PROMPT_FIELDS, GenerationRequest
from schemas.result import FinalRecord, StreamChunk
from schemas.status import WorkerStatus
from schemas.usage import UsageRecord

JSON_DIR = Path(__file__).parent / "json"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# file stem -> wire type; "result" is the tagged union a reply-topic consumer decodes.
RECORD_TYPES: dict[str, Any] = {
    "generation_request": GenerationRequest,
    "result": StreamChunk | FinalRecord,
    "worker_status": WorkerStatus,
    "dead_letter_record": DeadLetterRecord,
    "control_record": ControlRecord,
    "usage_record": UsageRecord,
    "progress_record": ProgressRecord,
}


def build_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one record type, self-contained ($defs inline)."""
    schema = {"$schema": JSON_SCHEMA_DIALECT, "title": name, **msgspec.json.schema(RECORD_TYPES[name])}
    if name == "generation_request":
        # msgspec cannot state "exactly one of" (the request checks it in __post_init__); say it here so
        # producers that validate against the schema learn it too. A null counts as absent.
        schema["$defs"]["GenerationRequest"]["oneOf"] = [
            {"required": [field], "properties": {field: {"not": {"type": "null"}}}} for field in PROMPT_FIELDS
        ]
    return schema


def render(name: str) -> str:
    return json.dumps(build_schema(name), indent=2) + "\n"


def schema_path(out_dir: Path, name: str) -> Path:
    return out_dir / f"{name}.schema.json"


def write_schemas(out_dir: Path = JSON_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in RECORD_TYPES:
        path = schema_path(out_dir, name)
        path.write_text(render(name), encoding="utf-8")
        paths.append(path)
    return paths


def stale_schemas(out_dir: Path = JSON_DIR) -> list[Path]:
    """Schema files in out_dir that are missing or differ from what the code generates."""
    stale = []
    for name in RECORD_TYPES:
        path = schema_path(out_dir, name)
        if not path.is_file() or path.read_text(encoding="utf-8") != render(name):
            stale.append(path)
    return stale


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=JSON_DIR, help=f"folder of the schema files (default {JSON_DIR})")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the files there differ from the code"
    )


def run(args: argparse.Namespace) -> int:
    if args.check:
        stale = stale_schemas(args.out)
        for path in stale:
            print(f"stale or missing: {path}", file=sys.stderr)
        if stale:
            print("regenerate with: llm-worker schema", file=sys.stderr)
            return 1
        print(f"{len(RECORD_TYPES)} schemas in {args.out} match the code")
        return 0
    for path in write_schemas(args.out):
        print(path)
    return 0
