"""The spec's JSON Schema and its reference page, generated from the pydantic models.

    torchrec-serve spec-docs      # rewrites config/models/spec.schema.json and config/models/SPEC.md

Editors that read JSON Schema (e.g. the YAML language server, through the ``$schema`` comment at the
top of each spec) complete and check spec files with it; a test keeps both files current.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from handlers.modeling.registry import shipped_architectures, spec_json_schema

MODELS_DIR = Path(__file__).resolve().parent.parent / "config" / "models"


def write_spec_docs(folder: Path = MODELS_DIR) -> list[Path]:
    schema_path, reference_path = folder / "spec.schema.json", folder / "SPEC.md"
    schema_path.write_text(json.dumps(spec_json_schema(), indent=2) + "\n")
    reference_path.write_text(spec_reference())
    return [schema_path, reference_path]


def spec_reference() -> str:
    """Markdown: one table of keys per architecture and per section, from the JSON Schema."""
    schema = spec_json_schema()
    definitions = schema["$defs"]
    lines = [
        "# Model spec reference",
        "",
        "Generated from the spec models by `torchrec-serve spec-docs`; do not edit by hand.",
        "A spec is YAML; `architecture` (default `dlrm`) picks which keys it takes: a registered",
        "name or a user's architecture by import path (`package.module:Attribute`), whose spec type",
        "adds its own keys to those below.",
        f"Shipped architectures: {', '.join(f'`{name}`' for name in shipped_architectures())}.",
        "",
    ]
    spec_types = [a.spec_type.__name__ for a in shipped_architectures().values()]
    sections = [name for name in definitions if name not in spec_types]
    for name in spec_types + sections:
        definition = definitions[name]
        if "properties" not in definition:
            continue
        title = _architecture_title(definition) if name in spec_types else f"`{name}`"
        lines += [f"## {title}", ""]
        if definition.get("description") and name not in spec_types:
            lines += [" ".join(definition["description"].split()), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        required = set(definition.get("required", ()))
        for key, prop in definition["properties"].items():
            default = "required" if key in required else f"`{json.dumps(prop.get('default'))}`"
            meaning = " ".join(prop.get("description", "").split())
            lines.append(f"| `{key}` | {_type(prop, definitions)} | {default} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def _architecture_title(definition: dict[str, Any]) -> str:
    return f"architecture: `{definition['properties']['architecture']['const']}`"


def _type(prop: dict[str, Any], definitions: dict[str, Any]) -> str:
    if "$ref" in prop:
        target = prop["$ref"].rsplit("/", 1)[-1]
        enum = definitions[target].get("enum")
        return " \\| ".join(f"`{v}`" for v in enum) if enum else f"[`{target}`](#{target.lower()})"
    if "const" in prop:
        return f"`{prop['const']}`"
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "anyOf" in prop:
        return " or ".join(_type(p, definitions) for p in prop["anyOf"])
    kind = prop.get("type")
    if kind == "array":
        return f"list of {_type(prop['items'], definitions)}"
    if kind == "object":
        return f"map to {_type(prop.get('additionalProperties', {}), definitions)}"
    if kind == "integer" and prop.get("exclusiveMinimum") == 0:
        return "integer > 0"
    if kind == "string" and prop.get("minLength"):
        return "non-empty string"
    return kind or "any"
