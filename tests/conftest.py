"""Shared fixtures: a persistent data dir (the default model is cached there once) and tiny
random-weight models of every supported family, built from their real transformers classes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from tests.isolation import changes, isolated_environment, snapshot, suite_paths  # noqa: E402

# Before anything reads settings or a cache path: this process and every child it starts keep to the
# suite's directory. The user's real home is snapshotted now and compared when the session ends.
# An xdist worker starts in the home its controller already moved, so the real one travels in MOELAB_TEST_REAL_HOME.
_WORKER = "PYTEST_XDIST_WORKER" in os.environ
REAL_HOME = Path(os.environ["MOELAB_TEST_REAL_HOME"] if _WORKER else os.path.expanduser("~")).resolve()
_HOME_BEFORE = snapshot(REAL_HOME)
_ENV = isolated_environment(dict(os.environ), REPO)
_ENV["MOELAB_TEST_REAL_HOME"] = str(REAL_HOME)
# Under pytest-xdist (scripts/test.sh runs two workers) each worker's torch, and every process it starts, gets its
# share of the cores: two full OpenMP pools on the same cores spin against each other and run several times slower.
_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
if _WORKER:
    _ENV["OMP_NUM_THREADS"] = str(_THREADS)
os.environ.clear()
os.environ.update(_ENV)
for _path in suite_paths(REPO).values():
    _path.mkdir(parents=True, exist_ok=True)

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKER:
    torch.set_num_threads(_THREADS)


def pytest_configure(config) -> None:
    """With xdist workers, the default model is dequantised once, here, before they start: two workers caching it
    at once would each replace the directory the other is reading."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        from moelab.engine.models import cache_default_model

        cache_default_model(suite_paths(REPO)["data"])


def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail the run when it created, changed or removed anything in the user's real home."""
    if REAL_HOME == suite_paths(REPO)["home"]:  # a run nested in the suite watches nothing of the user's
        return
    leaked = changes(_HOME_BEFORE, snapshot(REAL_HOME))
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"the suite reached outside its directory, into {REAL_HOME}:", *(f"  {c}" for c in leaked[:50])]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma2": ("Gemma2Config", {"hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3_text": ("Gemma3TextConfig", {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 64}),
    "olmo": ("OlmoConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "phi3": ("Phi3Config", {}),
}


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """Survives between runs so the default model is dequantised once per clone; it is also every
    process's ``MOELAB_DATA_DIR`` unless a test gives it another."""
    return suite_paths(REPO)["data"]


@pytest.fixture(scope="session")
def default_model_dir(data_dir: Path) -> Path:
    from moelab.engine.models import cache_default_model

    return cache_default_model(data_dir)


def build_tiny_model(family: str, target: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random-weight model of ``family`` with the default model's tokenizer, saved at ``target``."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls_name, extra = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, cls_name)(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, **TINY, **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return target


#: Tiny MoE models (hierarchical conversion): E experts, top-K, F neurons per expert, d_model D.
MOE_E, MOE_K, MOE_F, MOE_D = 4, 2, 64, 64
MOE_BASE = dict(hidden_size=MOE_D, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                initializer_range=0.1)  # large enough that the experts visibly move the logits
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=MOE_E, num_experts_per_tok=MOE_K,
                                      intermediate_size=MOE_F)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=2, num_experts=MOE_E, num_experts_per_tok=MOE_K,
                                         moe_intermediate_size=MOE_F, shared_expert_intermediate_size=48,
                                         intermediate_size=96)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_experts=MOE_E, num_experts_per_tok=MOE_K,
                                         moe_intermediate_size=MOE_F, intermediate_size=96, norm_topk_prob=True,
                                         mlp_only_layers=[1])),
}


def build_tiny_moe(family: str, target: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random-weight MoE model of ``family`` (``MOE_FAMILIES``) with the default model's tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls_name, extra = MOE_FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, cls_name)(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                             bos_token_id=tok.bos_token_id, **MOE_BASE, **extra)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    tok.save_pretrained(target)
    return target


def tiny_models_root(tmp_path_factory) -> Path:
    """The one directory the tiny models are saved under: the service tests list it in MOELAB_DATA_ROOTS
    (the API registers local models only from there), and nothing else lives in it."""
    root = tmp_path_factory.getbasetemp() / "tiny-models"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_model_dir):
    """Factory: ``tiny_model("phi3")`` -> directory of a saved random-weight model (cached)."""
    made: dict[str, Path] = {}

    def make(family: str = "llama") -> Path:
        if family not in made:
            made[family] = build_tiny_model(family, tiny_models_root(tmp_path_factory) / family, default_model_dir)
        return made[family]

    yield make
    for path in made.values():
        shutil.rmtree(path, ignore_errors=True)


CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium driven by Playwright, one for the whole session: Playwright's sync API runs
    an event loop of its own, so a second ``sync_playwright()`` in the same process would fail."""
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test.sh does this)")
    from playwright.sync_api import sync_playwright

    (REPO / "test-artifacts").mkdir(exist_ok=True)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()


#: What scripts/test.sh runs alone, after the parallel part: the tests that time models against each other, and the
#: browser tests, which share one live service per process (under xdist a job one cancelled showed as another's error).
SERIAL = ("tests/engine/test_speed.py::", "tests/engine/test_speed_prediction.py::", "tests/frontend/")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
