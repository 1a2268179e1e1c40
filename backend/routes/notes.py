"""Notes and tags on every stored resource: ``PATCH /api/v1/{collection}/{id}/notes`` and
``GET /api/v1/tags``. A resource's notes and tags come back in its own answer (``notes``, ``tags``)
and its collection's list filters by ``?tag=`` (``deps.with_tag``)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

from fastapi import APIRouter
from sqlalchemy import select

from moelab.store.deletion import RESOURCES
from ..deps import SessionDep, lookup
from ..schemas import NotesOut, NotesUpdate, TagCount, TagList

router = APIRouter(tags=["notes"])


def updated_tags(present: list[str], body: NotesUpdate) -> list[str]:
    """The tags after ``body``: replaced by ``tags``, or the present ones plus ``add_tags`` minus
    ``remove_tags``; in order, without duplicates."""
    tags = list(body.tags) if body.tags is not None else [*present, *body.add_tags]
    gone = set(body.remove_tags)
    return list(dict.fromkeys(t.strip() for t in tags if t.strip() not in gone))


def _patch_route(collection: str, resource_type: str) -> Callable[..., NotesOut]:
    table, what, _kind = RESOURCES[resource_type]

    def patch_notes(ident: str, body: NotesUpdate, session: SessionDep) -> NotesOut:
        from ..errors import ApiError
        from ..schemas import MAX_TAGS

        row = lookup(session, table, ident, what, collection)
        tags = updated_tags(list(row.tags or []), body)
        if len(tags) > MAX_TAGS:
            raise ApiError(422, f"tags: {what} {ident} would carry {len(tags)} tags; at most {MAX_TAGS} (remove some first)")
        if body.notes is not None:
            row.notes = body.notes or None
        row.tags = tags
        session.commit()
        return NotesOut(id=row.id, resource=collection, notes=row.notes, tags=tags)

    patch_notes.__name__ = f"patch_{resource_type}_notes"
    return patch_notes


#: URL collection → resource type (``RESOURCES``' key)
COLLECTIONS = {t.replace("_", "-"): t for t in RESOURCES}

for _collection, _type in COLLECTIONS.items():
    router.add_api_route(
        f"/{_collection}/{{ident}}/notes", _patch_route(_collection, _type), methods=["PATCH"], response_model=NotesOut,
        responses={404: {}, 422: {}}, summary=f"Set the notes and tags of one of the {_collection.replace('-', ' ')}",
        tags=[_collection],
    )


@router.get("/tags", response_model=TagList, summary="Every tag in use, with how many resources of each collection carry it")
def list_tags(session: SessionDep) -> TagList:
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for collection, resource_type in COLLECTIONS.items():
        table = RESOURCES[resource_type][0]
        for tags in session.execute(select(table.tags).where(table.tags.is_not(None))).scalars():
            for tag in tags or []:
                counts[tag][collection] += 1
    items = [TagCount(tag=t, count=sum(c.values()), resources=dict(c)) for t, c in counts.items()]
    return TagList(items=sorted(items, key=lambda i: (-i.count, i.tag)))
