"""Write a calibration profile (what ``autopar calibrate`` and ``autopar validate --calibrate`` measured) to a
file; ``costmodel.profiles.load_calibration`` reads it back."""

from __future__ import annotations

import json
from pathlib import Path

import tomli_w

from costmodel.calibration import Calibration, calibration_to_dict


def save_calibration(cal: Calibration, path: str | Path) -> Path:
    """Write ``cal`` as JSON (``.json``, default) or TOML (``.toml``)."""
    path = Path(path)
    data = calibration_to_dict(cal)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".toml":
        path.write_text("# autopar calibration profile (written by `autopar calibrate`)\n" + tomli_w.dumps(data))
    else:
        path.write_text(json.dumps(data, indent=1) + "\n")
    return path

