"""``oscar_compile.assembly``: the one assembly of model, compression and runtime, and the spec fitted once.

``oscar-compile serve``, ``python -m oscar_compile.runtime.serve`` and ``LLM`` all go through
``assemble``; the spec is fitted there (or at the first public door it reaches) and every step
past it takes the fitted spec as it is. Counted here by wrapping the fit itself
(``spec_fit._fit``): a door handed a fitted spec does no fit.
"""
import pytest

from oscar_compile import spec_fit

pytest.importorskip("fastapi")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fits(monkeypatch):
    """The specs fitted while the test runs (one entry per real fit)."""
    done = []
    real = spec_fit._fit

    def counting(spec, facts):
        done.append(facts)
        return real(spec, facts)

    monkeypatch.setattr(spec_fit, "_fit", counting)
    return done


def test_one_serve_start_fits_the_spec_once(fits):
    """The bundled model in INT2 with its shipped rotations, built as ``oscar-compile serve`` builds it."""
    from oscar_compile.cli import serve

    app, name = serve.app_from_args(serve.parse_args(["--device", "cpu", "--kv-memory", "0.05", "--no-cuda-graphs"]))
    assert name == "oscar-tiny-qwen3" and app.state.tensor_parallel is None
    assert len(fits) == 1, fits


def test_llm_fits_the_spec_once(fits):
    """``LLM`` goes through the same ``assemble``: one fit, whether the spec is a path or fitted already."""
    from oscar_compile.assembly import default_compression
    from oscar_compile.llm import LLM
    from oscar_compile.loading import BUNDLED_MODEL_DIR
    from oscar_compile.runtime.engine_config import EngineConfig
    from oscar_compile.spec import CompressionSpec
    from oscar_compile.spec_fit import fit_spec_to_model_dir

    spec, rotations = default_compression(BUNDLED_MODEL_DIR, None, None, bundled=True)
    config = EngineConfig(kv_memory_gb=0.05, cuda_graphs=False)
    LLM(None, spec, rotations, device="cpu", config=config)
    assert len(fits) == 1, fits
    fitted = fit_spec_to_model_dir(CompressionSpec.from_yaml(spec), BUNDLED_MODEL_DIR)
    assert len(fits) == 2
    LLM(None, fitted, rotations, device="cpu", config=config)
    assert len(fits) == 2  # fitted already: no door fits it again


def test_the_shims_name_the_assembly():
    from oscar_compile.runtime import serve

    assert serve.assemble.__module__ == "oscar_compile.assembly"
