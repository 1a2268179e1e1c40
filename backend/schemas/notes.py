"""Notes and tags: what a user writes on any stored resource (``PATCH``) and the tag index."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from .common import _In, _Noted


TAG_PATTERN = r"^[\w][\w .:+/-]{0,39}$"
MAX_TAGS = 16
MAX_NOTES = 20_000
Tag = Annotated[str, Field(pattern=TAG_PATTERN, description="1–40 characters: letters, digits, _ . : + / - and spaces, "
                                                                   "starting with a letter, digit or _")]


class NotesUpdate(_In):
    """Replace a resource's notes and/or tags; a field left out stays as it is."""

    notes: str | None = Field(None, max_length=MAX_NOTES, description="new notes ('' clears them)")
    tags: list[Tag] | None = Field(None, max_length=MAX_TAGS, description=f"the new tags, at most {MAX_TAGS} (replaces the old ones; [] clears them)")
    add_tags: list[Tag] = Field(default_factory=list, max_length=MAX_TAGS, description="tags to add to the present ones")
    remove_tags: list[Tag] = Field(default_factory=list, max_length=MAX_TAGS, description="tags to take away")

    @model_validator(mode="after")
    def _one_way(self) -> NotesUpdate:
        if self.tags is not None and (self.add_tags or self.remove_tags):
            raise ValueError("give either tags (replaces them all) or add_tags / remove_tags, not both")
        if self.notes is None and self.tags is None and not self.add_tags and not self.remove_tags:
            raise ValueError("nothing to change: give notes, tags, add_tags or remove_tags")
        return self


class NotesOut(_Noted):
    id: str
    resource: str = Field(description="the collection, e.g. 'evaluations'")


class TagCount(BaseModel):
    tag: str
    count: int = Field(description="resources carrying it")
    resources: dict[str, int] = Field(description="how many in each collection")


class TagList(BaseModel):
    items: list[TagCount]
