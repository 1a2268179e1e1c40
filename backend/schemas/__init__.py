"""The API contract: request and response models (separate from the SQL tables in ``db``).

Conversion parameters are generated from the engine's method registry (``moelab.engine.methods``):
a slider in the UI, a field here, a CLI option and a field of the method's parameter dataclass
carry one name, one default and one set of bounds.

Validation that needs only the request lives here (α_min ≤ α_max, τ > 0, sparsity in (0, 1),
S + A ≤ E …) and answers 422 with what to fix; checks that need stored state (experts that
fit the profile's d_ffn, a profile that failed) are made by the routes.

One module per resource, named after its routes in ``backend.routes``; ``common`` holds what several
resources share (the request base class, notes and tags, jobs, deletion) and ``declared`` the bodies
generated from the engine's parameter declarations. Every public name is re-exported here, so
``from backend.schemas import X`` does not depend on which module defines ``X``.
"""

from __future__ import annotations

from .activation_probes import (
    ACTIVATION_MAX_NEURONS,
    ACTIVATION_MAX_TOKENS,
    ActivationProbeCreate,
    ActivationProbeList,
    ActivationProbeOut,
    ActivationResult,
    NeuronReference,
)
from .artifacts import ArtifactFile, ArtifactList, ArtifactOut, ArtifactSummary
from .calibration_sets import (
    BuiltinCalibrationCreate,
    BuiltinName,
    BuiltinSetOut,
    CalibrationCreate,
    CalibrationSetList,
    CalibrationSetOut,
    HFCalibrationCreate,
    SampleOut,
    SamplePage,
)
from .charts import (
    ActivationTiles,
    CVHistogram,
    CVSummary,
    LayerCurves,
    LayerSimilarity,
    MethodPreview,
    NeuronCard,
    NeuronStats,
    RoutingHeatmap,
    SnippetToken,
    TaskSimilarity,
    TopToken,
)
from .common import MAX_INT, DeletedRef, DeleteOut, JobKind, JobOut, JobState, Num, ProgressOut, ResourceStatus
from .conversions import (
    METHOD_PARAMS,
    ConversionCreate,
    ConversionList,
    ConversionMethod,
    ConversionOut,
    ExpertMatching,
    ExpertNeurons,
    ExpertOut,
    LayerMatchingOut,
    MatchedExpert,
    SkippedLayer,
    method_params_model,
)
from .declared import declared_model
from .evaluations import EvaluationCreate, EvaluationList, EvaluationOut
from .exports import ExportCreate, ExportList, ExportOut, GgufCheck, GgufType
from .finetunes import FinetuneCreate, FinetuneList, FinetuneMode, FinetuneOut, TrainLog, TrainStep
from .health import HealthDiskOut, HealthOut
from .jobs import JobList
from .methods import ExportPlanIn, ExportPlanOut, MethodList, MethodOut, ParamList, ParamOut
from .models import LayerOut, ModelCreate, ModelLayers, ModelList, ModelOut
from .notes import MAX_NOTES, MAX_TAGS, TAG_PATTERN, NotesOut, NotesUpdate, Tag, TagCount, TagList
from .probes import PROBE_HELDOUT_PICK, PROBE_MAX_TEXT, ProbeCreate, ProbeList, ProbeOut
from .profile_compare import CompareScatter, LayerSpecificity, NeuronHit, NeuronSearch, ProfileComparison, SpecificNeuron
from .profiles import ProfileCreate, ProfileList, ProfileOut
from .tasks import TaskList, TaskName, TaskOut

__all__ = [
    # common
    "MAX_INT", "DeletedRef", "DeleteOut", "JobKind", "JobOut", "JobState", "Num", "ProgressOut", "ResourceStatus",
    # declared
    "declared_model",
    # notes
    "MAX_NOTES", "MAX_TAGS", "TAG_PATTERN", "NotesOut", "NotesUpdate", "Tag", "TagCount", "TagList",
    # jobs
    "JobList",
    # models
    "LayerOut", "ModelCreate", "ModelLayers", "ModelList", "ModelOut",
    # calibration_sets
    "BuiltinCalibrationCreate", "BuiltinName", "BuiltinSetOut", "CalibrationCreate", "CalibrationSetList", "CalibrationSetOut",
    "HFCalibrationCreate", "SampleOut", "SamplePage",
    # profiles
    "ProfileCreate", "ProfileList", "ProfileOut",
    # methods
    "ExportPlanIn", "ExportPlanOut", "MethodList", "MethodOut", "ParamList", "ParamOut",
    # conversions
    "METHOD_PARAMS", "ConversionCreate", "ConversionList", "ConversionMethod", "ConversionOut", "ExpertMatching", "ExpertNeurons",
    "ExpertOut", "LayerMatchingOut", "MatchedExpert", "SkippedLayer", "method_params_model",
    # exports
    "ExportCreate", "ExportList", "ExportOut", "GgufCheck", "GgufType",
    # tasks
    "TaskList", "TaskName", "TaskOut",
    # evaluations
    "EvaluationCreate", "EvaluationList", "EvaluationOut",
    # finetunes (FinetuneMode is the engine's, imported by the routes from here)
    "FinetuneCreate", "FinetuneList", "FinetuneMode", "FinetuneOut", "TrainLog", "TrainStep",
    # probes
    "PROBE_HELDOUT_PICK", "PROBE_MAX_TEXT", "ProbeCreate", "ProbeList", "ProbeOut",
    # activation_probes
    "ACTIVATION_MAX_NEURONS", "ACTIVATION_MAX_TOKENS", "ActivationProbeCreate", "ActivationProbeList", "ActivationProbeOut",
    "ActivationResult", "NeuronReference",
    # artifacts
    "ArtifactFile", "ArtifactList", "ArtifactOut", "ArtifactSummary",
    # health
    "HealthDiskOut", "HealthOut",
    # charts
    "ActivationTiles", "CVHistogram", "CVSummary", "LayerCurves", "LayerSimilarity", "MethodPreview", "NeuronCard", "NeuronStats",
    "RoutingHeatmap", "SnippetToken", "TaskSimilarity", "TopToken",
    # profile_compare
    "CompareScatter", "LayerSpecificity", "NeuronHit", "NeuronSearch", "ProfileComparison", "SpecificNeuron",
]
