"""A profile on disk: written atomically, read lazily.

Layout of a profile directory::

    manifest.json             written last; status "complete", settings, versions, timings
    neurons.parquet           layer, neuron, mean, abs_mean, std, cv, rate
    samples.parquet           sample, text, task, domain, group, n_tokens
    stats.safetensors         small per-layer statistics and the S_L / S_M matrices
    activations.safetensors   EW A_ℓ per layer and the ATopK feature rows (for clustering)
    second_moment.safetensors XᵀX per layer, float64 (MI Eq. 1)
    top_tokens.safetensors    per layer, each neuron's K top-activating tokens by |h| (CM Eq. 1):
                              ``layers.{i}.value`` float32 [d_ffn, K] signed h, |h| descending,
                              ``layers.{i}.token`` int64 [d_ffn, K] token index into tokens.parquet
                              (-1: the set had fewer than K distinct tokens)
    tokens.parquet            every calibration token: token (global index), sample, position,
                              token_id, piece (the text it decodes to), repeated (its whole prefix
                              repeats another sample's, so it is never a top token)

The last two exist when ``settings.top_tokens`` > 0 (profiles made before them have neither; a
reader checks ``StoredProfile.has_top_tokens``). ``piece`` lets the API show snippets with no
tokenizer and no model.

The whole directory is built under a temporary name and renamed into place
(``atomic.atomic_directory``), so an interrupted run never leaves something that
``StoredProfile.open`` would take for a complete profile.
"""

from __future__ import annotations

import json
import mmap
import platform
import time
from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from safetensors import safe_open
from safetensors.numpy import save_file

from ..atomic import atomic_directory, write_json_atomic

if TYPE_CHECKING:  # reading a profile must not import torch: the API process serves charts from it
    from ..data.calibration import CalibrationSet
    from .profiler import ProfileResult, ProfileSettings

FORMAT = "moelab.profile"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ProfileNotFound(FileNotFoundError):
    """No complete profile at a path; the message says why."""


def _versions() -> dict[str, str]:
    import safetensors
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
    }


