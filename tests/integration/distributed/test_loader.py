"""The distributed loader in one process (a group of one rank): what it shards, what it loads whole, and what a
reload after a lost rank does."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_dspark.adapters.hf.loader import HfModelLoader
from mlx_dspark.adapters.mlx.distributed import DistributedLoader, MirroredTarget
from mlx_dspark.application.settings import ModelSettings
from mlx_dspark.domain.errors import IncompatibleDrafter, ModelUnavailable
from tests.fakes.tiny_models import tiny_model
from tests.integration.families.test_family_checkpoints import write_checkpoint


def test_the_target_is_sharded_once_other_models_load_whole_and_a_lost_group_refuses_reloads(tmp_path: Path) -> None:
    target = str(write_checkpoint(tmp_path / "t", "llama", tiny_model("llama", 0)))
    other = str(write_checkpoint(tmp_path / "d", "llama", tiny_model("llama", 5)))
    loader = DistributedLoader(HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "c"))), "any", target)
    sharded = loader.load_target(target)
    assert isinstance(sharded.target, MirroredTarget) and sharded.identity.endswith("+tp1")
    assert loader.load_target(target) is sharded  # the engine's reload finds the same shard
    draft = loader.load_target(other)
    assert not isinstance(draft.target, MirroredTarget)  # a draft model runs whole on rank 0
    assert loader.draft_model_source(draft) is not None
    with pytest.raises(IncompatibleDrafter, match="cannot be the sharded target"):
        loader.draft_model_source(sharded)
    sharded.target.lost = "the distributed target lost a rank (test); restart every rank to serve again"
    with pytest.raises(ModelUnavailable, match="restart every rank"):
        loader.load_target(target)
    with pytest.raises(ModelUnavailable, match="restart every rank"):
        sharded.target.reset(0)
