"""``fit_spec`` makes a ``FittedSpec``: the spec as written, resolved for one model, and marked so.

The marker is what lets every step past a public door take the spec as it is: a door handed a
fitted spec returns it (no work), one handed a spec fitted to another model refuses it.
"""
import pickle

import pytest

from oscar_compile.spec import CompressionSpec, shipped_spec
from oscar_compile.spec_fit import FittedSpec, FittedTo, SpecDoesNotFitModel, fit_spec


def test_fit_makes_a_fitted_spec_that_serializes_and_compares_as_the_spec():
    spec = shipped_spec("oscar-int2")
    fitted = fit_spec(spec, 64, 4, "Qwen3ForCausalLM")
    assert isinstance(fitted, FittedSpec) and isinstance(fitted, CompressionSpec)
    assert fitted.fitted_to == FittedTo(64, 4, "Qwen3ForCausalLM")
    assert fitted.kv_cache.group_size == 64 and fitted != spec  # capped at the head dim
    assert fit_spec(spec, 128, 4) == spec and spec == fit_spec(spec, 128, 4)  # nothing to cap: equal both ways
    again = CompressionSpec.from_json(fitted.to_json())
    assert type(again) is CompressionSpec and again == fitted and "fitted" not in fitted.to_json()
    copied = pickle.loads(pickle.dumps(fitted))  # what a tensor-parallel rank receives
    assert copied == fitted and copied.fitted_to == fitted.fitted_to


def test_fitting_a_fitted_spec_to_its_model_is_a_no_op_and_to_another_an_error():
    fitted = fit_spec(shipped_spec("oscar-int2"), 64, 4)
    assert fit_spec(fitted, 64, 4, "another name") is fitted
    with pytest.raises(SpecDoesNotFitModel, match="fitted to the model \\(head_dim 64, 4 layers\\)"):
        fit_spec(fitted, 128, 4)
    with pytest.raises(SpecDoesNotFitModel, match="head_dim 64, 8 layers"):
        fit_spec(fitted, 64, 8)


def test_only_fit_spec_makes_one_and_a_copy_with_new_cache_settings_is_plain_again():
    with pytest.raises(TypeError, match="made by oscar_compile.spec_fit.fit_spec"):
        _ = FittedSpec().fitted_to
    fitted = fit_spec(shipped_spec("oscar-int2"), 64, 4)
    calibration = fitted.calibration.model_copy(update={"num_tokens": 1024})
    assert isinstance(fitted.model_copy(update={"calibration": calibration}), FittedSpec)
    regrouped = fitted.model_copy(update={"kv_cache": fitted.kv_cache.model_copy(update={"group_size": 48})})
    assert type(regrouped) is CompressionSpec  # to be fitted again (48 does not divide 64)
    with pytest.raises(SpecDoesNotFitModel, match="group_size 48 does not divide head_dim 64"):
        fit_spec(regrouped, 64, 4)
