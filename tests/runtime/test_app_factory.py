"""The one app factory (``oscar_compile.assembly.build_app``): the serve command, the random-model
bench and any other server build the OpenAI app over an ``Assembly`` through it."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from oscar_compile.assembly import Assembly, build_app  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig, build_engine  # noqa: E402
from oscar_compile.runtime.server.server_config import ServerConfig  # noqa: E402


def test_the_app_serves_the_assembly_under_its_names(tiny_model, tokenizer):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=16))
    built = Assembly(tiny_model, tokenizer, engine, name="tiny-dir")
    app, name = build_app(built, server=ServerConfig())
    assert name == "tiny-dir" and app.state.tensor_parallel is None
    app, name = build_app(built, ["alias", "other"])
    assert name == "alias"
    with pytest.raises(ValueError, match="served_model_name"):
        build_app(Assembly(tiny_model, tokenizer, engine))
