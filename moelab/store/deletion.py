"""What depends on a resource, and deleting a resource with (or without) everything that does.

A resource's dependants are the resources that read it:

    model            ← profiles of it, conversions of it (hierarchical)
    calibration set  ← profiles over it; conversions, evaluations and fine-tunes that name it as their text
    profile          ← conversions made from it (also as a MIDAS extra profile)
    conversion       ← its evaluations, fine-tunes and probes
    evaluation, fine-tune, probe, export: nothing (a fine-tune's result is a conversion of its own; deleting that
                       conversion only clears the fine-tune's ``result_conversion_id``)

A conversion's exports (its GGUF files) are parts of it, not dependants: they never make a DELETE
of the conversion ask for ``cascade``, and they always go with it (their jobs cancelled, their rows
deleted first, their files inside the conversion's artifact).

Rows are deleted dependants first (foreign keys hold at every step), in one transaction; job rows
stay as history. Artifacts are removed after the commit, each by one rename to a temporary name and
then a recursive delete (``ArtifactStore.remove``), so a crash never leaves a half-deleted artifact
that reads as complete, and the leftover is cleaned at the next start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from .artifacts import ArtifactStore
from .db import ActivationProbe, CalibrationSet, Conversion, Evaluation, Export, Finetune, Model, Probe, Profile

#: resource type (as in ``Job.resource_type``) → (table, name in messages, artifact kind or None)
RESOURCES: dict[str, tuple[type, str, str | None]] = {
    "models": (Model, "model", None),
    "calibration_sets": (CalibrationSet, "calibration set", "calibration-sets"),
    "profiles": (Profile, "profile", "profiles"),
    "conversions": (Conversion, "conversion", "conversions"),
    "evaluations": (Evaluation, "evaluation", "evaluations"),
    "finetunes": (Finetune, "fine-tune", "finetunes"),
    "probes": (Probe, "probe", "probes"),
    "activation_probes": (ActivationProbe, "activation probe", "activation-probes"),
    "exports": (Export, "export", None),  # stored inside its conversion's artifact (``ArtifactStore.export_path``)
}


@dataclass(frozen=True)
class Node:
    type: str  # a key of RESOURCES
    id: str
    parent: str | None = field(default=None, compare=False)  # an export's conversion (where its files are)

    def describe(self) -> str:
        return f"{RESOURCES[self.type][1]} {self.id}"


def _ids(session: Session, column: Any, value: str) -> list[str]:
    table = column.class_
    return list(session.execute(select(table.id).where(column == value).order_by(table.created_at)).scalars())


def _ids_where_params(session: Session, table: type, test: Any) -> list[str]:
    """Rows whose JSON ``params`` name the resource (a soft reference, filtered here: portable across
    SQLite and Postgres, and these tables hold hundreds of rows, not millions)."""
    rows = session.execute(select(table.id, table.params).order_by(table.created_at)).all()
    return [ident for ident, params in rows if isinstance(params, dict) and test(params)]


def dependants(session: Session, node: Node) -> list[Node]:
    """The resources that read ``node`` directly."""
    out: list[Node] = []
    if node.type == "models":
        out += [Node("profiles", i) for i in _ids(session, Profile.model_id, node.id)]
        out += [Node("conversions", i) for i in _ids(session, Conversion.model_id, node.id)]
    elif node.type == "calibration_sets":
        out += [Node("profiles", i) for i in _ids(session, Profile.calibration_set_id, node.id)]
        out += [Node("conversions", i) for i in _ids_where_params(session, Conversion, lambda p: p.get("calibration") == node.id)]
        out += [Node("evaluations", i) for i in _ids_where_params(session, Evaluation, lambda p: p.get("source") == node.id)]
        out += [Node("finetunes", i) for i in _ids_where_params(session, Finetune, lambda p: p.get("source") == node.id)]
    elif node.type == "profiles":
        direct = _ids(session, Conversion.profile_id, node.id)
        extra = _ids_where_params(session, Conversion, lambda p: node.id in (p.get("extra_profile_ids") or []))
        out += [Node("conversions", i) for i in dict.fromkeys(direct + extra)]
        out += [Node("activation_probes", i) for i in _ids(session, ActivationProbe.profile_id, node.id)]
    elif node.type == "conversions":
        out += [Node("evaluations", i) for i in _ids(session, Evaluation.conversion_id, node.id)]
        out += [Node("finetunes", i) for i in _ids(session, Finetune.conversion_id, node.id)]
        out += [Node("probes", i) for i in _ids(session, Probe.conversion_id, node.id)]
    return [n for n in dict.fromkeys(out) if n != node]


def parts(session: Session, node: Node) -> list[Node]:
    """What is part of ``node`` and goes with it without being asked for: a conversion's exports."""
    if node.type != "conversions":
        return []
    rows = session.execute(select(Export.id).where(Export.conversion_id == node.id).order_by(Export.created_at)).scalars()
    return [Node("exports", i, parent=node.id) for i in rows]


def tree(session: Session, root: Node) -> list[Node]:
    """``root`` and everything that depends on it or is part of it, transitively, dependants before
    what they read (the order rows can be deleted in)."""
    order: list[Node] = []
    seen: set[Node] = set()

    def visit(node: Node) -> None:
        seen.add(node)
        for child in parts(session, node) + dependants(session, node):
            if child not in seen:
                visit(child)
        order.append(node)

    visit(root)
    return order


def delete_rows(session: Session, nodes: list[Node]) -> None:
    """Delete the rows of ``nodes`` (in the order of :func:`tree`) in the session's transaction;
    fine-tunes whose result conversion goes keep their record, without the link."""
    conversions = [n.id for n in nodes if n.type == "conversions"]
    if conversions:
        for finetune in session.execute(select(Finetune).where(Finetune.result_conversion_id.in_(conversions))).scalars().unique():
            finetune.result_conversion_id = None
            if finetune.summary and finetune.summary.get("result_conversion_id") in conversions:
                finetune.summary = {**finetune.summary, "result_conversion_id": None}  # a new dict: JSON columns track assignment
        session.flush()
    for node in nodes:
        row = session.get(RESOURCES[node.type][0], node.id)
        if row is not None:
            session.delete(row)
            session.flush()  # one at a time, in order: no relationship tells the unit of work the FK order


def remove_artifacts(store: ArtifactStore, nodes: list[Node]) -> int:
    """Remove the artifacts of ``nodes`` (after their rows are gone); returns how many existed."""
    removed = 0
    conversions = {n.id for n in nodes if n.type == "conversions"}
    for node in nodes:
        kind = RESOURCES[node.type][2]
        if kind is not None and store.remove(kind, node.id):
            removed += 1
        elif node.type == "exports" and node.parent and node.parent not in conversions:  # else it goes with its conversion
            removed += int(store.remove_export(node.parent, node.id))
    return removed


def export_node(session: Session, export_id: str) -> Node:
    """The node of one export, with its conversion (where its files are)."""
    row = session.get(Export, export_id)
    return Node("exports", export_id, parent=row.conversion_id if row is not None else None)
