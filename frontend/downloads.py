"""``/download/<kind>/<id>.zip`` on the frontend's own server: a stored artifact (a converted model
directory …) streamed from the API's archive route to the browser; ``/download/exports/<exp-id>/<file>``:
one file of an export (a conversion's ``.gguf``), streamed from the API's file route;
``/download/evaluations/<ev-id>/tasks.<csv|md>``: an evaluation's paper-style task table.

Why a relay instead of a link to the API: the browser may not reach the API's address (in
docker-compose the frontend calls ``http://api:8000``) and cannot send its bearer token; the
frontend can. The zip is passed through piece by piece, never held in memory or on disk.
"""

from __future__ import annotations

import re

from flask import Flask, Response, stream_with_context

from moelab.api_client import ApiError, api

#: artifact kinds a person downloads from the UI (models have no artifact of their own)
KINDS = ("calibration-sets", "profiles", "conversions", "evaluations", "finetunes")


def download_url(kind: str, ident: str) -> str:
    """The frontend path that downloads ``kind``/``ident`` as a zip."""
    return f"/download/{kind}/{ident}.zip"


def _download(kind: str, ident: str) -> Response:
    if kind not in KINDS:
        return Response(f"nothing to download for {kind!r}; one of {', '.join(KINDS)}", status=404, mimetype="text/plain")
    try:
        pieces = api().archive(kind, ident)
    except ApiError as exc:  # in words, with the API's status (409: its job has not succeeded …)
        return Response(f"could not download {ident}: {exc}", status=exc.status or 502, mimetype="text/plain")
    return Response(stream_with_context(pieces), mimetype="application/zip",
                    headers={"Content-Disposition": f'attachment; filename="{ident}.zip"'})


def export_download_url(export_id: str, filename: str) -> str:
    """The frontend path that downloads one file of a ready export (its .gguf)."""
    return f"/download/exports/{export_id}/{filename}"


_EXPORT_ID, _FILENAME = re.compile(r"^exp-[0-9a-f]{16}$"), re.compile(r"^[\w][\w.+-]*$")


def _download_export(export_id: str, filename: str) -> Response:
    if not _EXPORT_ID.match(export_id) or not _FILENAME.match(filename):
        return Response(f"no export file {export_id}/{filename}", status=404, mimetype="text/plain")
    try:
        pieces, headers = api().stream(f"/exports/{export_id}/files/{filename}")
    except ApiError as exc:  # 404 unknown or gone, 409 its job has not written it yet: in words
        return Response(f"could not download {filename}: {exc}", status=exc.status or 502, mimetype="text/plain")
    sent = {"Content-Disposition": f'attachment; filename="{filename}"'}
    if headers.get("content-length"):  # the browser shows how far a multi-GB download is
        sent["Content-Length"] = headers["content-length"]
    return Response(stream_with_context(pieces), mimetype="application/octet-stream", headers=sent)


def tasks_table_url(evaluation_id: str, ext: str) -> str:
    """The frontend path that downloads an evaluation's task table (``ext``: csv or md)."""
    return f"/download/evaluations/{evaluation_id}/tasks.{ext}"


_EVALUATION_ID, _TABLE_FORMATS = re.compile(r"^ev-[0-9a-f]{16}$"), {"csv": ("csv", "text/csv"), "md": ("markdown", "text/markdown")}


def _download_tasks_table(evaluation_id: str, ext: str) -> Response:
    if not _EVALUATION_ID.match(evaluation_id) or ext not in _TABLE_FORMATS:
        return Response(f"no task table {evaluation_id}/tasks.{ext}; csv or md", status=404, mimetype="text/plain")
    fmt, mimetype = _TABLE_FORMATS[ext]
    try:
        pieces, _ = api().stream(f"/evaluations/{evaluation_id}/tasks-table?format={fmt}")
    except ApiError as exc:  # 409: it ran no tasks, or has not finished
        return Response(f"could not download the task table of {evaluation_id}: {exc}", status=exc.status or 502, mimetype="text/plain")
    return Response(b"".join(pieces), mimetype=mimetype,
                    headers={"Content-Disposition": f'attachment; filename="{evaluation_id}-tasks.{ext}"'})


def register(server: Flask) -> None:
    server.add_url_rule("/download/<kind>/<ident>.zip", "moelab_download", _download)
    server.add_url_rule("/download/exports/<export_id>/<filename>", "moelab_download_export", _download_export)
    server.add_url_rule("/download/evaluations/<evaluation_id>/tasks.<ext>", "moelab_download_tasks_table", _download_tasks_table)
