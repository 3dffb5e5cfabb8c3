"""Write a calibration profile (what ``autopar calibrate`` and ``autopar validate --calibrate`` measured) to a
file; ``costmodel.profiles.load_calibration`` reads it back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from costmodel.calibration import Calibration, calibration_to_dict


def save_calibration(cal: Calibration, path: str | Path) -> Path:
    """Write ``cal`` as JSON (``.json``, default) or TOML (``.toml``)."""
    path = Path(path)
    data = calibration_to_dict(cal)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".toml":
        path.write_text(_to_toml(data))
    else:
        path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    raise TypeError(f"cannot write {type(value).__name__} to TOML")  # pragma: no cover


def _to_toml(data: dict[str, Any]) -> str:
    lines = ["# autopar calibration profile (written by `autopar calibrate`)"]
    tables = {k: v for k, v in data.items() if isinstance(v, list)}
    for key, value in data.items():
        if key not in tables:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, items in tables.items():
        for item in items:
            lines.append(f"[[{key}]]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in item.items())
    return "\n".join(lines) + "\n"
