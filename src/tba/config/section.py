"""The base of every config section: unknown keys refused, assignments validated, field docstrings kept."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, coerce_numbers_to_str=True
    )
