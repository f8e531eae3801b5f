"""The fit estimate against the caches each family's tiny model really makes: KV layers, recurrent layers,
and the recurrent state's bytes measured after a forward."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from mlx_dspark.domain import fit
from tests.fakes.tiny_models import FAMILIES, hf_config, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_the_shape_counts_the_caches_the_model_makes(family: str) -> None:
    config = hf_config(family)
    shape = fit.shape_from_config(config)
    model = tiny_model(family, seed=0)
    caches = make_prompt_cache(model)
    model(mx.array([[3, 1, 4, 1, 5]]), cache=caches)
    kv = [c for c in caches if isinstance(c, KVCache | RotatingKVCache)]
    recurrent = [c for c in caches if isinstance(c, ArraysCache)]
    assert shape.kv_layers == len(kv)
    assert shape.sliding_layers == sum(isinstance(c, RotatingKVCache) for c in kv)
    assert shape.state_layers == len(recurrent)
    # The tiny models compute in float32: 4-byte convolution windows.
    measured = sum(a.nbytes for c in recurrent for _, a in tree_flatten(c.state) if a is not None)
    cfg = config.get("text_config") or config
    assert shape.state_layers * fit.recurrent_state_bytes(cfg, kv_bytes=4) == measured