_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
                       "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def save_file_streaming(tensors: dict[str, np.ndarray], path: Path) -> None:
    """A safetensors file written one array at a time.

    ``safetensors.numpy.save_file`` serialises every array into one buffer first; the XᵀX
    matrices of a large model (32 × 4096² float64 = 4.3 GB at 8B), possibly memory-mapped
    from a streamed profile's scratch files, would all be in memory at once.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, arr in tensors.items():
        nbytes = int(arr.size) * arr.dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[arr.dtype.name], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for arr in tensors.values():
            flat = np.ascontiguousarray(arr).reshape(-1)
            step = max(1, (64 << 20) // max(1, flat.itemsize))
            for i in range(0, flat.size, step):
                fh.write(memoryview(flat[i : i + step]).cast("B"))
            mapped = getattr(arr, "_mmap", None)
            if mapped is not None:  # a memory-mapped array: drop its pages from our resident set once written
                mapped.madvise(mmap.MADV_DONTNEED)


def write_profile(result: ProfileResult, cset: CalibrationSet, out: Path) -> Path:
    """Publish ``result`` at ``out`` atomically (replacing any previous profile there)."""
    t0 = time.perf_counter()
    out = Path(out)
    with atomic_directory(out) as tmp:
        rows = []
        stats: dict[str, np.ndarray] = {
            "similarity.outputs": result.similarity_outputs,
            "similarity.mlp_inputs": result.similarity_mlp_inputs,
        }
        acts: dict[str, np.ndarray] = {"atopk.token_index": result.feature_token_index}
        second: dict[str, np.ndarray] = {}
        for i, lay in enumerate(result.layers):
            rows.append(
                pd.DataFrame(
                    {
                        "layer": np.full(len(lay.cv), i, dtype=np.int32),
                        "neuron": np.arange(len(lay.cv), dtype=np.int32),
                        "mean": lay.mean,
                        "abs_mean": np.abs(lay.mean),
                        "std": lay.std,
                        "cv": lay.cv,
                        "rate": lay.rate,
                    }
                )
            )
            stats |= {
                f"layers.{i}.group_means": lay.group_means,
                f"layers.{i}.h_hist": lay.h_hist,
                f"layers.{i}.h_hist_edges": lay.h_hist_edges,
                f"layers.{i}.h_outside": lay.h_outside,
            }
            acts |= {f"layers.{i}.sample_means": lay.sample_means, f"layers.{i}.atopk": lay.atopk_indices}
            if lay.xtx is not None:
                second[f"layers.{i}.xtx"] = lay.xtx
        top = {f"layers.{i}.{k}": v for i, lay in enumerate(result.layers) if lay.top_value is not None
               for k, v in (("value", lay.top_value), ("token", lay.top_token))}
        pd.concat(rows, ignore_index=True).to_parquet(tmp / "neurons.parquet", index=False)
        frame = cset.to_frame()
        frame.insert(0, "sample", np.arange(len(frame), dtype=np.int32))
        frame["group"] = [result.groups[g] for g in result.sample_group]
        frame["n_tokens"] = result.sample_tokens.astype(np.int32)
        frame.to_parquet(tmp / "samples.parquet", index=False)
        save_file(stats, str(tmp / "stats.safetensors"))
        save_file(acts, str(tmp / "activations.safetensors"))
        files = ["neurons.parquet", "samples.parquet", "stats.safetensors", "activations.safetensors"]
        if second:
            save_file_streaming(second, tmp / "second_moment.safetensors")
            files.append("second_moment.safetensors")
        if top and result.token_pieces is not None:
            save_file(top, str(tmp / "top_tokens.safetensors"))
            _token_table(result).to_parquet(tmp / "tokens.parquet", index=False)
            files += ["top_tokens.safetensors", "tokens.parquet"]
        timings = dict(result.timings, write_s=time.perf_counter() - t0)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "status": "complete",
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": result.model,
            "calibration": result.calibration,
            "settings": asdict(result.settings),
            "cv_basis": result.group_basis,
            "cv_definition": "CV_j = std_t(a_jt) / (|mean_t(a_jt)| + eps) over signed group means (EW Eq. 3)",
            "groups": result.groups,
            "n_layers": len(result.layers),
            "d_ffn": [int(len(lay.cv)) for lay in result.layers],
            "n_tokens": result.n_tokens,
            "n_feature_tokens": int(len(result.feature_token_index)),
            "top_tokens": int(result.settings.top_tokens) if "top_tokens.safetensors" in files else 0,
            "files": files,
            "versions": _versions(),
            "timings": timings,
        }
        write_json_atomic(tmp / MANIFEST, manifest)  # last: its presence marks completeness
    return out


def _token_table(result: ProfileResult) -> pd.DataFrame:
    """One row per calibration token, in global token order (sample after sample)."""
    lengths = result.sample_tokens.astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sample = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    return pd.DataFrame({
        "token": np.arange(int(lengths.sum()), dtype=np.int64),
        "sample": sample,
        "position": (np.arange(int(lengths.sum())) - np.repeat(starts, lengths)).astype(np.int32),
        "token_id": result.token_ids.astype(np.int32),
        "piece": pd.Series(result.token_pieces, dtype="string"),
        "repeated": result.token_repeated.astype(bool),
    })


class StoredProfile:
    """Read access to a complete profile; tensors are loaded per key, on demand."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = Path(path)
        self.manifest = manifest

    @classmethod
    def open(cls, path: Path | str) -> "StoredProfile":
        path = Path(path)
        mf = path / MANIFEST
        if not path.is_dir():
            raise ProfileNotFound(f"{path}: no such profile directory (create one with `moelab profile`)")
        if not mf.is_file():
            raise ProfileNotFound(f"{path}: not a complete profile (no {MANIFEST}; was the run interrupted?)")
        manifest = json.loads(mf.read_text())
        if manifest.get("format") != FORMAT or manifest.get("status") != "complete":
            raise ProfileNotFound(f"{path}: {MANIFEST} does not describe a complete moelab profile")
        missing = [f for f in manifest.get("files", []) if not (path / f).is_file()]
        if missing:
            raise ProfileNotFound(f"{path}: profile files missing: {', '.join(missing)}")
        return cls(path, manifest)

    @property
    def n_layers(self) -> int:
        return int(self.manifest["n_layers"])

    @property
    def settings(self) -> ProfileSettings:
        from .profiler import ProfileSettings

        return ProfileSettings(**self.manifest["settings"])

    @cached_property
    def neurons(self) -> pd.DataFrame:
        return pd.read_parquet(self.path / "neurons.parquet")

    @cached_property
    def samples(self) -> pd.DataFrame:
        return pd.read_parquet(self.path / "samples.parquet")

    @cached_property
    def _cv(self) -> list[np.ndarray]:
        return self.column_by_layer("cv")

    def cv_by_layer(self) -> list[np.ndarray]:
        """Per-layer neuron CV arrays (EW Eq. 3), cached: the allocation preview reads them often."""
        return self._cv

    def column_by_layer(self, column: str) -> list[np.ndarray]:
        """Any per-neuron column of ``neurons.parquet`` split by layer, in neuron order."""
        nt = self.neurons
        return [g.sort_values("neuron")[column].to_numpy() for _, g in nt.groupby("layer", sort=True)]

    def _tensor(self, file: str, key: str) -> np.ndarray:
        with safe_open(str(self.path / file), framework="numpy") as fh:
            return fh.get_tensor(key)

    def similarity(self, kind: str) -> np.ndarray:
        """``kind``: ``outputs`` (D2 S_L) or ``mlp_inputs`` (D2 S_M)."""
        return self._tensor("stats.safetensors", f"similarity.{kind}")

    def group_means(self, layer: int) -> np.ndarray:
        return self._tensor("stats.safetensors", f"layers.{layer}.group_means")

    def h_histogram(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(counts, edges, [below, above]) of h values in ``layer``."""
        return tuple(self._tensor("stats.safetensors", f"layers.{layer}.{k}") for k in ("h_hist", "h_hist_edges", "h_outside"))

    def sample_means(self, layer: int) -> np.ndarray:
        return self._tensor("activations.safetensors", f"layers.{layer}.sample_means")

    def atopk(self, layer: int) -> np.ndarray:
        return self._tensor("activations.safetensors", f"layers.{layer}.atopk")

    def feature_token_index(self) -> np.ndarray:
        return self._tensor("activations.safetensors", "atopk.token_index")

    @property
    def has_top_tokens(self) -> bool:
        """Whether the profile keeps its neurons' top-activating tokens (profiles made before
        ``top_tokens``, or with ``top_tokens=0``, do not)."""
        return "top_tokens.safetensors" in self.manifest.get("files", [])

    def top_tokens(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(values [d_ffn, K] float32 signed h, tokens [d_ffn, K] int64 index into ``tokens``) of ``layer``."""
        if not self.has_top_tokens:
            raise ProfileNotFound(f"{self.path}: this profile keeps no top tokens (made before them or with top_tokens=0); re-profile")
        return tuple(self._tensor("top_tokens.safetensors", f"layers.{layer}.{k}") for k in ("value", "token"))

    @cached_property
    def tokens(self) -> pd.DataFrame:
        """tokens.parquet: token, sample, position, token_id, piece, repeated (row i is token i)."""
        if not self.has_top_tokens:
            raise ProfileNotFound(f"{self.path}: this profile stores no calibration tokens (made before top tokens); re-profile")
        return pd.read_parquet(self.path / "tokens.parquet")

    def xtx(self, layer: int) -> np.ndarray:
        if "second_moment.safetensors" not in self.manifest["files"]:
            raise ProfileNotFound(f"{self.path}: profiled without the second moment (second_moment=False)")
        return self._tensor("second_moment.safetensors", f"layers.{layer}.xtx")
