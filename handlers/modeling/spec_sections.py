"""The spec's small value types, shared by every section: strict numbers and names, the base of
a section, and what one request may hold (``LimitsSpec``, ``IdsPerItem``).

Example::

    IdsPerItem(min=1, max=1)          # a feature the model takes exactly one id of
    LimitsSpec(max_ids_per_bag=64)    # caps on one request, the rest as default
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from handlers.runtime.inputs import Limits

PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
Name = Annotated[StrictStr, Field(min_length=1)]
LayerSizes = Annotated[tuple[PositiveInt, ...], Field(min_length=1)]


class Section(BaseModel):
    """A spec section: unknown keys refused, frozen once parsed."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class IdsPerItem(Section):
    """How many ids one bag of a feature holds: per item, or for a feature sent once per request
    (a history), per request. ``min: 0`` lets a request leave the feature out; a model that takes
    exactly one id (a candidate's id, a user id) says ``{min: 1, max: 1}``. Requests outside it are
    a 400 naming the item and feature; the build's synthetic requests and the padding items of a
    forward keep to it."""

    min: NonNegativeInt = Field(0, description="fewest ids; 0: the feature may be left out")
    max: PositiveInt | None = Field(
        None, description="most ids; default the table's max_sequence_length or limits.max_ids_per_bag"
    )

    @model_validator(mode="after")
    def _ordered(self) -> "IdsPerItem":
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max: must be at least min ({self.min}), got {self.max}")
        return self


class LimitsSpec(Section):
    """Caps on a single request; anything above is a 4xx naming the field."""

    max_request_bytes: PositiveInt = Field(
        Limits.max_request_bytes, description="bytes in one request body (gzip-decoded); more is a 413"
    )
    max_items_per_request: PositiveInt = Field(
        Limits.max_items_per_request, description="items in one request"
    )
    max_ids_per_bag: PositiveInt = Field(Limits.max_ids_per_bag, description="ids in one bag")
    max_items_per_forward: PositiveInt = Field(
        Limits.max_items_per_forward,
        description="items in one forward; a larger TorchServe batch runs as several forwards",
    )

    @model_validator(mode="after")
    def _request_fits_a_forward(self) -> "LimitsSpec":
        if self.max_items_per_request > self.max_items_per_forward:
            raise ValueError(
                "max_items_per_request: must not exceed max_items_per_forward "
                f"({self.max_items_per_forward}), got {self.max_items_per_request}"
            )
        return self

    def to_limits(self) -> Limits:
        return Limits(**self.model_dump())
