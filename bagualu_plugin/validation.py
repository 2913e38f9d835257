"""Errors of cross-field checks that still name the field to change.

A pydantic model validator can only attach an error to the whole model. `reject` carries each
problem's field path (relative to the model) in the error context, so a caller that reports
errors, such as `RecipeError`, names `model.top_k` rather than `model`.
"""

from __future__ import annotations

from pydantic_core import PydanticCustomError

FIELD_PROBLEMS = "field_problems"


def reject(problems: list[tuple[str, str]]) -> None:
    """Raise one validation error listing every (relative field path, message); none: return."""
    if problems:
        summary = "; ".join(f"{path}: {msg}" for path, msg in problems)
        raise PydanticCustomError(FIELD_PROBLEMS, "{summary}", {"summary": summary, "problems": problems})
