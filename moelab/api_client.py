"""The one place the API's URLs live for its clients (the UI and the CLI): a thin httpx client of the moelab HTTP
API (/api/v1).

Every call returns the decoded JSON or raises :class:`ApiError` whose message a person can
read ("profile p-… not found", "alpha_min (0.8) must not exceed alpha_max (0.5)", "the API at
… is not reachable"), so pages show it in words instead of a blank figure.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from moelab.settings import get_settings


#: resource collections that answer DELETE /{kind}/{id}[?cascade=true] (and, but models, have artifacts)
RESOURCE_KINDS = ("models", "calibration-sets", "profiles", "conversions", "evaluations", "finetunes")


class ApiError(Exception):
    """An API answer that is not a success, or no answer at all, as one readable message."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:300] or response.reason_phrase}"
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):  # FastAPI's raw validation list
        detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', [])[1:])}: {e.get('msg')}" for e in detail)
    errors = body.get("errors") if isinstance(body, dict) else None
    if errors and not detail:
        detail = "; ".join(str(e.get("msg", e)) for e in errors)
    if detail and response.status_code < 500:  # the API's sentence says what to fix; its status stays on ApiError.status
        return str(detail)
    return f"{detail or response.text[:300]} (HTTP {response.status_code})"


class ApiClient:
    def __init__(self, base_url: str | None = None, token: str | None = None, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        settings = get_settings()
        self.base_url = (base_url or settings.resolved_api_url()).rstrip("/")
        token = token if token is not None else settings.token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers, transport=transport)

    # ------------------------------------------------------------------ plumbing

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise ApiError(f"the API at {self.base_url} did not answer {method} {path} in time; is it overloaded?") from None
        except httpx.HTTPError as exc:
            raise ApiError(f"the API at {self.base_url} is not reachable ({exc.__class__.__name__}); is `moelab serve` running?") from None
        if response.status_code >= 400:
            raise ApiError(_message(response), response.status_code)
        if not response.content:
            return None
        return response.json()

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("POST", path, json=body)

    # ------------------------------------------------------------------ resources

    def health(self) -> dict[str, Any]:
        return self.get("/health")

    def models(self) -> list[dict[str, Any]]:
        return self.get("/models")["items"]

    def create_model(self, source: str = "default") -> dict[str, Any]:
        return self.post("/models", {"source": source})

    def builtin_sets(self) -> list[dict[str, Any]]:
        return self.get("/calibration-sets/builtins")

    def calibration_sets(self) -> list[dict[str, Any]]:
        return self.get("/calibration-sets")["items"]

    def calibration_set(self, set_id: str) -> dict[str, Any]:
        return self.get(f"/calibration-sets/{set_id}")

    def create_builtin_set(self, name: str, samples: int | None = None, split: str = "calibration") -> dict[str, Any]:
        """``samples`` unset: the API's default."""
        body = {"source": "builtin", "name": name, "split": split} | ({"samples": samples} if samples else {})
        return self.post("/calibration-sets", body)

    def upload_set(self, filename: str, content: bytes, name: str | None = None) -> dict[str, Any]:
        data = {"name": name} if name else {}
        return self.request("POST", "/calibration-sets/upload", files={"file": (filename, content)}, data=data)

    def samples(self, set_id: str, offset: int = 0, limit: int = 20, task: str | None = None) -> dict[str, Any]:
        return self.get(f"/calibration-sets/{set_id}/samples", offset=offset, limit=limit, task=task)

    def profiles(self) -> list[dict[str, Any]]:
        return self.get("/profiles")["items"]

    def profile(self, profile_id: str) -> dict[str, Any]:
        return self.get(f"/profiles/{profile_id}")

    def create_profile(self, model_id: str, calibration_set_id: str, **params: Any) -> dict[str, Any]:
        return self.post("/profiles", {"model_id": model_id, "calibration_set_id": calibration_set_id, **params})

    def conversions(self) -> list[dict[str, Any]]:
        return self.get("/conversions")["items"]

    def conversion(self, conversion_id: str) -> dict[str, Any]:
        return self.get(f"/conversions/{conversion_id}")

    def create_conversion(self, **body: Any) -> dict[str, Any]:
        """``method``, its inputs (``profile_id`` …) and its parameter block named after it (see ``methods``)."""
        return self.post("/conversions", {k: v for k, v in body.items() if v is not None})

    def methods(self) -> list[dict[str, Any]]:
        """Every conversion method with its parameters (the designer builds its panels from this)."""
        return self.get("/methods")["items"]

    def evaluations(self, conversion_id: str | None = None, **filters: Any) -> list[dict[str, Any]]:
        """Newest first; ``filters``: tag, method, text, status, q (words in the id, text, notes, tags)."""
        return self.get("/evaluations", conversion_id=conversion_id, **filters)["items"]

    def layer_curves(self, evaluation_id: str, variant: str = "converted") -> dict[str, Any]:
        """Per-layer reconstruction error, load CV and expert shares of one evaluation (run overlays)."""
        return self.get(f"/evaluations/{evaluation_id}/charts/layers", variant=variant)

    def set_notes(self, kind: str, ident: str, **body: Any) -> dict[str, Any]:
        """PATCH the notes and tags of any resource: ``notes``, ``tags`` (replace) or ``add_tags`` / ``remove_tags``."""
        return self.request("PATCH", f"/{kind}/{ident}/notes", json={k: v for k, v in body.items() if v is not None})

    def tags(self) -> list[dict[str, Any]]:
        return self.get("/tags")["items"]

    def create_evaluation(self, conversion_id: str, source: str = "builtin:mixed", n_windows: int = 8, seq_len: int = 128,
                          baselines: bool = False, multiple_choice_per_task: int = 0, tasks: list[str] | None = None,
                          limit: int | None = None, task_dir: str | None = None) -> dict[str, Any]:
        """``baselines``: also evaluate AbsTopK, the uniform α allocation and TEAL at the conversion's cost
        (slower); off for a quick look. ``tasks``: lm-evaluation-harness tasks (``limit`` items each)."""
        body = {"conversion_id": conversion_id, "source": source, "n_windows": n_windows, "seq_len": seq_len,
                "baselines": baselines, "multiple_choice_per_task": multiple_choice_per_task}
        if tasks:
            body.update(tasks=list(tasks), limit=limit, task_dir=task_dir)
        return self.post("/evaluations", body)

    def tasks(self, task_dir: str | None = None) -> list[dict[str, Any]]:
        """The lm-evaluation-harness tasks an evaluation can name without network (built-in ones first, then those of
        ``task_dir``, a server directory of task YAMLs)."""
        return self.get("/tasks", **({"task_dir": task_dir} if task_dir else {}))["items"]

    def evaluation_report(self, evaluation_id: str) -> dict[str, Any]:
        """The full evaluation record (per-layer reconstruction error, routing) from the artifact store."""
        return self.get(f"/artifacts/evaluations/{evaluation_id}/files/evaluation.json")

    def jobs(self, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
        return self.get("/jobs", limit=limit, state=state)["items"]

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> Any:
        return self.request("DELETE", f"/jobs/{job_id}")

    def retry_job(self, job_id: str) -> dict[str, Any]:
        """Re-run a failed or cancelled job (a fine-tune resumes from its latest checkpoint)."""
        return self.request("POST", f"/jobs/{job_id}/retry")

    def delete(self, kind: str, ident: str, cascade: bool = False) -> dict[str, Any]:
        """Delete a resource (``kind``: models, calibration-sets, profiles, conversions, evaluations,
        finetunes). Without ``cascade`` one that others use is refused: ApiError 409 naming them."""
        if kind not in RESOURCE_KINDS:
            raise ApiError(f"cannot delete a {kind!r}; one of {', '.join(RESOURCE_KINDS)}")
        return self.request("DELETE", f"/{kind}/{ident}", params={"cascade": "true"} if cascade else None)

    def archive(self, kind: str, ident: str, chunk: int = 1 << 20) -> Iterator[bytes]:
        """A stored artifact (a converted model directory …) as a zip, streamed in ``chunk``-byte
        pieces. The API's refusal (404, 409 not finished, 429 busy) is raised before the first piece,
        so a caller can still answer with the message instead of a broken download."""
        return self.stream(f"/artifacts/{kind}/{ident}/archive", chunk)[0]

    def stream(self, path: str, chunk: int = 1 << 20) -> tuple[Iterator[bytes], dict[str, str]]:
        """``GET path`` streamed in ``chunk``-byte pieces, with the response's headers; the API's refusal
        is raised (``ApiError``) before the first piece."""
        try:
            response = self._http.send(self._http.build_request("GET", path), stream=True)
        except httpx.TimeoutException:
            raise ApiError(f"the API at {self.base_url} did not answer GET {path} in time; is it overloaded?") from None
        except httpx.HTTPError as exc:
            raise ApiError(f"the API at {self.base_url} is not reachable ({exc.__class__.__name__}); is `moelab serve` running?") from None
        if response.status_code >= 400:
            response.read()
            response.close()
            raise ApiError(_message(response), response.status_code)

        def pieces() -> Iterator[bytes]:
            try:
                yield from response.iter_bytes(chunk)
            finally:  # the browser went away mid-download: the API's stream (and its slot) ends too
                response.close()

        return pieces(), dict(response.headers)

    def create_export(self, conversion_id: str, gguf_type: str = "f16", fmt: str = "gguf") -> dict[str, Any]:
        """Export a ready conversion (``fmt`` gguf, ``gguf_type`` f16 | q8_0 | f32) as a job; the same
        export again returns the existing one. ApiError 409 says why a layout does not export."""
        return self.post(f"/conversions/{conversion_id}/exports", {"format": fmt, "type": gguf_type})

    def exports(self, conversion_id: str) -> dict[str, Any]:
        """A conversion's exports (``items``) and whether it exports to GGUF (``gguf``)."""
        return self.get(f"/conversions/{conversion_id}/exports")

    def export(self, export_id: str) -> dict[str, Any]:
        return self.get(f"/exports/{export_id}")

    def export_plan(self, method: str, params: dict[str, Any], family: str | None = None) -> dict[str, Any]:
        return self.post(f"/methods/{method}/export-plan", {"params": params, "family": family})

    def finetune_params(self) -> list[dict[str, Any]]:
        return self.get("/finetunes/params")["items"]

    def finetunes(self, conversion_id: str | None = None) -> list[dict[str, Any]]:
        return self.get("/finetunes", conversion_id=conversion_id)["items"]

    def finetune(self, finetune_id: str) -> dict[str, Any]:
        return self.get(f"/finetunes/{finetune_id}")

    def create_finetune(self, conversion_id: str, **params: Any) -> dict[str, Any]:
        """``params``: mode, steps, batch_size, seq_len, lr, lora_rank, lb_coef, bias_step … (None: the API default)."""
        return self.post("/finetunes", {"conversion_id": conversion_id, **{k: v for k, v in params.items() if v is not None}})

    def finetune_log(self, finetune_id: str, max_points: int | None = None) -> dict[str, Any]:
        return self.get(f"/finetunes/{finetune_id}/log", max_points=max_points)

    # ------------------------------------------------------------------ charts

    def expert_neurons(self, conversion_id: str, layer: int) -> dict[str, Any]:
        return self.get(f"/conversions/{conversion_id}/experts/{layer}")

    def expert_matching(self, conversion_a: str, conversion_b: str, layer: int | None = None) -> dict[str, Any]:
        """B's routed experts matched to A's by their dense neurons (one layer: with its Jaccard matrix)."""
        return self.get(f"/conversions/{conversion_a}/matching/{conversion_b}", layer=layer)

    def probes(self, conversion_id: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        return self.get("/probes", conversion_id=conversion_id, kind=kind)["items"]

    def probe(self, probe_id: str) -> dict[str, Any]:
        return self.get(f"/probes/{probe_id}")

    def create_probe(self, conversion_id: str, kind: str = "routing", **body: Any) -> dict[str, Any]:
        """``text=…`` or ``sample_source="builtin:NAME", sample=i``; ``max_new_tokens`` for generate."""
        return self.post("/probes", {"conversion_id": conversion_id, "kind": kind, **body})

    def probe_result(self, probe_id: str) -> dict[str, Any]:
        return self.get(f"/probes/{probe_id}/result")

    def create_activation_probe(self, profile_id: str, layer: int, neurons: list[int], **body: Any) -> dict[str, Any]:
        """``text=…`` or ``sample_source="builtin:NAME", sample=i``: neurons' h on every token (a job)."""
        return self.post("/activation-probes", {"profile_id": profile_id, "layer": layer, "neurons": neurons, **body})

    def activation_probe(self, probe_id: str) -> dict[str, Any]:
        return self.get(f"/activation-probes/{probe_id}")

    def activation_result(self, probe_id: str) -> dict[str, Any]:
        return self.get(f"/activation-probes/{probe_id}/result")

    def cv_histogram(self, profile_id: str) -> dict[str, Any]:
        return self.get(f"/profiles/{profile_id}/charts/cv-histogram")

    def cv_summary(self, profile_id: str, tau: float | None = None) -> dict[str, Any]:
        return self.get(f"/profiles/{profile_id}/charts/cv-summary", tau=tau)

    def activations(self, profile_id: str, layer: int = 0, order: str = "task", normalize: str = "none",
                    max_cols: int | None = None) -> dict[str, Any]:
        return self.get(f"/profiles/{profile_id}/charts/activations", layer=layer, order=order, normalize=normalize, max_cols=max_cols)

    def neuron_stats(self, profile_id: str, layer: int = 0) -> dict[str, Any]:
        return self.get(f"/profiles/{profile_id}/charts/neuron-stats", layer=layer)

    def neuron_card(self, profile_id: str, layer: int, neuron: int) -> dict[str, Any]:
        """One neuron's CV, mean, rate, per-group means and top-activating tokens with snippets."""
        return self.get(f"/profiles/{profile_id}/neurons/{int(layer)}/{int(neuron)}")

    def task_similarity(self, profile_id: str, layer: int | None = None) -> dict[str, Any]:
        return self.get(f"/profiles/{profile_id}/charts/task-similarity", layer=layer)

    def compare_profiles(self, a: str, b: str, layer: int | None = None, threshold: float | None = None,
                         top: int | None = None, snippets: int | None = None, fdr: float | None = None) -> dict[str, Any]:
        """Two profiles of one model neuron by neuron: set-specificity d (kept at Benjamini–Hochberg q ≤ ``fdr``),
        shares per layer, top neurons of each side."""
        return self.get("/profiles/compare", a=a, b=b, layer=layer, threshold=threshold, fdr=fdr, top=top, snippets=snippets)

    def search_neurons(self, profile_id: str, **filters: Any) -> dict[str, Any]:
        """Neurons by cv_min/cv_max, rate_min/rate_max, vs + min_specificity, token text; sort, offset, limit."""
        return self.get(f"/profiles/{profile_id}/neurons/search", **filters)

    def layer_similarity(self, profile_id: str, **dense2moe: Any) -> dict[str, Any]:
        """S_L, S_M and the fusion a dense2moe conversion with these parameters (delta, n_fused, layer, …) would pick."""
        return self.get(f"/profiles/{profile_id}/charts/layer-similarity", **dense2moe)

    def allocation_preview(self, profile_id: str, **params: Any) -> dict[str, Any]:
        return self.get(f"/profiles/{profile_id}/allocation-preview", **params)

    def method_preview(self, profile_id: str, method: str, **params: Any) -> dict[str, Any]:
        return self.get(f"/profiles/{profile_id}/preview/{method}", **params)

    def conversion_routing(self, conversion_id: str, evaluation_ids: list[str] | None = None, variant: str = "converted") -> dict[str, Any]:
        params: dict[str, Any] = {"variant": variant}
        if evaluation_ids:
            params["evaluation_id"] = list(evaluation_ids)
        return self.get(f"/conversions/{conversion_id}/charts/routing", **params)


_client: ApiClient | None = None


def api() -> ApiClient:
    """The process-wide client (one connection pool)."""
    global _client
    if _client is None:
        _client = ApiClient()
    return _client
