import json
from pathlib import Path

import pytest

from oscar_compile.spec import CompressionSpec, SpecError, shipped_spec, specs_dir

SPEC_FILES = sorted(specs_dir().glob("*.yaml"))
REQUIRED = {"oscar-int2", "hadamard-int2", "naive-int2", "oscar-int4", "bf16"}


def test_required_specs_are_shipped():
    assert REQUIRED <= {p.stem for p in SPEC_FILES}


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_every_shipped_spec_loads_and_round_trips(path):
    spec = CompressionSpec.from_yaml(path)
    assert CompressionSpec.from_json(spec.to_json()) == spec
    assert CompressionSpec.from_dict(__import__("yaml").safe_load(spec.to_yaml())) == spec


def test_paper_recipe_values():
    s = shipped_spec("oscar-int2")
    assert (s.kv_cache.bits, s.kv_cache.group_size, s.kv_cache.sink_tokens, s.kv_cache.recent_tokens) == (
        2, 128, 64, 256)
    assert (s.key.rotation, s.key.clip_ratio, s.value.clip_ratio, s.value.target) == (
        "oscar", 0.96, 0.92, "score_weighted")
    naive = shipped_spec("naive-int2")
    assert naive.key.rotation == naive.value.rotation == "none"
    assert naive.key.clip_ratio == naive.value.clip_ratio == 1.0


@pytest.mark.parametrize(
    "data, fragments",
    [
        ({"kv_cache": {"bits": 3}}, ["kv_cache.bits", "2, 4 or 16"]),
        ({"key": {"rotaton": "oscar"}}, ["key.rotaton", "unknown field", "rotation"]),
        ({"value": {"target": "outputs"}}, ["value.target", "score_weighted", "attention_output"]),
        ({"key": {"granularity": "per_token"}}, ["key.granularity", "per_layer", "per_head"]),
        ({"kv_cache": {"scale_dtype": "int8"}}, ["kv_cache.scale_dtype", "float16"]),
        ({"value": {"clip_ratio": 1.5}}, ["value.clip_ratio", "less than or equal to 1"]),
        ({"key": {"clip_ratio": 0}}, ["key.clip_ratio", "greater than 0"]),
        ({"calibration": {"num_tokens": "8k"}}, ["calibration.num_tokens", "integer"]),
        ({"kv_cache": {"sink_tokens": 10}}, ["sink_tokens", "multiple of page_size"]),
        ({"layers": [{"match": [0], "kv_cache": {"bitz": 16}}]}, ["layers.0.kv_cache.bitz", "unknown field"]),
        ({"version": 2}, ["version"]),
        ({"extra_section": {}}, ["extra_section", "unknown field", "kv_cache"]),
    ],
)
def test_invalid_specs_name_the_field_and_the_allowed_values(data, fragments):
    with pytest.raises(SpecError) as err:
        CompressionSpec.from_dict(data)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_yaml_errors_and_non_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache: [1, 2\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        CompressionSpec.from_yaml(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="mapping"):
        CompressionSpec.from_yaml(bad)


def test_layer_overrides_resolve_in_order():
    spec = CompressionSpec.from_dict(
        {"layers": [{"match": [0, -1], "kv_cache": {"bits": 16}}, {"match": [1], "key": {"granularity": "per_head"}}]}
    )
    l0, l1, l2, last = (spec.for_layer(i, 4) for i in (0, 1, 2, 3))
    assert l0.kv_cache.bits == 16 and l0.overridden_to_16_bits and not l0.quantized
    assert last.kv_cache.bits == 16
    assert l1.kv_cache.bits == 2 and l1.key.granularity == "per_head" and l1.key.rotation == "oscar"
    assert l2.key.granularity == "per_layer"
    with pytest.raises(SpecError, match="out of range"):
        spec.check_layers(1)


def test_published_json_schema_is_current():
    schema_path = Path(__file__).resolve().parents[1] / "oscar_compile" / "schema" / "compression-spec.schema.json"
    assert json.loads(schema_path.read_text()) == json.loads(json.dumps(CompressionSpec.json_schema(), sort_keys=True))
